"""Which mixed precision a job trains in: the flag, else what the launcher was given, else `auto` from
the hardware (16-bit only where the device computes it natively), agreed once for the whole job (rank 0's)
before the Accelerator is made; and FSDP2's policy for it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mlm_ddp.cluster.launcher import Topology, parent_command_line
from mlm_ddp.compat import accelerate as compat_accelerate
from mlm_ddp.compat import torch as compat_torch


def agree_precision(mine: tuple[str, str], rank: int, gather: Callable[[Any], list[Any]]) -> tuple[str, str]:
    """One precision for the job: rank 0's. Every rank's own choice, gathered over the start-up group
    (`gather`: every rank's value in rank order, a collective; never the store, whose keys outlive a
    torchrun restart), and rank 0's taken; rank 0 names, in one line, every rank that would have chosen
    otherwise (`auto` on GPUs of another generation: a job split between bf16 and fp16 would not even agree
    on its gradients' dtype). A launcher's or a flag's precision is the same on every rank already."""
    from accelerate.logging import get_logger

    every = gather([*mine, os.uname().nodename])
    chosen, why, _ = every[0]
    apart = [(r, p, host) for r, (p, _, host) in enumerate(every) if p != chosen]
    if rank == 0 and apart:
        get_logger(__name__).warning(
            "precision %s for every rank (rank 0's: %s); %d rank(s) would have chosen otherwise: %s", chosen, why,
            len(apart), ", ".join(f"rank {r} on {host} {p}" for r, p, host in apart))
    return chosen, why


PRECISIONS = ("no", "fp16", "bf16")


# where accelerate launch takes its precision from when it was not given one on its command line
LAUNCHER_SOURCE = "accelerate launch (its --mixed_precision, --config_file or `accelerate config` file)"


def launcher_precision(env: Mapping[str, str] | None = None,
                       launch_argv: list[str] | None = None) -> tuple[str, str] | None:
    """(precision, where it was said) that `accelerate launch` was given, or None when it was given none.

    accelerate launch exports ACCELERATE_MIXED_PRECISION to its processes, and exports "no" also when
    nothing was said: "no" counts only when the launch command (`launch_argv`, by default the parent
    process's command line) or the config file it read says so.
    """
    value = (os.environ if env is None else env).get("ACCELERATE_MIXED_PRECISION")
    if not value:
        return None
    if value != "no":
        return value, LAUNCHER_SOURCE
    argv = parent_command_line() if launch_argv is None else launch_argv
    said = said_no(argv)
    return ("no", said) if said else None


def said_no(argv: list[str]) -> str | None:
    """Where an accelerate launch command line `argv` says mixed_precision "no": its flag, its
    --config_file, or the default config file of `accelerate config`; None if it does not."""
    import yaml

    starts = [i for i, part in enumerate(argv) if part == "launch" or part.endswith("accelerate.commands.launch")]
    if not starts:
        return None
    # accelerate's own parser: the training script's flags (ours) come after its script or -m module
    launch = compat_accelerate.launch_arguments(argv[starts[0] + 1:])
    if launch is None:
        return None
    if launch.mixed_precision == "no":
        return "accelerate launch --mixed_precision no"
    config = launch.config_file if launch.config_file is not None else compat_accelerate.default_config_file()
    try:
        with open(config) as handle:
            loaded = yaml.safe_load(handle) or {}
    except (OSError, yaml.YAMLError):
        return None
    return f"mixed_precision: no in {config}" if isinstance(loaded, dict) and loaded.get("mixed_precision") == "no" \
        else None


@dataclass(frozen=True)
class Hardware:
    """What the precision `auto` picks depends on, for the device this process trains on."""

    device_type: str  # "cuda" or "cpu"
    capability: tuple[int, int] | None = None  # the CUDA device's compute capability
    cpu_bf16: bool = False  # the CPU computes bf16 natively: AVX512-BF16 or AMX on x86, bf16 instructions on Arm


def hardware(topo: Topology) -> Hardware:
    """This process's device, read without creating a CUDA context: the capability comes from the device
    properties of this rank's own GPU (`torch.cuda.is_bf16_supported()` would allocate on cuda:0, from
    every rank, and counts emulated bf16 as supported)."""
    import torch

    if topo.cuda_devices:
        return Hardware("cuda", tuple(torch.cuda.get_device_capability(topo.device)))
    return Hardware("cpu", cpu_bf16=cpu_computes_bf16())


def cpu_computes_bf16() -> bool:
    """This CPU computes bf16 natively: AVX512-BF16 or AMX on x86; elsewhere oneDNN's own test (on Arm the bf16
    instructions: it emulates nothing there)."""
    import platform

    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return compat_torch.cpu_has_avx512_bf16() or compat_torch.cpu_has_amx_tile()
    return compat_torch.onednn_computes_bf16()


def auto_precision(hw: Hardware) -> tuple[str, str]:
    """(precision, why) for `--mixed_precision auto`: 16-bit only where the device computes it natively."""
    if hw.device_type == "cuda":
        major, minor = hw.capability or (0, 0)
        if major >= 8:
            return "bf16", f"compute capability {major}.{minor} computes bf16 natively"
        if major >= 7:
            return "fp16", (f"compute capability {major}.{minor} (V100, T4) has fp16 tensor cores and emulates bf16: "
                            "fp16 with a gradient scaler")
        return "no", f"compute capability {major}.{minor} has no tensor cores"
    if hw.cpu_bf16:
        return "bf16", "this CPU computes bf16 natively (AVX512-BF16 or AMX)"
    return "no", "this CPU has no native bf16 (AVX512-BF16 or AMX): bf16 would be emulated, several times slower"


def choose_precision(requested: str, launcher: tuple[str, str] | None, hw: Hardware) -> tuple[str, str]:
    """(precision, why): --mixed_precision; else what the launcher was given; else `auto_precision`.
    Refuses a launcher and a flag that disagree, and fp16 on a CPU (accelerate would train in fp32
    there without a word: it has no fp16 autocast or gradient scaler for the CPU)."""
    from mlm_ddp.errors import BadInput

    asked, where = launcher if launcher is not None else (None, "")
    if asked is not None and asked not in PRECISIONS:
        raise BadInput(f"{where} asks for mixed precision {asked!r}; mlm_ddp trains in {', '.join(PRECISIONS)}: "
                       "launch with --mixed_precision bf16 (or pass it to mlm_ddp)")
    if requested != "auto" and asked is not None and asked != requested:
        raise BadInput(f"--mixed_precision {requested} and the launcher's {asked} (from {where}) disagree: "
                       "give one of them, or the same value to both")
    if requested != "auto":
        precision, why = requested, f"--mixed_precision {requested}"
    elif asked is not None:
        precision, why = asked, f"from {where}"
    else:
        precision, why = auto_precision(hw)
        why = f"auto: {why}"
    if precision == "fp16" and hw.device_type != "cuda":
        raise BadInput(f"mixed precision fp16 ({why}) needs a CUDA GPU; on a CPU accelerate would train in fp32 "
                       "without saying so: use --mixed_precision bf16 or no")
    return precision, why


def fsdp2_policy(precision: str) -> Any:
    """FSDP2's mixed-precision policy for `precision` (None for fp32): parameters gathered in 16 bits
    for compute; gradients reduced in fp32, as DDP reduces autocast's fp32 gradients; and outputs not
    cast (accelerate's own policy casts the root's outputs to 16 bits, which would round the loss
    *sums* the model returns to bf16's 8-bit mantissa, or overflow them in fp16)."""
    if precision == "no":
        return None
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, output_dtype=None)

