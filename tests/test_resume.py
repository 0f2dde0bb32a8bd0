"""Exact resume, the whole matrix: {map-style, streaming} x {1, 2 processes} x {accumulation 1, 2}.

A run of 8 optimizer steps saves at step 4 (mid-epoch); a copy of that checkpoint, resumed, must
train steps 5..8 with the same losses (dropout on: RNG states are restored too). A resumed stream
re-reads at most one chunk of texts, never its epoch from the start. With accumulation the runs log every
3 steps, so the checkpoint falls inside a logged window: the resumed run's first line covers steps 4-6, as
the uninterrupted run's does (the checkpoint carries the window's sums).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from mlm_ddp.config import parse_args
from mlm_ddp.train import train
from tests.conftest import launch_runs, tiny_args, train_losses

CHUNK = 4  # --shuffle_buffer_size: texts per shuffled chunk of a stream
RESUMED = re.compile(r"stream resumed at epoch (\d+), chunk (\d+), block (\d+): re-read (\d+) raw text")


def cell_args(kind: str, procs: int, ga: int) -> list[str]:
    common = ["--max_train_steps", "8", "--checkpointing_steps", "4", "--gradient_accumulation_steps", str(ga),
              "--per_device_train_batch_size", str(8 // procs), "--logging_steps", str(2 * ga - 1)]
    if kind == "stream":
        common += ["--streaming", "--shuffle_buffer_size", str(CHUNK), "--max_eval_samples", "16"]
    return common


CELLS = [(kind, procs, ga) for kind in ("map", "stream") for procs in (1, 2) for ga in (1, 2)]


@pytest.fixture(scope="module")
def two_process_cells(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every 2-process cell's uninterrupted run and its resume, under one `accelerate launch`
    (tests.conftest.launch_runs): the resume reads the uninterrupted run's checkpoint of step 4 from its
    folder and trains into a folder of its own."""
    root = tmp_path_factory.mktemp("resume-2")
    cases = []
    for kind, procs, ga in CELLS:
        if procs == 2:
            cell, common = f"{kind}-{ga}", cell_args(kind, procs, ga)
            straight, resumed = root / cell / "straight", root / cell / "resumed"
            cases += [{"id": f"{cell}-straight", "out": str(straight),
                       "argv": tiny_args(tiny_model, corpus, straight, *common)},
                      {"id": f"{cell}-resumed", "out": str(resumed),
                       "argv": tiny_args(tiny_model, corpus, resumed, *common, "--resume_from_checkpoint",
                                         str(straight / "checkpoints" / "step-0000004"))}]
    return launch_runs(cases, root / "results")


@pytest.mark.parametrize(("kind", "procs", "ga"), CELLS, ids=[f"{k}-{p}-{g}" for k, p, g in CELLS])
def test_resume_continues_the_uninterrupted_curve(kind: str, procs: int, ga: int, tiny_model: Path, corpus: dict,
                                                  tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                  request: pytest.FixtureRequest) -> None:
    """One process: in this process, the checkpoint copied into a new folder and resumed as `latest`. Two:
    from the shared launch (two_process_cells)."""
    if procs == 1:
        straight, resumed, common = tmp_path / "straight", tmp_path / "resumed", cell_args(kind, procs, ga)
        train(parse_args(tiny_args(tiny_model, corpus, straight, *common)))
        (resumed / "checkpoints").mkdir(parents=True)
        shutil.copytree(straight / "checkpoints" / "step-0000004", resumed / "checkpoints" / "step-0000004")
        caplog.clear()
        with caplog.at_level("INFO"):
            train(parse_args(tiny_args(tiny_model, corpus, resumed, *common, "--resume_from_checkpoint", "latest")))
        log = caplog.text
    else:
        runs = request.getfixturevalue("two_process_cells")
        done = [runs[f"{kind}-{ga}-{run}"] for run in ("straight", "resumed")]
        assert [r["exit"] for r in done] == [0, 0], [r["log"][-3000:] for r in done]
        straight, resumed = (Path(r["out"]) for r in done)
        log = done[1]["log"]

    a, b = train_losses(straight), train_losses(resumed)
    assert sorted(b) == ([5, 6, 7, 8] if ga == 1 else [6, 8])
    worst = max(abs(a[s] - b[s]) / a[s] for s in b)
    assert worst <= (1e-6 if procs == 1 else 1e-5), (worst, a, b)
    if kind == "stream":
        epoch, chunk, block, reread = map(int, RESUMED.search(log).groups())
        # 4 steps in, the position is past the first chunk (a replay would re-read chunk * CHUNK texts
        # and more); only the current chunk was read again
        assert epoch == 0 and chunk >= 1 and block >= 1 and 0 < reread <= CHUNK
        assert sorted((straight / "checkpoints" / "step-0000004").glob("data_state_*.json"))  # what it resumed


