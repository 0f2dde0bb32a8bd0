"""Generated configurations and the properties every run must keep (docs/design.md, pitfall 12).

Over map-style and streamed data and mixtures of two sources, 1 and 2 processes, accumulation 1 to 4,
data so small that some rank gets fewer micro-batches than a window, checkpoints by steps and by epoch,
and resumes into the same and into another folder, every run either

- finishes with exactly the expected optimizer steps and checkpoints (a resumed one continuing the
  uninterrupted curve), changing nothing outside its own output folder, or
- stops at once with exit code 2 and one error line, changing nothing at all;

and no run hangs (each batch of runs has a time limit); a mixture on 2 processes trains the per-step losses
of 1 process. The expected numbers are computed here from
the token counts, independently of the training code. Runs of the same process count share one
start-up (tests/matrix_driver.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import (
    SAME_STEPS,
    TINY_PEAK_TFLOPS,
    BySource,
    corpus_paragraphs,
    exact_lines,
    launch_runs,
    recorded_batches,
    trained_blocks,
)

SEQ = 16
STREAM_STEPS, STREAM_EVERY = 5, 2
EPOCHS = 2
RUN_BOUND_S = 60  # one tiny run takes about a second; a livelock or a hang would take forever


@dataclass
class Case:
    id: str
    procs: int
    argv: list[str]
    out: Path
    exit: int = 0
    steps: int | None = None
    checkpoints: list[int] = field(default_factory=list)
    resumes_from: tuple[str, int] | None = None  # (case id, step) of the checkpoint it continues
    same_curve_as: str | None = None  # the case (of another topology) whose per-step losses it trains


def words_lines(count: int, offset: int) -> list[str]:
    """`count` short lines of real text (1 to 3 words), so block counts move in steps of one."""
    words = " ".join(corpus_paragraphs()[offset: offset + 40]).split()
    lines, at = [], 0
    for i in range(count):
        n = 1 + (i * 7 + offset) % 3
        lines.append(" ".join(words[at: at + n]))
        at += n
    return lines


def blocks(tokenizer, lines: list[str]) -> int:
    """Packed blocks of SEQ tokens: every text is [CLS] text [SEP], all concatenated, the rest kept."""
    tokens = sum(len(tokenizer(line)["input_ids"]) for line in lines)
    return math.ceil(tokens / SEQ)


def epoch_checkpoints(steps: int, per_epoch: int, accumulation: int) -> list[int]:
    """The steps that read the last micro-batch of an epoch: a window may run across the epoch end."""
    return [s for s in range(1, steps + 1)
            if (s * accumulation) // per_epoch > ((s - 1) * accumulation) // per_epoch]


def mixstream_files(tokenizer, root: Path) -> list[Path]:
    """The streamed mixtures' two sources: 5 and 3 texts of exactly SEQ tokens, each one block."""
    files = [root / "data" / "mixstream-a.txt", root / "data" / "mixstream-b.txt"]
    for path, count, offset in zip(files, (5, 3), (60, 90), strict=True):
        if not path.exists():
            lines = exact_lines(tokenizer, corpus_paragraphs()[offset:offset + 10], count, SEQ)
            path.write_text("\n".join(lines) + "\n")
    return files


