"""torch's names that are not its public API, which mlm_ddp reaches (see mlm_ddp/compat/__init__.py).

Each function here is the only place in mlm_ddp that touches its name; each `present` looks the name up
when it is called (a release that moved it fails `check`, never a run). torch is imported inside the
functions: `check("numpy")` and the like must not pay torch's import.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from mlm_ddp.compat import Reach

C10D = "torch.distributed.distributed_c10d"
C10D_NATIVE = "torch._C._distributed_c10d"


def _has(module: str, name: str) -> bool:
    return hasattr(importlib.import_module(module), name)


# --- process groups -----------------------------------------------------------------------------------------------

def set_group_timeout(timeout: timedelta, group: Any = None) -> None:
    """The timeout of `group`'s later collectives (None: the default group's). torch has no public call that
    changes a formed group's timeout; every backend of the group takes it (gloo and NCCL)."""
    importlib.import_module(C10D)._set_pg_timeout(timeout, group)


def default_store() -> Any:
    """The store the default process group was formed on, as the group holds it (its prefixes included).
    Its public counterpart, `ProcessGroup.get_group_store()`, came with torch's group splitting, after the
    torch floor pyproject declares; the store `join_process_group` made is not at hand where the group was
    kept from an earlier run of the process."""
    return importlib.import_module(C10D)._get_default_store()


def flight_recorder_dump() -> bytes:
    """This process's Flight Recorder ring, every backend's, as the pickle torch's NCCL dump writes on a
    timeout. torch.distributed.flight_recorder is its analyzer (`torchfrtrace`), with no dump of its own."""
    return importlib.import_module(C10D_NATIVE)._dump_fr_trace()


# --- the CPU's native bf16 ----------------------------------------------------------------------------------------

