"""`python -m mlm_ddp.prepare` and training from its folder (`--prepared_data`): the same blocks in the
same order whatever the workers or tasks; training on them gives the raw files' per-step losses (1 and 2
processes), resumes and resumes elastically onto the uninterrupted curve; a task killed mid-write is
redone alone; every bad input ends with exit 2, one line, and nothing half-written used. The Slurm
array and Submitit paths: tests/test_prepare_slurm.py."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from mlm_ddp import prepare as prep
from mlm_ddp.config import parse_args
from mlm_ddp.data import prepared as fmt
from mlm_ddp.data.pack import tokenize_dataset
from mlm_ddp.data.sources import LONG_TEXT, resolve
from mlm_ddp.data.text import load_text
from mlm_ddp.prepare import make_plan
from mlm_ddp.train import main as train_main
from mlm_ddp.train import train
from tests.conftest import NO_DROPOUT, REPO, SAME_STEPS, corpus_paragraphs, tiny_args, train_losses
from tests.test_elastic import launch

STEPS, SAVED = 8, 4


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A folder of two training files, one of 2 500 lines (three tokenization chunks of 1 000 texts, blank
    lines among them), one of 500; and a validation file."""
    paragraphs = corpus_paragraphs()
    root = tmp_path_factory.mktemp("texts")
    (root / "corpus").mkdir()
    big = paragraphs[:1200] + [""] + paragraphs[:1299]
    (root / "corpus" / "a.txt").write_text("\n".join(big) + "\n")
    (root / "corpus" / "b.txt").write_text("\n".join(paragraphs[1200:1700]) + "\n")
    (root / "valid.txt").write_text("\n".join(paragraphs[1700:]) + "\n")
    return {"corpus": root / "corpus", "big": root / "corpus" / "a.txt", "valid": root / "valid.txt", "root": root}


def prepare_args(model: Path, source: Path, out: Path, *extra: str) -> list[str]:
    return ["--model_name_or_path", str(model), "--train_file", str(source), "--output_dir", str(out),
            "--max_seq_length", "32", "--num_workers", "1", *extra]


def run_prepare(args: list[str], preexec: object = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "mlm_ddp.prepare", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600, preexec_fn=preexec)


def blocks(folder: Path) -> dict[str, list[list[int]]]:
    """Every block of each split, in the manifest's order."""
    manifest = json.loads((folder / fmt.MANIFEST).read_text())
    out: dict[str, list[list[int]]] = {split: [] for split in fmt.SPLITS}
    for shard in manifest["shards"]:
        out[shard["split"]] += Dataset.from_file(str(folder / shard["path"]))["input_ids"]
    return out


def error_lines(stderr: str, prog: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"{prog}: error:")]


