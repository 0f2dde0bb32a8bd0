"""Run under `accelerate launch` by test_topology.py: which samples does each rank train on?

Builds the training loaders with the functions `train()` uses, in the same order (`shard_stream`
then shuffle as in `rank_dataset`, `train_loader`, `TrainFeed` with a real all-reduce), over data
whose samples are their own ids; runs one epoch of optimizer-step windows plus the first window of
the next, and writes `<out>/rank<R>.json` with the ids per step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from datasets import Dataset

from mlm_ddp.cluster import launcher as distributed
from mlm_ddp.data.epochs import train_loader
from mlm_ddp.data.feed import TrainFeed
from mlm_ddp.data.stream import shard_stream


def ids_of(rows: list[dict]) -> list[int]:
    return [row["id"] for row in rows]


def one_epoch(accelerator: Accelerator, ds, batch: int, accumulation: int) -> dict:
    rank, world = accelerator.process_index, accelerator.num_processes

    def any_rank(flag: bool) -> bool:
        return accelerator.reduce(torch.tensor(float(flag)), reduction="sum").item() > 0

    loader = train_loader(ds, ids_of, batch, rank, world, seed=7, num_workers=0)
    feed = TrainFeed(loader, ids_of, accumulation, epoch=0, start=0, any_rank=any_rank)
    steps: list[list[int]] = []
    while True:
        window = [i for micro in feed.next_window() for i in micro]
        if feed.epoch == 1 and feed.index > 0:  # a stream's end was agreed: this window opens epoch 1
            next_epoch_first = window
            break
        steps.append(window)
        if feed.epoch == 1:  # map-style: epoch 0 ended exactly with this window
            next_epoch_first = [i for micro in feed.next_window() for i in micro]
            break
    return {"steps": steps, "next_epoch_first": next_epoch_first, "dropped": feed.dropped_batches}


def main(argv: list[str] | None = None) -> int:
    out, n = Path((argv or sys.argv[1:])[0]), int((argv or sys.argv[1:])[1])
    topo = distributed.detect()
    accelerator = Accelerator(cpu=True)
    distributed.check_accelerator(topo, accelerator.num_processes, str(accelerator.distributed_type))
    rank, world = accelerator.process_index, accelerator.num_processes
    table = Dataset.from_dict({"id": list(range(n))})
    # a stream of 3 shards over 2 ranks: split text by text, ranks' parts differ in length
    raw_stream = table.to_iterable_dataset(num_shards=3)
    stream = shard_stream(raw_stream, rank, world).shuffle(seed=7, buffer_size=8)
    record = {
        "world": world,
        "map": one_epoch(accelerator, table, batch=4, accumulation=1),
        "stream": one_epoch(accelerator, stream, batch=4, accumulation=2),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
