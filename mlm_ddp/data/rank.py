"""One rank's pipeline, assembled: what it tokenizes (`rank_dataset`), its loaders with their masking
collators and the run's length (`rank_data`), and its batches on the device (`to_device`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from datasets import Dataset, IterableDataset
from torch.utils.data import DataLoader

from mlm_ddp.cluster.collectives import any_rank, gather_rows, patient_main_process_first
from mlm_ddp.config import DataConfig, TrainingConfig
from mlm_ddp.data.epochs import eval_loader, loader_workers, train_loader
from mlm_ddp.data.feed import TrainFeed, epoch_steps
from mlm_ddp.data.masking import EVAL_SPLIT, TRAIN_SPLIT, MaskingCollator
from mlm_ddp.data.mixed_stream import MixedStream
from mlm_ddp.data.mixture import MixedBlocks, Mixture, mixture_loader
from mlm_ddp.data.pack import describe_sequences, pack_stats, tokenize_dataset
from mlm_ddp.data.stream import (
    PackedStream,
    check_training_shards,
    is_stream,
    plan_stream_split,
    shard_stream,
    stream_sharding,
)
from mlm_ddp.data.surface import character_table
from mlm_ddp.data.text import AnyDataset
from mlm_ddp.errors import BadInput


def _first_sequences(ds: Dataset, limit: int | None) -> Dataset:
    """The first `limit` tokenized sequences (run_mlm.py's --max_train_samples: after packing)."""
    return ds if limit is None else ds.select(range(min(limit, len(ds))))


def rank_dataset(raw: AnyDataset, tokenizer: Any, cfg: DataConfig, rank: int, world_size: int,
                 shuffle_seed: int | None = None) -> AnyDataset | PackedStream:
    """What this rank tokenizes: its own part of a raw stream (a PackedStream when it is training
    data, i.e. shuffled), or the whole map-style split (which the samplers shard, so that every
    rank shares the one cached tokenization)."""
    if isinstance(raw, IterableDataset):
        if shuffle_seed is not None:
            check_training_shards(raw, rank, world_size, cfg)
        split = plan_stream_split(raw, world_size)
        part = shard_stream(raw, rank, world_size)
        if shuffle_seed is not None:
            return PackedStream(part, tokenizer, cfg, shuffle_seed, split=split.kind,
                                part_bytes=None if split.part_bytes is None else split.part_bytes[rank])
        return tokenize_dataset(part, tokenizer, cfg)
    limit = cfg.max_train_samples if shuffle_seed is not None else cfg.max_eval_samples
    if cfg.prepared_data is not None or is_blocks(raw, cfg.text_column):  # blocks, memory-mapped (data.prepared)
        return _first_sequences(raw, limit)
    return _first_sequences(tokenize_dataset(raw, tokenizer, cfg), limit)


def is_blocks(raw: Dataset, text_column: str) -> bool:
    """A prepared folder's blocks (a mixture's source, or its held-out share), not texts."""
    columns = raw.column_names or []
    return "input_ids" in columns and text_column not in columns


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The batch's tensors on `device`; its other values (the collator's `padded` flag) as they are."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@dataclass
class RankData:
    """This rank's training and evaluation loaders, and the run's length in optimizer steps."""

    train_ds: Any
    train_loader: DataLoader
    train_collator: MaskingCollator
    eval_loader: DataLoader | dict[str, DataLoader] | None  # {name: loader}: several held-out sources
    total_steps: int
    note: str  # what the start-up log says about the data


