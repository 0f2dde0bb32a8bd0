"""`python -m mlm_ddp.prepare` over Slurm array tasks on the real two-node test cluster
(tests/slurm_cluster.sh): `sbatch --array=0-1 slurm/prepare.sh` and `--nodes 2` through Submitit each
give exactly the blocks of one local prepare, in the same order, with the files split between the
tasks; a relaunch after a task lost its part redoes that task only and leaves the complete one alone."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from datasets import Dataset

from mlm_ddp.prepare import main as prepare_main
from tests.conftest import REPO, corpus_paragraphs, run_module
from tests.test_slurm import ENDED, job_state

PARTITION = "test"  # the partition of tests/slurm_cluster.sh
SPLITS = ("train", "eval")
PART0, PART1 = "parts/task-00000-of-00002", "parts/task-00001-of-00002"


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four .txt files of unequal sizes (2300, 700, 250 and 80 lines, about 0.75 MB in all): the first
    spans three chunks of 1000 rows, its last one running on through the whole second file, and the
    fourth chunk spans the last two files; the first file's bytes are about those of the three others
    together, so balancing by bytes gives each of two tasks a share."""
    paragraphs = corpus_paragraphs()
    root = tmp_path_factory.mktemp("prepare_texts")
    # more lines than the corpus has paragraphs: they repeat, shifted, so no two chunks are alike
    (root / "a.txt").write_text("\n".join(paragraphs[(7 * i) % len(paragraphs)] for i in range(2300)) + "\n")
    (root / "b.txt").write_text("\n".join(paragraphs[300:1000]) + "\n")
    (root / "c.txt").write_text("\n".join(paragraphs[1000:1250]) + "\n")
    (root / "d.txt").write_text("\n".join(paragraphs[1250:1330]) + "\n")
    return root


def flags(tiny_model: Path, texts: Path, out: Path) -> list[str]:
    """The prepare flags every run here shares (5% of the texts held out: both splits are compared)."""
    return ["--model_name_or_path", str(tiny_model), "--train_file", str(texts), "--output_dir", str(out),
            "--max_seq_length", "32"]


def blocks(folder: Path) -> dict[str, list[list[int]]]:
    """split -> every block of the folder, its shards read in the manifest's order."""
    manifest = json.loads((folder / "manifest.json").read_text())
    found: dict[str, list[list[int]]] = {split: [] for split in SPLITS}
    for shard in manifest["shards"]:
        found[shard["split"]] += Dataset.from_file(str(folder / shard["path"])).data.column("input_ids").to_pylist()
    return found


def shard_counts(folder: Path) -> tuple[dict, list[tuple]]:
    """The manifest's counts, and (split, input file, blocks, tokens) of its shards in order."""
    manifest = json.loads((folder / "manifest.json").read_text())
    return manifest["counts"], [(s["split"], s["file"], s["blocks"], s["tokens"]) for s in manifest["shards"]]


