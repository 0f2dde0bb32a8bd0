"""What training took from each source of a mixture (blocks, tokens, passes), counted from the batches it
trained on.

Every block a mixture serves carries its source and that source's pass (`masking.SOURCE_KEY`); the collator
hands them on beside each micro-batch's tensors, (rows, 3) on the host: each row's source, pass and tokens.
`TrainFeed` takes them off every window it reads (`SourceCounts.held`), before the window goes to the device,
and a window counts once its optimizer step is taken (`took`), where `tokens_seen` counts it. So a window
read and not trained never counts: a stream's partial window at an epoch end, a window a loss-spike rollback
skips, the window a stop signal saves before. Counting is numpy on the host: nothing is read back from the
device, and the hot loop waits for nothing.

A checkpoint saves the counts of all ranks together, by source name (`total`: one gather, at the save); a
resume goes on from them on any number of processes and with other weights (--allow_source_changes), so the
figures are what was trained before plus what each rank trains from there, and they add up to `tokens_seen`.
A source that a resume dropped keeps its figures, with weight 0.

passes: of map-style sources, blocks trained / the source's blocks (a fraction; after a change of weights
too, which moves a source to where the new schedule has it); of streams, passes begun (a stream's length is
unknown), the most of any rank's part.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mlm_ddp.data.masking import SOURCE_KEY
from mlm_ddp.data.mixed_stream import MixedStream
from mlm_ddp.data.mixture import MixedBlocks

COLUMNS = 3  # per source: blocks, tokens, passes begun (the highest pass of a block trained, plus one)
Gather = Callable[[list[float]], list[list[float]]]  # every rank's numbers, in rank order (a collective)


class SourceCounts:
    """This rank's count of what training took from each source since the start or the checkpoint it goes
    on from, and that checkpoint's counts (all ranks)."""

    def __init__(self, names: list[str], shares: list[float], sizes: list[int] | None) -> None:
        self.names, self.shares = list(names), list(shares)
        self.sizes = sizes  # each source's blocks (map-style); None: streams, whose length is unknown
        self.restore(None)

    @classmethod
    def of(cls, ds: Any) -> SourceCounts | None:
        """The counts of a mixture's training data (None: one source)."""
        if isinstance(ds, MixedBlocks):
            return cls([s.name for s in ds.sources], [s.share for s in ds.sources], [len(s.blocks) for s in ds.sources])
        if isinstance(ds, MixedStream):
            return cls(ds.names, ds.shares, None)
        return None

    def restore(self, before: list[dict[str, Any]] | None, mine: list[list[int]] | None = None) -> None:
        """Go on from a checkpoint's counts (`before`: all ranks', as `total` gave them; None: nothing before),
        of which this rank counted `mine` itself (only a checkpoint that saved no counts: see `TrainFeed`)."""
        self.before = {row["name"]: row for row in before or []}
        zeros = np.zeros((len(self.names), COLUMNS), dtype=np.int64)
        self.mine = zeros if mine is None else np.asarray(mine, dtype=np.int64).reshape(zeros.shape)
        self.window = np.zeros_like(zeros)

    def held(self, window: list[dict[str, Any]]) -> None:
        """Take the source tags off a window's batches (they never reach the device) and hold their counts
        until its step is taken (`took`); a window read after it replaces them."""
        self.window = np.zeros_like(self.mine)
        for batch in window:
            tags = batch.pop(SOURCE_KEY)  # (rows, 3): source, pass, tokens
            np.add.at(self.window[:, 0], tags[:, 0], 1)
            np.add.at(self.window[:, 1], tags[:, 0], tags[:, 2])
            np.maximum.at(self.window[:, 2], tags[:, 0], tags[:, 1] + 1)

    def took(self) -> None:
        """The window last read was trained: its blocks count."""
        self.mine[:, :2] += self.window[:, :2]
        np.maximum(self.mine[:, 2], self.window[:, 2], out=self.mine[:, 2])
        self.window = np.zeros_like(self.mine)

    def begun(self) -> list[int]:
        """Each source's passes begun before this run's start (streams: where a part of another topology starts)."""
        return [int(self.before.get(name, {}).get("passes", 0)) for name in self.names]

    def total(self, gather: Gather) -> list[dict[str, Any]]:
        """Each source's name, blocks, tokens and passes so far, all ranks (`gather`: a collective), then those
        of the sources only the checkpoint knew; what a checkpoint saves."""
        ranks = np.asarray(gather([float(v) for v in self.mine.ravel()]), dtype=np.float64)
        ranks = ranks.reshape(-1, len(self.names), COLUMNS)  # (ranks, sources, columns)
        blocks, tokens, begun = ranks[:, :, 0].sum(axis=0), ranks[:, :, 1].sum(axis=0), ranks[:, :, 2].max(axis=0)
        out = []
        for s, name in enumerate(self.names):
            was = self.before.get(name, {"blocks": 0, "tokens": 0, "passes": 0})
            passes = (max(was["passes"], int(begun[s])) if self.sizes is None
                      else was["passes"] + blocks[s] / self.sizes[s])
            out.append({"name": name, "blocks": was["blocks"] + int(blocks[s]),
                        "tokens": was["tokens"] + int(tokens[s]), "passes": passes})
        return out + [dict(row) for name, row in self.before.items() if name not in self.names]

    def report(self, gather: Gather) -> list[dict[str, Any]]:
        """summary.json's `sources`: each one's name, weight (0: dropped by a resume), blocks, tokens, passes."""
        weights = dict(zip(self.names, self.shares, strict=True))
        return [{"name": row["name"], "weight": weights.get(row["name"], 0.0), "blocks": row["blocks"],
                 "tokens": row["tokens"], "passes": round(row["passes"], 4)} for row in self.total(gather)]
