"""The seam to other libraries' internals (mlm_ddp/compat/): no reach outside it, every reach's feature check
passes on the installed stack (one test per reach, named by it, so the release that moves a name fails CI by
that name), and a name taken away ends `check` in one line naming the library, its version and the tested range.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from mlm_ddp import compat
from mlm_ddp.errors import BadInput
from tests.conftest import REPO

PKG = REPO / "mlm_ddp"
LIBRARIES = ("torch", "accelerate", "datasets", "transformers", "numpy", "argparse")
# modules of those libraries that are not their documented API: importing from them is a reach
UNDOCUMENTED = ("transformers.masking_utils", "transformers.hf_argparser", "datasets.iterable_dataset",
                "datasets.arrow_writer", "accelerate.commands")
# library objects' attributes that mlm_ddp must not write outside the seam (no underscore, still internal)
WRITTEN = ("distributed_type", "found_inf")
ALLOWED = {"os._exit"}  # the standard library's documented exit without clean-up


def reaches_in(source: str) -> list[str]:
    """Each reach into a library's internals in `source`, as 'line: what'."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = ast.unparse(node.value)
            if base not in ("self", "cls") and ast.unparse(node) not in ALLOWED:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and node.args[1].value.startswith("_") and not node.args[1].value.startswith("__")):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            private = any(part.startswith("_") for part in node.module.split("."))
            for alias in node.names:
                if private or alias.name.startswith("_") or node.module.startswith(UNDOCUMENTED):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] in LIBRARIES and (a.name.startswith(UNDOCUMENTED) or any(
                          part.startswith("_") for part in a.name.split(".")))]
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for part in ast.walk(target):
                    if (isinstance(part, ast.Attribute) and part.attr in WRITTEN
                            and ast.unparse(part.value) not in ("self", "cls")):
                        found.append(f"{node.lineno}: {ast.unparse(part)} = ...")
    return found


def test_no_reach_outside_the_seam() -> None:
    outside = {str(path.relative_to(REPO)): hits for path in sorted(PKG.rglob("*.py"))
               if "compat" not in path.relative_to(PKG).parts and (hits := reaches_in(path.read_text()))}
    assert outside == {}


def test_the_walk_finds_each_kind_of_reach() -> None:
    source = "\n".join([
        "from torch.distributed import distributed_c10d",
        "distributed_c10d._set_pg_timeout(t, g)",
        "x = getattr(model, '_supports_sdpa', False)",
        "from torch._C._distributed_c10d import dump",
        "from transformers.masking_utils import create_bidirectional_mask",
        "import datasets.iterable_dataset",
        "accelerator.state.distributed_type = 'FSDP'",
        "self._mine = 1; os._exit(3); print(self._mine)",
    ])
    found = reaches_in(source)
    assert sorted(line.split(":")[0] for line in found) == ["2", "3", "4", "5", "6", "7"], found


def all_reaches() -> list[compat.Reach]:
    return [reach for library in compat.MODULES for reach in compat.reaches(library)]


@pytest.mark.parametrize("reach", all_reaches(), ids=lambda reach: reach.name)
def test_each_reach_is_present_on_the_installed_stack(reach: compat.Reach) -> None:
    assert not compat.missing(reach), compat.line_for(reach)


def test_every_library_has_its_seam() -> None:
    assert set(compat.MODULES) == set(LIBRARIES)
    assert all(compat.reaches(library) for library in ("torch", "accelerate", "datasets", "transformers"))


def dotted(name: str) -> tuple[object, str] | None:
    """(owner, attribute) for a reach named as a plain dotted path to a module attribute, else None."""
    if not all(part.isidentifier() for part in name.split(".")):
        return None
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:-1]:
            owner = getattr(owner, part, None)
        return (owner, parts[-1]) if owner is not None and hasattr(owner, parts[-1]) else None
    return None


TAKEABLE = [reach for reach in all_reaches() if dotted(reach.name)]


@pytest.mark.parametrize("reach", TAKEABLE, ids=lambda reach: reach.name)
def test_a_name_taken_away_is_one_line_at_check(reach: compat.Reach, monkeypatch: pytest.MonkeyPatch) -> None:
    """As a release that moved it: the name deleted, `check` ends in one line naming the library, its
    installed version, the name and the tested range."""
    owner, attribute = dotted(reach.name)
    monkeypatch.delattr(owner, attribute)
    with pytest.raises(BadInput) as refused:
        compat.check(reach.library)
    line = str(refused.value)
    assert "\n" not in line and reach.name in line, line
    assert f"{reach.library} {compat.installed_version(reach.library)} has no " in line, line
    assert f"tested on {compat.tested_range(reach.library)}" in line, line


def test_the_tested_range_starts_at_pyprojects_floor() -> None:
    for library in ("torch", "accelerate", "datasets", "transformers"):
        floor = compat.declared_floor(library)
        assert floor is not None, library
        assert compat.tested_range(library) == f"{library} {floor} to {compat.NEWEST_TESTED[library]}"


def test_a_moved_name_stops_train_in_one_line_before_anything_is_written(
        tiny_model: Path, corpus: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """`mlm_ddp.train` on a stack where one reach's name moved: exit 2, the check's one line, no traceback, no
    folder, before the model is loaded."""
    from mlm_ddp.train import main
    from tests.conftest import tiny_args

    reach = TAKEABLE[0]
    owner, attribute = dotted(reach.name)
    monkeypatch.delattr(owner, attribute)
    out = tmp_path / "out"
    assert main(tiny_args(tiny_model, corpus, out, "--max_train_steps", "2")) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("mlm_ddp.train: error:")]
    assert errors == [f"mlm_ddp.train: error: {compat.line_for(reach)}"] and "Traceback" not in err, err
    assert not out.exists()