def cpu_has_avx512_bf16() -> bool:
    """x86: the CPU has the AVX512-BF16 instructions (cpuinfo's answer)."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported())


def cpu_has_amx_tile() -> bool:
    """x86: the CPU has AMX tiles, which compute bf16 (cpuinfo's answer)."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def onednn_computes_bf16() -> bool:
    """oneDNN's own test that this CPU computes bf16 (on Arm: the bf16 instructions; it emulates none there)."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _has_onednn_bf16_op() -> bool:
    import torch

    return hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported")  # an op namespace resolves names on lookup


# --- mixed precision and the optimizer step -----------------------------------------------------------------------

def loss_scale(scaler: Any) -> Any:
    """A GradScaler's current scale, the tensor itself on its device: `get_scale()` reads it back to the host
    (a sync). GradScaler keeps it in `_scale` once it scaled a loss, and `update` changes it there."""
    return scaler._scale


def _scaler_keeps_its_scale() -> bool:
    import torch

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    scaler.scale(torch.ones(()))
    scale = getattr(scaler, "_scale", None)
    return isinstance(scale, torch.Tensor) and scale.item() == scaler.get_scale() == 2.0


@contextmanager
def skipped_where_found_inf(optimizer: Any, found_inf: Any) -> Iterator[None]:
    """Inside the block, a fused Adam/AdamW `optimizer` (torch's own, not a wrapper) skips its step on the
    device where `found_inf` (a float tensor, ()) is non-zero: the attribute GradScaler hands fused optimizers.
    The optimizer's public step has no argument for it."""
    optimizer.found_inf = found_inf
    try:
        yield
    finally:
        del optimizer.found_inf


def _adam_steps_read_found_inf() -> bool:
    """The functional Adam and AdamW that their `step` calls take `found_inf`. Read off the functions'
    signatures, not the methods' source, so that a `step` wrapped by a profiler or a test is not taken for a
    release that moved the name."""
    from torch.optim import adam, adamw

    return all("found_inf" in inspect.signature(function).parameters for function in (adam.adam, adamw.adamw))


# --- learning-rate schedules --------------------------------------------------------------------------------------

# keys of an LRScheduler's state_dict() (its attributes): the steps counted, and each group's rate after the
# last step; scheduler.json holds them, and a resume takes them up through load_state_dict()
STEP_COUNT = "_step_count"
LAST_LR = "_last_lr"


def _schedule_state_carries(key: str) -> bool:
    """LRScheduler keeps `key` as an attribute, and LambdaLR's state_dict() and load_state_dict() carry its
    attributes. Read from the source: a scheduler is built on an optimizer, whose first construction imports
    torch._dynamo (seconds, at every start)."""
    from torch.optim import lr_scheduler

    return (f"self.{key}" in inspect.getsource(lr_scheduler.LRScheduler)
            and "self.__dict__.items()" in inspect.getsource(lr_scheduler.LambdaLR.state_dict)
            and "self.__dict__.update(state_dict)" in inspect.getsource(lr_scheduler.LambdaLR.load_state_dict))


def _last_rates_carried() -> bool:
    """As `_schedule_state_carries`, and `get_last_lr()` gives what a load put there."""
    from torch.optim import lr_scheduler

    return (_schedule_state_carries(LAST_LR)
            and f"return self.{LAST_LR}" in inspect.getsource(lr_scheduler.LRScheduler.get_last_lr))


# --- torch.distributed.checkpoint's metadata ----------------------------------------------------------------------

# the private globals a sharded checkpoint's `.metadata` pickle references (beside the public ones of
# torch.distributed.checkpoint.metadata): what checkpoint.py's safe unpickler allows
DCP_METADATA_PRIVATE = frozenset({("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                                  ("torch.serialization", "_get_layout")})


REACHES: list[Reach] = [
    Reach("torch", f"{C10D}._set_pg_timeout", lambda: _has(C10D, "_set_pg_timeout"),
          "a formed group's collectives wait --save_timeout during a checkpoint, --ddp_timeout again after"),
    Reach("torch", f"{C10D}._get_default_store", lambda: _has(C10D, "_get_default_store"),
          "the hang watchdog's own connection to the process group's store, and the store's --ddp_timeout"),
    Reach("torch", f"{C10D_NATIVE}._dump_fr_trace", lambda: _has(C10D_NATIVE, "_dump_fr_trace"),
          "the Flight Recorder's dump of a rank whose collective failed or hung"),
    Reach("torch", "torch.cpu._is_avx512_bf16_supported", lambda: _has("torch.cpu", "_is_avx512_bf16_supported"),
          "--mixed_precision auto on an x86 CPU: bf16 only where it computes it natively"),
    Reach("torch", "torch.cpu._is_amx_tile_supported", lambda: _has("torch.cpu", "_is_amx_tile_supported"),
          "--mixed_precision auto on an x86 CPU: bf16 only where it computes it natively"),
    Reach("torch", "operator torch.ops.mkldnn._is_mkldnn_bf16_supported", _has_onednn_bf16_op,
          "--mixed_precision auto on an Arm CPU: bf16 only where it computes it natively"),
    Reach("torch", "torch.amp.GradScaler._scale", _scaler_keeps_its_scale,
          "fp16: whether the gradient scaler skipped a step, read without a host sync"),
    Reach("torch", "torch.optim.adam.adam(found_inf=...)", _adam_steps_read_found_inf,
          "fused AdamW skips a non-finite step on the device, without a host sync"),
    Reach("torch", f"torch.optim.lr_scheduler.LRScheduler.{STEP_COUNT}", lambda: _schedule_state_carries(STEP_COUNT),
          "a resumed run's schedule takes up the checkpoint's step count (scheduler.json)"),
    Reach("torch", f"torch.optim.lr_scheduler.LRScheduler.{LAST_LR}", _last_rates_carried,
          "a resumed run's schedule takes up the checkpoint's rates, and checks a resume moves none (scheduler.json)"),
    *(Reach("torch", f"{module}.{name}", lambda module=module, name=name: _has(module, name),
            "a sharded checkpoint's metadata is unpickled allowing only the classes it holds")
      for module, name in sorted(DCP_METADATA_PRIVATE)),
]
