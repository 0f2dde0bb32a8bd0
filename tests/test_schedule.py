"""Warmup-stable-decay and the decay branch.

The schedule: for each decay shape, warm-up, stable and decay steps given as steps or as a fraction,
the rates equal transformers' `get_wsd_schedule` at every step. In runs: the learning rate in
metrics.jsonl equals that schedule at every step; a main run with no decay (stable to its end) saves
step 5; decay branches from it (1-sqrt, linear, cosine with a floor) train steps 6-8 as an uninterrupted
run with that decay does (losses within SAME_STEPS), while the main run's folder stays byte-identical
and can go on with its stable phase.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers import get_wsd_schedule

from mlm_ddp.config import TrainingConfig, parse_args
from mlm_ddp.errors import BadInput
from mlm_ddp.loop.schedule import build_scheduler, check_continuation, continue_schedule
from mlm_ddp.train import train
from tests.conftest import NO_DROPOUT, SAME_STEPS, read_metrics, tiny_args, train_losses

PEAK, WARMUP, SOURCE, DECAY = 1e-3, 2, 5, 3  # the runs: warm-up 2, decay from step 5 over 3, 8 steps in all
WSD = ["--lr_scheduler_type", "warmup_stable_decay", "--num_warmup_steps", str(WARMUP)]
QUICK = [*NO_DROPOUT, "--report", "false", "--max_eval_samples", "8"]


def rates(scheduler: torch.optim.lr_scheduler.LambdaLR, steps: int) -> list[float]:
    """The first group's rate after each of `steps` scheduler steps (index k: after k steps)."""
    out = [scheduler.get_last_lr()[0]]
    for _ in range(steps):
        scheduler.optimizer.step()
        scheduler.step()
        out.append(scheduler.get_last_lr()[0])
    return out


def optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)


def transformers_rates(steps: int, total: int, decay: int, decay_type: str = "cosine", min_lr_ratio: float = 0.0,
                       warmup: int = WARMUP) -> list[float]:
    return rates(get_wsd_schedule(optimizer(), warmup, decay, num_training_steps=total, decay_type=decay_type,
                                  min_lr_ratio=min_lr_ratio), steps)


@pytest.mark.parametrize("min_lr_ratio", [0.0, 0.1])
@pytest.mark.parametrize("decay_type", ["linear", "cosine", "1-sqrt"])
@pytest.mark.parametrize(("warmup", "total", "decay", "steps"), [(2, 8, "3", 3), (5, 40, "0.25", 10),
                                                                 (0, 13, "1", 1), (3, 9, "6", 6)])
def test_each_shape_is_transformers_schedule_in_three_phases(decay_type: str, min_lr_ratio: float, warmup: int,
                                                             total: int, decay: str, steps: int) -> None:
    training = TrainingConfig(lr_scheduler_type="warmup_stable_decay", num_warmup_steps=warmup,
                              num_decay_steps=float(decay), decay_type=decay_type, min_lr_ratio=min_lr_ratio)
    got = rates(build_scheduler(optimizer(), training, total), total)
    assert got == transformers_rates(total, total, steps, decay_type, min_lr_ratio, warmup)
    assert all(a < b for a, b in zip(got[:warmup], got[1:warmup + 1], strict=True))  # warm-up rises to the peak
    assert got[warmup:total - steps + 1] == [PEAK] * (total - steps - warmup + 1)  # stable, decay's first step
    assert all(a > b for a, b in zip(got[total - steps:], got[total - steps + 1:], strict=False))  # decays
    assert got[total] == pytest.approx(min_lr_ratio * PEAK, abs=1e-15)


def test_no_decay_is_a_stable_phase_without_end() -> None:
    training = TrainingConfig(lr_scheduler_type="warmup_stable_decay", num_warmup_steps=2, num_decay_steps=0)
    got = rates(build_scheduler(optimizer(), training, 10), 30)  # a run continued past its first budget
    assert got[:2] == [0.0, PEAK / 2] and got[2:] == [PEAK] * 29


@pytest.mark.parametrize("name", ["cosine_with_min_lr", "cosine_warmup_with_min_lr"])
def test_the_cosines_with_a_floor_take_min_lr_ratio(name: str) -> None:
    got = rates(build_scheduler(optimizer(), TrainingConfig(lr_scheduler_type=name, num_warmup_steps=2,
                                                            min_lr_ratio=0.2), 10), 10)
    # the floor, reached at the end (the variant with a warm-up rate reaches it one step early, as transformers
    # writes it)
    assert max(got) == pytest.approx(PEAK) and min(got[2:]) == pytest.approx(0.2 * PEAK)