def rank_data(data: DataConfig, training: TrainingConfig, tokenizer: Any, raw_train: AnyDataset,
              raw_eval: AnyDataset | dict[str, AnyDataset] | None, accelerator: Any, preprocessing_timeout: int,
              layout_batch: int | None = None) -> RankData:
    """Tokenize and pack (the main process first, the others then load its cache), and this rank's
    loaders with their masking collators; `layout_batch`: see `train_loader`."""
    rank, world = accelerator.process_index, accelerator.num_processes
    refused: BadInput | None = None
    with patient_main_process_first(accelerator, preprocessing_timeout):
        def part(raw: AnyDataset, config: DataConfig) -> Any:
            return rank_dataset(raw, tokenizer, config, rank, world, shuffle_seed=training.seed)

        try:
            train_ds = train_dataset(data, training, raw_train, part, rank, world)
        except BadInput as err:  # said once every rank knows, below: a rank that went on would wait for it
            refused = err
        if refused is not None:
            raw_eval = None
        if isinstance(raw_eval, dict):  # several held-out sources: each tokenized, packed and sharded on its
            # own, so that its blocks and masks are those it has as the only --validation_file
            eval_ds = {name: rank_dataset(raw, tokenizer, data, rank, world) for name, raw in raw_eval.items()}
        else:
            eval_ds = None if raw_eval is None else rank_dataset(raw_eval, tokenizer, data, rank, world)
    # a stream's shards are checked by the ranks that read them (stream.check_training_shards): all agree
    if data.streaming and world > 1 and any_rank(accelerator, refused is not None):
        raise refused or BadInput("--streaming: another rank's part of the training stream is refused; its line "
                                  "says why")
    if refused is not None:
        raise refused
    common = dict(whole_word_mask=data.whole_word_mask, seed=training.seed,
                  pad_to=data.max_seq_length if data.pad_to_max_length else 0)
    train_collator = MaskingCollator.for_tokenizer(
        tokenizer, split=TRAIN_SPLIT, mlm_probability=data.mlm_probability, mask_replace_prob=data.mask_replace_prob,
        random_replace_prob=data.random_replace_prob, **common)
    # evaluation: its own rate and BERT's 80/10/10 (the collator's defaults), whatever rate and split the
    # training masks with, so that runs of other training rates are scored on the same held-out inputs. The
    # whole-word setting is shared, since it changes what one masked position is (a word, not a token): runs
    # are compared at equal --whole_word_mask (docs/data.md, "Masking rates: training and evaluation"). The
    # characters its masked tokens cover give bits per character, comparable across tokenizers.
    eval_collator = MaskingCollator.for_tokenizer(tokenizer, split=EVAL_SPLIT, characters=character_table(tokenizer),
                                                  mlm_probability=data.eval_mlm_probability, **common)
    pin = accelerator.device.type == "cuda"
    workers = loader_workers(data.dataloader_num_workers, accelerator.device.type, is_stream(train_ds),
                             len(os.sched_getaffinity(0)))
    make_loader = mixture_loader if isinstance(train_ds, MixedBlocks) else train_loader
    train_dl = make_loader(train_ds, train_collator, training.per_device_train_batch_size, rank, world,
                           training.seed, workers, layout_batch, pin)
    def held_out(ds: Any) -> DataLoader:
        return eval_loader(ds, eval_collator, training.per_device_eval_batch_size, rank, world,
                           workers, pin)

    if isinstance(eval_ds, dict):
        eval_dl = {name: held_out(ds) for name, ds in eval_ds.items()}
    else:
        eval_dl = None if eval_ds is None else held_out(eval_ds)
    if isinstance(train_ds, MixedStream):
        shares = ", ".join(f"{n} {s:.1%}" for n, s in zip(train_ds.names, train_ds.shares, strict=True))
        return RankData(train_ds, train_dl, train_collator, eval_dl, training.max_train_steps,
                        f"streaming a mixture of {len(train_ds.parts)} sources ({shares} of the blocks, each "
                        f"block's source fixed by its global position; each source's texts split over the ranks "
                        f"as one stream's), tokenized on the fly")
    if is_stream(train_ds):
        return RankData(train_ds, train_dl, train_collator, eval_dl, training.max_train_steps,
                        f"streaming, tokenized on the fly; {stream_sharding(raw_train.num_shards, world)}; "
                        f"{plan_stream_split(raw_train, world).note()}")
    sampler, seq = train_dl.batch_sampler, data.max_seq_length
    total_steps = training.max_train_steps or epoch_steps(
        training.num_train_epochs, sampler.epoch_blocks, sampler.global_batch * training.gradient_accumulation_steps)
    layout = "" if sampler.layout_batch == sampler.global_batch else (
        f" (the epochs keep the layout of the run that began, {sampler.layout_batch} per micro-batch)")
    if isinstance(train_ds, MixedBlocks):
        mix = train_ds.describe(total_steps * sampler.global_batch * training.gradient_accumulation_steps)
        return RankData(train_ds, train_dl, train_collator, eval_dl, total_steps,
                        f"{mix}; an epoch is a pass over the source of the largest weight, "
                        f"{sampler.batches_per_epoch:g} micro-batches per rank{layout}")
    return RankData(train_ds, train_dl, train_collator, eval_dl, total_steps,
                    f"{describe_sequences(pack_stats(train_ds, seq), data)}, {sampler.batches_per_epoch:g} "
                    f"micro-batches per epoch per rank, {sampler.padding} sequences repeated to fill the last "
                    f"global batch{layout}; rank r takes slice r of every global batch")


def train_dataset(data: DataConfig, training: TrainingConfig, raw_train: AnyDataset, part: Callable[..., Any],
                  rank: int, world: int) -> Any:
    """This rank's training data: `part(raw, config)` of one source, or of each source of a mixture."""
    if isinstance(raw_train, Mixture) and data.streaming:  # each source this rank's part of its stream
        return MixedStream([part(raw, config) for raw, config in zip(raw_train.raw, raw_train.configs, strict=True)],
                           raw_train.names, raw_train.shares, training.per_device_train_batch_size, rank, world)
    if isinstance(raw_train, Mixture):  # each source packed on its own, then mixed by global block (data.mixture)
        return MixedBlocks(raw_train.sources(part), training.seed)
    return part(raw_train, data)


def train_feed(data: RankData, accumulation: int, state: Any, stream_state: dict | None, accelerator: Any,
               collective: Callable[[str], AbstractContextManager]) -> TrainFeed:
    """The feed of optimizer-step windows from a checkpoint's data position (`state`, its counters) and
    this rank's saved stream position. A stream's feed agrees on every window and epoch end: each such
    collective is named first through `collective` (the heartbeat's, which this package does not import)."""

    def ran_out(flag: bool) -> bool:
        with collective("the all-reduce of the stream's ran-out flags"):
            return any_rank(accelerator, flag)

    def gathered(values: list[float]) -> list[list[float]]:
        with collective("the gather of every rank's account of the stream's epoch"):
            return gather_rows(accelerator, values)

    feed = TrainFeed(data.train_loader, data.train_collator, accumulation, state.epoch, state.batch_in_epoch, ran_out,
                     stream_state, gathered, state.block_in_epoch, state.sources)
    if feed.stream and state.step < data.total_steps:  # only reading tells whether a stream fills a step
        feed.prime()  # before anything is written
    return feed
