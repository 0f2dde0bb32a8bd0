"""A prepared folder: a corpus tokenized and packed once (`python -m mlm_ddp.prepare`), which every rank
memory-maps instead of tokenizing (`--prepared_data DIR`).

Layout of DIR:
- `plan.json`: what is prepared, from what, split into which tasks; written first, the same for
  every task of the same command;
- `rows/f00012.json`: the rows of input file 12, counted once by whichever task needed them first
  (a task needs the rows of the files before its own: mlm_ddp.data.sources);
- `parts/task-00001-of-00004/`: one task's Arrow files (`datasets`' own format, memory-mapped when
  read), one `train-f00012.arrow` (and `eval-f00012.arrow`) per input file, its `part.json`
  (blocks, tokens and bytes per shard) and, last, its marker `COMPLETE`. A task writes into
  `parts/.tmp-...`, flushes every file to the disk (fsync) before the marker, and renames the folder
  into place only when complete (the rename flushed too), so a part without its marker is never read
  and a part with it survives a crash whole;
- `manifest.json`: written last, once every part is complete and every shard holds what its part
  recorded: the format version, the tokenizer's fingerprint, the sequence length and packing mode,
  the counts, the source files, and the shards in the order training reads them (input file by input
  file), each with its blocks and bytes. Training reads a folder only through it, and checks every
  shard's bytes and blocks (from the Arrow batches' headers: no token is read) before using it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
from datasets import Dataset, concatenate_datasets

from mlm_ddp.config import DataConfig
from mlm_ddp.errors import BadInput

FORMAT_VERSION = 2  # 2: chunks of a split's rows across its files, as the map-style path; shards checked
MANIFEST = "manifest.json"
PLAN = "plan.json"
PARTS = "parts"
ROWS = "rows"
MARKER = "COMPLETE"
PART_FILE = "part.json"
SPLITS = ("train", "eval")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """What decides the token ids: the fast tokenizer's whole definition (vocabulary, normalizer,
    pre-tokenizer, post-processor with its special tokens), hashed."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise BadInput(f"{type(tokenizer).__name__} is not a fast tokenizer: a prepared folder records a fast "
                       "tokenizer's definition")
    return hashlib.sha256(backend.to_str().encode()).hexdigest()[:16]


def packing(cfg: DataConfig) -> str:
    return "line_by_line" if cfg.line_by_line else "packed"


def task_dir_name(task: int, tasks: int) -> str:
    return f"task-{task:05d}-of-{tasks:05d}"


def part_dir(folder: Path, task: int, tasks: int) -> Path:
    return folder / PARTS / task_dir_name(task, tasks)


def part_complete(folder: Path, task: int, tasks: int) -> bool:
    """Task `task`'s part is in place with its marker: the only kind of part that is ever read."""
    return (part_dir(folder, task, tasks) / MARKER).is_file()


def shard_name(split: str, file_index: int) -> str:
    return f"{split}-f{file_index:05d}.arrow"


def open_shard(path: Path, blocks: int, size: int) -> tuple[Dataset | None, str | None]:
    """(the shard memory-mapped, None), or (None, what differs from the `blocks` blocks in `size` bytes
    written to it). A shard cut short by a crash can keep its size (its tail zeros, which Arrow reads as
    the end of the stream): its blocks are counted too, from the batches' headers (no token is read)."""
    try:
        found = path.stat().st_size
    except FileNotFoundError:
        return None, "missing"
    if found != size:
        return None, f"{found} bytes"
    try:
        ds = Dataset.from_file(str(path))
    except (OSError, pa.ArrowException) as err:
        return None, f"unreadable ({type(err).__name__}: {str(err)[:200]})"
    return (ds, None) if len(ds) == blocks else (None, f"{len(ds)} blocks")


def read_manifest(folder: Path) -> dict:
    """The manifest of a prepared folder, or one line saying why there is none to use."""
    path = folder / MANIFEST
    if not folder.is_dir():
        raise BadInput(f"--prepared_data {folder}: no such folder")
    if not path.is_file():
        plan = " (it holds a plan: some of its parts are not complete; run the same prepare command again)" \
            if (folder / PLAN).is_file() else ""
        raise BadInput(f"--prepared_data {folder}: no {MANIFEST}, so not a finished mlm_ddp.prepare folder{plan}")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as err:
        raise BadInput(f"{path}: unreadable ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise BadInput(f"{path}: format version {version!r}, this mlm_ddp reads {FORMAT_VERSION}; prepare the "
                       "corpus again with this version")
    return manifest


def check_manifest(manifest: dict, folder: Path, cfg: DataConfig, tokenizer: Any) -> None:
    """Refuse a prepared folder this run would read wrongly, naming both values."""
    where = f"--prepared_data {folder}"
    theirs, mine = manifest["tokenizer"]["fingerprint"], tokenizer_fingerprint(tokenizer)
    if theirs != mine:
        raise BadInput(f"{where} was tokenized by another tokenizer ({manifest['tokenizer']['name']}, fingerprint "
                       f"{theirs}) than this run's ({getattr(tokenizer, 'name_or_path', '?')}, fingerprint {mine}); "
                       "prepare it again with this run's --model_name_or_path/--tokenizer_name, or train with that "
                       "tokenizer")
    if manifest["max_seq_length"] != cfg.max_seq_length:
        raise BadInput(f"{where} holds blocks of {manifest['max_seq_length']} tokens and this run's --max_seq_length "
                       f"is {cfg.max_seq_length}; pass --max_seq_length {manifest['max_seq_length']}, or prepare "
                       "again")
    if manifest["packing"] != packing(cfg):
        raise BadInput(f"{where} was prepared {manifest['packing']} and this run asks for {packing(cfg)}; "
                       f"{'add' if manifest['packing'] == 'line_by_line' else 'drop'} --line_by_line, or prepare "
                       "again")
    if cfg.whole_word_mask and not manifest["word_continues"]:
        raise BadInput(f"{where} was prepared without word boundaries and this run asks for --whole_word_mask; "
                       "prepare it again with --whole_word_mask")


def open_shards(folder: Path, manifest: dict, split: str, keep_words: bool) -> Dataset | None:
    """One split of the prepared folder, its shards memory-mapped in the manifest's order (None: none)."""
    shards = [s for s in manifest["shards"] if s["split"] == split]
    if not shards:
        return None
    opened = []
    for shard in shards:
        path = folder / shard["path"]
        ds, problem = open_shard(path, shard["blocks"], shard["bytes"])
        if ds is None:
            raise BadInput(f"{path}: {problem}, the manifest says {shard['blocks']} blocks in {shard['bytes']} bytes; "
                           "the prepared folder was changed, or lost data in a crash, after it was written: prepare "
                           "it again")
        opened.append(ds)
    ds = opened[0] if len(opened) == 1 else concatenate_datasets(opened)
    if manifest["word_continues"] and not keep_words:
        ds = ds.remove_columns("word_continues")
    return ds


def load_prepared(cfg: DataConfig, tokenizer: Any) -> tuple[Dataset, Dataset | None, dict]:
    """(train, eval, manifest) of `--prepared_data`, checked against this run and memory-mapped: nothing
    is tokenized, and nothing is read beyond the manifest and the Arrow files' headers."""
    folder = Path(cfg.prepared_data)
    manifest = read_manifest(folder)
    check_manifest(manifest, folder, cfg, tokenizer)
    train = open_shards(folder, manifest, "train", cfg.whole_word_mask)
    if train is None:
        raise BadInput(f"--prepared_data {folder}: holds no training blocks")
    return train, open_shards(folder, manifest, "eval", cfg.whole_word_mask), manifest
