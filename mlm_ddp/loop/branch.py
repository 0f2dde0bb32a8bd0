"""A decay branch (--decay_from CHECKPOINT): a warmup_stable_decay run's checkpoint of the stable phase,
step N, continued in another --output_dir with a decay that starts at N and ends the run at N + decay.

The source folder is only read (its run can go on with its stable phase). The branch is a resume from
another folder (run_folder.py) whose accepted changes are the schedule's: `BRANCH_CHANGES`, and the
steps (--max_train_steps, already a resumable setting); anything else that changed is refused as in any
resume. Its end and decay are resolved here, in steps, the same on every attempt (also once the source
checkpoint is rotated away: N is then read from its name), and recorded in config.yaml with the flag.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

from mlm_ddp.compat.torch import LAST_LR
from mlm_ddp.config import Config
from mlm_ddp.errors import BadInput
from mlm_ddp.loop import checkpoint as ckpt
from mlm_ddp.loop.schedule import WSD, at_peak, warmup_steps

# what a branch may set otherwise than its source: the decay, and the flag itself
BRANCH_CHANGES = frozenset({"run.decay_from", "training.num_decay_steps", "training.decay_type",
                            "training.min_lr_ratio"})
_STEP_NAME = re.compile(r"^step-(\d+)$")


def source_step(path: Path) -> int:
    """N, the optimizer steps the source checkpoint had done: its trainer state, else its folder's name
    (a branch that resumes its own checkpoints after the main run rotated the source away)."""
    if ckpt.is_complete(path):
        return ckpt.read_state(path).step
    if (match := _STEP_NAME.match(path.name)) and not path.exists():
        return int(match.group(1))
    raise BadInput(f"--decay_from {path}: not a complete mlm_ddp checkpoint (no {ckpt.MARKER} marker or "
                   f"{ckpt.STATE_FILE}); give one of a run's checkpoints, e.g. OUT/checkpoints/step-0001000")


def resolved(cfg: Config) -> Config:
    """`cfg`, or with --decay_from a copy whose --num_decay_steps is its steps D (a fraction f of the branch's
    N + D steps: D = f N / (1 - f)) and whose --max_train_steps is N + D, where the run ends, whatever it was.
    Before anything is written, and before any process talks to another: no log line here (`describe` is
    logged later)."""
    run, training = cfg.run, cfg.training
    if run.decay_from is None:
        return cfg
    if training.lr_scheduler_type != WSD or not training.num_decay_steps:
        raise BadInput(f"--decay_from decays a warmup_stable_decay run: pass --lr_scheduler_type {WSD} and "
                       "--num_decay_steps above 0 (steps, or a fraction of the branch's steps)")
    # recorded absolute: config.yaml, the card and a requeued job (another working directory) name one folder
    source = os.path.abspath(run.decay_from)
    step, fraction = source_step(Path(source)), training.num_decay_steps
    decay = int(fraction) if fraction >= 1 else max(1, round(fraction * step / (1 - fraction)))
    if (warmup := warmup_steps(training, step + decay)) > step:  # a fraction: of the branch's steps
        raise BadInput(f"--decay_from {source}: the warm-up (--num_warmup_steps {training.num_warmup_steps}: "
                       f"{warmup} steps of the branch's {step + decay}) would not be over at its start, step {step}; "
                       "give --num_warmup_steps in steps, as the source's run warmed up")
    return dataclasses.replace(cfg, run=dataclasses.replace(run, decay_from=source), training=dataclasses.replace(
        training, num_decay_steps=float(decay), max_train_steps=step + decay))


def source_metrics(decay_from: str | None) -> Path | None:
    """The metrics.jsonl of the run a decay branch continues (--decay_from OUT/checkpoints/step-N ->
    OUT/metrics.jsonl): its evaluation and probe before training are the branch's 'before' too."""
    return None if decay_from is None else Path(decay_from).parent.parent / "metrics.jsonl"


def describe(cfg: Config) -> str | None:
    """The log line of a decay branch (None for any other run)."""
    run, training = cfg.run, cfg.training
    if run.decay_from is None:
        return None
    decay, end = int(training.num_decay_steps or 0), training.max_train_steps or 0
    return (f"decay branch of {run.decay_from}: from step {end - decay}, a {training.decay_type} decay over {decay} "
            f"steps to {training.min_lr_ratio:g} x the peak learning rate; the run ends at step {end} "
            "(--max_train_steps)")


def check_outside(path: Path, output_dir: Path) -> None:
    """The source of a branch lies outside the branch's --output_dir."""
    out = output_dir.resolve()
    if out == path.resolve() or out in path.resolve().parents:
        raise BadInput(f"--decay_from {path} lies in --output_dir {output_dir}: a decay branch writes its own "
                       "folder and leaves its source's untouched; choose another --output_dir")


def check_source(path: Path, saved: dict) -> None:
    """The source of a branch that starts: a checkpoint of a warmup_stable_decay run at its peak rate (its
    stable phase, or the first step of its decay). `saved`: the config it was written with."""
    kind = (saved.get("training") or {}).get("lr_scheduler_type")
    if kind != WSD:
        raise BadInput(f"--decay_from {path}: its run's schedule is {kind}, not {WSD}; a decay branch continues "
                       f"a {WSD} run in its stable phase")
    try:
        schedule = json.loads((path / ckpt.SCHEDULER_FILE).read_text())
    except ValueError as err:
        raise BadInput(f"{path / ckpt.SCHEDULER_FILE}: unreadable ({err})") from err
    if not at_peak(schedule):
        raise BadInput(f"--decay_from {path}: its learning rates after step {schedule.get('last_epoch')} are "
                       f"{schedule.get(LAST_LR)}, below their peak {schedule.get('base_lrs')}: it is in its "
                       "warm-up or its decay; branch from a checkpoint of the stable phase")


def closing(cfg: Config) -> str:
    """What the closing line adds for a decay branch ('' for any other run)."""
    if cfg.run.decay_from is None:
        return ""
    decay = int(cfg.training.num_decay_steps or 0)
    return (f"; a decay branch of {cfg.run.decay_from} (from step {(cfg.training.max_train_steps or 0) - decay}, "
            f"{cfg.training.decay_type} over {decay} steps)")


def card_line(cfg: Config) -> str:
    """The model card's sentence on where a branch comes from ('' for any other run)."""
    if cfg.run.decay_from is None:
        return ""
    training = cfg.training
    decay = int(training.num_decay_steps or 0)
    start = (training.max_train_steps or 0) - decay
    return (f"A decay branch: continued from the checkpoint `{cfg.run.decay_from}` (step {start}, the stable "
            f"phase of a warmup-stable-decay run), with a {training.decay_type} decay over its last {decay} "
            f"steps to {training.min_lr_ratio:g} x the peak learning rate.\n\n")
