"""Text -> tokens -> packed blocks -> per-rank batches. Knows nothing about the model.

Packing follows run_mlm's `group_texts`: every text is tokenized as `[CLS] text [SEP]`, the texts of
one tokenization batch are concatenated and cut into blocks of exactly `max_seq_length` tokens. The
remainder of each tokenization batch is kept as one shorter block (padded when batched), never
dropped; `PackStats` counts it.

Sharding, one way per kind of data, never twice (the loaders are not passed through
`accelerator.prepare`, so Accelerate does not split them again; accelerate #3547):

- map-style: one seeded permutation of the blocks per epoch, cut into global batches of
  `per_device_batch x world_size`; rank r takes the r-th slice of every global batch. The last global
  batch is filled up with the first blocks of the permutation (counted in `padding`), so every rank
  runs the same number of steps and the composition of each global batch, hence the loss curve, does
  not depend on how many processes share it. A run resumed on another number of processes keeps
  the first run's layout of the epochs (`EpochBatchSampler`), so its steps read the same blocks.
- streams: the raw texts are split before they are shuffled and tokenized (`shard_stream`). With a
  number of shards (files) divisible by the world size each rank reads only its own shards, the
  same ones every epoch; when the shards are local files their sizes are known up front and the
  files are dealt out by size (`balance_shards`), so the ranks' parts hold about as many bytes.
  Otherwise every rank reads the whole raw stream and keeps one text in world_size
  (`stream_sharding`). Either way each rank tokenizes and packs only its own texts. Ranks'
  streams end at different batches; `TrainFeed` makes all ranks end the epoch together, when the
  first rank's part runs out: the rest of the other parts is not trained on in that epoch, and
  `StreamEpochEnd` says how much that was.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict, concatenate_datasets, load_dataset
from datasets.distributed import split_dataset_by_node
from torch.utils.data import DataLoader, Sampler

from mlm_ddp.config import DataConfig, TrainingConfig
from mlm_ddp.distributed import patient_main_process_first
from mlm_ddp.errors import BadInput
from mlm_ddp.masking import EPOCH_KEY, EVAL_SPLIT, TRAIN_SPLIT, MaskingCollator

SUFFIX_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
EMBEDDED_CORPUS = "python-docs"
STREAM_EVAL_TEXTS = 1000  # texts held out from a stream without a validation file
# the first datasets release whose one-text shuffle buffer holds nothing between reads (PackedStream);
# pyproject's floor, which tests/test_data.py checks against this
STREAM_RESUME_DATASETS = (5, 1)
AnyDataset = Dataset | IterableDataset


def embedded_corpus() -> list[str]:
    """The offline default corpus: Python's own reference documentation, one text per topic.

    It ships inside every CPython (pydoc_data.topics, ~465k characters, ~128k BERT tokens in 3.11):
    real English prose about a subject every user knows, present without any download.
    """
    from pydoc_data.topics import topics

    return [topics[key].strip() for key in sorted(topics)]


def _builder_for(path_str: str, flag: str) -> str:
    path = Path(path_str)
    suffix = path.suffix.lower()
    if suffix not in SUFFIX_BUILDERS:
        raise BadInput(
            f"{flag} {path}: unknown file extension {suffix or '(none)'!r}; use one of "
            f"{', '.join(sorted(SUFFIX_BUILDERS))}"
        )
    if not path.is_file():
        raise BadInput(f"{flag} {path}: no such file")
    if path.stat().st_size == 0:
        raise BadInput(f"{flag} {path}: the file is empty")
    return SUFFIX_BUILDERS[suffix]


def _check_columns(columns: list[str] | None, text_column: str, source: str) -> None:
    if columns is not None and text_column not in columns:
        raise BadInput(
            f"{source}: no text column {text_column!r}; columns found: {', '.join(columns)}. "
            "Pass --text_column with one of them."
        )


def _first_columns(ds: IterableDataset, source: str) -> list[str]:
    """A stream's columns, read from its first example (which also proves it is not empty)."""
    try:
        first = next(iter(ds))
    except StopIteration:
        raise BadInput(f"{source}: holds no texts") from None
    return list(first)


def load_text(cfg: DataConfig, seed: int) -> tuple[AnyDataset, AnyDataset | None]:
    """(train, eval) raw text datasets, each with the text in `cfg.text_column`.

    eval is None only when there is no validation set and validation_split_percentage is 0.
    """
    if cfg.train_file is None and cfg.dataset_name is None:
        texts = [t for t in embedded_corpus() if t]
        raw: Any = Dataset.from_dict({cfg.text_column: texts})
        if cfg.streaming:
            raw = raw.to_iterable_dataset(num_shards=8)
        splits = {"train": raw}
        source = f"embedded corpus {EMBEDDED_CORPUS!r}"
    elif cfg.train_file is not None:
        data_files = {"train": cfg.train_file}
        builder = _builder_for(cfg.train_file, "--train_file")
        if cfg.validation_file is not None:
            if _builder_for(cfg.validation_file, "--validation_file") != builder:
                raise BadInput("--train_file and --validation_file must have the same format")
            data_files["validation"] = cfg.validation_file
        splits = _load(builder, None, data_files, cfg.streaming, f"--train_file {cfg.train_file}")
        source = cfg.train_file
    else:
        splits = _load(cfg.dataset_name, cfg.dataset_config_name, None, cfg.streaming,
                       f"--dataset_name {cfg.dataset_name}")
        source = f"dataset {cfg.dataset_name!r}"
        if "train" not in splits:
            raise BadInput(f"{source} has no 'train' split; splits found: {', '.join(splits)}")
        if cfg.validation_file is not None:
            raise BadInput("--validation_file goes with --train_file, not with --dataset_name")

    train = splits["train"]
    evaluation = splits.get("validation")
    for name, ds in (("train", train), ("validation", evaluation)):
        if ds is None:
            continue
        if name == "train":
            where = source
        else:
            where = cfg.validation_file or f"{source} (validation)"
        if isinstance(ds, IterableDataset):
            _check_columns(_first_columns(ds, where), cfg.text_column, where)
        else:
            _check_columns(ds.column_names, cfg.text_column, where)
            if len(ds) == 0:
                raise BadInput(f"{where}: holds no texts")

    if evaluation is None and cfg.validation_split_percentage > 0:
        if isinstance(train, IterableDataset):
            n_eval = cfg.max_eval_samples or STREAM_EVAL_TEXTS
            train, evaluation = train.skip(n_eval), train.take(n_eval)
        else:
            if len(train) < 2:
                raise BadInput(f"{source}: needs at least 2 texts to hold some out for evaluation")
            parts = train.train_test_split(
                test_size=cfg.validation_split_percentage / 100.0, shuffle=True, seed=seed
            )
            train, evaluation = parts["train"], parts["test"]
    if isinstance(train, IterableDataset):  # a stream's sequences are only known once read: count texts
        if cfg.max_train_samples is not None:
            train = train.take(cfg.max_train_samples)
        if evaluation is not None and cfg.max_eval_samples is not None:
            evaluation = evaluation.take(cfg.max_eval_samples)
    return train, evaluation


