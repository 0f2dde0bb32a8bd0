"""The run's config followed from `train.train(cfg)` through the source (a measure of the package's layout).

Read statically, as a newcomer reads it: starting in `train()` with `cfg`, every call that is handed the
config (the whole tree, a section such as `cfg.training`, a name bound to one, or an attribute of `self`
that a constructor was handed) is followed into the mlm_ddp function, method or constructor it resolves to,
depth first, each function once. The functions entered, in that order, fall into modules:

- a *stay* is a run of consecutive entries in one module (the walk entered that module and read there);
- a *climb* is a stay whose module stands on a higher floor than the stay before it: the reader went down
  and must come back up. A module's floor is its import depth: 0 for a module that imports nothing of
  mlm_ddp, else one more than the highest module it imports (imports that run, lazy ones included).

Fewer modules, stays and climbs mean the config is handed to the objects that own it once, instead of
being threaded down and back up through many modules.

    python -m tests.config_walk [--tree] [REPO]   # the walk's figures for a checkout (default: this one);
                                                  # --tree: each function entered, under its caller
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SECTIONS = ("model", "data", "training", "run")  # config/tree.py's Config: the tree's sections


@dataclass
class Module:
    name: str
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    bound: dict[str, str] = field(default_factory=dict)  # local name -> "mlm_ddp.x" or "mlm_ddp.x:attr"
    imports: set[str] = field(default_factory=set)


def read_package(repo: Path) -> dict[str, Module]:
    root = repo / "mlm_ddp"
    mods: dict[str, Module] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(repo).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_init else parts)
        tree = ast.parse(path.read_text())
        mod = Module(name)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                mod.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                mod.classes[node.name] = node
        package = name if is_init else name.rpartition(".")[0]
        for node in ast.walk(tree):  # lazy imports too: they bind the same names where they run
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("mlm_ddp"):
                        mod.bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "mlm_ddp"
                        mod.imports.add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    keep = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(keep + ([base] if base else []))
                if base.startswith("mlm_ddp"):
                    for alias in node.names:
                        mod.bound[alias.asname or alias.name] = f"{base}:{alias.name}"
                        mod.imports.add(base)
        mods[name] = mod
    for mod in mods.values():  # `from mlm_ddp.x import y` where y is a module is an import of that module
        mod.bound = {k: (v.replace(":", ".") if v.replace(":", ".") in mods else v) for k, v in mod.bound.items()}
        mod.imports = {i for i in mod.imports if i in mods} | {v for v in mod.bound.values() if v in mods}
    return mods


def floors(mods: dict[str, Module]) -> dict[str, int]:
    memo: dict[str, int] = {}

    def depth(name: str, seen: frozenset[str]) -> int:
        if name not in memo:
            below = [depth(i, seen | {name}) for i in mods[name].imports if i != name and i not in seen]
            memo[name] = 1 + max(below) if below else 0
        return memo[name]

    return {name: depth(name, frozenset()) for name in mods}


@dataclass(frozen=True)
class Target:
    module: str
    node: ast.FunctionDef | ast.ClassDef
    cls: ast.ClassDef | None = None  # the class a method belongs to


def resolve_name(mods: dict[str, Module], module: str, name: str, hops: int = 0) -> Target | None:
    mod = mods.get(module)
    if mod is None or hops > 5:
        return None
    if name in mod.functions:
        return Target(module, mod.functions[name])
    if name in mod.classes:
        return Target(module, mod.classes[name])
    bound = mod.bound.get(name)
    if bound and ":" in bound:  # re-exported: follow it to where it is defined
        where, attr = bound.split(":")
        return resolve_name(mods, where, attr, hops + 1)
    return None


def constructor(target: Target) -> Target:
    """A class call enters its __init__ (or __post_init__); a class with neither is still entered."""
    if not isinstance(target.node, ast.ClassDef):
        return target
    for item in target.node.body:
        if isinstance(item, ast.FunctionDef) and item.name in ("__init__", "__post_init__"):
            return Target(target.module, item, target.node)
    return Target(target.module, target.node)


class Walk:
    def __init__(self, mods: dict[str, Module]):
        self.mods = mods
        self.order: list[str] = []  # the module of each function entered, in the walk's order
        self.tree: list[str] = []  # each entry indented by its depth: what --tree prints
        self.depth = 0
        self.entered: set[tuple[str, int]] = set()
        self.self_carriers: dict[int, dict[str, str]] = {}  # id(class) -> self attribute -> "tree"/"section"

    def carries(self, expr: ast.expr, carriers: dict[str, str], cls: ast.ClassDef | None) -> str | None:
        """"tree" or "section" where `expr` is the config or one of its sections, else None (a single field,
        `cfg.training.seed`, is a plain value: handing it on is what a module that owns no config gets)."""
        if isinstance(expr, ast.Starred):
            expr = expr.value
        if isinstance(expr, ast.Name):
            return carriers.get(expr.id)
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            if expr.value.id == "self" and cls is not None:
                return self.self_carriers.get(id(cls), {}).get(expr.attr)
        if isinstance(expr, ast.Attribute) and self.carries(expr.value, carriers, cls) == "tree":
            return "section" if expr.attr in SECTIONS else None
        return None

    def callee(self, module: str, cls: ast.ClassDef | None, func: ast.expr) -> Target | None:
        if isinstance(func, ast.Name):
            found = resolve_name(self.mods, module, func.id)
            return constructor(found) if found else None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner = func.value.id
            if owner in ("self", "cls") and cls is not None:
                for item in cls.body:
                    if isinstance(item, ast.FunctionDef) and item.name == func.attr:
                        return Target(module, item, cls)
                return None
            bound = self.mods[module].bound.get(owner, "")
            if bound in self.mods:  # module.function
                found = resolve_name(self.mods, bound, func.attr)
                return constructor(found) if found else None
            found = resolve_name(self.mods, module, owner)  # Class.method / Class.classmethod
            if found and isinstance(found.node, ast.ClassDef):
                for item in found.node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == func.attr:
                        return Target(found.module, item, found.node)
        return None

    def enter(self, target: Target, carried: dict[str, str]) -> None:
        key = (target.module, id(target.node))
        if key in self.entered:
            return
        self.entered.add(key)
        self.order.append(target.module)
        owner = f"{target.cls.name}." if target.cls is not None and target.cls is not target.node else ""
        self.tree.append(f"{'  ' * self.depth}{target.module.removeprefix('mlm_ddp.')}:{owner}{target.node.name}"
                         f"({', '.join(sorted(carried))})")
        if isinstance(target.node, ast.ClassDef):
            return
        self.depth += 1
        try:
            self.read(target, carried)
        finally:
            self.depth -= 1

    def read(self, target: Target, carried: dict[str, str]) -> None:
        carriers = dict(carried)
        for node in self.in_order(target.node):
            kind = self.carries(node.value, carriers, target.cls) if isinstance(node, ast.Assign) else None
            for t in node.targets if kind else []:
                if isinstance(t, ast.Name):
                    carriers[t.id] = kind
                elif (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                      and target.cls is not None):
                    self.self_carriers.setdefault(id(target.cls), {})[t.attr] = kind
            if isinstance(node, ast.Call):
                self.follow(target, node, carriers)

    def follow(self, caller: Target, call: ast.Call, carriers: dict[str, str]) -> None:
        given = {i: kind for i, a in enumerate(call.args) if (kind := self.carries(a, carriers, caller.cls))}
        named = {k.arg: kind for k in call.keywords if k.arg and (kind := self.carries(k.value, carriers, caller.cls))}
        own = (isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name)
               and call.func.value.id == "self" and caller.cls is not None and id(caller.cls) in self.self_carriers)
        if not given and not named and not own:  # an object handed the config reads it in its own methods
            return
        target = self.callee(caller.module, caller.cls, call.func)
        if target is None:
            return
        params: list[str] = []
        if isinstance(target.node, ast.FunctionDef):
            params = [a.arg for a in target.node.args.posonlyargs + target.node.args.args]
            if target.cls is not None and params and params[0] in ("self", "cls"):
                params = params[1:]
        self.enter(target, {params[i]: kind for i, kind in given.items() if i < len(params)} | named)

    @staticmethod
    def in_order(node: ast.AST):
        """The nodes under `node` in the order Python runs them: a call's arguments before the call (in
        `build(cfg, preflight(cfg))` preflight is entered first); a nested def's body where it stands."""
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Call):
                yield from Walk.in_order(child)
                yield child
            else:
                yield child
                yield from Walk.in_order(child)


def measure(repo: Path = REPO) -> dict[str, object]:
    mods = read_package(repo)
    walk = Walk(mods)
    walk.enter(Target("mlm_ddp.train", mods["mlm_ddp.train"].functions["train"]), {"cfg": "tree"})
    floor = floors(mods)
    stays = [m for i, m in enumerate(walk.order) if i == 0 or walk.order[i - 1] != m]
    climbs = sum(1 for a, b in zip(stays, stays[1:], strict=False) if floor[b] > floor[a])
    return {"functions": len(walk.order), "modules": len(set(walk.order)), "stays": len(stays),
            "climbs": climbs, "path": stays, "tree": walk.tree}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    paths = [a for a in argv if a != "--tree"]
    found = measure(Path(paths[0]) if paths else REPO)
    if "--tree" in argv:
        print("\n".join(found["tree"]))
    print(f"{found['functions']} functions, {found['modules']} modules, {found['stays']} stays, "
          f"{found['climbs']} climbs")
    print(" -> ".join(m.removeprefix("mlm_ddp.") for m in found["path"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
