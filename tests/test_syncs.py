"""Host-device syncs in the hot loop (issue 30): counted on the CPU, where nothing syncs, by the
operations that would sync on a CUDA device. A torch dispatch mode sees every aten call inside one
optimizer step (train.agree_on_step and step.train_step, forward and backward included): scalar reads
(`.item()`, `int()`, `bool()`: aten._local_scalar_dense, is_nonzero), data-dependent shapes (nonzero,
masked_select, indexing or index_put with a boolean mask); `.tolist()`, which a dispatch mode does not
see on a CPU, is counted by wrapping it. The data loader's collation (numpy, on the host) is outside.

Issue 30's budget is one sync per optimizer step. The hot loop is not there yet: this test measures the
count per place, prints it, and holds it at today's ceiling so that no change adds one; the GPU suite
(tests/gpu) checks the same with torch.cuda.set_sync_debug_mode."""

from __future__ import annotations

import collections
import functools
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mlm_ddp.train
from mlm_ddp.config import parse_args
from tests.conftest import tiny_args

SCALAR_READS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.equal.default"}
DATA_DEPENDENT = {"aten.nonzero.default", "aten.masked_select.default"}
BOOLEAN_INDEXED = ("aten.index.Tensor", "aten.index_put.default", "aten.index_put_.default",
                   "aten._index_put_impl_.default")
# measured at accumulation 2: 16 before the collator gave the loss positions, 2 after; the budget is 1
SYNC_CEILING_PER_STEP = 2


def place() -> str:
    """The innermost mlm_ddp line on the stack."""
    frames = [f for f in traceback.extract_stack() if "/mlm_ddp/" in f.filename]
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"


class CountSyncs(TorchDispatchMode):
    def __init__(self, seen: collections.Counter) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        syncs = name in SCALAR_READS or name in DATA_DEPENDENT or (
            name in BOOLEAN_INDEXED and any(i is not None and i.dtype == torch.bool for i in args[1]))
        if syncs:
            self.seen[f"{name.removeprefix('aten.')} {place()}"] += 1
        return func(*args, **(kwargs or {}))


def counted(fn, seen: collections.Counter):
    tolist = torch.Tensor.tolist

    def counting_tolist(self: torch.Tensor) -> list:
        seen[f"tolist {place()}"] += 1
        return tolist(self)

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        torch.Tensor.tolist = counting_tolist
        try:
            with CountSyncs(seen):
                return fn(*args, **kwargs)
        finally:
            torch.Tensor.tolist = tolist

    return inner


def test_syncs_per_optimizer_step_stay_under_the_ceiling(tiny_model: Path, corpus: dict, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    seen: collections.Counter = collections.Counter()
    monkeypatch.setattr(mlm_ddp.train, "train_step", counted(mlm_ddp.train.train_step, seen))
    monkeypatch.setattr(mlm_ddp.train, "agree_on_step", counted(mlm_ddp.train.agree_on_step, seen))
    steps = 6
    mlm_ddp.train.train(parse_args(tiny_args(tiny_model, corpus, tmp_path, "--max_train_steps", str(steps),
                                             "--gradient_accumulation_steps", "2", "--report", "false")))
    per_step = sum(seen.values()) / steps
    print(f"syncs per optimizer step (accumulation 2): {per_step:g}; by place: "
          + ", ".join(f"{where} x{count / steps:g}" for where, count in seen.most_common()))
    assert seen, "nothing counted: the dispatch mode saw no step"
    assert per_step <= SYNC_CEILING_PER_STEP