def _first_sequences(ds: Dataset, limit: int | None) -> Dataset:
    """The first `limit` tokenized sequences (run_mlm.py's --max_train_samples: after packing)."""
    return ds if limit is None else ds.select(range(min(limit, len(ds))))


def _load(path: str, name: str | None, data_files: dict | None, streaming: bool, flag: str) -> dict:
    try:
        loaded = load_dataset(path, name, data_files=data_files, streaming=streaming)
    except (FileNotFoundError, ConnectionError, ValueError, OSError) as err:
        raise BadInput(
            f"{flag}: could not be loaded ({type(err).__name__}: {err}). A Hub name needs network "
            "access (unset HF_HUB_OFFLINE); a local file needs a readable path."
        ) from err
    if not isinstance(loaded, (DatasetDict, IterableDatasetDict)):
        raise BadInput(f"{flag}: expected named splits, got {type(loaded).__name__}")
    return dict(loaded)


def tokenize_and_pack(
    texts: list[Any], tokenizer: Any, block_size: int, with_word_continues: bool = False, line_by_line: bool = False
) -> dict[str, list[list[int]]]:
    """Pure: a batch of texts -> sequences `input_ids` (and `word_continues` for whole-word masking).

    Texts that are empty, blank or not strings are skipped. Packed (default): the texts are
    concatenated and cut into blocks of block_size tokens, the last one holding the remainder.
    `line_by_line`: each text is one sequence, truncated to block_size tokens.
    """
    kept = [t for t in texts if isinstance(t, str) and t.strip()]
    if not kept:
        return {"input_ids": [], **({"word_continues": []} if with_word_continues else {})}
    if line_by_line:
        encoded = tokenizer(kept, add_special_tokens=True, truncation=True, max_length=block_size, verbose=False)
        out = {"input_ids": [list(row) for row in encoded["input_ids"]]}
        if with_word_continues:
            out["word_continues"] = [_continues(encoded.word_ids(i)) for i in range(len(kept))]
        return out
    encoded = tokenizer(kept, add_special_tokens=True, verbose=False)
    ids: list[int] = []
    continues: list[int] = []
    for i, row in enumerate(encoded["input_ids"]):
        ids.extend(row)
        if with_word_continues:
            continues.extend(_continues(encoded.word_ids(i)))
    starts = range(0, len(ids), block_size)
    out = {"input_ids": [ids[s : s + block_size] for s in starts]}
    if with_word_continues:
        out["word_continues"] = [continues[s : s + block_size] for s in starts]
    return out


def _continues(words: list[int | None]) -> list[int]:
    """1 where a token continues the word of the token before it (whole-word masking), else 0."""
    return [int(w is not None and j > 0 and words[j - 1] == w) for j, w in enumerate(words)]


@dataclass(frozen=True)
class PackStats:
    """What packing made of a map-style split."""

    blocks: int
    tokens: int
    short_blocks: int  # remainders of tokenization batches, padded at batching time
    block_size: int

    @property
    def pad_fraction(self) -> float:
        """Share of the block slots that are padding."""
        return 1.0 - self.tokens / (self.blocks * self.block_size) if self.blocks else 0.0


def tokenize_dataset(raw: AnyDataset, tokenizer: Any, cfg: DataConfig) -> AnyDataset:
    """Tokenize and pack lazily (streams) or once, cached by `datasets` (map-style)."""
    columns = raw.column_names if raw.column_names is not None else _first_columns(raw, "stream")
    kwargs: dict[str, Any] = dict(
        batched=True,
        batch_size=1000,
        remove_columns=columns,
        input_columns=[cfg.text_column],
        fn_kwargs={
            "tokenizer": tokenizer,
            "block_size": cfg.max_seq_length,
            "with_word_continues": cfg.whole_word_mask,
            "line_by_line": cfg.line_by_line,
        },
    )
    if isinstance(raw, IterableDataset):
        return raw.map(tokenize_and_pack, **kwargs)
    return raw.map(tokenize_and_pack, num_proc=cfg.preprocessing_num_workers, desc="Tokenizing and packing",
                   load_from_cache_file=not cfg.overwrite_cache, **kwargs)


def pack_stats(ds: Dataset, block_size: int) -> PackStats:
    lengths = pc.list_value_length(ds.data.column("input_ids"))
    tokens = int(pc.sum(lengths).as_py() or 0)
    short = int(pc.sum(pc.less(lengths, block_size)).as_py() or 0)
    return PackStats(blocks=len(ds), tokens=tokens, short_blocks=short, block_size=block_size)


class EpochBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches of a map-style dataset, epoch after epoch, without end (see the
    module docstring).

    Epoch e is one permutation of the blocks seeded by (seed, e), wrapped to fill `epoch_blocks`
    slots: a multiple of `layout_batch`, the global micro-batch (per-device batch x processes) of the
    run that began the training. The epochs' slots are read as one sequence: each micro-batch takes
    the next `global_batch` = batch_size x world_size slots and rank r the r-th slice of them. A run
    resumed on another number of processes keeps the layout of the run that began, so each optimizer
    step reads the blocks the uninterrupted run's step read (the global batch per step is kept); its
    micro-batches may then run across an epoch end. Keys are `epoch * num_samples + block`, which
    `EpochKeyed` turns into rows that carry the epoch their masks are seeded with.

    Pure in (num_samples, batch_size, rank, world_size, seed, layout_batch) and the slot set by `seek`.
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int,
                 seed: int, shuffle: bool = True, layout_batch: int | None = None) -> None:
        if num_samples < 1:
            raise BadInput("the training data packs into zero blocks: give it more text")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.global_batch = batch_size * world_size
        self.layout_batch = layout_batch or self.global_batch
        self.epoch_blocks = math.ceil(num_samples / self.layout_batch) * self.layout_batch
        self.padding = self.epoch_blocks - num_samples  # blocks repeated to fill the last slots, every epoch
        self.start = 0  # slot of the next micro-batch, counted from the first epoch's first

    @property
    def batches_per_epoch(self) -> float:
        """Micro-batches per epoch (whole unless this run's global micro-batch differs from the layout's)."""
        return self.epoch_blocks / self.global_batch

    def seek(self, slot: int) -> None:
        self.start = slot

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The blocks of epoch `epoch`, slot by slot, (epoch_blocks,)."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples)
        return np.resize(order, self.epoch_blocks)  # wraps to fill

    def __iter__(self) -> Iterator[list[int]]:
        slot, epoch, order = self.start, -1, np.empty(0, dtype=np.int64)
        while True:
            mine = slot + self.rank * self.batch_size
            keys = []
            for position in range(mine, mine + self.batch_size):
                if position // self.epoch_blocks != epoch:
                    epoch = position // self.epoch_blocks
                    order = self.epoch_order(epoch)
                keys.append(epoch * self.num_samples + int(order[position % self.epoch_blocks]))
            yield keys
            slot += self.global_batch


