"""Resuming on another number of processes (real processes, gloo): a checkpoint of 4 processes x
batch 2 resumes on 2 x 4, on 2 x 2 with accumulation 2 and in one process x 8, each training the
uninterrupted 4-process run's remaining steps with its losses; a global batch that is not kept is
refused with the arithmetic; a stream goes on at the next epoch and says what it skipped."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from mlm_ddp.config import parse_args
from mlm_ddp.train import main, train
from tests.conftest import (
    CONFIGS,
    LAUNCH,
    NO_DROPOUT,
    SAME_STEPS,
    free_port,
    launch_runs,
    run_module,
    tiny_args,
    train_losses,
)

STEPS, SAVED = 10, 5


def launch(procs: int, args: list[str], module: str = "mlm_ddp.train") -> str:
    """`accelerate launch` of `procs` CPU processes running `module`; returns their log."""
    proc = run_module([*LAUNCH, "--config_file", str(CONFIGS / "cpu_ddp.yaml"), "--num_processes", str(procs),
                       "--num_cpu_threads_per_process", "1", "--main_process_port", str(free_port()),
                       "-m", module, *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def resumed_copy(straight: Path, out: Path) -> Path:
    """`out` holding only the straight run's checkpoint of step SAVED (a requeued job's folder)."""
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / f"step-{SAVED:07d}", out / "checkpoints" / f"step-{SAVED:07d}")
    return out


@pytest.fixture(scope="module")
def four_processes(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run: 4 processes x batch 2, global batch 8; dropout off, so every topology
    that keeps the global batch computes the same step."""
    out = tmp_path_factory.mktemp("elastic") / "straight"
    launch(4, tiny_args(tiny_model, corpus, out, "--max_train_steps", str(STEPS), "--checkpointing_steps",
                        str(SAVED), "--per_device_train_batch_size", "2", *NO_DROPOUT))
    return out


STREAM = ["--streaming", "--shuffle_buffer_size", "8", "--max_eval_samples", "16", "--max_train_steps", "6",
          "--checkpointing_steps", "3"]


def resume_args(tiny_model: Path, corpus: dict, out: Path, batch: int, accumulation: int) -> list[str]:
    return tiny_args(tiny_model, corpus, out, "--max_train_steps", str(STEPS), "--checkpointing_steps", str(SAVED),
                     *NO_DROPOUT, "--per_device_train_batch_size", str(batch),
                     "--gradient_accumulation_steps", str(accumulation), "--resume_from_checkpoint", "latest")


@pytest.fixture(scope="module")
def on_two(four_processes: Path, tiny_model: Path, corpus: dict,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The runs of two processes, under one launch (tests.conftest.launch_runs): the 4-process checkpoint
    resumed on 2 x 4 ("2x4x1") and on 2 x 2 with accumulation 2 ("2x2x2"), and a stream of 2 x 4 that
    saves at step 3 ("stream"); id -> its result."""
    root = tmp_path_factory.mktemp("on_two")
    cases = []
    for batch, accumulation in [(4, 1), (2, 2)]:
        out = resumed_copy(four_processes, root / f"{batch}x{accumulation}")
        cases.append({"id": f"2x{batch}x{accumulation}", "out": str(out),
                      "argv": resume_args(tiny_model, corpus, out, batch, accumulation)})
    stream = root / "stream"
    cases.append({"id": "stream", "out": str(stream),
                  "argv": tiny_args(tiny_model, corpus, stream, *STREAM, "--per_device_train_batch_size", "4")})
    runs = launch_runs(cases, root / "results")
    for name, result in runs.items():
        assert result["exit"] == 0, (name, result["log"][-3000:])
    return runs


@pytest.mark.parametrize(("procs", "batch", "accumulation"), [(2, 4, 1), (2, 2, 2), (1, 8, 1)])
def test_a_checkpoint_of_four_processes_resumes_on_fewer_with_the_same_losses(
        procs: int, batch: int, accumulation: int, four_processes: Path, tiny_model: Path, corpus: dict,
        tmp_path: Path, caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest) -> None:
    if procs == 1:
        out = resumed_copy(four_processes, tmp_path / "resumed")
        with caplog.at_level("INFO"):
            train(parse_args(resume_args(tiny_model, corpus, out, batch, accumulation)))
        log = caplog.text
    else:
        run = request.getfixturevalue("on_two")[f"{procs}x{batch}x{accumulation}"]
        out, log = Path(run["out"]), run["log"]
    assert f"at step {SAVED}, written by 4 process(es)" in log
    straight, resumed = train_losses(four_processes), train_losses(out)
    assert sorted(resumed) == list(range(SAVED + 1, STEPS + 1))
    worst = max(abs(straight[s] - resumed[s]) / straight[s] for s in resumed)
    assert worst <= SAME_STEPS, (worst, straight, resumed)
    # its own checkpoint keeps the first run's layout of the epochs
    state = json.loads((out / "checkpoints" / f"step-{STEPS:07d}" / "trainer_state.json").read_text())
    assert state["world_size"] == procs and state["layout_batch"] == 8


@pytest.mark.parametrize(("batch", "accumulation", "fix"), [
    (4, 1, r"global batch of 8 sequences per optimizer step \(2 per device x 4 process\(es\) x 1 accumulation\) "
           r"and this run's is 4 \(4 x 1 x 1\); .* per-device batch x accumulation must be 8: use "
           r"--gradient_accumulation_steps 2 or --per_device_train_batch_size 8$"),
    (3, 1, r"this run's is 3 .* must be 8: use --per_device_train_batch_size 8$"),
])
def test_another_global_batch_is_refused_with_the_arithmetic(batch: int, accumulation: int, fix: str,
                                                             four_processes: Path, tiny_model: Path, corpus: dict,
                                                             tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = resumed_copy(four_processes, tmp_path / "resumed")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    code = main(tiny_args(tiny_model, corpus, out, "--max_train_steps", str(STEPS), *NO_DROPOUT,
                          "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps",
                          str(accumulation), "--resume_from_checkpoint", "latest"))
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and re.search(fix, lines[-1]), lines[-1]
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing written


def test_a_stream_resumed_on_another_number_of_processes_goes_on_at_the_next_epoch(
        on_two: dict[str, dict], tiny_model: Path, corpus: dict, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    straight, out = Path(on_two["stream"]["out"]), tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step-0000003", out / "checkpoints" / "step-0000003")
    with caplog.at_level("INFO"):
        train(parse_args(tiny_args(tiny_model, corpus, out, *STREAM, "--per_device_train_batch_size", "8",
                                   "--resume_from_checkpoint", "latest")))
    skipped = re.search(r"written by 2 process\(es\) and this run has 1: .* training goes on at the start of epoch 1; "
                        r"the rest of epoch 0 is skipped. Its 2 part\(s\) had trained on (\d+) packed block\(s\) .*"
                        r"the stream's files hold .* MB, so at most .* MB \((\d+)%\) of the epoch is skipped",
                        caplog.text)
    assert skipped, caplog.text[-3000:]
    assert int(skipped.group(1)) == 3 * 2 * 4 and 0 < int(skipped.group(2)) <= 100  # 3 steps x 2 ranks x 4
    assert sorted(train_losses(out)) == [4, 5, 6]
    state = json.loads((out / "checkpoints" / "step-0000006" / "trainer_state.json").read_text())
    assert state["epoch"] == 1 and state["world_size"] == 1