@pytest.fixture(scope="module")
def local(tiny_model: Path, texts: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One task, one worker, here: the reference."""
    out = tmp_path_factory.mktemp("prepare_local") / "prepared"
    assert prepare_main([*flags(tiny_model, texts, out), "--num_workers", "1"]) == 0
    found = blocks(out)
    # what makes the comparisons worth something: both splits hold blocks, a.txt spans several chunks
    assert len(found["train"]) > 2000 and len(found["eval"]) > 50, {s: len(b) for s, b in found.items()}
    return {"out": out, "blocks": found, "counts": shard_counts(out)}


def submit_array(env: dict, args: list[str], logs: Path) -> str:
    """`sbatch --array=0-1 slurm/prepare.sh ARGS` from the repository; the array's job id."""
    log = str(logs / "prepare-%A_%a.out")
    proc = subprocess.run(["sbatch", "--parsable", "--array=0-1", "-o", log, "-e", log, "slurm/prepare.sh", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def wait_array(env: dict, job: str, logs: Path, timeout: float = 300) -> dict[int, tuple[str, str]]:
    """task -> (its final state, its log), once both tasks of the array ended."""
    deadline = time.monotonic() + timeout
    states = {}
    while time.monotonic() < deadline:
        states = {task: job_state(env, f"{job}_{task}") for task in (0, 1)}
        if all(state in ENDED for state in states.values()):
            return {task: (state, (logs / f"prepare-{job}_{task}.out").read_text()) for task, state in states.items()}
        time.sleep(0.5)
    raise AssertionError(f"array job {job} not done after {timeout} s: {states}")


@pytest.fixture(scope="module")
def array(slurm: dict, tiny_model: Path, texts: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`sbatch --array=0-1 slurm/prepare.sh` with the flags of the local prepare, but the script's own
    --num_workers (the 2 CPUs each task holds): neither the tasks nor the workers may change a block."""
    root = tmp_path_factory.mktemp("prepare_array")
    out = root / "prepared"
    job = submit_array(slurm, flags(tiny_model, texts, out), root)
    return {"out": out, "ended": wait_array(slurm, job, root)}


def test_two_array_tasks_give_the_blocks_of_one_local_prepare(array: dict, local: dict) -> None:
    out = array["out"]
    for task, (state, log) in array["ended"].items():
        assert state == "COMPLETED", log[-3000:]
        assert f"task {task} of 2: " in log and "on 2 worker(s)" in log, log[-3000:]
    assert (out / "manifest.json").is_file()
    assert blocks(out) == local["blocks"]
    assert shard_counts(out) == local["counts"]
    # the work was split: each task read its own input files, together all of them, each once, and
    # wrote the shards of the chunks that begin in them (a chunk that begins in the first file ends in
    # the second, which begins none): both tasks packed some
    files = [{r["file"] for r in json.loads((out / part / "part.json").read_text())["files"]}
             for part in (PART0, PART1)]
    assert files[0] and files[1] and not files[0] & files[1] and files[0] | files[1] == {0, 1, 2, 3}, files
    for part, mine in zip((PART0, PART1), files, strict=True):
        packed = {int(p.stem[-5:]) for p in (out / part).glob("*.arrow")}
        assert packed and packed <= mine, (packed, mine)


def test_nodes_2_through_submitit_gives_the_blocks_of_one_local_prepare(
        slurm: dict, tiny_model: Path, texts: Path, local: dict, tmp_path: Path) -> None:
    out = tmp_path / "prepared"
    proc = run_module(["mlm_ddp.prepare", *flags(tiny_model, texts, out), "--num_workers", "1", "--nodes", "2",
                       "--cluster", "slurm", "--partition", PARTITION], env=slurm, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "submitted 2 array task(s) of 2" in proc.stderr, proc.stderr
    assert all((out / part / "COMPLETE").is_file() for part in (PART0, PART1))
    assert blocks(out) == local["blocks"]
    assert shard_counts(out) == local["counts"]


def test_a_relaunch_redoes_only_the_task_without_its_marker(slurm: dict, tiny_model: Path, texts: Path, array: dict,
                                                            local: dict, tmp_path: Path) -> None:
    # a copy of the array's folder (the plan names the inputs, not the folder) that lost task 1's part
    # and so its manifest, as when task 1 died before its rename
    out = tmp_path / "prepared"
    shutil.copytree(array["out"], out)
    (out / "manifest.json").unlink()
    shutil.rmtree(out / PART1)
    kept = {p: p.stat().st_mtime_ns for p in [out / PART0, *(out / PART0).iterdir(), out / "plan.json"]}
    redo = json.loads((out / "plan.json").read_text())["assignment"][1]
    job = submit_array(slurm, flags(tiny_model, texts, out), tmp_path)
    ended = wait_array(slurm, job, tmp_path)
    for state, log in ended.values():
        assert state == "COMPLETED", log[-3000:]
    assert f"task 0 of 2: already complete ({out / PART0})" in ended[0][1], ended[0][1]
    assert f"task 1 of 2: {len(redo)} file(s)" in ended[1][1] and "already" not in ended[1][1], ended[1][1]
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    assert (out / PART1 / "COMPLETE").is_file() and (out / "manifest.json").is_file()
    assert blocks(out) == local["blocks"]
    assert shard_counts(out) == local["counts"]