class EpochKeyed(torch.utils.data.Dataset):
    """A map-style dataset read with `EpochBatchSampler`'s keys: each row also carries the epoch it
    is read in (`EPOCH_KEY`), because a micro-batch may hold blocks of two epochs."""

    def __init__(self, ds: Dataset) -> None:
        self.ds, self.n = ds, len(ds)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: int) -> dict:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[int]) -> list[dict]:
        rows = self.ds.__getitems__([key % self.n for key in keys])
        return [{**row, EPOCH_KEY: key // self.n} for row, key in zip(rows, keys, strict=True)]


def stream_sharding(num_shards: int, world_size: int) -> str:
    """How `shard_stream` splits a stream of `num_shards` shards over `world_size` ranks, and its cost."""
    if world_size == 1:
        return f"one process reads all {num_shards} shard(s)"
    if num_shards % world_size == 0:
        return (f"{num_shards} shards over {world_size} ranks: each rank reads only its "
                f"{num_shards // world_size} shard(s)")
    return (f"{num_shards} shard(s) over {world_size} ranks: each rank reads every raw text and keeps "
            f"one in {world_size} ({world_size}x raw reading, tokenizing not repeated); "
            f"split the data into a multiple of {world_size} files to read each text once")


def naive_shards(num_shards: int, world_size: int) -> list[list[int]]:
    """Shard indices per rank as `datasets` deals them (`IterableDataset.shard(..., contiguous=False)`,
    what `split_dataset_by_node` does): rank r gets shards r, r + world_size, ... of the current order."""
    return [list(range(rank, num_shards, world_size)) for rank in range(world_size)]


def balance_shards(sizes: list[int], world_size: int) -> list[list[int]]:
    """Pure: shard indices per rank, each rank `len(sizes) // world_size` of them, totals close.

    Greedy, largest first: each shard goes to the rank with the smallest total that still has room.
    Ranks keep equal shard counts so DataLoader workers share them as before. A heuristic can lose to
    a lucky file order, so the naive deal (`naive_shards`) is kept when its largest total is no
    larger: the result is never worse than it. Needs `len(sizes) % world_size == 0`.
    """
    if len(sizes) % world_size:
        raise ValueError(f"{len(sizes)} shards do not divide over {world_size} ranks")
    room = len(sizes) // world_size
    parts: list[list[int]] = [[] for _ in range(world_size)]
    totals = [0] * world_size
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min((r for r in range(world_size) if len(parts[r]) < room), key=lambda r: (totals[r], r))
        parts[rank].append(index)
        totals[rank] += sizes[index]
    naive = naive_shards(len(sizes), world_size)
    if max(sum(sizes[i] for i in part) for part in naive) <= max(totals):
        return naive
    return [sorted(part) for part in parts]


def _files_of(ds: IterableDataset) -> list[str] | None:
    """The file behind each shard of a stream loaded from files (one file per shard), else None.

    `datasets` has no public accessor: its file builders keep the shard files in the examples
    iterable's `base_files`, under any skip/take wrappers. Anything else (an in-memory table, a
    changed layout in another `datasets` version) gives None, and the stream is split as before.
    """
    ex_iterable: Any = ds._ex_iterable
    while not hasattr(ex_iterable, "kwargs") and hasattr(ex_iterable, "ex_iterable"):
        ex_iterable = ex_iterable.ex_iterable
    files = getattr(ex_iterable, "kwargs", {}).get("base_files")
    if not isinstance(files, list) or len(files) != ds.num_shards:
        return None
    if not all(isinstance(f, str) for f in files):
        return None
    return files


def shard_sizes(ds: IterableDataset) -> list[int] | None:
    """Bytes of each shard of a stream, when every shard is one local file (else None)."""
    files = _files_of(ds)
    if files is None or not all(os.path.isfile(f) for f in files):
        return None
    return [os.path.getsize(f) for f in files]


@dataclass(frozen=True)
class StreamSplit:
    """How a raw stream is split over the ranks, known before anything is read.

    kind: "whole" (one process), "files" (whole shards per rank), or "texts" (one text in
    world_size per rank: every part holds the same number of texts, give or take one).
    part_bytes: bytes of each rank's files, when they are local files; naive_bytes: the same for
    `datasets`' own deal of the files, for comparison.
    """

    kind: str
    world_size: int
    shards: list[list[int]] | None = None
    part_bytes: list[int] | None = None
    naive_bytes: list[int] | None = None

    def note(self) -> str:
        """The expected balance of the parts, for the start-up log."""
        if self.kind == "whole":
            return "one part: nothing is left unread at an epoch end"
        if self.kind == "texts":
            return ("the parts hold the same number of texts (one apart at most); an epoch ends when the "
                    "first part runs out, what is left of the others is reported then")
        if self.part_bytes is None:
            return ("the shards' sizes are unknown (not local files), so the parts may differ in size; an "
                    "epoch ends when the first part runs out, what is left of the others is reported then")
        total, smallest = sum(self.part_bytes), min(self.part_bytes)
        left = 1.0 - smallest * self.world_size / total if total else 0.0
        naive = "" if self.naive_bytes is None else (
            f" (dealt by position, the largest part would be {_mb(max(self.naive_bytes))})")
        return (f"files balanced by size, parts of {', '.join(_mb(b) for b in self.part_bytes)}{naive}; an "
                f"epoch ends when the smallest part runs out, so about {left:.1%} of the bytes (the other "
                "parts' ends) is left unread each epoch")


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 1e5 else f"{size} B"


def plan_stream_split(ds: IterableDataset, world_size: int) -> StreamSplit:
    """Which shards each rank reads (see `shard_stream`), and their bytes when known."""
    sizes = shard_sizes(ds)
    if world_size == 1:
        return StreamSplit("whole", 1, [list(range(ds.num_shards))], None if sizes is None else [sum(sizes)])
    if ds.num_shards % world_size:
        return StreamSplit("texts", world_size)
    if sizes is None:
        return StreamSplit("files", world_size)
    shards = balance_shards(sizes, world_size)
    naive = naive_shards(len(sizes), world_size)
    return StreamSplit("files", world_size, shards, [sum(sizes[i] for i in part) for part in shards],
                       [sum(sizes[i] for i in part) for part in naive])


def _is_mine(_example: dict, index: int, rank: int, world_size: int) -> bool:
    return index % world_size == rank


def shard_stream(ds: IterableDataset, rank: int, world_size: int) -> IterableDataset:
    """This rank's part of a raw stream: whole shards when they divide evenly, else every n-th text.

    Whole shards: when they are local files, the rank's files are picked by `balance_shards` and
    joined in one stream, so each part holds about as many bytes, and the same files every epoch
    (an epoch ends for everyone when the smallest part runs out; a part 10x larger than another
    would otherwise be 90% unread, every epoch). Reordering the files before loading would not be
    enough: `split_dataset_by_node` deals the shards after the per-epoch shard shuffle, so a rank's
    files change every epoch. Shards of unknown size (remote files, in-memory tables) are dealt by
    `split_dataset_by_node`.

    Not `split_dataset_by_node` in the uneven case: its example split is applied to the end of the
    pipeline, after `map`, so every rank would tokenize and pack every text. Filtering by position
    here, before the shuffle buffer and `map`, is a partition because every rank reads the same texts
    in the same (seeded) shard order, and with the same number of DataLoader workers, the same shards
    per worker.
    """
    if world_size == 1:
        return ds
    if ds.num_shards % world_size == 0:
        split = plan_stream_split(ds, world_size)
        if split.shards is None:
            return split_dataset_by_node(ds, rank=rank, world_size=world_size)
        # one single-file shard each, joined: skip/take wrappers split their count per file alike in
        # the training and the held-out stream, so the two stay disjoint
        return concatenate_datasets([ds.shard(num_shards=ds.num_shards, index=i, contiguous=True)
                                     for i in split.shards[rank]])
    return ds.filter(_is_mine, with_indices=True, fn_kwargs={"rank": rank, "world_size": world_size})


class PackedStream(torch.utils.data.IterableDataset):
    """This rank's training blocks from its part of a raw text stream, resumable exactly and cheaply.

    The texts are read in chunks of `chunk_texts`; each chunk is shuffled with a permutation seeded
    by (seed, epoch, chunk number), then tokenized and packed (`tokenize_and_pack`). The shards are
    reshuffled every epoch by `datasets`' `shuffle` with a one-text buffer (from datasets 5.0 it also
    interleaves up to 10 shards). From datasets 5.1 that buffer is empty between reads, so the
    source's `state_dict()` names exactly the next text; before 5.1 it held one more text and every
    resume skipped it (measured on 3.6 to 5.0.1), hence `STREAM_RESUME_DATASETS`. The position is
    (the source's `state_dict()` before the current chunk, the chunk number, blocks of it already
    yielded): a resume re-reads at most one chunk, never the stream from its start (datasets #5454),
    and yields exactly the blocks an uninterrupted run would have.
    Exact positions need `--dataloader_num_workers 0` (the state lives in this process).

    It also counts what it read in the current epoch (`texts_read`, `text_bytes`, `blocks_read`;
    kept in the position, so a resumed epoch counts on), which `TrainFeed` reports at the epoch end
    beside `split` (how the raw stream was split) and `part_bytes` (this rank's file bytes, if known).
    """

    def __init__(self, texts: IterableDataset, tokenizer: Any, cfg: DataConfig, seed: int,
                 split: str = "whole", part_bytes: int | None = None) -> None:
        self.texts = texts.shuffle(seed=seed, buffer_size=1)  # the shards' order, not the texts'
        self.tokenizer, self.cfg, self.seed = tokenizer, cfg, seed
        self.split, self.part_bytes = split, part_bytes
        self.epoch = 0
        self.position: dict[str, Any] = {"epoch": 0, "source": None, "chunk": 0, "blocks": 0}
        self._resume: dict[str, Any] | None = None
        self.reread_texts = 0  # raw texts read a second time by the last resume (one chunk at most)
        self.texts_read = self.text_bytes = self.blocks_read = 0  # this epoch, so far

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._resume = epoch, None
        self.position = {"epoch": epoch, "source": None, "chunk": 0, "blocks": 0}
        self.texts_read = self.text_bytes = self.blocks_read = 0

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.set_epoch(state["epoch"])
        self._resume = copy.deepcopy(state)

    def __iter__(self) -> Iterator[dict[str, list[int]]]:
        self.texts.set_epoch(self.epoch)
        chunk, skip, resuming = 0, 0, False
        if self._resume is not None and self._resume["source"] is not None:
            resuming = True
            # datasets warns that a shuffle buffer's content is not in a state dict; ours holds one
            # text and is empty between reads, so there is nothing to lose
            quiet = logging.getLogger("datasets.iterable_dataset")
            level = quiet.level
            quiet.setLevel(logging.ERROR)
            try:
                self.texts.load_state_dict(self._resume["source"])
            finally:
                quiet.setLevel(level)
            chunk, skip = self._resume["chunk"], self._resume["blocks"]
            # counts up to the chunk being resumed (checkpoints older than these counts: from 0)
            self.texts_read = self._resume.get("texts", 0)
            self.text_bytes = self._resume.get("bytes", 0)
            self.blocks_read = self._resume.get("epoch_blocks", 0)
        self._resume = None
        rows = iter(self.texts)
        column = self.cfg.text_column
        while True:
            source = self.texts.state_dict()  # before this chunk: where a resume starts reading
            texts_before, bytes_before = self.texts_read, self.text_bytes
            texts = [row[column] for row in itertools.islice(rows, self.cfg.shuffle_buffer_size)]
            if not texts:
                return
            if resuming:
                self.reread_texts, resuming = len(texts), False
            self.texts_read += len(texts)
            self.text_bytes += sum(len(t.encode()) for t in texts if isinstance(t, str))
            order = np.random.default_rng([self.seed, self.epoch, chunk]).permutation(len(texts))
            packed = tokenize_and_pack([texts[i] for i in order], self.tokenizer, self.cfg.max_seq_length,
                                       with_word_continues=self.cfg.whole_word_mask,
                                       line_by_line=self.cfg.line_by_line)
            for k in range(skip, len(packed["input_ids"])):
                self.blocks_read += 1
                self.position = {"epoch": self.epoch, "source": source, "chunk": chunk, "blocks": k + 1,
                                 "texts": texts_before, "bytes": bytes_before, "epoch_blocks": self.blocks_read}
                yield {key: values[k] for key, values in packed.items()}
            chunk, skip = chunk + 1, 0


def check_stream_resume(datasets_version: str) -> None:
    """Refuse a stream resume that would silently skip texts (a datasets older than pyproject allows)."""
    release = tuple(int(part) for part in datasets_version.split(".")[:2] if part.isdigit())
    if release < STREAM_RESUME_DATASETS:
        raise BadInput(
            f"resuming a --streaming run needs datasets >= {'.'.join(map(str, STREAM_RESUME_DATASETS))} "
            f"(installed: {datasets_version}): older versions skip a text at every resume; upgrade datasets"
        )


def is_stream(ds: Any) -> bool:
    return isinstance(ds, (IterableDataset, PackedStream))


def rank_dataset(raw: AnyDataset, tokenizer: Any, cfg: DataConfig, rank: int, world_size: int,
                 shuffle_seed: int | None = None) -> AnyDataset | PackedStream:
    """What this rank tokenizes: its own part of a raw stream (a PackedStream when it is training
    data, i.e. shuffled), or the whole map-style split (which the samplers shard, so that every
    rank shares the one cached tokenization)."""
    if isinstance(raw, IterableDataset):
        split = plan_stream_split(raw, world_size)
        part = shard_stream(raw, rank, world_size)
        if shuffle_seed is not None:
            return PackedStream(part, tokenizer, cfg, shuffle_seed, split=split.kind,
                                part_bytes=None if split.part_bytes is None else split.part_bytes[rank])
        return tokenize_dataset(part, tokenizer, cfg)
    limit = cfg.max_train_samples if shuffle_seed is not None else cfg.max_eval_samples
    return _first_sequences(tokenize_dataset(raw, tokenizer, cfg), limit)


@dataclass(frozen=True)
class RankRead:
    """What one rank's part gave in one stream epoch. None: not known here (a stream other than a
    PackedStream, or one read in DataLoader workers; `part_bytes`: files of unknown size)."""

    micro_batches: int  # trained and dropped
    ended: bool  # this rank's part ran out (it read all of it)
    texts: int | None = None  # raw texts read
    blocks: int | None = None  # packed blocks read
    text_bytes: int | None = None  # UTF-8 bytes of the texts read
    part_bytes: int | None = None  # bytes of this rank's files

    def to_list(self) -> list[float]:
        """Fixed-length numbers for a gather (-1: unknown)."""
        return [float(self.micro_batches), float(self.ended)] + [
            -1.0 if v is None else float(v) for v in (self.texts, self.blocks, self.text_bytes, self.part_bytes)]

    @classmethod
    def from_list(cls, values: list[float]) -> RankRead:
        known = [None if v < 0 else int(v) for v in values[2:]]
        return cls(int(values[0]), bool(values[1]), *known)


def unread_fractions(ranks: list[RankRead], split: str) -> list[float | None]:
    """Pure: the share of each rank's part left unread when a stream epoch ended (None: unknown).

    A part that ran out was read whole (0). The others are estimated from what the whole parts held:
    - split "texts" (one text in world_size per rank): every part holds as many texts as a whole one,
      give or take one, so the rest is 1 - texts read / texts of a whole part;
    - split "files" with local file sizes: the whole parts give the text bytes per file byte (the
      files' format overhead, assumed alike), so the rest is 1 - text bytes read / (that ratio x
      this part's file bytes).
    """
    whole = [r for r in ranks if r.ended]
    if split == "texts" and any(r.texts for r in whole):
        part_texts = max(r.texts or 0 for r in whole)
        read = [None if r.texts is None else r.texts / part_texts for r in ranks]
    elif split == "files" and (pairs := [(r.text_bytes, r.part_bytes) for r in whole
                                         if r.text_bytes is not None and r.part_bytes]):
        per_file_byte = sum(a for a, _ in pairs) / sum(b for _, b in pairs)
        read = [None if r.text_bytes is None or not r.part_bytes or not per_file_byte
                else r.text_bytes / (per_file_byte * r.part_bytes) for r in ranks]
    else:
        read = [None] * len(ranks)
    return [0.0 if r.ended else None if share is None else max(0.0, 1.0 - share)
            for r, share in zip(ranks, read, strict=True)]


@dataclass(frozen=True)
class StreamEpochEnd:
    """How a stream epoch ended: every rank's `RankRead`, from one gather."""

    epoch: int
    trained_batches: int  # micro-batches of full optimizer steps, the same on every rank
    ranks: list[RankRead] = field(default_factory=list)
    split: str = "whole"

    def describe(self, dropped_so_far: int) -> str:
        """The epoch-end log line (after "step N: ")."""
        enders = [str(r) for r, read in enumerate(self.ranks) if read.ended]
        who = f"rank {enders[0]}'s part" if len(enders) == 1 else f"the parts of ranks {', '.join(enders)}"
        parts = []
        for rank, (read, unread) in enumerate(zip(self.ranks, unread_fractions(self.ranks, self.split),
                                                  strict=True)):
            got = f"rank {rank} read {read.micro_batches} micro-batches"
            if read.texts is not None:
                got += f", {read.texts} texts, {read.blocks} blocks"
            if read.ended:
                got += ", all of its part"
            elif unread is None:
                got += ", unknown share of its part unread"
            else:
                got += f", about {unread:.0%} of its part unread"
            parts.append(got)
        return (f"epoch {self.epoch} of the stream ended on every rank after {self.trained_batches} "
                f"micro-batches, when {who} ran out (micro-batches of partial steps dropped so far, rank 0: "
                f"{dropped_so_far}); {'; '.join(parts)}")


@dataclass(frozen=True)
class FeedPosition:
    """Where a `TrainFeed`'s next window starts: what a checkpoint taken before it resumes from."""

    epoch: int
    batch_in_epoch: int  # micro-batches of `epoch` this rank has read (map-style: whole ones)
    block_in_epoch: int | None  # map-style: slots of `epoch` read by all ranks together; streams: None
    stream: dict[str, Any] | None  # this rank's exact stream position, if it has one


class TrainFeed:
    """This rank's micro-batches, one window of `accumulation` per optimizer step, epoch after epoch.

    Map-style: `EpochBatchSampler` reads the epochs as one sequence of slots, so a window may run
    across an epoch end, as it would in one process; `start_block` (slots of `epoch` already read,
    all ranks) places a resumed run, else `start` micro-batches. Streams: the ranks' shards end at
    different batches. A window never crosses an epoch end; when any rank cannot fill its window,
    all ranks learn it from one all-reduce (`any_rank`), drop their partial windows and start the
    next epoch together, so no rank waits in a collective for one that has run out (datasets #6623,
    #6437). The micro-batches of dropped partial windows are counted in `dropped_batches`; the rest
    of a longer shard is not read in that epoch: at each epoch end one more collective (`gather`:
    every rank's numbers, in rank order; None when this is the only process) collects what each rank
    read into `last_epoch_end`. An epoch that ends before any rank filled one window can never train:
    all ranks raise the same BadInput there, instead of starting the next epoch forever.
    """

    def __init__(self, loader: DataLoader, collator: Any, accumulation: int, epoch: int, start: int,
                 any_rank: Callable[[bool], bool], stream_state: dict[str, Any] | None = None,
                 gather: Callable[[list[float]], list[list[float]]] | None = None,
                 start_block: int | None = None) -> None:
        self.loader, self.collator, self.accumulation = loader, collator, accumulation
        self.any_rank = any_rank
        self.gather = gather if gather is not None else (lambda values: [values])
        self.stream = is_stream(loader.dataset)
        # a PackedStream read in this process can say exactly where it is; anything else re-reads
        self.exact = isinstance(loader.dataset, PackedStream) and loader.num_workers == 0
        self.sampler: EpochBatchSampler | None = None if self.stream else loader.batch_sampler
        self.dropped_batches = 0
        self.last_epoch_batches = 0  # micro-batches each rank trained on in the last stream epoch
        self.last_epoch_end: StreamEpochEnd | None = None
        self.seek(epoch, start, start_block, stream_state)

    def seek(self, epoch: int, start: int, start_block: int | None = None,
             stream_state: dict[str, Any] | None = None) -> None:
        """Continue from a position (`__init__`'s arguments): a start, a resume or a rollback."""
        self._epoch, self._index = epoch, start  # streams: position of the next micro-batch
        self._stream_state = stream_state if self.exact else None
        if self.sampler is not None:  # map-style: the slot of the next micro-batch, from the first epoch
            within = start_block if start_block is not None else start * self.sampler.global_batch
            self.slot = epoch * self.sampler.epoch_blocks + within
        self._it: Iterator[Any] | None = None
        self._primed: list[Any] | None = None  # a window read ahead by `prime`, and where it starts
        self._primed_at: FeedPosition | None = None

    @property
    def epoch(self) -> int:
        return self._epoch if self.sampler is None else self.slot // self.sampler.epoch_blocks

    @property
    def index(self) -> int:
        """Micro-batches of the current epoch read so far (map-style: whole ones)."""
        if self.sampler is None:
            return self._index
        return self.slot % self.sampler.epoch_blocks // self.sampler.global_batch

    def prime(self) -> None:
        """Read the next window now (for streams a collective, on every rank), so that a stream too
        small for one optimizer step stops the run before it writes anything; `next_window` returns
        this window first and `position` still says where it starts."""
        self._primed_at = self.position()
        self._primed = self.next_window()

    def position(self) -> FeedPosition:
        """Where the next window starts."""
        if self._primed is not None and self._primed_at is not None:
            return self._primed_at
        block = None if self.sampler is None else self.slot % self.sampler.epoch_blocks
        return FeedPosition(self.epoch, self.index, block, self.stream_state())

    def _open(self) -> Iterator[Any]:
        if hasattr(self.collator, "set_epoch"):
            self.collator.set_epoch(self.epoch)
        if self.sampler is not None:
            self.sampler.seek(self.slot)
            return iter(self.loader)
        self.loader.dataset.set_epoch(self.epoch)  # reseeds the shuffle
        state, self._stream_state = self._stream_state, None
        if state is not None and state["epoch"] == self.epoch:
            self.loader.dataset.load_state_dict(state)  # re-reads at most one chunk
            return iter(self.loader)
        it = iter(self.loader)
        for _ in range(self._index):  # no saved state: re-read up to the position
            next(it)
        return it

    def _next_epoch(self) -> None:
        self._epoch, self._index, self._it = self._epoch + 1, 0, None

    def next_window(self) -> list[Any]:
        """The micro-batches of the next optimizer step on this rank (a collective for streams)."""
        if self._primed is not None:
            window, self._primed = self._primed, None
            return window
        if self.sampler is not None:
            if self._it is None:
                self._it = self._open()
            window = [next(self._it) for _ in range(self.accumulation)]
            self.slot += self.accumulation * self.sampler.global_batch
            return window
        while True:
            if self._it is None:
                self._it = self._open()
            window = list(itertools.islice(self._it, self.accumulation))
            if not self.any_rank(len(window) < self.accumulation):
                self._index += len(window)
                return window
            # some rank ran out: its epoch ends here, and so does everyone's (every rank is here)
            end = self._epoch_end(len(window))
            if self._index == 0:  # not one step in a whole epoch: the next epochs would end alike
                raise BadInput(too_small_for_a_step(end, self.accumulation, self.loader.batch_size))
            self.dropped_batches += len(window)
            self.last_epoch_batches = self._index
            self.last_epoch_end = end
            self._next_epoch()

    def _epoch_end(self, partial: int) -> StreamEpochEnd:
        """Every rank's account of the epoch that just ended (a collective)."""
        ds = self.loader.dataset
        packed = ds if isinstance(ds, PackedStream) else None
        mine = RankRead(self._index + partial, partial < self.accumulation,
                        part_bytes=None if packed is None else packed.part_bytes)
        if packed is not None and self.exact:  # its counters live in this process
            mine = RankRead(mine.micro_batches, mine.ended, packed.texts_read, packed.blocks_read,
                            packed.text_bytes, packed.part_bytes)
        ranks = [RankRead.from_list(values) for values in self.gather(mine.to_list())]
        return StreamEpochEnd(self._epoch, self._index, ranks, packed.split if packed else "whole")

    def stream_state(self) -> dict[str, Any] | None:
        """Where this rank's stream is, for a checkpoint (None: map-style, or not exact)."""
        if not self.exact:
            return None
        if self._stream_state is not None:  # loaded but not read from yet
            return copy.deepcopy(self._stream_state)
        return self.loader.dataset.state_dict()

    @property
    def epoch_float(self) -> float:
        """Epochs done so far (streams: whole epochs only, their length is unknown)."""
        if self.sampler is None:
            return float(self._epoch)
        return self.slot / self.sampler.epoch_blocks


def epoch_steps(epochs: float, epoch_blocks: int, step_blocks: int) -> int:
    """Optimizer steps of `epochs` epochs of `epoch_blocks` slots, `step_blocks` per step (the global
    batch): every slot of them is trained on. When a step does not divide the epochs, the last step
    is filled with the first blocks of the next epoch (rather than dropping the epoch's last ones
    and never completing it)."""
    return max(1, math.ceil(epochs * epoch_blocks / step_blocks - 1e-9))  # 1e-9: float noise


def too_small_for_a_step(end: StreamEpochEnd, accumulation: int, batch_size: int | None) -> str:
    """The error when a whole stream epoch gave no rank a full optimizer step, with what to change."""
    # a rank whose part did not run out stopped reading at a full window: it has that many or more
    per_rank = ", ".join(f"rank {rank}: {r.micro_batches}{'' if r.ended else ' or more'}"
                         for rank, r in enumerate(end.ranks))
    fewest = min(r.micro_batches for r in end.ranks if r.ended)
    fix = f"--gradient_accumulation_steps {fewest} or less, " if fewest else ""
    return (f"the training stream is too small for one optimizer step: epoch {end.epoch} gave "
            f"{per_rank} micro-batch(es) of --per_device_train_batch_size {batch_size} blocks, and every "
            f"rank needs --gradient_accumulation_steps {accumulation} of them for a step, with "
            f"{len(end.ranks)} process(es); every epoch would end before a step. Use {fix}a smaller "
            "--per_device_train_batch_size, fewer processes, or more text")


def _own_generator(seed: int) -> torch.Generator:
    """Each iter(DataLoader) draws a worker seed; from its own generator it leaves torch's global RNG
    (dropout) untouched, so a resumed run draws the same dropout masks as an uninterrupted one."""
    return torch.Generator().manual_seed(seed)


def train_loader(ds: AnyDataset, collator: Any, batch_size: int, rank: int, world_size: int,
                 seed: int, num_workers: int, layout_batch: int | None = None, pin: bool = False) -> DataLoader:
    """A stream is already this rank's (`rank_dataset`); map-style data is sharded by the sampler,
    whose epochs are laid out for `layout_batch` (the global micro-batch of the run that began the
    training; default: this run's). `pin`: page-locked batches (for a CUDA device), which is what makes
    `to_device`'s non_blocking copies asynchronous; from pageable memory the host waits for each."""
    common = dict(collate_fn=collator, num_workers=num_workers, generator=_own_generator(seed), pin_memory=pin)
    if is_stream(ds):
        return DataLoader(ds, batch_size=batch_size, **common)
    sampler = EpochBatchSampler(len(ds), batch_size, rank, world_size, seed, layout_batch=layout_batch)
    return DataLoader(EpochKeyed(ds), batch_sampler=sampler, **common)


def eval_loader(ds: AnyDataset, collator: Any, batch_size: int, rank: int, world_size: int,
                num_workers: int, pin: bool = False) -> DataLoader:
    """Each rank reads a disjoint part of the eval set (a stream is already this rank's, from
    `rank_dataset`); nothing is padded or repeated."""
    if not isinstance(ds, IterableDataset) and world_size > 1:
        ds = ds.shard(num_shards=world_size, index=rank, contiguous=True)
    return DataLoader(ds, batch_size=batch_size, collate_fn=collator, num_workers=num_workers,
                      generator=_own_generator(0), pin_memory=pin)


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The batch's tensors on `device`; its other values (the collator's `padded` flag) as they are."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@dataclass
class RankData:
    """This rank's training and evaluation loaders, and the run's length in optimizer steps."""

    train_ds: Any
    train_loader: DataLoader
    train_collator: MaskingCollator
    eval_loader: DataLoader | None
    total_steps: int
    note: str  # what the start-up log says about the data


def rank_data(data: DataConfig, training: TrainingConfig, tokenizer: Any, raw_train: AnyDataset,
              raw_eval: AnyDataset | None, accelerator: Any, preprocessing_timeout: int,
              layout_batch: int | None = None) -> RankData:
    """Tokenize and pack (the main process first, the others then load its cache), and this rank's
    loaders with their masking collators; `layout_batch`: see `train_loader`."""
    rank, world = accelerator.process_index, accelerator.num_processes
    with patient_main_process_first(accelerator, preprocessing_timeout):
        train_ds = rank_dataset(raw_train, tokenizer, data, rank, world, shuffle_seed=training.seed)
        eval_ds = None if raw_eval is None else rank_dataset(raw_eval, tokenizer, data, rank, world)
    masking = dict(mlm_probability=data.mlm_probability, whole_word_mask=data.whole_word_mask,
                   seed=training.seed, pad_to=data.max_seq_length if data.pad_to_max_length else 0)
    train_collator = MaskingCollator.for_tokenizer(tokenizer, split=TRAIN_SPLIT, **masking)
    pin = accelerator.device.type == "cuda"
    train_dl = train_loader(train_ds, train_collator, training.per_device_train_batch_size, rank, world,
                            training.seed, data.dataloader_num_workers, layout_batch, pin)
    eval_dl = None if eval_ds is None else eval_loader(
        eval_ds, MaskingCollator.for_tokenizer(tokenizer, split=EVAL_SPLIT, **masking),
        training.per_device_eval_batch_size, rank, world, data.dataloader_num_workers, pin)
    if is_stream(train_ds):
        return RankData(train_ds, train_dl, train_collator, eval_dl, training.max_train_steps,
                        f"streaming, tokenized on the fly; {stream_sharding(raw_train.num_shards, world)}; "
                        f"{plan_stream_split(raw_train, world).note()}")
    sampler, seq = train_dl.batch_sampler, data.max_seq_length
    total_steps = training.max_train_steps or epoch_steps(
        training.num_train_epochs, sampler.epoch_blocks, sampler.global_batch * training.gradient_accumulation_steps)
    layout = "" if sampler.layout_batch == sampler.global_batch else (
        f" (the epochs keep the layout of the run that began, {sampler.layout_batch} per micro-batch)")
    return RankData(train_ds, train_dl, train_collator, eval_dl, total_steps,
                    f"{describe_sequences(pack_stats(train_ds, seq), data)}, {sampler.batches_per_epoch:g} "
                    f"micro-batches per epoch per rank, {sampler.padding} sequences repeated to fill the last "
                    f"global batch{layout}; rank r takes slice r of every global batch")


def describe_sequences(stats: PackStats, data: DataConfig) -> str:
    """The start-up log's words for the training sequences, with their share of padding."""
    seq = data.max_seq_length
    if not data.line_by_line:
        return (f"{stats.blocks} blocks of {seq} tokens ({stats.tokens} tokens, {stats.short_blocks} shorter tail "
                f"blocks, {stats.pad_fraction:.2%} padding)")
    lines = f"{stats.blocks} lines of at most {seq} tokens, {stats.tokens / max(stats.blocks, 1):.1f} on average"
    if data.pad_to_max_length:
        return f"{lines} ({stats.pad_fraction:.2%} padding: every batch padded to {seq})"
    return f"{lines} (each batch padded to its longest line: at most {stats.pad_fraction:.2%} padding)"
