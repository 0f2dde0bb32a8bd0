"""The seam to other libraries' internals. Every private or undocumented name of torch, accelerate,
datasets, transformers, numpy or argparse that mlm_ddp uses is reached here, one module per library
(`compat.torch`, `compat.accelerate`, ...), and nowhere else: tests/test_compat.py walks the package's
source for a reach outside.

Each module lists what it reaches as `Reach`es: the name, a feature check, what mlm_ddp uses it for.
`check(...)` runs every check of the libraries named, before anything is written, so that a release that
moved a name ends the run in one line naming the library, its installed version and the range mlm_ddp is
tested on, never in a traceback mid-run. Where a public API does the job, the code uses it, not this seam.

May import: `mlm_ddp.errors` and itself.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass

from mlm_ddp.errors import BadInput

# the seam module of each library: mlm_ddp.compat.<module>
MODULES = {"torch": "torch", "accelerate": "accelerate", "datasets": "datasets", "transformers": "transformers",
           "numpy": "numpy", "argparse": "argparse"}
# the newest release of each library the whole suite passed on (the lowest is pyproject's floor); argparse is
# the standard library's, tested on the Python versions pyproject admits
NEWEST_TESTED = {"torch": "2.13.0", "accelerate": "1.15.0", "datasets": "5.2.0", "transformers": "5.24.0",
                 "numpy": "2.4.6"}


@dataclass(frozen=True)
class Reach:
    """One name of another library that is not its public API, and how to tell that a release still has it."""

    library: str  # a key of MODULES
    name: str  # what is reached, as a reader would look it up: "torch.distributed.distributed_c10d._set_pg_timeout"
    present: Callable[[], bool]  # the feature check: True where this release has the name as mlm_ddp uses it
    purpose: str  # what mlm_ddp uses it for, one clause


def installed_version(library: str) -> str:
    """The installed release of `library` ('Python X.Y' for the standard library's modules)."""
    if library == "argparse":
        import sys

        return f"Python {sys.version_info.major}.{sys.version_info.minor}"
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def declared_floor(library: str) -> str | None:
    """The lowest version of `library` that mlm_ddp's installed metadata admits (pyproject's `>=`), if any."""
    try:
        requires = importlib.metadata.requires("mlm_ddp") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    from packaging.requirements import Requirement

    for line in requires:
        requirement = Requirement(line)
        if requirement.name == library and requirement.marker is None:
            floors = [spec.version for spec in requirement.specifier if spec.operator == ">="]
            return floors[0] if floors else None
    return None


def tested_range(library: str) -> str:
    """'transformers 5.10.4 to 5.24.0': the versions the suite passed on, as one line says them."""
    if library == "argparse":
        return "the Python versions pyproject admits"
    floor, newest = declared_floor(library), NEWEST_TESTED.get(library)
    if floor and newest:
        return f"{library} {floor} to {newest}"
    return f"{library} {newest or floor or '(untested)'}"


def reaches(library: str) -> list[Reach]:
    """The reaches of one library, from its seam module."""
    return list(importlib.import_module(f"mlm_ddp.compat.{MODULES[library]}").REACHES)


def missing(reach: Reach) -> bool:
    try:
        return not reach.present()
    except Exception:  # noqa: BLE001 - a check that cannot even run means the name moved
        return True


def line_for(reach: Reach) -> str:
    """The one line a moved name ends a run with."""
    return (f"{reach.library} {installed_version(reach.library)} has no {reach.name} ({reach.purpose}); "
            f"mlm_ddp is tested on {tested_range(reach.library)}: install a {reach.library} in that range")


def check(*libraries: str) -> None:
    """Every reach of `libraries` (all of them when none is named) is present, or BadInput with one line
    naming the first that is not."""
    for library in libraries or tuple(MODULES):
        for reach in reaches(library):
            if missing(reach):
                raise BadInput(line_for(reach))
