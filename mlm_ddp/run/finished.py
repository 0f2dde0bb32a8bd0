"""Whether the run in a folder finished: its summary.json, what says so, and what a resume does with it.

summary.json is written last, atomically, when a run finishes; it is the one mark of a finished run,
read by `auto` (nothing to do), by a resume (nothing to do where the checkpoint is at the run's end),
by `mlm_ddp.submit` and by the report. So a run resumed to train further moves it aside first.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from mlm_ddp.config import Config
from mlm_ddp.errors import AlreadyFinished
from mlm_ddp.loop import checkpoint as ckpt

SUMMARY_FILE = "summary.json"
PREVIOUS_SUMMARY = "previous_summary.json"  # the summary of the finish that a resume trained further from


def finished_summary(out: Path) -> dict | None:
    """The summary of a run that finished in `out`; None when there is none or it is torn (a run
    killed while writing it, before it was written atomically, did not finish)."""
    try:
        summary = json.loads((out / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def saved_config(out: Path) -> dict:
    """The folder's config.yaml ({} when there is none or it is unreadable)."""
    try:
        saved = yaml.safe_load((out / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return saved if isinstance(saved, dict) else {}


def end_if_finished(cfg: Config, checkpoint: Path) -> None:
    """A finished run resumed from a checkpoint of its own at (or past) its end has nothing to do: end as
    `auto` does (AlreadyFinished). Run on, it would train no step and write final/, the card and summary.json
    again, without the figures of a training. The end is --max_train_steps, or, counted in epochs, where
    the finished run ended when the epochs are its own (while summary.json is there, config.yaml is the
    finished run's: `set_aside` moves the summary first)."""
    out = Path(cfg.run.output_dir)
    if (summary := finished_summary(out)) is None:
        return
    training, saved = cfg.training, saved_config(out).get("training") or {}
    total = training.max_train_steps
    same_epochs = saved.get("max_train_steps") is None and saved.get("num_train_epochs") == training.num_train_epochs
    if total is None and same_epochs:
        total = summary.get("steps")
    if isinstance(total, int) and ckpt.read_state(checkpoint).step >= total:
        raise AlreadyFinished(f"--output_dir {out} holds a finished run: nothing to do ({checkpoint.name} is at its "
                              f"last step, {total}; a larger --max_train_steps trains further)")


def set_aside(out: Path) -> None:
    """A finished run resumed to train further is no longer finished: left in place, its summary.json would
    make a requeue with `auto` end the run as done at whatever step it stopped. Moved, not deleted: it
    describes final/ (kept until this run's finish replaces both) and holds figures no other file does (the
    wall time, the probe's paired change). Main process; before config.yaml is written (`end_if_finished`)."""
    if (out / SUMMARY_FILE).exists():
        os.replace(out / SUMMARY_FILE, out / PREVIOUS_SUMMARY)