def build_cases(tiny_model: Path, root: Path) -> list[Case]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    cases: list[Case] = []

    def base(case_id: str, train_file: Path, batch: int, accumulation: int, *extra: str) -> tuple[list[str], Path]:
        out = root / case_id
        return [
            "--model_name_or_path", str(tiny_model), "--train_file", str(train_file), "--output_dir", str(out),
            "--validation_split_percentage", "0", "--max_seq_length", str(SEQ),
            "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", str(accumulation),
            "--learning_rate", "1e-3", "--num_warmup_steps", "0", "--logging_steps", "1", "--report", "false",
            # a given peak, as tiny_args gives: no second of matmuls at each run's start (measured: 1.2 s of a run's
            # 1.5 s); that the measurement leaves the resumed curve alone is tests/test_resume.py's to check
            "--peak_tflops", str(TINY_PEAK_TFLOPS), "--cpu_threads", "1", "--mixed_precision", "no", *extra,
        ], out

    def map_cases(prefix: str, procs: int, path: Path, batch: int, per_epoch: int) -> None:
        """Accumulation 1..4 over EPOCHS epochs of `per_epoch` micro-batches, a checkpoint per epoch."""
        for ga in range(1, 5):
            argv, out = base(f"{prefix}-ga{ga}", path, batch, ga, "--num_train_epochs", str(EPOCHS),
                             "--checkpointing_steps", "epoch")
            steps = math.ceil(EPOCHS * per_epoch / ga)
            cases.append(Case(out.name, procs, argv, out, steps=steps,
                              checkpoints=epoch_checkpoints(steps, per_epoch, ga)))

    # map-style, one process: micro-batches per epoch 1..7 (batch 1) x accumulation 1..4, 2 epochs,
    # a checkpoint at each epoch end
    files: dict[int, Path] = {}
    for n in range(1, 80):
        lines = words_lines(n, 0)
        count = blocks(tokenizer, lines)
        if count <= 7 and count not in files:
            files[count] = root / "data" / f"map-{count}.txt"
            files[count].parent.mkdir(parents=True, exist_ok=True)
            files[count].write_text("\n".join(lines) + "\n")
    assert sorted(files) == list(range(1, 8)), sorted(files)
    for per_epoch, path in sorted(files.items()):
        map_cases(f"map-p1-b{per_epoch}", 1, path, 1, per_epoch)

    # map-style, two processes, batch 2: the last global batch is filled up by repeating blocks
    for size in (5, 13):
        lines = words_lines(size, 3)
        path = root / "data" / f"map2-{size}.txt"
        path.write_text("\n".join(lines) + "\n")
        map_cases(f"map-p2-n{size}", 2, path, 2, math.ceil(blocks(tokenizer, lines) / (2 * 2)))

    # streams: one file (one shard), read in one chunk; with 2 processes rank r keeps texts r, r+2, ...
    # A rank whose part gives fewer micro-batches than a window can never fill a step: exit 2.
    for size in (6, 24):
        lines = words_lines(size, 5)
        path = root / "data" / f"stream-{size}.txt"
        path.write_text("\n".join(lines) + "\n")
        for procs in (1, 2):
            per_rank = [math.ceil(blocks(tokenizer, lines[r::procs]) / 2) for r in range(procs)]  # batch 2
            for ga in range(1, 5):
                argv, out = base(f"stream-p{procs}-n{size}-ga{ga}", path, 2, ga, "--streaming",
                                 "--max_train_steps", str(STREAM_STEPS), "--checkpointing_steps", str(STREAM_EVERY),
                                 "--shuffle_buffer_size", "1000")
                if min(per_rank) < ga:
                    cases.append(Case(out.name, procs, argv, out, exit=2))
                else:
                    cases.append(Case(out.name, procs, argv, out, steps=STREAM_STEPS,
                                      checkpoints=list(range(STREAM_EVERY, STREAM_STEPS + 1, STREAM_EVERY))))
        # a stream has no epoch end known in advance: refused at once
        for procs in (1, 2):
            argv, out = base(f"stream-p{procs}-n{size}-epoch", path, 2, 1, "--streaming", "--max_train_steps", "3",
                             "--checkpointing_steps", "epoch")
            cases.append(Case(out.name, procs, argv, out, exit=2))

    # mixtures: two files above, each read several times over, dropout off; 2 processes x batch 2
    # train the steps of 1 process x batch 4 (one global batch, so the same blocks from the same sources);
    # streamed mixtures finish and resume exactly (their blocks depend on the ranks' parts, as one stream's)
    no_dropout = ["--config_overrides", "hidden_dropout_prob=0,attention_probs_dropout_prob=0"]
    for procs, batch in ((1, 4), (2, 2)):
        for ga in (1, 2):
            argv, out = base(f"mix-p{procs}-ga{ga}", files[7], batch, ga, "--train_file", str(files[7]),
                             str(root / "data" / "map2-13.txt"), "--train_weights", "0.6", "0.4", *no_dropout,
                             "--max_train_steps", "6", "--checkpointing_steps", "2")
            cases.append(Case(out.name, procs, argv, out, steps=6, checkpoints=[2, 4, 6],
                              same_curve_as=f"mix-p1-ga{ga}" if procs == 2 else None))
        # streamed: each rank reads its parts of both sources, which run out and restart within the run; every
        # text is one block (test_a_streamed_mixture_resumed_on_another_number_of_processes_keeps_its_counts)
        argv, out = base(f"mixstream-p{procs}", files[7], 2, 1, "--streaming", "--train_file",
                         *map(str, mixstream_files(tokenizer, root)),
                         "--train_weights", "0.6", "0.4", "--max_train_steps", str(STREAM_STEPS),
                         "--checkpointing_steps", str(STREAM_EVERY), "--shuffle_buffer_size", "4")
        cases.append(Case(out.name, procs, argv, out, steps=STREAM_STEPS,
                          checkpoints=list(range(STREAM_EVERY, STREAM_STEPS + 1, STREAM_EVERY))))

    # resumes from the first checkpoint of finished runs (one in two), alternately into the same folder
    # (the later checkpoints are set aside) and into a fresh one; and into another run's folder: refused
    finished = [c for c in cases if c.exit == 0 and c.checkpoints and c.checkpoints[0] < c.steps]
    for i, case in enumerate(finished[::2]):
        step = case.checkpoints[0]
        source = case.out / "checkpoints" / f"step-{step:07d}"
        same = i % 2 == 0
        out = case.out if same else root / f"{case.id}-resumed"
        argv = [*case.argv, "--output_dir", str(out), "--resume_from_checkpoint", str(source)]
        cases.append(Case(f"{case.id}-resume-{'same' if same else 'other'}", case.procs, argv, out,
                          steps=case.steps, checkpoints=case.checkpoints, resumes_from=(case.id, step)))
    for procs in (1, 2):
        donor, victim = [c for c in finished if c.procs == procs][:2]
        source = donor.out / "checkpoints" / f"step-{donor.checkpoints[0]:07d}"
        argv = [*donor.argv, "--output_dir", str(victim.out), "--resume_from_checkpoint", str(source)]
        cases.append(Case(f"{donor.id}-into-{victim.id}", procs, argv, victim.out, exit=2))
    return cases


