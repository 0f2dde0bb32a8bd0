"""The learning-rate schedule: transformers' own (`get_scheduler`, `get_wsd_schedule`), built from the
training section and the run's total of optimizer steps; and how a resumed run takes up its count.

Warmup-stable-decay (`--lr_scheduler_type warmup_stable_decay`): a linear warm-up of --num_warmup_steps,
the peak rate, then a decay of --num_decay_steps (--decay_type, down to --min_lr_ratio x the peak) that
ends with the run: with --max_train_steps T the stable phase is T - warm-up - decay steps. With
--num_decay_steps 0 there is no decay and the stable phase has no end: the rate stays at its peak
however far the run is continued (--max_train_steps may grow on resume), and a decay branch
(--decay_from, branch.py) decays from any of its checkpoints.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import get_scheduler, get_wsd_schedule

from mlm_ddp.compat.torch import LAST_LR, STEP_COUNT
from mlm_ddp.config import TrainingConfig
from mlm_ddp.errors import BadInput

WSD = "warmup_stable_decay"
MIN_LR = ("cosine_with_min_lr", "cosine_warmup_with_min_lr")  # transformers' cosines that take min_lr_rate


def in_steps(value: float, total_steps: int, at_least: int = 0) -> int:
    """A flag that counts steps: a whole number as it is, a fraction below 1 of the run's total steps."""
    return int(value) if value >= 1 or value == 0 else max(at_least, round(value * total_steps))


def decay_steps(training: TrainingConfig, total_steps: int) -> int:
    """--num_decay_steps in steps (a fraction gives at least one step)."""
    return in_steps(training.num_decay_steps or 0.0, total_steps, at_least=1)


def warmup_steps(training: TrainingConfig, total_steps: int) -> int:
    """--num_warmup_steps in steps."""
    return in_steps(training.num_warmup_steps, total_steps)


def build_scheduler(optimizer: torch.optim.Optimizer, training: TrainingConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' schedule --lr_scheduler_type over `total_steps` optimizer steps, stepped once per step."""
    name, warmup = training.lr_scheduler_type, warmup_steps(training, total_steps)
    if name in MIN_LR:
        return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps,
                             scheduler_specific_kwargs={"min_lr_rate": training.min_lr_ratio})
    if name != WSD:
        return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)
    decay = decay_steps(training, total_steps)
    if decay == 0:  # no decay: a stable phase without end (transformers counts it, so it is infinite)
        return get_wsd_schedule(optimizer, warmup, 0, num_stable_steps=math.inf, min_lr_ratio=training.min_lr_ratio)
    if warmup + decay > total_steps:
        raise BadInput(f"--lr_scheduler_type {WSD}: --num_warmup_steps {warmup} and --num_decay_steps "
                       f"{training.num_decay_steps} ({decay} steps) do not fit in the run's {total_steps} steps; "
                       "lower them or raise --max_train_steps")
    return get_wsd_schedule(optimizer, warmup, decay, num_training_steps=total_steps,
                            decay_type=training.decay_type, min_lr_ratio=training.min_lr_ratio)


def rates_at(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> list[float]:
    """Each parameter group's learning rate after `step` optimizer steps of this schedule."""
    return [base * rate(step) for base, rate in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]


def check_continuation(scheduler: torch.optim.lr_scheduler.LambdaLR, saved: dict[str, Any],
                       changes: dict[str, tuple[Any, Any]], allow: bool) -> str | None:
    """A resume whose schedule sets another rate at the checkpoint's step than the checkpoint's run had: a
    longer run moves a cosine or linear decay under way back up (step 95 of 100 at 0.05 x the peak becomes
    0.53 x with 200 steps), a warm-up given as a fraction moves. Refused, or with --allow_lr_jump the
    warning to log; None where the rates agree (or the checkpoint, from an older mlm_ddp, holds none)."""
    before = saved.get(LAST_LR)
    if not before:
        return None
    step = int(saved["last_epoch"])
    after = rates_at(scheduler, step)
    if len(before) == len(after) and all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-15)
                                         for a, b in zip(before, after, strict=True)):
        return None
    lengths = {f"--{key.split('.', 1)[1]}": (old, new) for key, (old, new) in changes.items()
               if key in ("training.max_train_steps", "training.num_train_epochs")}
    moved = [f"{flag} {old} -> {new}" for flag, (old, new) in lengths.items()]
    keep = " ".join(f"{flag} {old}" for flag, (old, _) in lengths.items() if old is not None)
    what = (f"at step {step} this run's schedule sets the learning rate to {after[0]:.4g} where the checkpoint's "
            f"run was at {before[0]:.4g} ({', '.join(moved) or 'the schedule changed'})")
    if allow:
        return f"{what}: resuming with the jump (--allow_lr_jump)"
    raise BadInput(f"--resume_from_checkpoint: {what}, which would move a warm-up or decay already under way: "
                   f"keep the run's length ({keep or 'as it was'}), or pass --allow_lr_jump to resume with the jump; "
                   f"to train on past a decay, train {WSD} and branch from its stable phase (--decay_from)")


def continue_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, saved: dict[str, Any]) -> None:
    """Take up a saved schedule's step count, and nothing else: this run's schedule (built from its own
    config, which a decay branch or a longer --max_train_steps changes) sets the rate from that step on.
    Loading the whole state would keep the saved run's rate for the first step after the resume (its
    optimizer's groups hold it): this schedule's own state, with the saved step count, is loaded instead."""
    step = int(saved["last_epoch"])
    rates = rates_at(scheduler, step)
    for group, rate in zip(scheduler.optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    state = scheduler.state_dict()
    state.update({"last_epoch": step, STEP_COUNT: int(saved.get(STEP_COUNT, step + 1)), LAST_LR: rates})
    scheduler.load_state_dict(state)


def at_peak(saved: dict[str, Any]) -> bool:
    """A saved schedule whose rate after its last step is its peak in every parameter group (the
    stable phase of warmup_stable_decay, or the first step of its decay)."""
    return saved.get(LAST_LR) == saved.get("base_lrs") and bool(saved.get("base_lrs"))
