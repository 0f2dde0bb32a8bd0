"""What `python -m mlm_ddp.prepare` reads: its splits and its chunks, exactly as training reads them.

Splits. `--dataset_name FOLDER` is resolved by `datasets` itself, through `load_dataset_builder`, the
function `load_dataset` calls (its data-files patterns, a README's `configs:`, the folder's most
common format): `train-*`/`train.*` are the training split, `validation*`/`valid*`/`dev*` the
validation split. Training (mlm_ddp.data.text) reads only those two; any other split, such as a
`test*` file, is left out by prepare as well, and without a validation split the same
`--validation_split_percentage` is held out. `--train_file`/`--validation_file`: the files given
(a file, a folder or a glob).

Chunks. The map-style path tokenizes a split `TOKENIZE_BATCH` rows at a time over its files read one
after the other (a `datasets.map` batch spans two files where one ends mid-batch), and packs each
batch on its own. Prepare cuts the same chunks: chunk j of a split is its rows
[j * TOKENIZE_BATCH, (j + 1) * TOKENIZE_BATCH) and belongs to the file that holds its first row; the
task of that file reads it, into the next files where it must (`owned_chunks`). So a task needs the
row at which each of its files starts in its split: the rows of the files before it (`count_rows`).
"""

from __future__ import annotations

import glob
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from datasets import load_dataset, load_dataset_builder

from mlm_ddp.config import DataConfig
from mlm_ddp.data.pack import TOKENIZE_BATCH
from mlm_ddp.data.text import (
    SUFFIX_BUILDERS,
    UTF8_CHECKED,
    check_columns,
    first_undecodable,
    only_blank,
    utf8_refusal,
)
from mlm_ddp.errors import BadInput, say

PROG = "mlm_ddp.prepare"
LONG_TEXT = 1_000_000  # characters of one text above which prepare warns (docs/prepare.md "Measured")
READ_SPLITS = {"train": "train", "validation": "eval"}  # a folder's splits that training reads -> prepare's
NOT_OPTIONS = ("name", "version", "data_dir", "data_files", "description")  # builder config fields that are not options


@dataclass(frozen=True)
class Corpus:
    """The files prepare reads, by split, and how `datasets` reads them."""

    builder: str  # the `datasets` builder: text, json, csv or parquet
    options: dict[str, Any]  # its config's options that differ from the defaults (a README's `configs:`)
    splits: dict[str, list[Path]]  # "train" and "eval" -> their files, in the order training reads them
    left_out: dict[str, list[str]]  # a folder's other splits (test...), which training never reads


def check_file(file: Path, flag: str) -> None:
    try:
        size = file.stat().st_size
        with open(file, "rb"):
            pass
    except OSError as err:
        raise BadInput(f"{file}: cannot be read ({err.strerror or err})") from err
    if size == 0:
        raise BadInput(f"{file}: the file is empty; remove it from {flag}")
    if file.suffix.lower() != ".parquet" and only_blank(file):
        raise BadInput(f"{file}: the file holds only blank lines, no text; remove it from {flag}")


def expand(spec: str, flag: str) -> list[Path]:
    """A file, a folder (its files of a known suffix, recursively) or a glob -> files, sorted."""
    path = Path(spec)
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIX_BUILDERS)
    elif any(ch in spec for ch in "*?["):
        found = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
    else:
        found = [path] if path.is_file() else []
    if not found:
        raise BadInput(f"{flag} {spec}: no such file, or no {'/'.join(sorted(SUFFIX_BUILDERS))} file in it")
    for file in found:
        if file.suffix.lower() not in SUFFIX_BUILDERS:
            raise BadInput(f"{flag}: {file} has an unknown extension {file.suffix or '(none)'!r}; use one of "
                           f"{', '.join(sorted(SUFFIX_BUILDERS))}")
        check_file(file, f"{flag} {spec}")
        if file.suffix.lower() != ".parquet" and (bad := first_undecodable(file, limit=UTF8_CHECKED)) is not None:
            raise utf8_refusal(flag, str(file), bad)  # found before the plan is written
    return found


def one_corpus(train_file: Any) -> None:
    """prepare writes one corpus: several --train_file sources are refused with the way to mix them."""
    if isinstance(train_file, (list, tuple)) and len(train_file) > 1:
        raise BadInput(f"prepare writes one corpus, not {len(train_file)} --train_file sources: prepare each "
                       "source into its own folder and mix the folders in training (--train_file A B --train_weights)")


def resolve(data: DataConfig) -> Corpus:
    """The corpus of these flags, split as training splits it."""
    if data.streaming:
        raise BadInput("--streaming: a prepared folder is read memory-mapped, not streamed; drop --streaming")
    if data.prepared_data is not None:
        raise BadInput("--prepared_data: that folder is prepared already; give the raw text (--train_file)")
    if data.dataset_name is not None:
        return dataset_folder(data)
    if data.train_file is None:
        raise BadInput("give the corpus: --train_file (a file, a folder or a glob) or --dataset_name (a local "
                       "dataset folder)")
    one_corpus(data.train_file)
    splits = {"train": expand(data.train_file[0], "--train_file"), "eval": []}
    if data.validation_file is not None:
        if len(data.validation_file) > 1:
            raise BadInput(f"--validation_file: prepare writes one held-out set, not {len(data.validation_file)} "
                           "(a folder or a glob joins several files into it); to evaluate sources apart, train "
                           "from the raw files")
        splits["eval"] = expand(data.validation_file[0], "--validation_file")
    builders = {SUFFIX_BUILDERS[p.suffix.lower()] for files in splits.values() for p in files}
    if len(builders) > 1:
        raise BadInput(f"the input files mix formats ({', '.join(sorted(builders))}); give files of one format")
    return Corpus(builders.pop(), {}, splits, {})


