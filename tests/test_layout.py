"""The package's layout: every import of mlm_ddp read from the source (lazy ones inside
functions too), and the arrows between its folders run one way.

Floors, lowest first: `errors` < compat/ (the seam to other libraries' internals) < cluster/ < config/ <
model/ < data/ < loop/ < probe/ < run/ < the entry points (the top-level modules users run, `train.py` the
one that wires a run). A module may import its
own folder, a lower floor, and `errors`; never a higher floor, never an entry point (only entry points
may import those). Imports under `if TYPE_CHECKING:` never run, but they count: a cycle closed by one is
still two modules that cannot be read apart, and it becomes an import-time cycle the day someone needs the
name at run time (a dataclass field, `typing.get_type_hints`, HfArgumentParser reading annotations). The
shared type moves to a module both import (as `ProbeConfig` lives in probe/config.py).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests import config_walk
from tests.conftest import REPO

PKG = REPO / "mlm_ddp"
FLOORS = ["errors", "compat", "cluster", "config", "model", "data", "loop", "probe", "run"]  # lowest first
ENTRY_POINTS = ["train", "submit", "prepare", "probe", "predict", "report", "bench", "tokenizer", "distributed"]
NOT_ENTRIES = {"__init__", "errors"}  # top-level modules that are neither an entry point nor a floor of their own
# named rules, beside the floors, as the issue states them: (from a folder, to a module or folder under mlm_ddp)
FORBIDDEN = [
    ("data", "run", "data/ knows nothing of a run's outputs"),
    ("model", "run", "model/ knows nothing of a run's outputs"),
    ("data", "cluster.watchdog", "data/ knows nothing of the hang watchdog"),
    ("data", "cluster.heartbeat", "data/ is handed the heartbeat's collective, never imports it"),
    ("model", "cluster.watchdog", "model/ knows nothing of the hang watchdog"),
    ("model", "cluster.heartbeat", "model/ knows nothing of heartbeats"),
    ("model", "data", "the model knows no data (docs/design.md, 'The parts')"),
    ("loop", "run", "the loop sits below the run's outputs: report, log, folder"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py")) if "__pycache__" not in p.parts}


def type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside |= {id(n) for child in node.body for n in ast.walk(child)}
    return inside


def imports_of(name: str, path: Path, known: Iterable[str]) -> dict[str, bool]:
    """The mlm_ddp modules `name` imports anywhere in its source -> whether it runs (not TYPE_CHECKING).
    `from mlm_ddp.x import y` counts as mlm_ddp.x.y when that is a module, else as mlm_ddp.x."""
    known = set(known)
    tree = ast.parse(path.read_text())
    typing_only = type_checking_nodes(tree)
    found: dict[str, bool] = {}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x / from .y import x
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            while target and target not in known:  # mlm_ddp.x.attr -> mlm_ddp.x
                target = target.rpartition(".")[0]
            if target and target != name and target != "mlm_ddp":
                found[target] = found.get(target, False) or id(node) not in typing_only
    return found


def import_graph() -> dict[str, dict[str, bool]]:
    mods = modules()
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def floor(module: str) -> str:
    """A module's floor: its folder under mlm_ddp, `errors`, or "entry" for a top-level entry module."""
    parts = module.split(".")
    if len(parts) == 1:
        return "package"
    if len(parts) == 2 and parts[1] != "errors" and parts[1] not in FLOORS:
        return "entry"
    return parts[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one node (Tarjan), each sorted; a cycle lies within one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def violations(graph: dict[str, dict[str, bool]]) -> list[str]:
    """What the layout refuses, one line each: module cycles (type-only imports included, and named where
    one closes the cycle), folder cycles, arrows down-to-up between floors, the named rules, a package module
    importing an entry point."""
    at_run_time = cycles({m: {t for t, runs in ts.items() if runs} for m, ts in graph.items()})
    out = [f"module cycle: {' <-> '.join(group)}" + ("" if group in at_run_time else
                                                       " (closed by an import under TYPE_CHECKING: move the type "
                                                       "they share to a module both import)")
           for group in cycles({m: set(ts) for m, ts in graph.items()})]
    folders: dict[str, set[str]] = {}
    for module, targets in graph.items():
        for target in targets:
            a, b = floor(module), floor(target)
            if a != b:
                folders.setdefault(a, set()).add(b)
            if b == "entry" and a != "entry":
                out.append(f"{module} imports the entry point {target}: move what it needs below the entry points")
            if a in FLOORS and b in FLOORS and FLOORS.index(b) > FLOORS.index(a):
                out.append(f"{module} ({a}/) imports {target} ({b}/), a higher floor")
            inside = target.partition(".")[2] + "."  # cluster.watchdog. for mlm_ddp.cluster.watchdog
            for source, forbidden, why in FORBIDDEN:
                if a == source and inside.startswith(forbidden + "."):
                    out.append(f"{module} imports {target}: {why}")
    out += [f"folder cycle: {' <-> '.join(group)}" for group in cycles(folders)]
    return out


def test_the_arrows_run_one_way() -> None:
    graph = import_graph()
    assert len(graph) > 40 and "mlm_ddp.cluster.launcher" in graph  # the walk found the package
    assert violations(graph) == []


def test_the_check_fails_on_a_bad_import() -> None:
    """The check can fail: a synthetic graph with each kind of bad arrow names each one."""
    graph = import_graph()
    bad = {m: dict(t) for m, t in graph.items()}
    bad["mlm_ddp.data.pack"]["mlm_ddp.run.report"] = True  # data/ up to run/
    bad["mlm_ddp.model.loading"]["mlm_ddp.cluster.watchdog"] = True  # model/ to the watchdog
    bad["mlm_ddp.loop.evaluation"]["mlm_ddp.run.run_log"] = True  # the loop up to the run log (it once did)
    bad["mlm_ddp.probe.features"]["mlm_ddp.predict"] = True  # a package module to an entry point (it once did)
    bad["mlm_ddp.cluster.durable"]["mlm_ddp.cluster.watchdog"] = True  # watchdog -> durable already: a cycle
    found = "\n".join(violations(bad))
    for expected in ["mlm_ddp.data.pack (data/) imports mlm_ddp.run.report (run/), a higher floor",
                     "mlm_ddp.model.loading imports mlm_ddp.cluster.watchdog: model/ knows nothing of the hang",
                     "mlm_ddp.loop.evaluation imports mlm_ddp.run.run_log: the loop sits below",
                     "mlm_ddp.probe.features imports the entry point mlm_ddp.predict",
                     "module cycle: ", "mlm_ddp.cluster.durable <-> ", "folder cycle: "]:
        assert expected in found, (expected, found)
    # a type-only import keeps the floors, and closes a cycle too (two modules that import each other, one
    # side under TYPE_CHECKING, are a cycle)
    typing_only = {m: dict(t) for m, t in graph.items()}
    typing_only["mlm_ddp.cluster.durable"]["mlm_ddp.cluster.watchdog"] = False
    cycle = [line for line in violations(typing_only) if line.startswith("module cycle: ")]
    assert len(cycle) == 1 and "mlm_ddp.cluster.durable <-> " in cycle[0] and "mlm_ddp.cluster.watchdog" in cycle[0]
    assert cycle[0].endswith("(closed by an import under TYPE_CHECKING: move the type they share to a module both "
                             "import)"), cycle
    typing_only = {m: dict(t) for m, t in graph.items()}
    typing_only["mlm_ddp.cluster.durable"]["mlm_ddp.run.hub"] = False
    floors = violations(typing_only)
    assert "mlm_ddp.cluster.durable (cluster/) imports mlm_ddp.run.hub (run/), a higher floor" in floors, floors


def test_a_cycle_through_a_type_only_import_is_found_in_the_source(tmp_path: Path) -> None:
    """Two modules of one folder, read from their source: one imports the other at run time, the other imports it
    back under `if TYPE_CHECKING:` (what probe/compare.py did to probe/standalone.py for ProbeConfig). The walk
    reads the typing-only import as one, and the layout names the cycle."""
    (tmp_path / "compare.py").write_text("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n\n"
                                         "if TYPE_CHECKING:\n    from mlm_ddp.probe.standalone import ProbeConfig\n")
    (tmp_path / "standalone.py").write_text("from mlm_ddp.probe.compare import change\n")
    known = set(modules())
    graph = {name: imports_of(name, tmp_path / f"{name.rpartition('.')[2]}.py", known)
             for name in ("mlm_ddp.probe.compare", "mlm_ddp.probe.standalone")}
    assert graph == {"mlm_ddp.probe.compare": {"mlm_ddp.probe.standalone": False},
                     "mlm_ddp.probe.standalone": {"mlm_ddp.probe.compare": True}}
    assert violations(graph) == ["module cycle: mlm_ddp.probe.compare <-> mlm_ddp.probe.standalone (closed by an "
                                 "import under TYPE_CHECKING: move the type they share to a module both import)"]


def test_lazy_and_relative_imports_are_read(tmp_path: Path) -> None:
    """An import inside a function counts as one at the top."""
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from mlm_ddp.run import report\n    import mlm_ddp.loop.step\n")
    found = imports_of("mlm_ddp.data.x", source, modules())
    assert found == {"mlm_ddp.run.report": True, "mlm_ddp.loop.step": True}


def test_the_top_of_the_package_is_short() -> None:
    """At most 10 entries at the top of mlm_ddp/ besides the entry points; every folder says what it owns
    and may import."""
    top = sorted(p.stem for p in PKG.iterdir() if p.name != "__pycache__" and (p.suffix == ".py" or p.is_dir()))
    others = [name for name in top if name not in ENTRY_POINTS and name != "bench_prepare"]
    assert len(others) <= 10, others
    for folder in FLOORS[1:]:
        doc = ast.get_docstring(ast.parse((PKG / folder / "__init__.py").read_text())) or ""
        assert "import" in doc, f"mlm_ddp/{folder}/__init__.py does not say what it may import"


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_answers_help(entry: str, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture) -> None:
    """`python -m mlm_ddp.X --help` where users type it, whatever folder its body moved to: run as `-m` runs
    it (runpy, a package through its __main__.py), in this process, where the imports are already paid for."""
    import runpy
    import warnings

    monkeypatch.setattr(sys, "argv", [f"mlm_ddp.{entry}", "--help"])
    with pytest.raises(SystemExit) as exited, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "found in sys.modules": other tests imported it
        runpy.run_module(f"mlm_ddp.{entry}", run_name="__main__", alter_sys=True)
    assert exited.value.code in (0, None)
    out = capsys.readouterr().out
    assert "usage" in out.lower(), out[:500]


def test_the_walk_follows_sections_not_fields(tmp_path: Path) -> None:
    """The walk on a package of four modules: a section or a name bound to one is followed, a field is not,
    an attribute of `self` set from the config is, a re-export resolves; a return up a floor is a climb."""
    pkg = tmp_path / "mlm_ddp"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("from mlm_ddp.low.leaves import leaf\n")
    (pkg / "low" / "leaves.py").write_text("def leaf(data):\n    return data\n\n"
                                           "def untouched(seed):\n    return seed\n")
    (pkg / "mid.py").write_text(
        "from mlm_ddp.low import leaf\nfrom mlm_ddp.low.leaves import untouched\n\n"
        "class Owner:\n    def __init__(self, cfg):\n        self.data = cfg.data\n        self.use()\n\n"
        "    def use(self):\n        leaf(self.data)\n        untouched(self.data.seed)\n")
    (pkg / "train.py").write_text(
        "from mlm_ddp import mid\nfrom mlm_ddp.low.leaves import leaf, untouched\n\n"
        "def train(cfg):\n    untouched(cfg.training.seed)\n    mid.Owner(cfg)\n    section = cfg.data\n"
        "    helper(section)\n\ndef helper(data):\n    leaf(data)\n")
    found = config_walk.measure(tmp_path)
    assert found["tree"] == ["train:train(cfg)", "  mid:Owner.__init__(cfg)", "    mid:Owner.use()",
                             "      low.leaves:leaf(data)", "  train:helper(data)"]
    assert found["path"] == ["mlm_ddp.train", "mlm_ddp.mid", "mlm_ddp.low.leaves", "mlm_ddp.train"]
    assert (found["modules"], found["stays"], found["climbs"]) == (3, 4, 1)


@pytest.mark.parametrize(("entry", "argv"), [
    ("train", []), ("probe.standalone", ["model_dir"]), ("prepare", ["--output_dir", "out", "--train_file", "a.txt"]),
    ("bench", []), ("bench_prepare", ["--corpus", "corpus", "--medium", "corpus", "--small", "corpus"]),
    ("tokenizer", ["--output_dir", "unused"]),  # submit's: test_submit's test_bad_input_is_refused_before_submission
])
def test_a_mistyped_flag_is_named_not_a_traceback(entry: str, argv: list[str], capsys: pytest.CaptureFixture,
                                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tool refuses a flag it does not know as argparse does: exit 2, the flag named, no traceback,
    nothing written (submit checks the training flags before it submits)."""
    import importlib

    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("a line of text\n")
    main = importlib.import_module(f"mlm_ddp.{entry}").main
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--max_train_step", "10"])  # a prefix of --max_train_steps is a typo, not that flag
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --max_train_step 10" in err and "Traceback" not in err, err[-1000:]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.txt", "corpus"]
