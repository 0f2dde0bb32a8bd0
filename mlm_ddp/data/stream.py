"""Streams over the ranks: the raw stream split by shards (balanced by bytes) or by texts, and the
packed, resumable stream each rank reads.

The raw texts are split before they are shuffled and tokenized (`shard_stream`). With a
number of shards (files) divisible by the world size each rank reads only its own shards, the
same ones every epoch; when the shards are local files their sizes are known up front and the
files are dealt out by size (`balance_shards`), so the ranks' parts hold about as many bytes.
Otherwise every rank reads the whole raw stream and keeps one text in world_size
(`stream_sharding`). Either way each rank tokenizes and packs only its own texts.
"""

from __future__ import annotations

import copy
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from datasets import IterableDataset, concatenate_datasets

from mlm_ddp.compat import datasets as compat_datasets
from mlm_ddp.config import DataConfig
from mlm_ddp.data.pack import tokenize_and_pack
from mlm_ddp.errors import BadInput

# the first datasets release whose one-text shuffle buffer holds nothing between reads (PackedStream);
# pyproject's floor, which tests/test_data.py checks against this (and compat.check, the behaviour itself)
STREAM_RESUME_DATASETS = (5, 1)
# how a saved stream position names its next text: 2 since every topology reads a stream as its files one
# by one (`single_shards`); 1 (no key) before, when one process read it as one stream, whose datasets state
# does not load into the files' (a KeyError deep inside datasets)
STREAM_LAYOUT = 2


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


def balance_shards(sizes: list[int], world_size: int, equal_counts: bool = True) -> list[list[int]]:
    """Pure: shard indices per rank, totals close; each rank `len(sizes) // world_size` of them with
    `equal_counts` (then `len(sizes) % world_size == 0` is needed), else any number.

    Greedy, largest first: each shard goes to the rank with the smallest total that still has room.
    Ranks of a stream keep equal shard counts so DataLoader workers share them as before (mlm_ddp.prepare's
    tasks need not). A heuristic can lose to a lucky file order, so the naive deal (`naive_shards`) is
    kept when its largest total is no larger: the result is never worse than it.
    """
    if equal_counts and len(sizes) % world_size:
        raise ValueError(f"{len(sizes)} shards do not divide over {world_size} ranks")
    room = len(sizes) // world_size if equal_counts else len(sizes)
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


def shard_sizes(ds: IterableDataset) -> list[int] | None:
    """Bytes of each shard of a stream, when every shard is one local file (else None: an in-memory table,
    a parquet stream; the files of a stream: `compat.datasets.shard_files`, datasets has no public accessor)."""
    files = compat_datasets.shard_files(ds)
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
    if sizes is None:  # dealt by position, the same shards every epoch
        return StreamSplit("files", world_size, naive_shards(ds.num_shards, world_size))
    shards = balance_shards(sizes, world_size)
    naive = naive_shards(len(sizes), world_size)
    return StreamSplit("files", world_size, shards, [sum(sizes[i] for i in part) for part in shards],
                       [sum(sizes[i] for i in part) for part in naive])


def _is_mine(_example: dict, index: int, rank: int, world_size: int) -> bool:
    return index % world_size == rank


def single_shards(ds: IterableDataset) -> list[IterableDataset]:
    """Each shard of a stream as a stream of its own: `datasets` divides the stream's skip/take counts
    (the held-out share, --max_train_samples) over its shards here (`split_number`: n // shards each,
    one more for the first n % shards), which fixes which texts they cover whatever the world size.

    Its features are resolved first, from the whole stream's first text: joining the shards again
    would otherwise read each shard's first text for them, and fail on a shard the skip emptied.
    """
    ds = compat_datasets.with_features(ds)
    return [ds.shard(num_shards=ds.num_shards, index=i, contiguous=True) for i in range(ds.num_shards)]