def dataset_folder(data: DataConfig) -> Corpus:
    """`--dataset_name FOLDER`, resolved by `datasets`' own rules (what `load_dataset` reads)."""
    name = data.dataset_name
    if not Path(name).is_dir():
        raise BadInput(f"--dataset_name {name}: prepare reads local files; download the dataset first (its folder "
                       "can be given here)")
    if data.validation_file is not None:
        raise BadInput("--validation_file goes with --train_file, not with --dataset_name")
    try:
        builder = load_dataset_builder(name, data.dataset_config_name)
    except (FileNotFoundError, ValueError, OSError) as err:
        raise BadInput(f"--dataset_name {name}: could not be read as a dataset folder ({type(err).__name__}: "
                       f"{err})") from err
    if builder.name not in SUFFIX_BUILDERS.values():
        raise BadInput(f"--dataset_name {name}: holds {builder.name} files; prepare reads "
                       f"{', '.join(sorted(set(SUFFIX_BUILDERS.values())))} files")
    found = {str(split): [Path(p) for p in files] for split, files in (builder.config.data_files or {}).items()}
    if "train" not in found:
        raise BadInput(f"dataset {name!r} has no 'train' split; splits found: {', '.join(found) or 'none'}")
    splits = {mine: found.get(theirs, []) for theirs, mine in READ_SPLITS.items()}
    for file in (f for files in splits.values() for f in files):
        check_file(file, f"--dataset_name {name}")
    default = type(builder.config)()
    options = {f.name: getattr(builder.config, f.name) for f in fields(builder.config)
               if f.name not in NOT_OPTIONS and getattr(builder.config, f.name) != getattr(default, f.name)}
    try:
        json.dumps(options)  # recorded in the plan, passed to every task
    except TypeError as err:
        raise BadInput(f"--dataset_name {name}: its `configs:` set {', '.join(options)}, which prepare cannot record "
                       f"({err}); convert the folder to plain {builder.name} files") from err
    left_out = {split: [str(p) for p in files] for split, files in found.items() if split not in READ_SPLITS}
    return Corpus(builder.name, options, splits, left_out)


Reader = Callable[[str], Iterator[list[Any]]]  # a file's path -> its rows, a batch at a time


def reader(builder: str, options: dict[str, Any], column: str) -> Reader:
    """How a file's rows are read: `datasets`' own builder, streamed (the rows training reads, blank
    ones included), each batch checked for the text column, a text long enough to take gigabytes named."""

    def read(path: str) -> Iterator[list[Any]]:
        try:
            stream = load_dataset(builder, data_files=[path], split="train", streaming=True, **options)
            for number, batch in enumerate(stream.iter(batch_size=TOKENIZE_BATCH)):
                check_columns(list(batch), column, path)
                texts = batch[column]
                if (odd := next((t for t in texts if t is not None and not isinstance(t, str)), None)) is not None:
                    raise BadInput(f"{path}: column {column!r} holds {type(odd).__name__} values, not text; pass "
                                   "--text_column with a column of text")
                for row, text in enumerate(texts):
                    if isinstance(text, str) and len(text) > LONG_TEXT:
                        at = number * TOKENIZE_BATCH + row + 1
                        say(f"{PROG}: warning: {path}, text {at}: {len(text) / 1e6:.1f}M "
                            "characters in one text; the tokenizer holds all its tokens at once (measured: 4 GB for "
                            "27M characters): split such texts into lines")
                yield texts
        except BadInput:
            raise
        except Exception as err:  # noqa: BLE001 - pyarrow, json and csv readers each raise their own types
            raise BadInput(f"{path}: cannot be read as {builder} ({type(err).__name__}: {str(err)[:300]})") from err

    return read


def count_rows(path: str, builder: str, options: dict[str, Any]) -> int:
    """The rows of one file as training reads them (blank ones included), without converting them."""
    try:
        stream = load_dataset(builder, data_files=[path], split="train", streaming=True, **options)
        return sum(table.num_rows for table in stream.with_format("arrow").iter(batch_size=10 * TOKENIZE_BATCH))
    except Exception as err:  # noqa: BLE001 - as in reader
        raise BadInput(f"{path}: cannot be read as {builder} ({type(err).__name__}: {str(err)[:300]})") from err


@dataclass
class FileRead:
    """What reading a task's own file found: its rows (blank ones included) and its non-blank texts."""

    rows: int = 0
    texts: int = 0


def owned_chunks(files: list[str], start: int, read: Reader, seen: FileRead) -> Iterator[tuple[int, list[Any]]]:
    """(chunk number, its rows) of the split's chunks whose first row is in `files[0]`, which starts at
    row `start` of its split; `files[1:]` are the files after it. Reads `files[0]` whole (counted into
    `seen`), then the next files only as far as its last chunk needs."""
    size = TOKENIZE_BATCH
    skip = -start % size  # its first rows end a chunk that began in a file before it
    number, rows = (start + skip) // size, []
    for k, path in enumerate(files):
        for batch in read(path):
            if k == 0:
                seen.rows += len(batch)
                seen.texts += sum(1 for t in batch if isinstance(t, str) and t.strip())
                cut = min(skip, len(batch))
                batch, skip = batch[cut:], skip - cut
            else:
                batch = batch[:size - len(rows)]  # only what the open chunk lacks
            rows.extend(batch)
            while len(rows) >= size:
                yield number, rows[:size]
                rows, number = rows[size:], number + 1
            if k > 0 and not rows:
                return
        if not rows:  # no chunk open at the end of this file: the next one begins in the next file
            return
    if rows:
        yield number, rows  # the split's last chunk, shorter
