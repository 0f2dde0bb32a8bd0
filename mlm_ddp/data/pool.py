"""The tokenizing processes of one `python -m mlm_ddp.prepare` task: what a worker does to one chunk of
texts (`Packer`), and the workers that do it in order with a bounded read-ahead (`Workers`).
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from datasets import Features, Sequence, Value

from mlm_ddp.data.pack import tokenize_and_pack


@dataclass(frozen=True)
class Packer:
    """What a worker does to one chunk (picklable; a worker process gets it once)."""

    tokenizer: Any
    max_seq_length: int
    word_continues: bool
    line_by_line: bool
    id_type: str  # the smallest unsigned type that holds every token id

    def schema(self) -> Features:
        columns = {"input_ids": Sequence(Value(self.id_type))}
        if self.word_continues:
            columns["word_continues"] = Sequence(Value("uint8"))
        return Features(columns)

    def table(self, texts: list[str]) -> pa.Table | None:
        packed = tokenize_and_pack(texts, self.tokenizer, self.max_seq_length, self.word_continues,
                                   self.line_by_line)
        if not packed["input_ids"]:
            return None
        return pa.table({name: pa.array(rows, type=pa.list_(pa.from_numpy_dtype(
            np.dtype(self.id_type if name == "input_ids" else "uint8")))) for name, rows in packed.items()})

    def __call__(self, chunk: tuple[list[str], list[bool]]) -> tuple[pa.Table | None, pa.Table | None, int]:
        """(train blocks, held-out blocks, non-blank texts) of one chunk."""
        texts, held = chunk
        kept = sum(1 for t in texts if isinstance(t, str) and t.strip())
        return (self.table([t for t, h in zip(texts, held, strict=True) if not h]),
                self.table([t for t, h in zip(texts, held, strict=True) if h]), kept)


class Workers:
    """`packer` on `count` processes, made once per task: `map` runs it over items in order, with at
    most 2 per worker in flight (Pool.imap would read the whole input ahead); one worker runs it here.
    A worker that dies (killed for memory) fails the task with WorkerDied, where a multiprocessing.Pool
    would wait for its result forever."""

    def __init__(self, packer: Packer, count: int) -> None:
        self.packer, self.count, self.pool = packer, count, None

    def __enter__(self) -> Workers:
        if self.count > 1:
            context = multiprocessing.get_context("spawn")  # a fork would copy the tokenizer's thread state
            self.pool = ProcessPoolExecutor(self.count, mp_context=context, initializer=_set_packer,
                                            initargs=(self.packer,))
        return self

    def __exit__(self, *_exc: Any) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def map(self, items: Iterator[Any]) -> Iterator[Any]:
        if self.pool is None:
            yield from map(self.packer, items)
            return
        pending: deque = deque()
        try:
            for item in items:
                pending.append(self.pool.submit(_pack, item))
                if len(pending) >= 2 * self.count:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool as err:
            raise WorkerDied(f"a tokenizing worker process died ({err}): killed for memory? A warning above names "
                             "any text long enough; lower --num_workers or split such texts, then run the same "
                             "command again (complete parts are kept)") from err


class WorkerDied(Exception):
    """A worker process of the task ended without its result."""


_PACKER: list[Packer] = []  # the packer of a worker process, set once by the pool's initializer


def _set_packer(packer: Packer) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: the pool is the parallelism
    _PACKER.append(packer)


def _pack(item: Any) -> Any:
    return _PACKER[0](item)
