"""Timing and memory of benchmark steps on any device, and where a GPU step's device time goes by kind of
kernel: what `mlm_ddp.bench` measures with (the figures, not the recipes)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mlm_ddp.loop.speed import synchronize

# a kernel's kind by its name (cuBLAS/CUTLASS GEMMs, cuDNN/flash attention, the fused AdamW, the rest)
KERNEL_KINDS = (("matmul", re.compile(r"gemm|cutlass|cublas|sm\d+_xmma|ampere_|hopper_|nvjet|matmul|aten::mm|addmm|bmm",
                                      re.I)),
                ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn.*(mha|attn)", re.I)),
                ("optimizer", re.compile(r"adam|multi_tensor|foreach|fused_adam", re.I)))


def device_seconds(device: torch.device, work: Callable[[], None], host: list[float] | None = None) -> float:
    """Seconds from now until the device has done what `work` queues: CUDA events around it on a GPU, read
    once after it (the host queues the steps ahead, as in training), the host's clock on a CPU. `host` gets
    the seconds the host took to queue it (on a CPU the same): below the device's, the host kept ahead."""
    synchronize(device)  # an empty queue: the start is now
    started = time.perf_counter()
    if device.type != "cuda":
        work()
        seconds = time.perf_counter() - started
        if host is not None:
            host.append(seconds)
        return seconds
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work()
    end.record()
    if host is not None:
        host.append(time.perf_counter() - started)
    end.synchronize()
    return start.elapsed_time(end) / 1000


def time_to_quality(reference: list[tuple[float, float]], candidate: list[tuple[float, float]]) -> dict[str, Any]:
    """Training seconds (a) takes to its final perplexity, and (b) to reach it (evaluated after each
    repeat, so a step resolution of --steps); their ratio, None where (b) never reaches it."""
    target, seconds_a = reference[-1][1], reference[-1][0]
    seconds_b = next((t for t, ppl in candidate if ppl <= target), None)
    return {"target_perplexity": target, "hf_s": seconds_a, "mlm_ddp_s": seconds_b,
            "ratio": seconds_a / seconds_b if seconds_b else None}


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new high-water mark: CUDA's allocator statistics, or the kernel's peak RSS of this process
    (Linux: writing 5 to /proc/self/clear_refs resets VmHWM). False where it cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_memory(device: torch.device, was_reset: bool) -> int | None:
    """Bytes: peak allocated on the GPU, or the process's peak RSS since the reset; None without a reset
    (the number would be the whole run's, not the recipe's)."""
    if not was_reset:
        return None
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    status = Path("/proc/self/status").read_text()
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")), None)


def max_known(a: int | None, b: int | None) -> int | None:
    return max((x for x in (a, b) if x is not None), default=None)


def kernel_kind(name: str) -> str:
    """matmul, attention, optimizer or elementwise (everything else: norms, activations, dropout, copies)."""
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "elementwise")


def seconds_by_kind(events: Any, device: torch.device) -> dict[str, float]:
    """Self time per kernel kind of a profiler's `key_averages()`: the device's on a GPU, the host's on a CPU."""
    field = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    kinds: dict[str, float] = {}
    for event in events:
        kind = kernel_kind(event.key)
        kinds[kind] = kinds.get(kind, 0.0) + getattr(event, field, 0.0) / 1e6
    return kinds
