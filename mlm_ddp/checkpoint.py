"""Checkpoint folders: written whole or not at all, found newest-complete-first.

Layout: `output_dir/checkpoints/step-0000500/` holding accelerate's `save_state` files (model,
optimizer, scheduler, RNG states of every rank), `trainer_state.json` (counters and data position),
`config.yaml` (the resolved config of the run) and, written last, the marker `COMPLETE`. A save goes
to `.tmp-step-*` first and is renamed into place only when complete, so a crash mid-save never leaves
a folder that `latest` would pick up.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from mlm_ddp.config import ConfigError

MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d{7,})$")


@dataclass
class TrainerState:
    """Counters a resumed run continues from, and where each rank's data continues."""

    step: int  # optimizer steps done
    epoch: int  # epoch of the next micro-batch to read
    batch_in_epoch: int  # index, within that epoch, of the next micro-batch this rank reads
    tokens_seen: int  # non-padding input tokens, all ranks together
    world_size: int


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / STATE_FILE).is_file()


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found)]


def partial_checkpoints(output_dir: str | Path) -> list[Path]:
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not is_complete(p))


def resolve_resume(spec: str, output_dir: str | Path) -> Path:
    """'latest' -> the newest complete checkpoint of output_dir; else the folder given, checked."""
    if spec == "latest":
        found = complete_checkpoints(output_dir)
        if not found:
            raise ConfigError(
                f"--resume_from_checkpoint latest: no complete checkpoint in {checkpoints_dir(output_dir)}"
            )
        return found[-1]
    path = Path(spec)
    if not path.is_dir():
        raise ConfigError(f"--resume_from_checkpoint {spec}: no such folder")
    if not is_complete(path):
        raise ConfigError(
            f"--resume_from_checkpoint {spec}: not a complete mlm_ddp checkpoint (no {MARKER} marker "
            f"or {STATE_FILE}); it may be a save that was interrupted"
        )
    return path


def read_state(path: Path) -> TrainerState:
    try:
        return TrainerState(**json.loads((path / STATE_FILE).read_text()))
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{path / STATE_FILE}: unreadable trainer state ({err})") from err


def temp_dir(output_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(output_dir) / f".tmp-{step_dir_name(step)}"


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finalize(tmp: Path, state: TrainerState, config_yaml: str) -> Path:
    """Main process, after every rank wrote into tmp: add state and config, fsync, mark, rename."""
    (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
    (tmp / "config.yaml").write_text(config_yaml)
    _fsync_tree(tmp)
    (tmp / MARKER).write_text("ok\n")
    _fsync_tree(tmp)
    final = tmp.parent / step_dir_name(state.step)
    if final.exists():  # a save of the same step from an earlier, superseded attempt
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def rotate(output_dir: str | Path, keep: int | None) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints; returns what was deleted."""
    if keep is None:
        return []
    doomed = complete_checkpoints(output_dir)[:-keep]
    for path in doomed:
        shutil.rmtree(path)
    return doomed
