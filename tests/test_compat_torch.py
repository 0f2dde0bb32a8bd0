"""torch's and accelerate's reaches that tests/test_compat.py cannot take away by deleting a module attribute
(instance attributes, an operator, what a method's source or a class's state shows): each one made absent as a
release that moved it would, and `check` ends in one line naming it. And the seam's functions do what their
callers rely on, on the installed stack."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from mlm_ddp import compat
from mlm_ddp.cluster import flight
from mlm_ddp.compat import accelerate as compat_accelerate
from mlm_ddp.compat import torch as compat_torch
from mlm_ddp.errors import BadInput
from tests.conftest import REPO


def refusal(library: str) -> str:
    """The one line `check(library)` ends in."""
    with pytest.raises(BadInput) as refused:
        compat.check(library)
    line = str(refused.value)
    assert "\n" not in line, line
    return line


def assert_names(line: str, library: str, name: str) -> None:
    assert f"{library} {compat.installed_version(library)} has no {name} (" in line, line
    assert f"tested on {compat.tested_range(library)}" in line, line


def test_the_onednn_operator_taken_away(monkeypatch: pytest.MonkeyPatch) -> None:
    # a build whose mkldnn namespace has no such operator (an op namespace resolves names on lookup: deleting
    # the attribute would not take it away)
    monkeypatch.setattr(torch.ops, "mkldnn", types.SimpleNamespace())
    assert_names(refusal("torch"), "torch", "operator torch.ops.mkldnn._is_mkldnn_bf16_supported")


class ScaleKeptElsewhere(torch.amp.GradScaler):
    """A GradScaler that keeps its scale under another name."""

    def scale(self, outputs):  # noqa: ANN001, ANN201 - GradScaler's own signature
        scaled = super().scale(outputs)
        self.kept, self._scale = self._scale, None
        return scaled

    def get_scale(self) -> float:
        return float(self.kept.item())


def test_the_scalers_scale_tensor_taken_away(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.amp, "GradScaler", ScaleKeptElsewhere)
    assert_names(refusal("torch"), "torch", "torch.amp.GradScaler._scale")


def test_adam_steps_that_read_no_found_inf(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.optim import adamw

    def functional(params: list, grads: list, *args: object, **kwargs: object) -> None:
        return None

    monkeypatch.setattr(adamw, "adamw", functional)
    assert_names(refusal("torch"), "torch", "torch.optim.adam.adam(found_inf=...)")


def test_a_wrapped_optimizer_step_is_no_moved_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A profiler's or a test's wrapper around AdamW.step (no functools.wraps) leaves the check passing."""
    step = torch.optim.AdamW.step

    def recorded(self: torch.optim.Optimizer, *args: object, **kwargs: object) -> object:
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recorded)
    compat.check("torch")


def test_a_schedule_state_that_no_longer_carries_its_attributes(monkeypatch: pytest.MonkeyPatch) -> None:
    def state_dict(self: torch.optim.lr_scheduler.LambdaLR) -> dict:
        return {"last_epoch": self.last_epoch}

    monkeypatch.setattr(torch.optim.lr_scheduler.LambdaLR, "state_dict", state_dict)
    assert_names(refusal("torch"), "torch", f"torch.optim.lr_scheduler.LRScheduler.{compat_torch.STEP_COUNT}")


def test_last_rates_read_from_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    def get_last_lr(self: torch.optim.lr_scheduler.LRScheduler) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    monkeypatch.setattr(torch.optim.lr_scheduler.LRScheduler, "get_last_lr", get_last_lr)
    assert_names(refusal("torch"), "torch", f"torch.optim.lr_scheduler.LRScheduler.{compat_torch.LAST_LR}")


def test_an_accelerator_state_that_turns_fsdp_on_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate.state import AcceleratorState

    def __init__(self: AcceleratorState, *args: object, **kwargs: object) -> None:  # noqa: N807
        self.parallelism = "fsdp"

    monkeypatch.setattr(AcceleratorState, "__init__", __init__)
    assert_names(refusal("accelerate"), "accelerate", "accelerate.state.AcceleratorState.distributed_type")