def test_a_resume_in_another_precision_says_so(tiny_model: Path, corpus: dict, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """`auto` resolved on other hardware (here: a CPU without native bf16, then one with it): the same
    config resumes, and the run says that the precision changed; the checkpoint records the first one."""
    import json

    from accelerate.state import AcceleratorState, GradientState

    from mlm_ddp.cluster import precision

    out = tmp_path / "run"
    args = tiny_args(tiny_model, corpus, out, "--mixed_precision", "auto", "--checkpointing_steps", "1",
                     "--max_eval_samples", "8")
    monkeypatch.setattr(precision, "hardware", lambda _topo: precision.Hardware("cpu", cpu_bf16=False))
    train(parse_args([*args, "--max_train_steps", "1"]))
    saved = json.loads((out / "checkpoints" / "step-0000001" / "trainer_state.json").read_text())
    assert saved["precision"] == "no"
    AcceleratorState._reset_state(True)  # a new process would start with none (the conftest resets between tests)
    GradientState._reset_state()
    monkeypatch.setattr(precision, "hardware", lambda _topo: precision.Hardware("cpu", cpu_bf16=True))
    with caplog.at_level("WARNING"):
        train(parse_args([*args, "--max_train_steps", "2", "--resume_from_checkpoint", "latest", "--allow_lr_jump"]))
    assert "the precision changed: the checkpoint trained in no, this run trains in bf16 (auto: " in caplog.text


def test_a_checkpoint_from_before_a_new_flag_resumes() -> None:
    """A saved config.yaml without a flag added since (here: the masking split, the optimizer, the schedule's
    decay) compares as that flag's default; a value that differs from it is still a change."""
    from mlm_ddp.config import Config
    from mlm_ddp.run.run_folder import config_changes

    current = Config().to_dict()
    older = {section: dict(values) for section, values in current.items()}
    for section, key in (("data", "mask_replace_prob"), ("data", "random_replace_prob"),
                         ("training", "optimizer"), ("training", "num_decay_steps")):
        del older[section][key]
    assert config_changes(older, current) == {}
    current["data"]["mask_replace_prob"] = 1.0
    assert config_changes(older, current) == {"data.mask_replace_prob": (0.8, 1.0)}


def test_a_resume_runs_the_optimizer_implementation_it_is_given(tiny_model: Path, corpus: dict, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """--optimizer_impl may change on resume (RESUMABLE_CHANGES), but torch's load_state_dict restores it
    from the checkpoint's parameter groups: a checkpoint of fused AdamW resumed with for-loop ran fused. The
    steps after the resume run this run's implementation, with their step counts where it keeps them."""
    import torch
    from accelerate.state import AcceleratorState, GradientState

    out = tmp_path / "run"
    args = tiny_args(tiny_model, corpus, out, "--checkpointing_steps", "1", "--max_eval_samples", "8")
    train(parse_args([*args, "--max_train_steps", "1", "--optimizer_impl", "fused"]))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    ran = []
    step = torch.optim.AdamW.step

    def recorded(self: torch.optim.AdamW, *a: object, **k: object) -> object:
        group = self.param_groups[0]
        counts = {self.state[p]["step"].device.type for p in group["params"] if "step" in self.state[p]}
        ran.append((bool(group["fused"]), group["foreach"], counts))
        return step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", recorded)
    train(parse_args([*args, "--max_train_steps", "3", "--optimizer_impl", "for-loop", "--resume_from_checkpoint",
                      "latest", "--allow_lr_jump"]))
    assert ran == [(False, False, {"cpu"})] * 2


def test_the_peak_measured_at_start_up_draws_nothing_from_the_restored_generators() -> None:
    """Without --peak_tflops a run measures the matmul peak after its checkpoint restored the RNG states
    (train.build): a draw from torch's global generator there would shift every dropout mask of the resumed
    steps. The suite's runs mostly give a peak (tiny_args, tests/test_matrix.py), so it is checked here."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from mlm_ddp.loop.speed import measure_peak

    accelerator = SimpleNamespace(device=torch.device("cpu"), mixed_precision="no", autocast=contextlib.nullcontext)
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    assert measure_peak(accelerator, min_seconds=0.0) > 0
    assert torch.equal(torch.random.get_rng_state(), before)