def test_a_resume_takes_up_the_step_count_and_this_runs_schedule() -> None:
    """A stable-phase schedule saved at step 5 (as checkpoint.py writes it: JSON) continued by a schedule
    with a decay from step 5: the rate from step 5 on is the new schedule's, as a run that had it all along."""
    stable = TrainingConfig(lr_scheduler_type="warmup_stable_decay", num_warmup_steps=WARMUP, num_decay_steps=0)
    saved_at = build_scheduler(optimizer(), stable, 100)
    rates(saved_at, SOURCE)
    saved = json.loads(json.dumps(saved_at.state_dict()))
    decayed = TrainingConfig(lr_scheduler_type="warmup_stable_decay", num_warmup_steps=WARMUP,
                             num_decay_steps=DECAY, decay_type="linear")
    branch = build_scheduler(optimizer(), decayed, SOURCE + DECAY)
    continue_schedule(branch, saved)
    assert branch.last_epoch == SOURCE and branch.optimizer.param_groups[0]["lr"] == PEAK
    whole = transformers_rates(SOURCE + DECAY, SOURCE + DECAY, DECAY, "linear")
    assert rates(branch, DECAY) == whole[SOURCE:]


@pytest.mark.parametrize("kind", ["linear", "cosine", "warmup_stable_decay"])
@pytest.mark.parametrize(("total", "step", "longer"), [(100, 95, 200), (10, 3, 11), (10, 10, 20), (8, 1, 9)])
def test_a_longer_run_may_not_move_a_decay_under_way(kind: str, total: int, step: int, longer: int) -> None:
    """A checkpoint of step `step` of `total`, resumed with --max_train_steps `longer`.
    Where the longer schedule sets another rate at that step (a decay under way) the resume is refused,
    naming the step and the flag, or with --allow_lr_jump goes on with a warning; where it sets the same
    one (a warm-up given in steps, the stable phase of warmup_stable_decay) it goes on silently."""
    decay = {"num_decay_steps": 2} if kind == "warmup_stable_decay" else {}
    training = TrainingConfig(lr_scheduler_type=kind, num_warmup_steps=WARMUP, **decay)
    saved_at = build_scheduler(optimizer(), training, total)
    rates(saved_at, step)
    saved = json.loads(json.dumps(saved_at.state_dict()))
    resumed = build_scheduler(optimizer(), training, longer)
    changes = {"training.max_train_steps": (total, longer)}
    before, after = saved["_last_lr"][0], resumed.lr_lambdas[0](step) * PEAK
    assert (before == after) == (step <= WARMUP or (kind == "warmup_stable_decay" and step <= total - 2))
    if before == after:
        assert check_continuation(resumed, saved, changes, allow=False) is None
        return
    refusal = rf"at step {step} .*--max_train_steps {total} -> {longer}.*\(--max_train_steps {total}\).*--allow_lr_jump"
    with pytest.raises(BadInput, match=refusal):
        check_continuation(resumed, saved, changes, allow=False)
    assert "resuming with the jump" in check_continuation(resumed, saved, changes, allow=True)