def run_all(cases: list[Case], procs: int, root: Path) -> dict[str, dict]:
    """Every case of `procs` processes under one start-up, with a time limit for them all."""
    mine = [c for c in cases if c.procs == procs]
    return launch_runs([{"id": c.id, "argv": c.argv, "out": str(c.out), "root": str(root)} for c in mine],
                       root.parent / f"{root.name}-results-p{procs}", procs,  # outside root: written while others run
                       timeout=RUN_BOUND_S * len(mine))


@pytest.fixture(scope="module")
def matrix(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Case], dict[str, dict]]:
    root = tmp_path_factory.mktemp("matrix")
    cases = build_cases(tiny_model, root)
    results = {**run_all(cases, 1, root), **run_all(cases, 2, root)}
    return cases, results


def check(case: Case, result: dict, cases: dict[str, Case], curves: dict[str, dict[int, float]]) -> None:
    assert result["elapsed"] < RUN_BOUND_S
    if case.exit != 0:
        assert result["exit"] == case.exit, result
        assert len(result["errors"]) == 1 and result["errors"][0].startswith("mlm_ddp.train: error:"), result
        assert result["changed"] == [], result  # nothing written, nothing removed
        return
    assert result["exit"] == 0, result
    assert result["changed_outside"] == [], result
    assert result["summary_steps"] == case.steps
    if result["sources"] is not None:  # a mixture's: what each source gave, counted on every rank, added up
        assert sum(s["tokens"] for s in result["sources"]) == result["tokens_seen"], result
    curve = {int(k): v for k, v in result["curve"].items()}
    if case.resumes_from is None:
        assert sorted(curve) == list(range(1, case.steps + 1))
        assert result["checkpoints"] == case.checkpoints
        if case.same_curve_as is not None:
            reference = curves[case.same_curve_as]
            assert all(abs(curve[s] - reference[s]) <= SAME_STEPS * abs(reference[s]) + 1e-7 for s in curve), (
                curve, reference)
        return
    source_id, step = case.resumes_from
    same_folder = case.out == cases[source_id].out
    assert sorted(curve) == list(range(1 if same_folder else step + 1, case.steps + 1))
    reference = curves[source_id]  # the uninterrupted run's curve, recorded before any resume
    # a step whose micro-batches drew no mask has loss 0: compare with an absolute floor
    assert all(abs(curve[s] - reference[s]) <= SAME_STEPS * abs(reference[s]) + 1e-7 for s in curve), (curve, reference)
    later = [s for s in case.checkpoints if s > step]
    assert result["checkpoints"] == (case.checkpoints if same_folder else later)
    # the abandoned run's later checkpoints: kept, but where neither `latest` nor rotation looks
    assert result["aside"] == ([f"checkpoints/abandoned-after-step-{step:07d}/step-{s:07d}" for s in later]
                               if same_folder else [])