@pytest.fixture(scope="module")
def one_worker(tiny_model: Path, texts: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "one"
    assert prep.main(prepare_args(tiny_model, texts["corpus"], out, "--validation_file", str(texts["valid"]))) == 0
    return out


def test_the_blocks_do_not_depend_on_the_workers_or_the_tasks(one_worker: Path, tiny_model: Path, texts: dict,
                                                              tmp_path: Path) -> None:
    flags = ("--validation_file", str(texts["valid"]))
    two_workers = tmp_path / "two-workers"
    proc = run_prepare(prepare_args(tiny_model, texts["corpus"], two_workers, *flags, "--num_workers", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    two_tasks = tmp_path / "two-tasks"
    for task in (1, 0):  # in either order: the last to find every part complete writes the manifest
        assert prep.main(prepare_args(tiny_model, texts["corpus"], two_tasks, *flags, "--tasks", "2",
                                      "--task", str(task))) == 0
    expected = blocks(one_worker)
    assert expected["train"] and expected["eval"]
    for other in (two_workers, two_tasks):
        assert blocks(other) == expected
        mine, theirs = (json.loads((f / fmt.MANIFEST).read_text())["counts"] for f in (other, one_worker))
        assert mine == theirs
    # the counts say what the shards hold; only a chunk's last block is short
    manifest = json.loads((one_worker / fmt.MANIFEST).read_text())
    lengths = [len(b) for b in expected["train"]]
    assert manifest["counts"]["train"] == {"blocks": len(lengths), "tokens": sum(lengths),
                                           "padding": 32 * len(lengths) - sum(lengths)}
    chunks = 3 + 1  # a.txt: 2 500 lines, b.txt: 500
    assert max(lengths) == 32 and sum(1 for n in lengths if n < 32) <= chunks
    assert manifest["counts"]["texts"] == sum(1 for f in (texts["big"], texts["corpus"] / "b.txt", texts["valid"])
                                              for line in f.read_text().splitlines() if line.strip())
    parts = sorted(p.name for p in (two_tasks / fmt.PARTS).iterdir())
    assert parts == ["task-00000-of-00002", "task-00001-of-00002"]  # no temporary folder left


@pytest.fixture(scope="module")
def big_file_prepared(tiny_model: Path, texts: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2 500-line file and the validation file, prepared: what the raw-file runs read."""
    out = tmp_path_factory.mktemp("prepared") / "big"
    assert prep.main(prepare_args(tiny_model, texts["big"], out, "--validation_file", str(texts["valid"]))) == 0
    return out


def raw_args(model: Path, texts: dict, out: Path, *extra: str) -> list[str]:
    corpus = {"train": texts["big"], "valid": texts["valid"]}
    return tiny_args(model, corpus, out, "--max_train_steps", str(STEPS), *NO_DROPOUT, "--cpu_threads", "1", *extra)


def prepared_args(model: Path, prepared: Path, out: Path, *extra: str) -> list[str]:
    args = raw_args(model, {"big": Path("-"), "valid": Path("-")}, out, *extra)
    for flag in ("--train_file", "--validation_file"):  # the prepared folder is the whole data set
        at = args.index(flag)
        del args[at:at + 2]
    return [*args, "--prepared_data", str(prepared)]


@pytest.fixture(scope="module")
def two_process_runs(tiny_model: Path, texts: dict, big_file_prepared: Path,
                     tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """2 processes x batch 4: from the raw files, and from the prepared folder with a checkpoint at SAVED."""
    root = tmp_path_factory.mktemp("two")
    runs = {"raw": root / "raw", "prepared": root / "prepared"}
    launch(2, raw_args(tiny_model, texts, runs["raw"], "--per_device_train_batch_size", "4"))
    launch(2, prepared_args(tiny_model, big_file_prepared, runs["prepared"], "--per_device_train_batch_size", "4",
                            "--checkpointing_steps", str(SAVED)))
    return runs


def assert_same_curve(expected: dict[int, float], got: dict[int, float]) -> None:
    worst = max(abs(expected[s] - got[s]) / expected[s] for s in got)
    assert worst <= SAME_STEPS, (worst, expected, got)


def eval_losses(out: Path) -> list[float]:
    return [r["eval_loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "eval_loss" in r]


def test_one_process_trains_the_raw_files_curve_from_the_prepared_folder(tiny_model: Path, texts: dict,
                                                                        big_file_prepared: Path,
                                                                        tmp_path: Path) -> None:
    train(parse_args(raw_args(tiny_model, texts, tmp_path / "raw")))
    result = train(parse_args(prepared_args(tiny_model, big_file_prepared, tmp_path / "prepared")))
    raw, prepared = train_losses(tmp_path / "raw"), train_losses(tmp_path / "prepared")
    assert sorted(prepared) == list(range(1, STEPS + 1))
    assert_same_curve(raw, prepared)
    assert eval_losses(tmp_path / "prepared") == pytest.approx(eval_losses(tmp_path / "raw"), rel=SAME_STEPS)
    assert result.eval_before is not None


def test_two_processes_train_the_raw_files_curve_from_the_prepared_folder(two_process_runs: dict) -> None:
    raw, prepared = train_losses(two_process_runs["raw"]), train_losses(two_process_runs["prepared"])
    assert sorted(prepared) == list(range(1, STEPS + 1))
    assert_same_curve(raw, prepared)


@pytest.mark.parametrize(("procs", "batch"), [(2, 4), (1, 8)])
def test_a_prepared_run_resumes_and_resumes_on_another_number_of_processes(
        procs: int, batch: int, two_process_runs: dict, tiny_model: Path, big_file_prepared: Path,
        tmp_path: Path) -> None:
    straight = two_process_runs["prepared"]
    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    name = f"step-{SAVED:07d}"
    shutil.copytree(straight / "checkpoints" / name, out / "checkpoints" / name)
    args = prepared_args(tiny_model, big_file_prepared, out, "--per_device_train_batch_size", str(batch),
                         "--checkpointing_steps", str(SAVED), "--resume_from_checkpoint", "latest")
    if procs == 1:
        train(parse_args(args))
    else:
        launch(procs, args)
    resumed = train_losses(out)
    assert sorted(resumed) == list(range(SAVED + 1, STEPS + 1))
    assert_same_curve(train_losses(straight), resumed)


# --- a `datasets` folder: split as training splits it ------------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two `datasets` folders of the same training files, train-00000.txt to train-00002.txt (1 300, 650
    and 480 lines: the map-style path's batches of 1 000 rows span them), and a test.txt; one also has a
    validation.txt."""
    paragraphs = corpus_paragraphs()
    root = tmp_path_factory.mktemp("folders")
    lines = [paragraphs[(7 * i) % len(paragraphs)] for i in range(2430)]  # shifted: no two chunks alike
    lines[500] = ""
    found = {}
    for name, validation in (("validation", True), ("test", False)):
        folder = found[name] = root / name
        folder.mkdir()
        for number, (first, last) in enumerate(((0, 1300), (1300, 1950), (1950, 2430))):
            (folder / f"train-{number:05d}.txt").write_text("\n".join(lines[first:last]) + "\n")
        (folder / "test.txt").write_text("\n".join(paragraphs[1500:1650]) + "\n")
        if validation:
            (folder / "validation.txt").write_text("\n".join(paragraphs[1650:1799]) + "\n")
    return found


def folder_args(model: Path, folder: Path, out: Path, *extra: str) -> list[str]:
    args = raw_args(model, {"big": Path("-"), "valid": Path("-")}, out, *extra)
    at = args.index("--train_file")
    del args[at:at + 4]  # --train_file and --validation_file
    return [*args, "--dataset_name", str(folder)]


def prepare_folder_args(model: Path, folder: Path, out: Path, *extra: str) -> list[str]:
    return ["--model_name_or_path", str(model), "--dataset_name", str(folder), "--output_dir", str(out),
            "--max_seq_length", "32", "--num_workers", "1", *extra]


def eval_figures(out: Path) -> list[dict[str, float]]:
    keys = ("step", "eval_loss", "perplexity", "eval_accuracy", "eval_bits_per_char", "eval_characters")
    return [{k: r[k] for k in keys}
            for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]


def test_a_datasets_folder_trains_and_evaluates_as_the_raw_folder_once_prepared(tiny_model: Path, folders: dict,
                                                                               tmp_path: Path) -> None:
    folder, prepared = folders["validation"], tmp_path / "prepared"
    for task in ("1", "0"):  # task 0's last chunk reads into task 1's files
        assert prep.main(prepare_folder_args(tiny_model, folder, prepared, "--tasks", "2", "--task", task)) == 0
    train(parse_args(folder_args(tiny_model, folder, tmp_path / "raw")))
    train(parse_args(prepared_args(tiny_model, prepared, tmp_path / "from-prepared")))
    raw, got = train_losses(tmp_path / "raw"), train_losses(tmp_path / "from-prepared")
    assert sorted(got) == list(range(1, STEPS + 1))
    assert_same_curve(raw, got)
    expected, found = eval_figures(tmp_path / "raw"), eval_figures(tmp_path / "from-prepared")
    assert expected and [r["step"] for r in found] == [r["step"] for r in expected]
    for mine, theirs in zip(found, expected, strict=True):
        assert mine == pytest.approx(theirs, rel=SAME_STEPS)
    manifest = json.loads((prepared / fmt.MANIFEST).read_text())
    assert [(Path(s["path"]).name, s["role"]) for s in manifest["sources"]] == [
        ("train-00000.txt", "train"), ("train-00001.txt", "train"), ("train-00002.txt", "train"),
        ("validation.txt", "eval")]
    assert manifest["left_out"] == {"test": [str(folder / "test.txt")]} and manifest["held_out_percent"] == 0


def test_a_folder_with_a_test_split_and_no_validation_is_read_as_training_reads_it(
        tiny_model: Path, folders: dict, tmp_path: Path) -> None:
    """The test split left out, as training leaves it; the validation share held out of the training
    files, as training holds it out (drawn per text here: see docs/prepare.md)."""
    folder = folders["test"]
    cfg = parse_args(folder_args(tiny_model, folder, tmp_path / "raw", "--validation_split_percentage", "0"))
    prepared = tmp_path / "prepared"
    assert prep.main(prepare_folder_args(tiny_model, folder, prepared, "--validation_split_percentage", "0")) == 0
    raw_train, raw_eval = load_text(cfg.data, seed=42)
    assert raw_eval is None
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert blocks(prepared) == {"train": tokenize_dataset(raw_train, tokenizer, cfg.data)["input_ids"], "eval": []}
    corpus = resolve(cfg.data)
    assert [p.name for p in corpus.splits["train"]] == ["train-00000.txt", "train-00001.txt", "train-00002.txt"]
    assert corpus.splits["eval"] == [] and corpus.left_out == {"test": [str(folder / "test.txt")]}
    default = make_plan(parse_args(folder_args(tiny_model, folder, tmp_path / "x")).data, corpus, tokenizer, 42, 1)
    assert default["settings"]["held_out_percent"] == 5


# --- durable parts: on the disk before their marker, checked when read ---------------------------------


def test_a_part_is_on_the_disk_before_its_marker(tiny_model: Path, texts: dict, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The order of what reaches the disk, recorded at os.fsync, os.replace and os.rename (each then
    does its real work): every shard is flushed before the marker is put in place, the part's folder
    after that and before the rename that completes the part, and the parts folder after the rename."""
    events: list[tuple[str, ...]] = []
    real = {name: getattr(os, name) for name in ("fsync", "replace", "rename")}

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real["fsync"](fd)

    def move(name: str) -> object:
        def moved(src: object, dst: object, **kwargs: object) -> None:
            events.append((name, str(src), str(dst)))
            real[name](src, dst, **kwargs)
        return moved

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", move("replace"))
    monkeypatch.setattr(os, "rename", move("rename"))
    out = tmp_path / "out"
    assert prep.main(prepare_args(tiny_model, texts["corpus"], out, "--validation_file", str(texts["valid"]))) == 0
    monkeypatch.undo()
    parts = out / fmt.PARTS
    part = parts / "task-00000-of-00001"
    completed = next(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(part))
    tmp = Path(events[completed][1])
    marker = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(tmp / fmt.MARKER))
    shards = sorted(p.name for p in part.glob("*.arrow"))
    assert {name.split("-")[0] for name in shards} == {"train", "eval"}
    for name in shards:
        assert ("fsync", str(tmp / name)) in events[:marker], name
    assert ("fsync", str(tmp)) in events[marker:completed]
    assert ("fsync", str(parts)) in events[completed:]


def test_a_part_cut_short_after_its_marker_is_set_aside_and_redone(tiny_model: Path, texts: dict, one_worker: Path,
                                                                   tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"

    def task(number: int) -> list[str]:
        return prepare_args(tiny_model, texts["corpus"], out, "--validation_file", str(texts["valid"]), "--tasks",
                            "2", "--task", str(number))

    assert prep.main(task(0)) == 0
    shard = out / fmt.PARTS / "task-00000-of-00002" / "train-f00000.arrow"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)  # what a crash leaves of data never flushed
    capsys.readouterr()
    assert prep.main(task(1)) == 2  # the last task, which would write the manifest
    lines = error_lines(capsys.readouterr().err, "mlm_ddp.prepare")
    assert len(lines) == 1 and f"{shard}: {size // 2} bytes, where its task wrote" in lines[0], lines
    assert f"{size} bytes before marking its part complete" in lines[0] and "redo that task" in lines[0]
    assert not (out / fmt.MANIFEST).exists() and not fmt.part_complete(out, 0, 2)
    assert prep.main(task(0)) == 0  # the same command again redoes task 0 and writes the manifest
    assert blocks(out) == blocks(one_worker)


def test_training_refuses_a_shard_that_lost_its_tail_after_the_manifest(one_worker: Path, tiny_model: Path,
                                                                        tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    """Its size kept and its tail zeros, as some filesystems leave a file after a crash: Arrow reads the
    zeros as the end of the stream, so only the count of its blocks tells."""
    damaged, out = tmp_path / "damaged", tmp_path / "run"
    shutil.copytree(one_worker, damaged)
    entry = next(s for s in json.loads((damaged / fmt.MANIFEST).read_text())["shards"] if s["split"] == "train")
    shard = damaged / entry["path"]
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2] + bytes(len(data) - len(data) // 2))
    line = refused(prepared_args(tiny_model, damaged, out), capsys, out)
    assert line.startswith(f"mlm_ddp.train: error: {shard}: "), line
    assert f"the manifest says {entry['blocks']} blocks in {entry['bytes']} bytes" in line, line
    assert line.endswith("prepare it again"), line


# --- a task killed mid-write ------------------------------------------------------------------------


def test_a_task_killed_mid_write_is_redone_alone_and_the_result_is_unchanged(
        tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    paragraphs = corpus_paragraphs()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, share in (("a.txt", paragraphs[:900]), ("b.txt", paragraphs[900:])):  # ~2 s of work each
        (corpus / name).write_text("\n".join(share * 12) + "\n")
    straight, out = tmp_path / "straight", tmp_path / "killed"
    assert prep.main(prepare_args(tiny_model, corpus, straight)) == 0

    def task(number: int) -> list[str]:
        return prepare_args(tiny_model, corpus, out, "--tasks", "2", "--task", str(number))

    assert prep.main(task(0)) == 0
    done = {p: p.stat().st_mtime_ns for p in (out / fmt.PARTS / "task-00000-of-00002").iterdir()}
    victim = subprocess.Popen([sys.executable, "-m", "mlm_ddp.prepare", *task(1)], cwd=REPO,
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not any(p.stat().st_size for p in (out / fmt.PARTS).glob(".tmp-task-00001-of-00002.*/*.arrow")):
        assert victim.poll() is None, "the task ended before it was killed: give it more to do"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    # nothing of the killed task is taken for a part, and no manifest claims the folder is ready
    assert not (out / fmt.PARTS / "task-00001-of-00002").exists() and not (out / fmt.MANIFEST).exists()
    assert "no manifest.json" in refused(prepared_args(tiny_model, out, tmp_path / "refused"), capsys,
                                         tmp_path / "refused")
    again = []  # the same command, for every task: its exit code and what it said
    for number in (0, 1):
        again.append((prep.main(task(number)), capsys.readouterr().err))
    assert [code for code, _ in again] == [0, 0], again
    assert "task 0 of 2: already complete" in again[0][1]
    assert {p: p.stat().st_mtime_ns for p in (out / fmt.PARTS / "task-00000-of-00002").iterdir()} == done
    assert "task 1 of 2: 1 file(s)" in again[1][1]
    assert blocks(out) == blocks(straight)
    assert sorted(p.name for p in (out / fmt.PARTS).iterdir()) == ["task-00000-of-00002", "task-00001-of-00002"]


# --- bad input: exit 2, one line, nothing half-written used ---------------------------------------------


@contextlib.contextmanager
def full_disk(folder: Path) -> Iterator[object]:
    """`folder` on a 256 KiB tmpfs (a disk that fills); where mounting is not allowed, the same write
    failure from a file-size limit on the child process (EFBIG instead of ENOSPC). Yields the child's
    preexec_fn."""
    folder.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)],
                             capture_output=True).returncode == 0

    def limit() -> None:
        if not mounted:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    try:
        yield limit
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)


def bad_file(kind: str, root: Path) -> Path:
    """A training folder whose second file is bad in one way."""
    folder = root / kind
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in corpus_paragraphs()[:50]))
    content = {"empty": "", "blank": "\n \n\t\n",
               "blank values": json.dumps({"text": " "}) + "\n" + json.dumps({"text": ""}) + "\n",
               "not json": "{\"text\": \"cut off\n{{{\n",
               "no text column": json.dumps({"body": "a text"}) + "\n",
               "numbers": json.dumps({"text": "a text"}) + "\n" + json.dumps({"text": 5}) + "\n"}[kind]
    (folder / "b.jsonl").write_text(content)
    return folder


@pytest.mark.parametrize("weights", [[], ["--train_weights", "0.9", "0.1"]])
def test_two_sources_are_refused_with_the_way_to_mix_them(weights: list[str], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    """Several --train_file sources: one line that says to prepare each and mix the folders (before, without
    weights, it asked for --train_weights, which prepare then refused too)."""
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("a line of text\n")
    out = tmp_path / "out"
    argv = ["--train_file", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), *weights, "--output_dir", str(out)]
    assert prep.main(argv) == 2
    lines = error_lines(capsys.readouterr().err, "mlm_ddp.prepare")
    assert len(lines) == 1 and "prepare writes one corpus, not 2 --train_file sources: prepare each source into " \
        "its own folder and mix the folders in training" in lines[0], lines
    assert not out.exists()


@pytest.mark.parametrize(("kind", "words"), [
    ("empty", "b.jsonl: the file is empty; remove it from --train_file"),
    ("blank", "b.jsonl: the file holds only blank lines, no text; remove it from --train_file"),
    ("blank values", "b.jsonl: holds no texts (every line or 'text' value is blank)"),
    ("not json", "b.jsonl: cannot be read as json"),
    ("no text column", "b.jsonl: no text column 'text'; columns found: body"),
    ("numbers", "b.jsonl: column 'text' holds int values, not text; pass --text_column with a column of text"),
])
def test_a_bad_input_file_stops_prepare_with_one_line_and_no_part(kind: str, words: str, tiny_model: Path,
                                                                  tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    """Found before any work or while reading: the prepare this command began leaves nothing, no plan.json (which a
    fixed rerun would have to match) and no .tmp part (a file found bad mid-read is the case that could leave both)."""
    out = tmp_path / "out"
    assert prep.main(prepare_args(tiny_model, bad_file(kind, tmp_path), out)) == 2
    lines = error_lines(capsys.readouterr().err, "mlm_ddp.prepare")
    assert len(lines) == 1 and words in lines[0], lines
    assert not out.exists()


def test_a_disk_that_fills_stops_prepare_with_one_line_and_a_rerun_finishes(tiny_model: Path, texts: dict,
                                                                            one_worker: Path, tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    flags = ("--validation_file", str(texts["valid"]))
    small = tmp_path / "small"
    with full_disk(small) as limit:
        proc = run_prepare(prepare_args(tiny_model, texts["corpus"], small / "out", *flags), preexec=limit)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = error_lines(proc.stderr, "mlm_ddp.prepare")
        assert len(lines) == 1 and "could not be written" in lines[0] and "run the same command again" in lines[0]
        assert not list((small / "out").rglob(fmt.MARKER)) and not (small / "out" / fmt.MANIFEST).exists()
        leftover = tmp_path / "moved"
        shutil.copytree(small / "out", leftover)  # the same folder, on a disk with room
    assert prep.main(prepare_args(tiny_model, texts["corpus"], leftover, *flags)) == 0, capsys.readouterr().err
    assert blocks(leftover) == blocks(one_worker)


@pytest.mark.parametrize(("change", "words"), [
    (("--max_seq_length", "64"), "holds a prepare of other settings"),
    (("--train_file", "OTHER"), "holds a prepare of other inputs"),
])
def test_a_folder_of_another_prepare_is_refused(change: tuple[str, str], words: str, one_worker: Path,
                                                tiny_model: Path, texts: dict, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "copy"
    shutil.copytree(one_worker, out)
    before = sorted((p, p.stat().st_mtime_ns) for p in out.rglob("*"))
    value = str(texts["big"]) if change[1] == "OTHER" else change[1]
    args = prepare_args(tiny_model, texts["corpus"], out, "--validation_file", str(texts["valid"]), change[0], value)
    assert prep.main(args) == 2
    lines = error_lines(capsys.readouterr().err, "mlm_ddp.prepare")
    assert len(lines) == 1 and words in lines[0] and "--overwrite_output_dir" in lines[0], lines
    assert sorted((p, p.stat().st_mtime_ns) for p in out.rglob("*")) == before  # nothing touched
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert prep.main(prepare_args(tiny_model, texts["corpus"], tmp_path / "other")) == 2
    assert "is not empty and holds no prepare" in capsys.readouterr().err


def refused(args: list[str], capsys: pytest.CaptureFixture, out: Path) -> str:
    assert train_main(args) == 2
    lines = error_lines(capsys.readouterr().err, "mlm_ddp.train")
    assert len(lines) == 1, lines
    assert not out.exists()  # refused before anything is written
    return lines[0]


@pytest.mark.parametrize(("extra", "words"), [
    (("--max_seq_length", "16"), "holds blocks of 32 tokens and this run's --max_seq_length is 16; pass "
                                 "--max_seq_length 32"),
    (("--line_by_line",), "was prepared packed and this run asks for line_by_line; drop --line_by_line"),
    (("--whole_word_mask",), "prepared without word boundaries and this run asks for --whole_word_mask"),
    (("--train_file", "x.txt"), "--prepared_data is the whole data set, already tokenized: drop --train_file"),
    (("--streaming", "--max_train_steps", "2"), "drop --streaming"),
])
def test_training_refuses_a_prepared_folder_it_would_read_wrongly(extra: tuple[str, ...], words: str,
                                                                 one_worker: Path, tiny_model: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    assert words in refused(prepared_args(tiny_model, one_worker, out, *extra), capsys, out)


def test_training_refuses_another_tokenizers_folder_and_a_damaged_one(one_worker: Path, tiny_model: Path,
                                                                     tiny_bpe_model: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    line = refused(prepared_args(tiny_bpe_model, one_worker, out), capsys, out)
    theirs = json.loads((one_worker / fmt.MANIFEST).read_text())["tokenizer"]["fingerprint"]
    assert "was tokenized by another tokenizer" in line and theirs in line and "than this run's" in line
    damaged = tmp_path / "damaged"
    shutil.copytree(one_worker, damaged)
    shard = next((damaged / fmt.PARTS).rglob("train-*.arrow"))
    shard.unlink()
    assert f"{shard}: missing, the manifest says" in refused(prepared_args(tiny_model, damaged, out), capsys, out)
    (damaged / fmt.MANIFEST).unlink()
    assert "no manifest.json, so not a finished mlm_ddp.prepare folder (it holds a plan" in refused(
        prepared_args(tiny_model, damaged, out), capsys, out)


def test_a_text_long_enough_to_take_gigabytes_is_named_and_still_prepared(tiny_model: Path, tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture) -> None:
    source = tmp_path / "long.txt"
    words = "the tokenizer holds every token of one text at once "
    long_text = words * (LONG_TEXT // len(words) + 1)
    source.write_text(f"a short first text of a few words\n{long_text}\nand a short last one\n")
    assert prep.main(prepare_args(tiny_model, source, tmp_path / "out")) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warned == [f"mlm_ddp.prepare: warning: {source}, text 2: {len(long_text) / 1e6:.1f}M characters in one "
                      "text; the tokenizer holds all its tokens at once (measured: 4 GB for 27M characters): split "
                      "such texts into lines"]
    manifest = json.loads((tmp_path / "out" / fmt.MANIFEST).read_text())
    assert manifest["counts"]["texts"] == 3


def test_a_worker_killed_for_memory_fails_the_task_at_once_not_a_hang(tiny_model: Path, tmp_path: Path) -> None:
    source = tmp_path / "corpus.txt"
    source.write_text("\n".join(corpus_paragraphs() * 12) + "\n")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "mlm_ddp.prepare",
                             *prepare_args(tiny_model, source, out, "--num_workers", "2")],
                            cwd=REPO, stderr=subprocess.PIPE, text=True)

    def workers() -> list[int]:  # the pool's processes: children of prepare started by multiprocessing
        found = []
        for status in Path("/proc").glob("[0-9]*/status"):
            with contextlib.suppress(OSError):
                if f"\nPPid:\t{proc.pid}\n" in status.read_text() and \
                        b"spawn_main" in (status.parent / "cmdline").read_bytes():
                    found.append(int(status.parent.name))
        return found

    deadline = time.monotonic() + 300
    while not any(p.stat().st_size for p in out.glob(f"{fmt.PARTS}/.tmp-*/*.arrow")) or not workers():
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(workers()[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)  # a multiprocessing.Pool would wait for the lost chunk forever
    assert proc.returncode == 1, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("mlm_ddp.prepare: error:")]
    assert len(lines) == 1 and "a tokenizing worker process died" in lines[0], err[-2000:]
    assert not list(out.rglob(fmt.MARKER)) and not (out / fmt.MANIFEST).exists()
