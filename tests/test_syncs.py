"""Host-device syncs in the hot loop (issue 30): counted on the CPU, where nothing syncs, by the
operations that would sync on a CUDA device. A torch dispatch mode sees every aten call of the training
loop (`train.fit`, forward and backward included): scalar reads (`.item()`, `int()`, `bool()`:
aten._local_scalar_dense, is_nonzero), data-dependent shapes (nonzero, masked_select, indexing or
index_put with a boolean mask); `.tolist()`, which a dispatch mode does not see on a CPU, is counted by
wrapping it. The collator's work (masking.py, positions.py, the data package) is left out: on a GPU run it runs on
the host, before the batch is copied to the device. The heartbeat says which step each count belongs to.

Issue 30's budget: one sync per optimizer step on the steps that neither log, evaluate nor save (the
all-reduce of the step's masked tokens and stop votes, read once). Before the budget was built: 16.
The GPU suite (tests/gpu) checks the same with torch.cuda.set_sync_debug_mode."""

from __future__ import annotations

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
SYNC_BUDGET = 1


HOST_SIDE = ("masking.py", "positions.py", "data/")  # the collator and the loaders: host tensors


def place() -> str:
    """The innermost mlm_ddp line on the stack, as its path under mlm_ddp/ (data/epochs.py:12)."""
    frames = [f for f in traceback.extract_stack() if "/mlm_ddp/" in f.filename]
    return f"{frames[-1].filename.rsplit('/mlm_ddp/', 1)[1]}:{frames[-1].lineno}" if frames else "?"


class CountSyncs(TorchDispatchMode):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        syncs = name in SCALAR_READS or name in DATA_DEPENDENT or (
            name in BOOLEAN_INDEXED and any(i is not None and i.dtype == torch.bool for i in args[1]))
        if syncs and not place().startswith(HOST_SIDE):
            self.seen.append(f"{name.removeprefix('aten.')} {place()}")
        return func(*args, **(kwargs or {}))


def test_the_hot_loop_syncs_once_per_optimizer_step(tiny_model: Path, corpus: dict, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from mlm_ddp.train import Hooks

    seen: list[str] = []
    first: dict[int, int] = {}  # step -> syncs counted when the loop entered it

    def at(beat) -> None:
        first.setdefault(beat.step, len(seen))

    tolist = torch.Tensor.tolist

    def counting_tolist(self: torch.Tensor) -> list:
        if not place().startswith(HOST_SIDE):
            seen.append(f"tolist {place()}")
        return tolist(self)

    fit = mlm_ddp.train.fit

    def counted_fit(*args, **kwargs):
        monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
        try:
            with CountSyncs(seen):
                return fit(*args, **kwargs)
        finally:
            monkeypatch.setattr(torch.Tensor, "tolist", tolist)

    monkeypatch.setattr(mlm_ddp.train, "fit", counted_fit)
    steps = 8
    mlm_ddp.train.train(parse_args(tiny_args(tiny_model, corpus, tmp_path, "--max_train_steps", str(steps),
                                             "--gradient_accumulation_steps", "2", "--logging_steps", "1000",
                                             "--report", "false")), Hooks(on_beat=at))
    # steps 2 .. steps-1: neither the first (the evaluation before training) nor the last (log, eval, save)
    per_step = {step: seen[first[step]:first[step + 1]] for step in range(2, steps)}
    print("syncs per optimizer step (accumulation 2): "
          + "; ".join(f"step {s}: {len(v)} ({', '.join(sorted(set(v)))})" for s, v in per_step.items()))
    assert all(per_step.values()), "nothing counted: the dispatch mode saw no step"
    assert max(len(v) for v in per_step.values()) <= SYNC_BUDGET