def test_every_generated_run_finishes_exactly_or_stops_at_once(matrix) -> None:
    cases, results = matrix
    by_id = {c.id: c for c in cases}
    assert set(results) == set(by_id)
    # each uninterrupted curve as recorded right after its run (a resume into the same folder rewrites it)
    curves = {c.id: {int(k): v for k, v in results[c.id]["curve"].items()}
              for c in cases if c.resumes_from is None and c.exit == 0}
    failures = []
    for case in cases:
        try:
            check(case, results[case.id], by_id, curves)
        except Exception as err:  # noqa: BLE001 - every broken property is listed, not only the first
            failures.append(f"{case.id}: {type(err).__name__}: {str(err)[:600]}")
    assert not failures, f"{len(failures)} of {len(cases)} runs broke a property:\n" + "\n".join(failures)
    # the matrix holds each kind of outcome, for 1 and 2 processes
    kinds = {(c.procs, c.exit, c.resumes_from is not None) for c in cases}
    assert {(p, e, r) for p in (1, 2) for e, r in ((0, False), (2, False), (0, True))} <= kinds


def test_a_streamed_mixture_resumed_on_another_number_of_processes_keeps_its_counts(
        matrix, tiny_model: Path, tmp_path: Path) -> None:
    """The 2-process streamed mixture's checkpoint at step 2, resumed on 1 process (4 blocks per device: the global
    batch kept) to its last step, 5: each source's blocks and tokens are the checkpoint's (all ranks) plus what this
    run's batches held, told by their tokens (every text is one block), and add up to tokens_seen; each part
    starts a pass no part had begun (counts restarted from zero would not)."""
    from transformers import AutoTokenizer

    from mlm_ddp.data.masking import EPOCH_KEY, TRAIN_SPLIT
    from mlm_ddp.train import main

    cases, _ = matrix
    case = next(c for c in cases if c.id == "mixstream-p2")
    checkpoint = case.out / "checkpoints" / f"step-{STREAM_EVERY:07d}"
    saved = json.loads((checkpoint / "trainer_state.json").read_text())
    assert sum(s["tokens"] for s in saved["sources"]) == saved["tokens_seen"] > 0
    out = tmp_path / "elastic"
    with recorded_batches() as made:
        assert main([*case.argv, "--output_dir", str(out), "--resume_from_checkpoint", str(checkpoint),
                     "--per_device_train_batch_size", "4"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    files = mixstream_files(tokenizer, case.out.parent)
    by_source = BySource(tokenizer, {"mixstream-a": files[0], "mixstream-b": files[1]}, SEQ)
    steps = trained_blocks(made)
    assert len(steps) == STREAM_STEPS - STREAM_EVERY
    counted = by_source.count([block for step in steps for block in step])
    summary = json.loads((out / "summary.json").read_text())
    before = {s["name"]: s for s in saved["sources"]}
    assert [(s["name"], s["blocks"], s["tokens"]) for s in summary["sources"]] == [
        (name, before[name]["blocks"] + c["blocks"], before[name]["tokens"] + c["tokens"])
        for name, c in counted.items()]
    assert sum(s["tokens"] for s in summary["sources"]) == summary["tokens_seen"]
    # the passes the blocks were read in (their masks' epoch): none that the 2 processes' parts had begun (one
    # there began a second pass, so pass 1, the stream's next epoch, would be one of theirs)
    assert max(s["passes"] for s in saved["sources"]) >= 2, saved["sources"]
    first_pass = {}
    for split, examples, _ in made:
        for example in examples if split == TRAIN_SPLIT else ():
            name = by_source.source[tuple(example["input_ids"])]
            first_pass[name] = min(first_pass.get(name, example[EPOCH_KEY]), example[EPOCH_KEY])
    assert first_pass == {name: before[name]["passes"] for name in counted}, (first_pass, before)
    assert all(s["passes"] > before[s["name"]]["passes"] for s in summary["sources"])
