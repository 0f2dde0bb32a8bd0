"""Several training sources mixed by their weights (`--train_file a.txt b.jsonl --train_weights 0.9 0.1`).

A weight is a share of the training *tokens*. Each source is loaded (a text file, a `datasets` folder or a
folder of `python -m mlm_ddp.prepare`) and packed into blocks on its own; then every slot of the run's one
sequence of global blocks (the slots `EpochBatchSampler` lays out: global batch after global batch, rank r
taking slice r) is given to a source by a fixed schedule, a smooth weighted round-robin over the slot
index (`Schedule`). A source's k-th slot reads its next block: its pass k // blocks, its block
permutation(seed, pass, source)[k % blocks]. So, without any state of their own:

- the draw is the same on every topology: it depends on the global slot only, never on rank or process;
- a resume is exact: the checkpoint's global slot (the epoch and block the feed saves) gives every
  source's position, its pass and its place in that pass's permutation;
- a source that runs out starts its next pass, reshuffled;
- shares are exact over any window up to one block per source: unlike a seeded random draw, whose
  share over 800 blocks strays by ~1% at a weight of 0.1 (binomial sd sqrt(800 x 0.1 x 0.9) = 8.5 blocks).

Each row carries its source (`SOURCE_KEY`) and pass, so that what training took of each source is counted
from the batches it trained on (`data.counts`), not computed from this schedule: a resume may change the
weights, and the schedule of the new ones says nothing of the steps trained with the old.

Slots are shared out in proportion to weight / (mean tokens per block), so that the shares are shares of
tokens: with packing every block holds --max_seq_length tokens (but one shorter block per tokenization
batch), so this is a share of blocks; with --line_by_line the blocks are lines of unequal length, and the
real tokens are counted (each source's mean line length), exact on average over a source's passes.
`--num_train_epochs` counts passes over the source of the largest weight.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch
from datasets import Dataset
from torch.utils.data import DataLoader

from mlm_ddp.config import DataConfig
from mlm_ddp.data.epochs import EpochBatchSampler, own_generator, worker_options
from mlm_ddp.data.masking import EPOCH_KEY, SOURCE_KEY
from mlm_ddp.data.prepared import MANIFEST, load_prepared
from mlm_ddp.data.text import AnyDataset, load_held_out, load_text
from mlm_ddp.errors import BadInput

DENOMINATOR = 10_000  # slot shares are whole numbers of slots per 10,000: each within 1e-4 of its target
SOURCE_CHANGES = frozenset({"data.train_file", "data.train_weights", "data.train_names"})


def apportion(shares: list[float], denominator: int = DENOMINATOR) -> list[int]:
    """Pure: shares -> whole slots per period summing to `denominator` (largest remainders; at least 1 each),
    then divided by their common divisor (a shorter period, the same proportions)."""
    total = sum(shares)
    exact = [denominator * s / total for s in shares]
    counts = [max(1, math.floor(e)) for e in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: max(0, denominator - sum(counts))]:
        counts[i] += 1
    while sum(counts) > denominator:  # the at-least-1 floor overshot: take from the largest
        counts[counts.index(max(counts))] -= 1
    divisor = math.gcd(*counts)
    return [c // divisor for c in counts]


@dataclass(frozen=True)
class Schedule:
    """Which source each global slot reads: a period of `sum(counts)` slots, `counts[s]` of them source s's,
    spread by smooth weighted round-robin (nginx's: each slot goes to the source furthest behind its share)."""

    counts: tuple[int, ...]
    order: np.ndarray  # (period,): the source of each slot of a period
    before: np.ndarray  # (period + 1, sources): slots of each source before each slot of a period

    @classmethod
    def from_counts(cls, counts: list[int]) -> Schedule:
        period, current, order = sum(counts), [0] * len(counts), []
        for _ in range(period):
            current = [c + w for c, w in zip(current, counts, strict=True)]
            pick = current.index(max(current))  # ties: the first source
            current[pick] -= period
            order.append(pick)
        order_np = np.asarray(order, dtype=np.int64)
        before = np.zeros((period + 1, len(counts)), dtype=np.int64)
        before[1:] = np.cumsum(np.eye(len(counts), dtype=np.int64)[order_np], axis=0)
        return cls(tuple(counts), order_np, before)

    @property
    def period(self) -> int:
        return len(self.order)

    def source_of(self, slot: int) -> int:
        return int(self.order[slot % self.period])

    def read_before(self, slot: int) -> np.ndarray:
        """(sources,): the blocks each source gave to the slots before `slot`."""
        return (slot // self.period) * np.asarray(self.counts, dtype=np.int64) + self.before[slot % self.period]


@dataclass
class Source:
    """One source's packed training blocks."""

    name: str
    share: float  # of the training tokens, normalised
    blocks: Dataset
    lengths: np.ndarray  # (blocks,): tokens of each block

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


class MixedBlocks(torch.utils.data.Dataset):
    """The sources' blocks read by global slot: key = slot, row = the block that slot reads, with the
    source's pass as its epoch (`EPOCH_KEY`: the masks of a block differ from pass to pass). Pure in
    (sources, seed)."""

    def __init__(self, sources: list[Source], seed: int) -> None:
        for source in sources:
            if len(source.blocks) == 0:
                raise BadInput(f"training source {source.name!r} packs into zero blocks: give it more text")
        self.sources, self.seed = sources, seed
        mean = [s.tokens / len(s.blocks) for s in sources]
        self.schedule = Schedule.from_counts(apportion([s.share / m for s, m in zip(sources, mean, strict=True)]))
        self._orders: dict[tuple[int, int], np.ndarray] = {}  # a few recent passes' permutations

    def _order(self, source: int, pass_: int) -> np.ndarray:
        """Source `source`'s blocks in pass `pass_`: a permutation seeded by (seed, pass, source)."""
        if (source, pass_) not in self._orders:
            if len(self._orders) >= 4 * len(self.sources):
                self._orders.clear()
            rng = np.random.default_rng([self.seed, pass_, 1 + source])
            self._orders[(source, pass_)] = rng.permutation(len(self.sources[source].blocks))
        return self._orders[(source, pass_)]

    def __len__(self) -> int:  # one period of the schedule; the sampler's keys run on past it
        return self.schedule.period

    def locate(self, slot: int) -> tuple[int, int, int]:
        """(source, its pass, its block) that global slot `slot` reads."""
        source = self.schedule.source_of(slot)
        k, n = int(self.schedule.read_before(slot)[source]), len(self.sources[source].blocks)
        return source, k // n, int(self._order(source, k // n)[k % n])

    def __getitem__(self, slot: int) -> dict:
        return self.__getitems__([slot])[0]

    def __getitems__(self, slots: list[int]) -> list[dict]:
        rows = []
        for slot in slots:
            source, pass_, block = self.locate(slot)
            rows.append({**self.sources[source].blocks[block], EPOCH_KEY: pass_, SOURCE_KEY: source})
        return rows

    def epoch_slots(self) -> int:
        """Slots of one pass over the source of the largest weight (an epoch of the mixture)."""
        first = max(range(len(self.sources)), key=lambda s: self.sources[s].share)
        return math.ceil(len(self.sources[first].blocks) * self.schedule.period / self.schedule.counts[first])

    def report(self, slots: int) -> list[dict[str, Any]]:
        """What the schedule gives each source in the first `slots` global slots: name, weight, blocks, tokens and
        passes. A plan (the start-up log's), or the counts of a checkpoint that saved none (exact if the mixture
        did not change since): what a run trained is counted (`data.counts`)."""
        out = []
        for index, (source, k) in enumerate(zip(self.sources, self.schedule.read_before(slots).tolist(), strict=True)):
            n = len(source.blocks)
            whole, part = divmod(k, n)
            tokens = whole * source.tokens + int(source.lengths[self._order(index, whole)[:part]].sum())
            out.append({"name": source.name, "weight": source.share, "blocks": k, "tokens": tokens, "passes": k / n})
        return out

    def describe(self, slots: int) -> str:
        """The start-up log's words: each source's share, size and the passes the run will make over it."""
        read = zip(self.sources, self.report(slots), strict=True)
        parts = [f"{r['name']} {r['weight']:.1%} of the tokens ({len(s.blocks)} blocks, {s.tokens} tokens; "
                 f"{r['passes']:.2f} passes in this run)" for s, r in read]
        return (f"a mixture of {len(parts)} sources, each block's source fixed by its global position "
                f"(weighted round-robin, period {self.schedule.period} blocks): {'; '.join(parts)}")


class MixtureBatchSampler(EpochBatchSampler):
    """This rank's micro-batches of a mixture: the global slots themselves (`MixedBlocks` maps each to its
    source's block), rank r taking slice r of every global micro-batch. Its epochs (for --num_train_epochs,
    checkpoints and the feed's position) are `MixedBlocks.epoch_slots` long, rounded up to whole global
    micro-batches of the run that began; no slot is ever repeated to fill one."""

    def __init__(self, epoch_slots: int, batch_size: int, rank: int, world_size: int, seed: int,
                 layout_batch: int | None = None) -> None:
        super().__init__(epoch_slots, batch_size, rank, world_size, seed, layout_batch=layout_batch)
        self.padding = 0

    def __iter__(self):  # noqa: ANN204 (a generator of lists of keys)
        slot = self.start
        while True:
            first = slot + self.rank * self.batch_size
            yield list(range(first, first + self.batch_size))
            slot += self.global_batch


@dataclass
class Mixture:
    """The training sources as loaded (raw texts, or prepared blocks), before tokenizing."""

    names: list[str]
    shares: list[float]
    raw: list[AnyDataset]
    configs: list[DataConfig]  # each source's own data section (its file, folder or prepared folder)

    def sources(self, tokenize: Any) -> list[Source]:
        """Each source packed into blocks by `tokenize(raw, config)`."""
        out = []
        for name, share, raw, config in zip(self.names, self.shares, self.raw, self.configs, strict=True):
            blocks = tokenize(raw, config)
            lengths = pc.list_value_length(blocks.data.column("input_ids")).to_numpy(zero_copy_only=False)
            out.append(Source(name, share, blocks, np.asarray(lengths, dtype=np.int64)))
        return out


def source_config(cfg: DataConfig, path: str) -> DataConfig:
    """The data section that loads source `path` alone: a prepared folder (it holds a manifest), a
    `datasets` folder, or a file; its held-out share is the mixture's unless --validation_file is given."""
    alone = dict(train_file=None, train_weights=None, train_names=None, validation_file=None)
    if cfg.validation_file is not None:
        alone["validation_split_percentage"] = 0.0
    if Path(path, MANIFEST).is_file():
        return dataclasses.replace(cfg, prepared_data=path, **alone)
    if Path(path).is_dir():
        return dataclasses.replace(cfg, dataset_name=path, **alone)
    return dataclasses.replace(cfg, **{**alone, "train_file": [path]})


def load_mixture(cfg: DataConfig, seed: int, tokenizer: Any) -> tuple[Mixture, AnyDataset | dict | None]:
    """The sources, and what is evaluated: the --validation_file sources, else each source's own held-out
    share, by source name."""
    names, total = cfg.train_source_names(), sum(cfg.train_weights)
    configs = [source_config(cfg, path) for path in cfg.train_file]
    raw, held = [], {}
    for name, config in zip(names, configs, strict=True):
        if config.prepared_data is not None:
            train, evaluation, _ = load_prepared(config, tokenizer)
        else:
            train, evaluation = load_text(config, seed)
        raw.append(train)
        if evaluation is not None:
            held[name] = evaluation
    if cfg.validation_file is not None:
        evaluation = load_held_out(cfg)
    else:
        evaluation = held or None  # by name even when one source holds some out: it is not the whole mixture
    return Mixture(names, [w / total for w in cfg.train_weights], raw, configs), evaluation


def load_data(cfg: DataConfig, seed: int, tokenizer: Any) -> tuple[Any, AnyDataset | dict | None]:
    """(train, eval) of the run: a prepared folder's blocks, a mixture of sources, or one source's texts."""
    if cfg.mixed:  # never with --prepared_data (DataConfig refuses both); a source may be a prepared folder
        return load_mixture(cfg, seed, tokenizer)
    if cfg.prepared_data is not None:  # blocks, memory-mapped; refused here if another tokenizer made them
        train, evaluation, _ = load_prepared(cfg, tokenizer)
        return train, evaluation
    return load_text(cfg, seed)


def source_changes(cfg: DataConfig) -> frozenset[str]:
    """The settings a resume may change under --allow_source_changes."""
    return SOURCE_CHANGES if cfg.allow_source_changes else frozenset()


def uncounted_note(cfg: DataConfig, state: Any, changes: dict, elastic: bool, note: str | None) -> str | None:
    """The resume's note (`note`, if any) and, for a mixture's checkpoint that saved no per-source counts (an
    earlier version), what summary.json's `sources` hold for the steps before it (data/feed.py: `_count_from`)."""
    if not cfg.mixed or state.sources is not None or not state.step:
        return note
    if cfg.streaming and not elastic:
        return note  # each rank's saved stream position holds its counts: exact
    if cfg.streaming:
        said = f"count from step {state.step}: they add up to the tokens trained since, not to tokens_seen"
    else:
        said = (f"up to step {state.step} are the schedule's figures"
                + (", estimated: the mixture changed" if SOURCE_CHANGES & set(changes) else ""))
    return "; ".join(filter(None, [note, "the checkpoint saved no per-source counts (an earlier version): "
                                         f"summary.json's sources {said}"]))


def sources_read_line(sources: list[dict] | None) -> str:
    """The closing line's words for a mixture: each source's tokens, share and passes."""
    if not sources:
        return ""
    total = sum(s["tokens"] for s in sources) or 1
    return "; sources: " + ", ".join(f"{s['name']} {s['tokens']} tokens ({s['tokens'] / total:.1%}, weight "
                                     f"{s['weight']:.1%}, {s['passes']:.2f} passes)" for s in sources)


def mixture_loader(ds: MixedBlocks, collator: Any, batch_size: int, rank: int, world_size: int, seed: int,
                   num_workers: int, layout_batch: int | None = None, pin: bool = False) -> DataLoader:
    """`epochs.train_loader` for a mixture: this rank's slice of every global micro-batch of slots."""
    sampler = MixtureBatchSampler(ds.epoch_slots(), batch_size, rank, world_size, seed, layout_batch)
    return DataLoader(ds, batch_sampler=sampler, collate_fn=collator, generator=own_generator(seed), pin_memory=pin,
                      **worker_options(num_workers, persistent=True))