@pytest.mark.parametrize(("values", "message"), [
    ({"lr_scheduler_type": "warmup_stable_decay"}, "needs --num_decay_steps"),
    ({"num_decay_steps": 10}, "--lr_scheduler_type is linear: drop them"),
    ({"decay_type": "1-sqrt"}, "--lr_scheduler_type is linear: drop them"),
    ({"lr_scheduler_type": "warmup_stable_decay", "num_decay_steps": 2.5}, "must be whole steps, a fraction"),
    ({"lr_scheduler_type": "warmup_stable_decay", "num_decay_steps": -1}, "must be whole steps, a fraction"),
    ({"lr_scheduler_type": "warmup_stable_decay", "num_decay_steps": 3, "min_lr_ratio": 1.0}, r"in \[0, 1\)"),
    ({"min_lr_ratio": 0.1}, "--min_lr_ratio sets the floor of warmup_stable_decay"),
])
def test_bad_schedule_flags_are_refused(values: dict, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        TrainingConfig(**values)


def test_warmup_and_decay_must_fit_the_run() -> None:
    training = TrainingConfig(lr_scheduler_type="warmup_stable_decay", num_warmup_steps=5, num_decay_steps=6)
    with pytest.raises(BadInput, match="do not fit in the run's 10 steps"):
        build_scheduler(optimizer(), training, 10)


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def lrs(out: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_metrics(out) if "lr" in r}


@pytest.fixture(scope="module")
def runs(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An uninterrupted 1-sqrt run; a main run with no decay to step 5; three decay branches of its step 5
    (1-sqrt, linear given as a fraction, cosine to a floor); the main run's folder before and after them."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    root = tmp_path_factory.mktemp("wsd")

    def run(name: str, *extra: str) -> Path:
        for state in (AcceleratorState, GradientState, PartialState):
            state._reset_state(*([True] if state is AcceleratorState else []))
        train(parse_args(tiny_args(tiny_model, corpus, root / name, *QUICK, *WSD, *extra)))
        return root / name

    straight = run("straight", "--num_decay_steps", str(DECAY), "--decay_type", "1-sqrt", "--max_train_steps",
                   str(SOURCE + DECAY), "--checkpointing_steps", "6")
    main = run("main", "--num_decay_steps", "0", "--max_train_steps", str(SOURCE), "--checkpointing_steps",
               str(SOURCE))
    source = main / "checkpoints" / f"step-{SOURCE:07d}"
    before = snapshot(main)
    branches = {
        # the budget of the main run's recipe (--max_train_steps 5) is replaced by the branch's end
        "1-sqrt": run("decayed", "--decay_from", str(source), "--num_decay_steps", str(DECAY), "--decay_type",
                      "1-sqrt", "--max_train_steps", str(SOURCE)),
        # 0.375 of the branch's N + D steps: D = 0.375 x 5 / 0.625 = 3
        "linear": run("linear", "--decay_from", str(source), "--num_decay_steps", "0.375", "--decay_type", "linear",
                      "--checkpointing_steps", "7", "--resume_from_checkpoint", "auto"),
    }
    # given relative to the working directory, as users type it: recorded absolute
    here = os.getcwd()
    os.chdir(main)
    try:
        branches["cosine"] = run("cosine", "--decay_from", str(source.relative_to(main)), "--num_decay_steps",
                                 str(DECAY), "--min_lr_ratio", "0.1")
    finally:
        os.chdir(here)
    return {"root": root, "straight": straight, "main": main, "source": source, "before": before,
            "after": snapshot(main), "branches": branches, "run": run}


def test_the_learning_rate_in_metrics_is_transformers_schedule(runs: dict) -> None:
    whole = transformers_rates(SOURCE + DECAY, SOURCE + DECAY, DECAY, "1-sqrt")
    assert lrs(runs["straight"]) == {step: whole[step] for step in range(1, SOURCE + DECAY + 1)}
    # the main run: warm-up, then its peak to the end (no decay)
    assert lrs(runs["main"]) == {1: PEAK / 2, **{step: PEAK for step in range(2, SOURCE + 1)}}
    for shape, floor in (("1-sqrt", 0.0), ("linear", 0.0), ("cosine", 0.1)):
        whole = transformers_rates(SOURCE + DECAY, SOURCE + DECAY, DECAY, shape, floor)
        curve = {**lrs(runs["main"]), **lrs(runs["branches"][shape])}
        # (a floor also starts the warm-up there: the main run's warm-up is its own, without one)
        assert curve == {step: whole[step] for step in range(1 if floor == 0 else WARMUP, SOURCE + DECAY + 1)
                         } | ({} if floor == 0 else {1: PEAK / 2}), shape


def test_a_decay_branch_trains_as_the_uninterrupted_run(runs: dict) -> None:
    straight, main = train_losses(runs["straight"]), train_losses(runs["main"])
    branch = train_losses(runs["branches"]["1-sqrt"])
    assert sorted(branch) == [6, 7, 8]
    assert max(abs(straight[s] - main[s]) / straight[s] for s in main) <= SAME_STEPS
    assert max(abs(straight[s] - branch[s]) / straight[s] for s in branch) <= SAME_STEPS


def test_the_source_is_untouched_and_the_branch_records_it(runs: dict) -> None:
    assert runs["after"] == runs["before"]
    out = runs["branches"]["1-sqrt"]
    written = yaml.safe_load((out / "config.yaml").read_text())
    assert written["run"]["decay_from"] == str(runs["source"])
    assert written["training"]["max_train_steps"] == SOURCE + DECAY and written["training"]["num_decay_steps"] == DECAY
    assert yaml.safe_load((runs["branches"]["linear"] / "config.yaml").read_text())["training"]["num_decay_steps"] == 3
    assert yaml.safe_load((runs["branches"]["cosine"] / "config.yaml").read_text())["run"]["decay_from"] == str(
        runs["source"])
    card = (out / "final" / "README.md").read_text()
    assert f"A decay branch: continued from the checkpoint `{runs['source']}` (step {SOURCE}" in card
    assert "--decay_from" in card and "1-sqrt decay over its last 3 steps" in card
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == SOURCE + DECAY and summary["eval_after"]["loss"] > 0
    # its evaluation before training is its source run's (the same run, continued)
    source_before = json.loads((runs["straight"] / "summary.json").read_text())["eval_before"]
    assert {k: summary["eval_before"][k] for k in ("loss", "perplexity", "accuracy", "mlm_probability")} == {
        k: source_before[k] for k in ("loss", "perplexity", "accuracy", "mlm_probability")}


def test_a_stopped_branch_continues_its_own_checkpoints(runs: dict, tiny_model: Path, corpus: dict,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """The linear branch saved step 7; a copy of it, given the branch's command, resumes there (not at the
    source) and trains step 8 as the branch did."""
    linear = runs["branches"]["linear"]
    again = runs["root"] / "linear-again"
    (again / "checkpoints").mkdir(parents=True)
    shutil.copytree(linear / "checkpoints" / "step-0000007", again / "checkpoints" / "step-0000007")
    with caplog.at_level("INFO"):
        runs["run"]("linear-again", "--decay_from", str(runs["source"]), "--num_decay_steps", "0.375",
                    "--decay_type", "linear", "--checkpointing_steps", "7", "--resume_from_checkpoint", "auto")
    assert "resumed from" in caplog.text and "step-0000007 at step 7" in caplog.text
    assert f"decay branch of {runs['source']}: from step {SOURCE}, a linear decay over {DECAY} steps" in caplog.text
    assert f"; a decay branch of {runs['source']} (from step {SOURCE}, linear over {DECAY} steps)" in caplog.text
    assert train_losses(again) == pytest.approx({8: train_losses(linear)[8]}, rel=SAME_STEPS)


def test_the_main_run_goes_on_with_its_stable_phase(runs: dict) -> None:
    main = runs["root"] / "main-on"
    shutil.copytree(runs["main"], main)
    shutil.rmtree(main / "final")
    (main / "summary.json").unlink()
    runs["run"]("main-on", "--num_decay_steps", "0", "--max_train_steps", str(SOURCE + 2), "--resume_from_checkpoint",
                "latest")
    assert lrs(main) == {1: PEAK / 2, **{step: PEAK for step in range(2, SOURCE + 3)}}


def test_a_run_in_its_decay_resumed_longer_is_refused_or_jumps_when_allowed(runs: dict, caplog) -> None:
    """The 1-sqrt run saved step 6, in its decay (steps 6-8): resumed with --max_train_steps 10 it would
    jump back up; refused before anything is written. With --allow_lr_jump it goes on, and says so."""
    out = runs["root"] / "longer"
    shutil.copytree(runs["straight"], out)
    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()
    shutil.rmtree(out / "checkpoints" / "step-0000008", ignore_errors=True)
    before = snapshot(out)
    longer = ["--num_decay_steps", str(DECAY), "--decay_type", "1-sqrt", "--max_train_steps", "10",
              "--resume_from_checkpoint", "latest"]
    with pytest.raises(BadInput, match="at step 6 .*--max_train_steps 8 -> 10.*--allow_lr_jump"):
        runs["run"]("longer", *longer)
    assert snapshot(out) == before
    with caplog.at_level("WARNING"):
        runs["run"]("longer", *longer, "--allow_lr_jump")
    assert "at step 6 this run's schedule sets the learning rate" in caplog.text
    assert sorted(lrs(out))[-4:] == [7, 8, 9, 10]


@pytest.mark.parametrize(("case", "message"), [
    ("into its own folder", "lies in --output_dir"),
    ("from the decay phase", "below their peak"),
    ("another learning rate", "was written with other settings .*training.learning_rate"),
    ("without warmup_stable_decay", "--decay_from decays a warmup_stable_decay run"),
    ("resuming another folder", "it continues this branch's own checkpoints"),
    ("a warm-up past the start", "would not be over at its start, step 5"),
])
def test_a_branch_that_cannot_be_is_refused_before_anything_is_written(runs: dict, tiny_model: Path, corpus: dict,
                                                                       case: str, message: str) -> None:
    out, decay = runs["root"] / "refused", ["--num_decay_steps", str(DECAY)]
    branch = [*WSD, "--decay_from", str(runs["source"]), *decay]
    extra = {"into its own folder": [*branch, "--output_dir", str(runs["main"])],
             "from the decay phase": [*WSD, "--decay_from", str(runs["straight"] / "checkpoints" / "step-0000006"),
                                      *decay],
             "another learning rate": [*branch, "--learning_rate", "2e-3"],
             "without warmup_stable_decay": ["--decay_from", str(runs["source"])],
             "resuming another folder": [*branch, "--resume_from_checkpoint", str(runs["source"])],
             "a warm-up past the start": [*branch, "--num_warmup_steps", "0.9"]}[case]
    with pytest.raises(BadInput, match=message):
        train(parse_args(tiny_args(tiny_model, corpus, out, *QUICK, *extra)))
    assert not out.exists() and snapshot(runs["main"]) == runs["before"]
