"""The parts of a run that a resume and a rollback put back, beside what accelerate's `save_state` holds (model,
optimizer, every rank's RNG states) and the counters of trainer_state.json, which the folder policy reads
before anything is built (run/run_folder.py: where the data continues, on how many processes).

Each part is an object with `state_dict()` and `load_state_dict(state)` (JSON-able dicts), registered once
under a name (`Parts.register`, in train.build). A checkpoint holds every part's section: the sections that
are the same on every rank in `parts.json` (written by the main process), a rank's own in
`parts_rank{R}.json`. Resume and rollback restore every part through one call (`Parts.load`); a part
registered after a resume read its checkpoint gets its section as it registers. A part whose section a
checkpoint lacks (a guard that was off when it was saved) keeps the state it was built with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from accelerate.logging import get_logger

from mlm_ddp.errors import BadInput

logger = get_logger(__name__)
SHARED_FILE = "parts.json"


def rank_file(rank: int) -> str:
    return f"parts_rank{rank}.json"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Part:
    obj: Stateful
    per_rank: bool  # its state is this rank's own (saved per rank); else the same on every rank


@dataclass(frozen=True)
class Sections:
    """One checkpoint's sections, as this rank reads them: shared by name, this rank's own by name."""

    folder: Path  # the checkpoint
    shared: dict[str, dict[str, Any]]
    mine: dict[str, dict[str, Any]]
    other_world: bool  # written by another number of processes: there are no sections of this rank's own


def read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        found = json.loads(file.read_text())
    except ValueError as err:
        raise BadInput(f"{file}: unreadable ({err}); the checkpoint is damaged") from err
    if not isinstance(found, dict):
        raise BadInput(f"{file}: not a mapping of sections; the checkpoint is damaged")
    return found


class Parts:
    """The registered parts of one process of a run. Every rank calls `collect` at the same point of a save
    (a part's `state_dict` may be a collective), in registration order, which `build` makes the same on every
    rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.registered: dict[str, Part] = {}
        self.loaded: Sections | None = None  # the sections of the checkpoint this process last restored

    def register(self, name: str, obj: Stateful, per_rank: bool = False) -> None:
        if name in self.registered:
            raise ValueError(f"a resumable part named {name!r} is registered already")
        self.registered[name] = Part(obj, per_rank)
        if self.loaded is not None:
            self._apply(name, self.loaded)

    def collect(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(shared sections, this rank's sections): every part's state now."""
        shared: dict[str, Any] = {}
        mine: dict[str, Any] = {}
        for name, part in self.registered.items():
            (mine if part.per_rank else shared)[name] = part.obj.state_dict()
        return shared, mine

    def write(self, folder: Path, collected: tuple[dict[str, Any], dict[str, Any]], is_main: bool) -> None:
        """This rank's files of a checkpoint being written into `folder`."""
        shared, mine = collected
        if is_main:
            (folder / SHARED_FILE).write_text(json.dumps(shared))
        if mine:
            (folder / rank_file(self.rank)).write_text(json.dumps(mine))

    def load(self, folder: Path, same_world: bool) -> None:
        """Restore every registered part from checkpoint `folder` (`same_world`: written by this number of
        processes, so that this rank's own sections are this rank's)."""
        self.loaded = Sections(folder, read_json(folder / SHARED_FILE),
                               read_json(folder / rank_file(self.rank)) if same_world else {}, not same_world)
        for name in self.registered:
            self._apply(name, self.loaded)

    def _apply(self, name: str, sections: Sections) -> None:
        part = self.registered[name]
        state = (sections.mine if part.per_rank else sections.shared).get(name)
        if state is not None:
            try:
                part.obj.load_state_dict(state)
            except (KeyError, TypeError, ValueError) as err:  # a section another part's code wrote, or edited
                file = rank_file(self.rank) if part.per_rank else SHARED_FILE
                raise BadInput(f"{sections.folder / file}: section {name!r} cannot be restored ({type(err).__name__}: "
                               f"{err}); the checkpoint is damaged or not written by mlm_ddp") from err
        elif part.per_rank and sections.other_world:
            logger.warning("%s starts afresh: its state is each process's own, and the checkpoint was written by "
                           "another number of processes", name)
