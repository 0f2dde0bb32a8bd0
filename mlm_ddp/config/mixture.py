"""Several training sources (`--train_file a b --train_weights 0.9 0.1`, or a YAML list of {path, weight,
name}): their flags brought to one form and checked, without reading a file (data.mixture reads them)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mlm_ddp.errors import BadInput

SOURCE_KEYS = ("path", "weight", "name")  # what one source of a YAML list may say


def unique_names(paths: list[str], flag: str) -> list[str]:
    """Each file's name in the records: its stem, or where stems collide as much of its path as tells it
    apart (a/general.txt and b/general.txt: 'general.txt' is no better, so 'a/general' and 'b/general').
    One file given twice is refused."""
    resolved = [Path(p).resolve() for p in paths]
    for i, path in enumerate(resolved):
        if path in resolved[:i]:
            first = paths[resolved.index(path)]
            raise BadInput(f"{flag} {paths[i]}: given twice{f' (as {first})' if first != paths[i] else ''}; "
                           "give each file once")

    def named(path: Path, level: int) -> str:  # 0: the stem, 1: the file name, k > 1: k - 1 folders and the stem
        return path.stem if level == 0 else path.name if level == 1 else "/".join([*path.parts[-level:-1], path.stem])

    levels = [0] * len(paths)
    while True:
        names = [named(p, level) for p, level in zip(resolved, levels, strict=True)]
        clashing = [i for i, name in enumerate(names) if names.count(name) > 1]
        if not clashing:
            return names
        if any(levels[i] >= len(resolved[i].parts) for i in clashing):
            raise BadInput(f"{flag}: two files are both named {names[clashing[0]]!r}; rename one")
        for i in clashing:
            levels[i] += 1


def _from_list(data: Any, sources: list[dict]) -> None:
    """A YAML's list of sources -> the three flags' lists (names and weights where given)."""
    if data.train_weights is not None or data.train_names is not None:
        raise BadInput("--train_file lists its sources with their weights and names: drop --train_weights and "
                       "--train_names, or give the sources as plain paths")
    for source in sources:
        unknown = sorted(set(source) - set(SOURCE_KEYS))
        if unknown or "path" not in source:
            raise BadInput(f"--train_file source {source}: a source is a mapping of path (required), weight and "
                           f"name{f'; unknown key(s) {unknown}' if unknown else ''}")
    data.train_file = [str(s["path"]) for s in sources]
    weights = [s.get("weight") for s in sources]
    data.train_weights = None if all(w is None for w in weights) else weights
    if any(s.get("name") is not None for s in sources):
        stems = unique_names(data.train_file, "--train_file")
        data.train_names = [str(s["name"]) if s.get("name") is not None else stem
                            for s, stem in zip(sources, stems, strict=True)]


def check_sources(data: Any) -> None:
    """Bring `--train_file`, `--train_weights` and `--train_names` (a DataConfig's) to lists of one length
    and check them: BadInput naming the value and the fix. Pure: no file is opened."""
    files = data.train_file
    if files is None:
        if data.train_weights is not None or data.train_names is not None:
            raise BadInput("--train_weights and --train_names go with several --train_file sources")
        return
    files = [files] if isinstance(files, (str, dict)) else list(files)
    if any(isinstance(f, dict) for f in files):
        if not all(isinstance(f, dict) for f in files):
            raise BadInput("--train_file: a list of sources holds either paths or mappings of path, weight and name, "
                           "not both")
        _from_list(data, files)
    else:
        data.train_file = [str(f) for f in files]
    count = len(data.train_file)
    if count == 0:
        raise BadInput("--train_file: give at least one file, or leave the flag out")
    if data.train_weights is None and count > 1:
        raise BadInput(f"--train_file gives {count} sources: give each one's share of the training tokens with "
                       f"--train_weights ({count} positive numbers, e.g. --train_weights {' '.join(['1'] * count)})")
    if data.train_weights is not None:
        if None in data.train_weights or len(data.train_weights) != count:
            given = sum(w is not None for w in data.train_weights)
            raise BadInput(f"--train_weights gives {given} weight(s) for {count} --train_file source(s): give one "
                           "per source, in the same order")
        for weight in data.train_weights:
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                    or weight <= 0:
                raise BadInput(f"--train_weights {weight!r}: each weight is a share of the training tokens and must "
                               "be a positive number")
        data.train_weights = [float(w) for w in data.train_weights]
    if data.train_names is not None:
        data.train_names = [str(n) for n in data.train_names]
        if len(data.train_names) != count:
            raise BadInput(f"--train_names gives {len(data.train_names)} name(s) for {count} --train_file "
                           "source(s): give one per source, in the same order")
    names = source_names(data)
    unique_names(data.train_file, "--train_file")  # one file given twice is refused, whatever the names
    for i, name in enumerate(names):
        if name in names[:i]:
            raise BadInput(f"--train_names: two sources are both named {name!r}; give each source its own name")
    if count > 1 and data.streaming and (data.dataloader_num_workers or 0) > 0:
        raise BadInput(f"--streaming with {count} --train_file sources reads each rank's blocks slot by slot in its "
                       "own process, where its position is exact: drop --dataloader_num_workers "
                       f"{data.dataloader_num_workers}")
    if count > 1 and data.streaming and data.line_by_line:
        raise BadInput(f"--streaming --line_by_line with {count} --train_file sources: a weight is a share of the "
                       "tokens, and a stream's line lengths are known only once read; mix streams packed (drop "
                       "--line_by_line), or mix the sources map-style (drop --streaming)")


def source_names(data: Any) -> list[str]:
    """The training sources' names: --train_names, else their file stems made unique."""
    if data.train_file is None:
        return []
    return list(data.train_names) if data.train_names is not None else unique_names(data.train_file, "--train_file")
