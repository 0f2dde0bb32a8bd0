"""Map-style data over the ranks: the epoch sampler and the loaders.

One seeded permutation of the blocks per epoch, cut into global batches of
`per_device_batch x world_size`; rank r takes the r-th slice of every global batch. The last global
batch is filled up with the first blocks of the permutation (counted in `padding`), so every rank
runs the same number of steps and the composition of each global batch, hence the loss curve, does
not depend on how many processes share it. A run resumed on another number of processes keeps
the first run's layout of the epochs (`EpochBatchSampler`), so its steps read the same blocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from datasets import Dataset, IterableDataset
from torch.utils.data import DataLoader, Sampler

from mlm_ddp.data.masking import EPOCH_KEY
from mlm_ddp.data.stream import is_stream
from mlm_ddp.data.text import AnyDataset
from mlm_ddp.errors import BadInput


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


def own_generator(seed: int) -> torch.Generator:
    """Each iter(DataLoader) draws a worker seed; from its own generator it leaves torch's global RNG
    (dropout) untouched, so a resumed run draws the same dropout masks as an uninterrupted one."""
    return torch.Generator().manual_seed(seed)


def train_loader(ds: AnyDataset, collator: Any, batch_size: int, rank: int, world_size: int,
                 seed: int, num_workers: int, layout_batch: int | None = None, pin: bool = False) -> DataLoader:
    """A stream is already this rank's (`rank_dataset`); map-style data is sharded by the sampler,
    whose epochs are laid out for `layout_batch` (the global micro-batch of the run that began the
    training; default: this run's). `pin`: page-locked batches (for a CUDA device), which is what makes
    `to_device`'s non_blocking copies asynchronous; from pageable memory the host waits for each."""
    common = dict(collate_fn=collator, generator=own_generator(seed), pin_memory=pin,
                  **worker_options(num_workers, persistent=not is_stream(ds)))
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
    return DataLoader(ds, batch_size=batch_size, collate_fn=collator, generator=own_generator(0), pin_memory=pin,
                      **worker_options(num_workers, persistent=not isinstance(ds, IterableDataset)))


def worker_options(num_workers: int, persistent: bool) -> dict[str, Any]:
    """DataLoader keywords for `num_workers`, each worker collating 2 batches ahead. `persistent` (map-style
    data): the workers live as long as the loader, so a new epoch or the next evaluation does not start
    them again; a stream's workers are started anew for each pass, from the stream as it is then."""
    if num_workers == 0:
        return {"num_workers": 0}
    return {"num_workers": num_workers, "persistent_workers": persistent, "prefetch_factor": 2}


def loader_workers(asked: int | None, device_type: str, stream: bool, cpus: int) -> int:
    """--dataloader_num_workers, or its default: 2 workers on a CUDA device for map-style or prepared data
    when the process has `cpus` >= 3 (the training thread keeps one), else 0 (DataConfig says why)."""
    if asked is not None:
        return asked
    return 2 if device_type == "cuda" and not stream and cpus >= 3 else 0
