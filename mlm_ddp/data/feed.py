"""The training feed: one window of micro-batches per optimizer step, epoch after epoch, every rank
ending each epoch together.

Ranks' streams end at different batches; `TrainFeed` makes all ranks end the epoch together, when the
first rank's part runs out: the rest of the other parts is not trained on in that epoch, and
`StreamEpochEnd` says how much that was.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import DataLoader

from mlm_ddp.data.counts import SourceCounts
from mlm_ddp.data.epochs import EpochBatchSampler
from mlm_ddp.data.mixed_stream import MixedStream
from mlm_ddp.data.mixture import MixedBlocks
from mlm_ddp.data.stream import PackedStream, is_stream
from mlm_ddp.errors import BadInput


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

    A mixture's windows come with their sources' counts (`counts`, data/counts.py): taken off each window as it
    is read, added once the loop says its step was taken (`count_trained`); `counted` (the checkpoint's, all
    ranks) places a resumed run's counts as the position places its data.
    """

    def __init__(self, loader: DataLoader, collator: Any, accumulation: int, epoch: int, start: int,
                 any_rank: Callable[[bool], bool], stream_state: dict[str, Any] | None = None,
                 gather: Callable[[list[float]], list[list[float]]] | None = None,
                 start_block: int | None = None, counted: list[dict[str, Any]] | None = None) -> None:
        self.loader, self.collator, self.accumulation = loader, collator, accumulation
        self.any_rank = any_rank
        self.gather = gather if gather is not None else (lambda values: [values])
        self.stream = is_stream(loader.dataset)
        # a PackedStream (or a mixture of them) read in this process can say exactly where it is; anything else re-reads
        self.exact = isinstance(loader.dataset, (PackedStream, MixedStream)) and loader.num_workers == 0
        self.sampler: EpochBatchSampler | None = None if self.stream else loader.batch_sampler
        self.dropped_batches = 0
        self.last_epoch_batches = 0  # micro-batches each rank trained on in the last stream epoch
        self.last_epoch_end: StreamEpochEnd | None = None
        self.counts = SourceCounts.of(loader.dataset)  # None: one source
        self.seek(epoch, start, start_block, stream_state, counted)

    def seek(self, epoch: int, start: int, start_block: int | None = None,
             stream_state: dict[str, Any] | None = None, counted: list[dict[str, Any]] | None = None) -> None:
        """Continue from a position (`__init__`'s arguments): a start, a resume or a rollback."""
        self._epoch, self._index = epoch, start  # streams: position of the next micro-batch
        self._stream_state = stream_state if self.exact else None
        if self.sampler is not None:  # map-style: the slot of the next micro-batch, from the first epoch
            within = start_block if start_block is not None else start * self.sampler.global_batch
            self.slot = epoch * self.sampler.epoch_blocks + within
        self._count_from(counted, stream_state)
        self._it: Iterator[Any] | None = None
        self._primed: list[Any] | None = None  # a window read ahead by `prime`, and where it starts
        self._primed_at: FeedPosition | None = None

    def _count_from(self, counted: list[dict[str, Any]] | None, stream_state: dict[str, Any] | None) -> None:
        """A mixture's counts at a start, a resume or a rollback: the checkpoint's. A checkpoint that saved none
        (an earlier version) gets what that version reported: map-style, the schedule's figures up to its
        position (exact if the mixture did not change since); a stream, each rank's saved counts (on the
        number of processes that wrote it; on another one the counts start at the resume)."""
        ds, counts = self.loader.dataset, self.counts
        if counts is None:
            return
        if counted is None and isinstance(ds, MixedBlocks) and self.slot:
            counted = ds.report(self.slot)
        legacy = counted is None and stream_state is not None and "tokens" in stream_state
        counts.restore(counted, ds.counted_before(stream_state) if legacy else None)
        if isinstance(ds, MixedStream):  # another topology's parts start at passes no part has begun
            ds.first_passes = counts.begun()

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
            return self._held(window)
        while True:
            if self._it is None:
                self._it = self._open()
            window = list(itertools.islice(self._it, self.accumulation))
            if not self.any_rank(len(window) < self.accumulation):
                self._index += len(window)
                return self._held(window)
            # some rank ran out: its epoch ends here, and so does everyone's (every rank is here)
            end = self._epoch_end(len(window))
            if self._index == 0:  # not one step in a whole epoch: the next epochs would end alike
                raise BadInput(too_small_for_a_step(end, self.accumulation, self.loader.batch_size))
            self.dropped_batches += len(window)
            self.last_epoch_batches = self._index
            self.last_epoch_end = end
            self._next_epoch()

    def _held(self, window: list[Any]) -> list[Any]:
        """A window as the loop gets it: a mixture's source tags taken off (counted when it is trained)."""
        if self.counts is not None:
            self.counts.held(window)
        return window

    def count_trained(self) -> None:
        """The window last read was trained (its step taken or skipped, as `tokens_seen` counts it)."""
        if self.counts is not None:
            self.counts.took()

    def counted(self) -> list[dict[str, Any]] | None:
        """A mixture's counts so far, all ranks, for a checkpoint (a collective, which every rank makes here)."""
        return None if self.counts is None else self.counts.total(self.gather)

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

    def sources(self) -> list[dict[str, Any]] | None:
        """A mixture's sources as trained so far: name, weight, blocks, tokens, passes (None: one source; a
        collective, which every rank makes here)."""
        return None if self.counts is None else self.counts.report(self.gather)

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
