"""A mixture of streams (`--streaming` with several `--train_file` sources): each source is split over the
ranks as one stream is (`stream.PackedStream`, this rank's part), and the round-robin of `mixture.Schedule`
says which source each slot of this rank reads, by the slot's global index (rank r's slice of each global
micro-batch). So every global batch takes the same number of blocks from each source on every topology
(which blocks depends on the parts, as with one stream); a part that runs out starts its next pass,
reshuffled (`PackedStream.set_epoch(pass)`); the position (this rank's blocks read, and each part's pass
and exact stream position) is saved per rank and resumed exactly. The mixture never ends an epoch: the
feed's epoch stays where it began. On another number of processes the parts differ, so a resume starts
every part at a pass no part has begun (`first_passes`, from the checkpoint's counts): a fresh shuffle.
Each block carries its source (`SOURCE_KEY`) and pass, which `data.counts` counts as training takes it.

Shares here are shares of blocks: a stream's mean block length is known only once read. With packing a
block holds --max_seq_length tokens but one shorter block per chunk of texts, so that is a share of tokens
to within those blocks; --line_by_line is refused (`config.mixture`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from mlm_ddp.data.masking import EPOCH_KEY, SOURCE_KEY
from mlm_ddp.data.mixture import Schedule, apportion
from mlm_ddp.data.stream import PackedStream
from mlm_ddp.errors import BadInput


class MixedStream(torch.utils.data.IterableDataset):
    """This rank's blocks of several sources' parts, slot by slot (see the module docstring)."""

    def __init__(self, parts: list[PackedStream], names: list[str], shares: list[float], batch_size: int,
                 rank: int, world_size: int) -> None:
        self.parts, self.names, self.shares = parts, names, shares
        self.schedule = Schedule.from_counts(apportion(shares))
        self.batch_size, self.rank, self.global_batch = batch_size, rank, batch_size * world_size
        self.split, self.part_bytes = "mixture", None  # what a stream's epoch end reports (never reached)
        self.first_passes = [0] * len(parts)  # each source's passes begun before (a resume on another topology)
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` afresh: every part at its pass `epoch`, or at the first pass no part has begun
        (a fresh start, or another topology)."""
        self.epoch, self._resume, self.read = epoch, None, 0
        self.passes = [max(epoch, first) for first in self.first_passes]

    def slot(self, i: int) -> int:
        """The global slot of this rank's i-th block of the epoch."""
        return (i // self.batch_size) * self.global_batch + self.rank * self.batch_size + i % self.batch_size

    @property
    def reread_texts(self) -> int:
        return sum(part.reread_texts for part in self.parts)

    def state_dict(self) -> dict[str, Any]:
        parts = [part.state_dict() for part in self.parts]
        return {"epoch": self.epoch, "read": self.read, "passes": list(self.passes), "parts": parts,
                "chunk": max(p["chunk"] for p in parts), "blocks": self.read}  # the last two: the log's

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.set_epoch(state["epoch"])
        self._resume = copy.deepcopy(state)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._resume is not None:
            self.read, self.passes = self._resume["read"], list(self._resume["passes"])
            for part, state in zip(self.parts, self._resume["parts"], strict=True):
                part.load_state_dict(state)  # its epoch is its pass
        else:
            for part, pass_ in zip(self.parts, self.passes, strict=True):
                part.set_epoch(pass_)
        self._resume = None
        reading = [iter(part) for part in self.parts]
        while True:
            source = self.schedule.source_of(self.slot(self.read))
            block = next(reading[source], None)
            if block is None:  # this part ran out: its next pass, reshuffled
                self.passes[source] += 1
                self.parts[source].set_epoch(self.passes[source])
                reading[source] = iter(self.parts[source])
                block = next(reading[source], None)
                if block is None:
                    raise BadInput(f"training source {self.names[source]!r}: rank {self.rank}'s part of the stream "
                                   "holds no text; give it more text or use fewer processes")
            self.read += 1
            yield {**block, EPOCH_KEY: self.passes[source], SOURCE_KEY: source}

    def counted_before(self, state: dict[str, Any]) -> list[list[int]]:
        """This rank's blocks, tokens and passes begun of each source up to a saved position of a version that
        saved no counts: its tokens and passes, and its blocks from the round-robin (this rank's slots)."""
        i = np.arange(state["read"])
        slots = i // self.batch_size * self.global_batch + self.rank * self.batch_size + i % self.batch_size
        blocks = np.bincount(self.schedule.order[slots % self.schedule.period], minlength=len(self.parts))
        return [[int(b), int(t), p + 1] for b, t, p in zip(blocks, state["tokens"], state["passes"], strict=True)]