def test_a_partial_state_that_shares_no_state(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate.state import PartialState

    monkeypatch.delattr(PartialState, "_shared_state")
    assert_names(refusal("accelerate"), "accelerate", "accelerate.state.PartialState.distributed_type")


def test_an_accelerator_that_counts_micro_batches_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate import Accelerator

    def _do_sync(self: Accelerator) -> None:
        self.micro_batches = getattr(self, "micro_batches", 0) + 1

    monkeypatch.setattr(Accelerator, "_do_sync", _do_sync)
    assert_names(refusal("accelerate"), "accelerate", "accelerate.Accelerator.step")


def test_a_launch_parser_without_mixed_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    import accelerate.commands.launch as launch

    def launch_command_parser() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser()
        parser.add_argument("--config_file")
        parser.add_argument("training_script")
        return parser

    monkeypatch.setattr(launch, "launch_command_parser", launch_command_parser)
    assert_names(refusal("accelerate"), "accelerate", "accelerate.commands.launch.launch_command_parser")


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_a_fused_step_is_skipped_where_found_inf(cls: type[torch.optim.Optimizer]) -> None:
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    optimizer = cls([param], lr=0.1, fused=True)
    with compat_torch.skipped_where_found_inf(optimizer, torch.ones(())):
        optimizer.step()
    assert torch.equal(param.detach(), torch.ones(3)) and not hasattr(optimizer, "found_inf")
    with compat_torch.skipped_where_found_inf(optimizer, torch.zeros(())):
        optimizer.step()
    assert (param.detach() < 1).all() and not hasattr(optimizer, "found_inf")


def test_the_loss_scale_is_the_scalers_own_tensor() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    scale = compat_torch.loss_scale(scaler)
    assert isinstance(scale, torch.Tensor) and scale.item() == scaler.get_scale() == 4.0


def test_the_launch_arguments_as_accelerate_reads_them() -> None:
    read = compat_accelerate.launch_arguments(["--config_file", "x.yaml", "-m", "mlm_ddp.train",
                                               "--mixed_precision", "no"])
    assert read is not None and (read.config_file, read.mixed_precision) == ("x.yaml", None)
    assert compat_accelerate.launch_arguments(["--num_processes", "two", "train.py"]) is None
    assert compat_accelerate.default_config_file().endswith(".yaml")


GROUP_OF_ONE = """
import os, sys
from datetime import timedelta

import torch
import torch.distributed as dist

from mlm_ddp.cluster import flight, watchdog
from mlm_ddp.cluster.collectives import patient_collectives

dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1,
                        timeout=timedelta(seconds=5))
with patient_collectives(7, 5):
    dist.all_reduce(torch.ones(1))
dist.all_reduce(torch.ones(1))
store, _ = watchdog.store_of_process_group()
store.set("mlm_ddp/probe", "answered")
print(store.get("mlm_ddp/probe").decode(), flight.dump(os.environ, 0))
dist.destroy_process_group()
"""


def test_a_group_of_one_changes_its_timeout_answers_from_its_store_and_dumps_its_collectives(tmp_path: Path) -> None:
    """In a process of its own (torch reads the Flight Recorder's settings once per process): a gloo group
    whose collectives wait 7 s inside `patient_collectives` and 5 s after it, as the recorder's entries say;
    the watchdog's store of the group answers; the dump is the recorder's, where flight.py writes it."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_FR_BUFFER_SIZE": "100",
           "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "flight_recorder" / "rank_")}
    (tmp_path / "flight_recorder").mkdir()
    done = subprocess.run([sys.executable, "-c", GROUP_OF_ONE, str(tmp_path / "store")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    answered, path = done.stdout.splitlines()[-1].split()  # gloo may print its connections first
    assert answered == "answered" and Path(path) == tmp_path / "flight_recorder" / "rank_0"
    trace = pickle.loads(Path(path).read_bytes())
    waits = [entry["timeout_ms"] for entry in trace["entries"] if "all_reduce" in entry["profiling_name"]]
    assert waits == [7000, 5000], trace["entries"]
    assert flight.last_collectives(trace) and flight.summary(tmp_path).startswith("flight recorder: only rank 0")