def shard_stream(ds: IterableDataset, rank: int, world_size: int) -> IterableDataset:
    """This rank's part of a raw stream: whole shards when they divide evenly, else every n-th text.

    Every topology reads the stream as its single shards joined (`single_shards`), so a skip or take
    applied to the whole stream (data.text) covers the same texts on 1, 2 or N processes: the first
    k_i texts of shard i, with `datasets`' own division of the count over the shards. Applied to the
    stream as one, it would cover the first texts in order on one process and the first of each file
    on several (docs/data.md, "Which texts a stream holds out").

    Whole shards: the rank's shards (local files picked by `balance_shards`, so each part holds about
    as many bytes; others dealt by position) are joined in one stream, the same shards every epoch (an
    epoch ends for everyone when the smallest part runs out; a part 10x larger than another would
    otherwise be 90% unread, every epoch). Not `split_dataset_by_node`: it deals the shards after the
    per-epoch shard shuffle, so a rank's files would change every epoch, and it divides skip/take
    counts by rank, not by shard.

    Every n-th text in the uneven case, not `split_dataset_by_node`'s example split: that is applied
    to the end of the pipeline, after `map`, so every rank would tokenize and pack every text.
    Filtering by position here, before the shuffle buffer and `map`, is a partition because every
    rank reads the same texts in the same (seeded) shard order, and with the same number of
    DataLoader workers, the same shards per worker.
    """
    parts = single_shards(ds)
    if world_size > 1 and ds.num_shards % world_size == 0:
        mine = plan_stream_split(ds, world_size).shards or naive_shards(ds.num_shards, world_size)
        return concatenate_datasets([parts[i] for i in mine[rank]])
    whole = concatenate_datasets(parts)
    if world_size == 1:
        return whole
    return whole.filter(_is_mine, with_indices=True, fn_kwargs={"rank": rank, "world_size": world_size})


def check_training_shards(ds: IterableDataset, rank: int, world_size: int, cfg: DataConfig) -> None:
    """Refuse a training stream with a shard that gives no text (the held-out share or --max_train_samples,
    divided over the shards, left it none), naming the shard's file and the flag to change.

    A rank whose part holds only such shards has nothing to train on (and joining an empty shard once
    ended the run with a bare StopIteration); a shard emptied on one topology is emptied on every one,
    so it is refused on every one. Each rank looks at the shards it reads anyway (all of them, or its
    own files): the first text of each, past its held-out share.
    """
    files = compat_datasets.shard_files(ds)
    shards = plan_stream_split(ds, world_size).shards  # None: every rank reads every shard
    mine = range(ds.num_shards) if shards is None else shards[rank]
    parts = single_shards(ds)
    for index in mine:
        if next(iter(parts[index]), None) is not None:
            continue
        where = f"file {files[index]}" if files else f"shard {index} of {ds.num_shards}"
        skipped, taken = compat_datasets.skip_take(parts[index])
        if taken == 0:
            raise BadInput(f"--streaming: {where} gives no text to train on: --max_train_samples "
                           f"{cfg.max_train_samples} is divided over the stream's {ds.num_shards} files and leaves "
                           f"it none; give --max_train_samples {ds.num_shards} or more")
        raise BadInput(f"--streaming: {where} gives no text to train on: it holds {skipped} texts or fewer, and "
                       f"the first {skipped} texts of each file are held out (--max_eval_samples "
                       f"{cfg.max_eval_samples or 'default 1000'}, divided over {ds.num_shards} files); lower "
                       "--max_eval_samples, give a --validation_file, or join the small files")


