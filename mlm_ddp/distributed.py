"""The one place that reads launcher environment variables (accelerate launch / torchrun / Slurm)."""

from __future__ import annotations

import os


def local_world_size() -> int:
    """Processes started on this node by the launcher (1 when run without one)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")  # set by torchrun, which accelerate launch runs
    return max(int(value), 1) if value.isdigit() else 1


def usable_cores() -> int:
    """CPU cores this process may run on (respects taskset, cgroups' cpusets, Slurm's binding)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cpu_threads_per_process(requested: int | None) -> int:
    """Intra-op threads for a CPU run: the request, else this node's cores split among its processes.

    `accelerate launch` without a config exports OMP_NUM_THREADS=1 (measured: the default job ran
    1.4x slower on 2 cores); torch.set_num_threads(this) undoes that for CPU training.
    """
    if requested is not None:
        return requested
    return max(usable_cores() // local_world_size(), 1)
