"""--on_loss_spike: a loss spike injected into one micro-batch of step 14 (a test seam that scales
its loss 1000x, tests/fault_driver.py; clipping off, so that the spike's gradient reaches AdamW's
second moment and slows every later step, as real spikes do): 'skip' drops that update, 'rollback'
reloads step 10's checkpoint and skips the spike's micro-batches (2 real processes); both finish
with exactly the configured steps, each logged once, and end within noise of the run without a
spike, closer to it than the same spike with the guard off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlm_ddp.cluster import heartbeat
from mlm_ddp.config import parse_args
from mlm_ddp.train import Hooks, train
from tests.conftest import read_metrics, tiny_args, train_losses
from tests.fault_driver import OneSpike
from tests.test_elastic import launch

STEPS, SPIKE, SAVED, FACTOR = 24, 14, 10, 1000
COMMON = ["--max_train_steps", str(STEPS), "--checkpointing_steps", "5", "--eval_steps", str(STEPS),
          "--max_eval_samples", "64", "--max_grad_norm", "0"]


def final_eval_loss(out: Path) -> float:
    return json.loads((out / "summary.json").read_text())["eval_after"]["loss"]


@pytest.fixture(scope="module")
def harm(no_spike: Path, tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> float:
    """How much worse the spike leaves the final eval loss with the guard off (a fraction)."""
    out = tmp_path_factory.mktemp("spikes") / "off"
    train(parse_args(tiny_args(tiny_model, corpus, out, *COMMON)), Hooks(loss_factor=OneSpike(f"{SPIKE}:{FACTOR}")))
    harm = final_eval_loss(out) / final_eval_loss(no_spike) - 1
    assert harm > 0.002
    return harm


@pytest.fixture(scope="module")
def no_spike(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("spikes") / "none"
    train(parse_args(tiny_args(tiny_model, corpus, out, *COMMON, "--on_loss_spike", "skip")))
    assert json.loads((out / "summary.json").read_text())["loss_spikes"] == {"skipped": 0, "rolled_back": 0}
    # the heartbeat of a finished run: the evaluation before training (its phase and its reduce),
    # BEATS_PER_STEP per step (what bench.py prices), the last step's evaluation's reduce, the fused AdamW's
    # on-device skip read before each checkpoint (--checkpointing_steps 5) and the all-reduce of the tokens
    # seen in each, the skip read after the last step, the final save and done
    beat = json.loads((out / "heartbeat" / "rank-00000.json").read_text())
    beats = 2 + heartbeat.BEATS_PER_STEP * STEPS + 1 + 2 * (STEPS // 5) + 1 + 2
    assert (beat["phase"], beat["step"], beat["seq"]) == ("done", STEPS, beats)
    return out


def test_skip_drops_the_spiked_update_and_keeps_the_step_count(
        no_spike: Path, harm: float, tiny_model: Path, corpus: dict, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "skip"
    with caplog.at_level("INFO"):
        train(parse_args(tiny_args(tiny_model, corpus, out, *COMMON, "--on_loss_spike", "skip")),
              Hooks(loss_factor=OneSpike(f"{SPIKE}:{FACTOR}")))
    assert f"step {SPIKE}: loss " in caplog.text and "(--loss_spike_factor 2): update skipped" in caplog.text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["loss_spikes"] == {"skipped": 1, "rolled_back": 0}
    straight, spiked = train_losses(no_spike), train_losses(out)
    assert sorted(spiked) == list(range(1, STEPS + 1))
    assert all(spiked[s] == straight[s] for s in range(1, SPIKE))  # judging changes nothing before the spike
    assert spiked[SPIKE] > 20 * straight[SPIKE]  # the spike is in the log, its update is not in the model
    assert abs(final_eval_loss(out) / final_eval_loss(no_spike) - 1) < harm / 2


def test_rollback_reloads_the_checkpoint_skips_the_spike_and_replays_to_the_same_end(
        no_spike: Path, harm: float, tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    """Rank 1 also takes 12 s longer than rank 0 to load the checkpoint, against a 6 s --ddp_timeout (a whole DDP
    checkpoint read from a busy network filesystem): rank 0 waits for it (--save_timeout), not for its next
    collective's --ddp_timeout."""
    out = tmp_path / "rollback"
    log = launch(2, ["--spike", f"{SPIKE}:{FACTOR}", "--slow_load", "1:12",
                     *tiny_args(tiny_model, corpus, out, *COMMON, "--on_loss_spike", "rollback",
                                "--per_device_train_batch_size", "4", "--ddp_timeout", "6")],
                 module="tests.fault_driver")
    assert f"step {SPIKE}: loss " in log and f"rolled back to step-{SAVED:07d}" in log, log[-3000:]
    assert log.count("skipped the micro-batches that caused a loss spike (epoch 0, micro-batch ") == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["loss_spikes"] == {"skipped": 0, "rolled_back": 1}
    steps = [r["step"] for r in read_metrics(out) if "loss" in r]
    assert steps == list(range(1, STEPS + 1))  # the replayed steps replace their first lines
    # the spike's line was replaced by the replay's: no logged loss is near it
    straight, rolled = train_losses(no_spike), train_losses(out)
    assert max(rolled.values()) < 1.5 * max(straight.values())
    assert abs(final_eval_loss(out) / final_eval_loss(no_spike) - 1) < harm / 2


def test_a_resumed_run_judges_its_first_steps_against_the_losses_the_checkpoint_saved(
        no_spike: Path, tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    """The guard judges once it knows MIN_HISTORY losses: a resume that forgot them would let a spike through
    in its first steps, where restarts often bring one; the checkpoint carries them."""
    import shutil

    out = tmp_path / "resumed"
    shutil.copytree(no_spike / "checkpoints" / f"step-{SAVED:07d}", out / "checkpoints" / f"step-{SAVED:07d}")
    saved = json.loads((out / "checkpoints" / f"step-{SAVED:07d}" / "parts.json").read_text())["loss_spike_guard"]
    assert len(saved["history"]) == SAVED and saved["history"] == [
        loss for step, loss in sorted(train_losses(no_spike).items()) if step <= SAVED]
    spike = Hooks(loss_factor=OneSpike(f"{SAVED + 1}:{FACTOR}"))
    train(parse_args(tiny_args(tiny_model, corpus, out, *COMMON, "--on_loss_spike", "skip",
                               "--resume_from_checkpoint", "latest")), spike)
    assert json.loads((out / "summary.json").read_text())["loss_spikes"] == {"skipped": 1, "rolled_back": 0}