class PackedStream(torch.utils.data.IterableDataset):
    """This rank's training blocks from its part of a raw text stream, resumable exactly and cheaply.

    The texts are read in chunks of `chunk_texts`; each chunk is shuffled with a permutation seeded
    by (seed, epoch, chunk number), then tokenized and packed (`tokenize_and_pack`). The shards are
    reshuffled every epoch by `datasets`' `shuffle` with a one-text buffer (from datasets 5.0 it also
    interleaves up to 10 shards). From datasets 5.1 that buffer is empty between reads, so the
    source's `state_dict()` names exactly the next text; before 5.1 it held one more text and every
    resume skipped it (measured on 3.6 to 5.0.1), hence `STREAM_RESUME_DATASETS`; no documented promise,
    so `compat.check` tries it on the installed datasets (`compat.datasets.resumes_exactly`). The position
    is (the source's `state_dict()` before the current chunk, the chunk number, blocks of it already
    yielded): a resume re-reads at most one chunk, never the stream from its start (datasets #5454),
    and yields exactly the blocks an uninterrupted run would have.
    Exact positions need `--dataloader_num_workers 0` (the state lives in this process).

    It also counts what it read in the current epoch (`texts_read`, `text_bytes`, `blocks_read`;
    kept in the position, so a resumed epoch counts on), which `TrainFeed` reports at the epoch end
    beside `split` (how the raw stream was split) and `part_bytes` (this rank's file bytes, if known).
    A chunk's texts and bytes are counted in proportion to its blocks yielded (its last block: all
    of them); the position keeps the counts before the chunk, which a resume re-reads.
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
            compat_datasets.load_stream_state(self.texts, self._resume["source"])
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
            chunk_bytes = sum(len(t.encode()) for t in texts if isinstance(t, str))
            order = np.random.default_rng([self.seed, self.epoch, chunk]).permutation(len(texts))
            packed = tokenize_and_pack([texts[i] for i in order], self.tokenizer, self.cfg.max_seq_length,
                                       with_word_continues=self.cfg.whole_word_mask,
                                       line_by_line=self.cfg.line_by_line)
            n_blocks = len(packed["input_ids"])
            if not n_blocks:  # texts that tokenize to nothing: read all the same
                self.texts_read, self.text_bytes = texts_before + len(texts), bytes_before + chunk_bytes
            for k in range(skip, n_blocks):
                # the chunk counted as its blocks are yielded, in proportion: counting a whole chunk
                # (up to --shuffle_buffer_size texts) on loading made a part look read before it was
                self.texts_read = texts_before + len(texts) * (k + 1) // n_blocks
                self.text_bytes = bytes_before + chunk_bytes * (k + 1) // n_blocks
                self.blocks_read += 1
                self.position = {"epoch": self.epoch, "source": source, "chunk": chunk, "blocks": k + 1,
                                 "texts": texts_before, "bytes": bytes_before, "epoch_blocks": self.blocks_read,
                                 "layout": STREAM_LAYOUT}
                yield {key: values[k] for key, values in packed.items()}
            chunk, skip = chunk + 1, 0


def stale_stream_position(state: dict | None) -> bool:
    """Whether a saved stream position (a PackedStream's, or a MixedStream's of them) was written in an
    earlier layout (STREAM_LAYOUT), so that it names no text of this one; a position that has read nothing
    of its epoch yet names none and is never stale."""
    parts = [] if state is None else state.get("parts", [state])
    return any(part.get("source") is not None and part.get("layout", 1) != STREAM_LAYOUT for part in parts)


def check_stream_resume(datasets_version: str) -> None:
    """Refuse a stream resume that would silently skip texts (a datasets older than pyproject allows)."""
    release = tuple(int(part) for part in datasets_version.split(".")[:2] if part.isdigit())
    if release < STREAM_RESUME_DATASETS:
        raise BadInput(
            f"resuming a --streaming run needs datasets >= {'.'.join(map(str, STREAM_RESUME_DATASETS))} "
            f"(installed: {datasets_version}): older versions skip a text at every resume; upgrade datasets"
        )


def is_stream(ds: Any) -> bool:
    """A stream of `datasets`, or one of ours (a PackedStream, a mixture of them)."""
    return isinstance(ds, (IterableDataset, torch.utils.data.IterableDataset))
