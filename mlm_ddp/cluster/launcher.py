"""The one place that reads launcher environment variables: accelerate launch / torchrun, Slurm, Submitit.

`detect()` turns the environment into a `Topology` (who this process is, where its peers meet, which
Slurm job it belongs to, why we think so, and which launcher settings are likely to fail the job);
`requeue()` puts that job back in Slurm's queue; `export_for_accelerate()`, just before the process group
forms, says those settings on rank 0, refuses a torchrun store that is gone (a split store) and fills in
the torchrun-style variables that Accelerate reads when processes were started by `srun` or Submitit
instead of torchrun. `python -m mlm_ddp.distributed` prints the topology (with `--connect`, proves the
processes can talk; with `--diagnose`, names the rank of a run that stopped first): the first thing to
run when a cluster job misbehaves.

Beside it: precision.py (which mixed precision the job trains in, and what the launcher said about it),
collectives.py (the process group: the Accelerator, side groups with patient timeouts, collectives).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from mlm_ddp.errors import BadInput

# Slurm gives every job an id; all nodes of a job derive the same rendezvous port from it, so two jobs
# sharing a node do not collide. Below the Linux ephemeral range (32768+), which outgoing sockets use.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 15000


DEFAULT_PORT = 29500  # torchrun's default

# torch's switch from the store its c10d rendezvous shares with the workers (the rank-0 agent's, reused by
# every round) to a store per start, hosted by rank 0's worker; read by every agent, so set on every node
SPLIT_STORE_SETTING = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

logger = logging.getLogger(__name__)  # before the process group: accelerate's logger needs its state


def slurm_master_port(job_id: int) -> int:
    """The rendezvous port of Slurm job `job_id` (slurm/*.sh computes the same number)."""
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list ("n[1-2]" -> "n1"), as `scontrol show hostnames` expands it."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, check=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(f"cannot expand the Slurm node list {nodelist!r} with scontrol ({err}); "
                           "export MASTER_ADDR to the first node's address") from err
    if not out:
        raise RuntimeError(f"scontrol expanded the Slurm node list {nodelist!r} to nothing")
    return out[0]


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None or not value.strip().isdigit():
        if default is None:
            raise RuntimeError(f"environment variable {name}={value!r}: expected a whole number")
        return default
    return int(value)


@dataclass(frozen=True)
class Topology:
    """What this process is in the job, derived from the environment alone (nothing is started)."""

    launcher: str  # "torchrun" (accelerate launch or torchrun), "slurm" (srun tasks), "submitit", "none"
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str | None
    master_port: int | None
    cuda_devices: int
    reasons: tuple[str, ...] = field(default=())
    job_id: str | None = None  # SLURM_JOB_ID, under any launcher inside a Slurm job; None outside Slurm
    warnings: tuple[str, ...] = field(default=())  # launcher settings likely to fail this job; rank 0 says them

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def backend(self) -> str | None:
        if not self.distributed:
            return None
        return "nccl" if self.cuda_devices else "gloo"

    @property
    def device(self) -> str:
        return f"cuda:{self.local_rank % self.cuda_devices}" if self.cuda_devices else "cpu"

    def describe(self) -> str:
        lines = [
            f"launcher      {self.launcher}",
            f"rank          {self.rank} of {self.world_size} (local rank {self.local_rank} of "
            f"{self.local_world_size} on node {self.node_rank} of {self.num_nodes})",
            f"master        {self.master_addr or '-'}:{self.master_port or '-'}",
            f"backend       {self.backend or '- (one process, no process group)'}",
            f"device        {self.device} ({self.cuda_devices} CUDA device(s) visible)",
        ]
        return "\n".join(lines + [f"because       {r}" for r in self.reasons]
                         + [f"warning       {w}" for w in self.warnings])


def array_task(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(this task's index from 0, the number of tasks) of a Slurm array job (`sbatch --array`), whatever
    its numbering (--array=1-8:2 gives 0..3 of 4); (0, 1) outside one."""
    env = os.environ if env is None else env
    if "SLURM_ARRAY_TASK_ID" not in env:
        return 0, 1
    step = _int(env, "SLURM_ARRAY_TASK_STEP", 1) or 1
    first = _int(env, "SLURM_ARRAY_TASK_MIN", 0)
    return (_int(env, "SLURM_ARRAY_TASK_ID") - first) // step, _int(env, "SLURM_ARRAY_TASK_COUNT", 1)


def parent_command_line() -> list[str]:
    """The command line of the process that started this one (accelerate launch, torchrun's agent), read
    from Linux's /proc; [] where /proc cannot tell (not Linux)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as handle:
            return [part.decode(errors="replace") for part in handle.read().split(b"\0") if part]
    except OSError:
        return []


def agent_argv(env: Mapping[str, str]) -> list[str]:
    """The command line of the torch elastic agent that started this worker (its parent process); []
    outside torchrun's agent or where /proc cannot tell."""
    return parent_command_line() if "TORCHELASTIC_RUN_ID" in env else []


def agent_flag(env: Mapping[str, str], argv: list[str], *names: str) -> str | None:
    """The value torchrun's agent took for the flag `names` (its spellings, e.g. "--rdzv-backend",
    "--rdzv_backend") from its command line `argv` (`--flag VALUE` or `--flag=VALUE`, the last one wins),
    else from its PET_ variable (torchrun's own fallback: PET_RDZV_BACKEND); None where neither says."""
    value = env.get("PET_" + names[0].lstrip("-").replace("-", "_").upper())
    for i, arg in enumerate(argv):
        if arg in names and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.split("=", 1)[0] in names and "=" in arg:
            value = arg.split("=", 1)[1]
    return value


def node_range(env: Mapping[str, str], argv: list[str]) -> tuple[int, int] | None:
    """(min, max) of torchrun's `--nnodes MIN:MAX` (`agent_flag`); None where no range was given (one
    number, or none). The workers' own variables carry only this round's count (GROUP_WORLD_SIZE)."""
    low, sep, high = (agent_flag(env, argv, "--nnodes") or "").partition(":")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit() or int(low) == int(high):
        return None
    return int(low), int(high)


def shared_store_warning(env: Mapping[str, str], argv: list[str]) -> str | None:
    """The start-up warning of an elastic node range on the rendezvous' shared store (None: not that job).

    With c10d's shared store, an agent keeps the store address of its first round unless it becomes rank 0
    (torch 2.13): when the rank-0 node is lost and a node that joins sorts before the others, it becomes
    rank 0 with a store of its own while the others' workers are handed the lost agent's. The workers of
    that start are split over two stores and can never all join."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get(SPLIT_STORE_SETTING) == "1":
        return None
    nodes = node_range(env, argv)
    if nodes is None:
        return None
    return (f"torchrun --nnodes {nodes[0]}:{nodes[1]} on the rendezvous' shared store: a node that joins a restart "
            "and becomes rank 0 gets a new store while the other nodes' workers keep the old rank 0's, and that "
            f"start never joins; export {SPLIT_STORE_SETTING}=1 on every node (a store per start, hosted by rank "
            "0's worker)")


def detect(env: Mapping[str, str] | None = None, cuda_devices: int | None = None,
           argv: list[str] | None = None) -> Topology:
    """The topology of this process. Pure in (env, cuda_devices, argv: the torch elastic agent's command
    line, read from /proc when not given) apart from `scontrol` for a Slurm master address that nobody
    exported."""
    env = os.environ if env is None else env
    reasons: list[str] = []
    warnings: list[str] = []
    if forced_cpu(env):
        # accelerate runs on the CPU whatever GPUs are visible: so does everything mlm_ddp decides
        # (device, backend, precision)
        cuda_devices = 0
        reasons.append("ACCELERATE_USE_CPU is set (--cpu, use_cpu: true): the CPU, whatever GPUs are visible")
    elif cuda_devices is None:
        import torch

        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0

    if "RANK" in env and "WORLD_SIZE" in env:
        # torchrun (which accelerate launch runs) exports these per process; inside an sbatch job
        # they win over SLURM_PROCID, which then numbers the launcher tasks (nodes), not processes.
        launcher = "torchrun"
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK", 0)
        local_world = _int(env, "LOCAL_WORLD_SIZE", world)
        node_rank = _int(env, "GROUP_RANK", rank // max(local_world, 1))
        reasons.append("RANK and WORLD_SIZE are set: started by accelerate launch / torchrun")
        addr, port = env.get("MASTER_ADDR"), _int(env, "MASTER_PORT", DEFAULT_PORT)
        if (warning := shared_store_warning(env, agent_argv(env) if argv is None else argv)) is not None:
            warnings.append(warning)
    elif "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        # one process per srun task (sbatch --ntasks-per-node=G + srun python ...), or Submitit,
        # which starts its tasks the same way
        launcher = "submitit" if env.get("SUBMITIT_EXECUTOR") == "slurm" else "slurm"
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_STEP_NUM_TASKS")
        local_rank, node_rank = _int(env, "SLURM_LOCALID", 0), _int(env, "SLURM_NODEID", 0)
        nodes = _int(env, "SLURM_STEP_NUM_NODES", _int(env, "SLURM_NNODES", 1))
        local_world = max(world // max(nodes, 1), 1)
        reasons.append(f"SLURM_PROCID and SLURM_STEP_NUM_TASKS are set: one {launcher} task per process")
        addr = env.get("MASTER_ADDR")
        if addr is None and world > 1:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
            addr = first_slurm_host(nodelist)
            reasons.append(f"master address: first host of {nodelist} (scontrol show hostnames)")
        if "MASTER_PORT" in env:
            port = _int(env, "MASTER_PORT")
        else:
            port = slurm_master_port(_int(env, "SLURM_JOB_ID", 0))
            reasons.append("master port: derived from SLURM_JOB_ID, the same on every node")
    else:
        launcher, rank, world, local_rank, local_world, node_rank = "none", 0, 1, 0, 1, 0
        addr, port = None, None
        reasons.append("no launcher variables (RANK/WORLD_SIZE or SLURM_PROCID): a single process")
        if "SLURM_JOB_ID" in env:
            reasons.append("inside a Slurm job but not in an srun step: use srun or accelerate launch "
                           "to start more than one process")

    if rank >= world or local_rank >= local_world:
        raise RuntimeError(f"rank {rank} / local rank {local_rank} do not fit world size {world} / "
                           f"local world size {local_world}: the launcher variables are inconsistent")
    if world > 1 and not cuda_devices:
        reasons.append("no CUDA device: processes talk over gloo on CPU (Accelerate state MULTI_CPU)")
    return Topology(launcher=launcher, rank=rank, local_rank=local_rank, world_size=world,
                    local_world_size=local_world, node_rank=node_rank,
                    num_nodes=max(world // max(local_world, 1), 1), master_addr=addr, master_port=port,
                    cuda_devices=cuda_devices, reasons=tuple(reasons), job_id=env.get("SLURM_JOB_ID") or None,
                    warnings=tuple(warnings))


def forced_cpu(env: Mapping[str, str]) -> bool:
    """accelerate's ACCELERATE_USE_CPU (`accelerate launch --cpu`, `use_cpu: true`), read as accelerate reads it."""
    return env.get("ACCELERATE_USE_CPU", "").strip().lower() in ("1", "true", "yes", "y", "on")


def requeue(topo: Topology) -> None:
    """Put this process's Slurm job back in the queue (`scontrol requeue`); the requeued job starts the
    same tasks again. Call it on one process (rank 0): it requeues the whole job."""
    if topo.job_id is None:
        raise RuntimeError("cannot requeue: this process is not in a Slurm job (no SLURM_JOB_ID)")
    subprocess.run(["scontrol", "requeue", topo.job_id], check=True, timeout=60)


def export_for_accelerate(topo: Topology, env: Mapping[str, str] | None = None) -> None:
    """Ready this process for the process group, which forms next: on rank 0 say the launcher's settings
    that are likely to fail the job (`Topology.warnings`); under torchrun's agent store, check that the
    store is there (`check_agent_store`); and give Accelerate the torchrun variables it reads when srun or
    Submitit started the processes.

    Without those variables a Slurm task initialises no process group and trains alone, silently.
    """
    env = os.environ if env is None else env
    if topo.rank == 0:
        for warning in topo.warnings:
            logger.warning("%s", warning)
    check_agent_store(topo, env)
    if topo.launcher not in ("slurm", "submitit") or not topo.distributed:
        return
    values = {"RANK": topo.rank, "WORLD_SIZE": topo.world_size, "LOCAL_RANK": topo.local_rank,
              "LOCAL_WORLD_SIZE": topo.local_world_size, "MASTER_ADDR": topo.master_addr,
              "MASTER_PORT": topo.master_port}
    for name, value in values.items():
        os.environ.setdefault(name, str(value))


def check_agent_store(topo: Topology, env: Mapping[str, str], argv: list[str] | None = None,
                      attempts: int = 3) -> None:
    """Under the c10d rendezvous' shared store (TORCHELASTIC_USE_AGENT_STORE=True) the rank-0 agent hosts
    the store before any worker starts, so a worker whose MASTER_ADDR:MASTER_PORT refuses connections was
    handed a store that is gone: the address of a rank-0 agent of an earlier round (torch 2.13 keeps it on
    a node that was not rank 0 then and is not now), while this round's rank 0 waits on a new store. Raises
    BadInput naming the split store and the setting at once, where the join would wait out its timeout on
    every node. A store that answers, a connect that times out (judged by the join), or another rendezvous
    (`argv`: the agent's command line, read from /proc when not given) passes."""
    if (topo.launcher != "torchrun" or not topo.distributed or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            or not topo.master_addr or not topo.master_port):
        return
    argv = agent_argv(env) if argv is None else argv
    if agent_flag(env, argv, "--rdzv-backend", "--rdzv_backend") != "c10d" and "--standalone" not in argv:
        return  # static (accelerate launch, slurm/multinode.sh): one round, its nodes ranked by the launcher
    for attempt in range(attempts):
        try:
            socket.create_connection((topo.master_addr, topo.master_port), timeout=10).close()
            return
        except OSError as err:
            if err.errno != errno.ECONNREFUSED:  # unreachable or timed out: the join judges it
                return
            if attempt + 1 == attempts:
                raise BadInput(
                    f"split store: rank {topo.rank} (node {topo.node_rank}) was handed the store "
                    f"{topo.master_addr}:{topo.master_port} by its torchrun agent, and nothing listens there "
                    f"({err.strerror}): the store of a lost rank-0 node, while this start's rank 0 waits on a new "
                    f"one, so not every process can join; export {SPLIT_STORE_SETTING}=1 on every node (a store "
                    "per start, hosted by rank 0's worker)") from err
            time.sleep(1)


def check_accelerator(topo: Topology, num_processes: int, distributed_type: str) -> None:
    """Fail loudly if the launcher started a group of processes but each one trains alone."""
    if num_processes != topo.world_size:
        raise RuntimeError(
            f"the launcher started {topo.world_size} processes ({topo.launcher}) but Accelerate runs "
            f"{num_processes} ({distributed_type}); every process would train alone on the same data. "
            "Run `python -m mlm_ddp.distributed` under the same launcher to see why."
        )


def fsdp_plugin_from_launcher(env: Mapping[str, str] | None = None) -> Any:
    """The FSDP plugin an `accelerate launch` FSDP config asked for (ACCELERATE_USE_FSDP and the FSDP_*
    variables), built here so that mlm_ddp can keep it on a CPU; None when FSDP was not asked for."""
    env = os.environ if env is None else env
    if env.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin()  # reads the FSDP_* variables, as Accelerator() would


def local_world_size() -> int:
    """Processes started on this node by the launcher (1 when run without one)."""
    return detect(cuda_devices=0).local_world_size


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


def connect(topo: Topology, timeout_s: float) -> str:
    """Form the process group the way training does, all-reduce the ranks, and report."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    export_for_accelerate(topo)
    started = time.perf_counter()
    accelerator = Accelerator(cpu=not topo.cuda_devices,
                              kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s))])
    check_accelerator(topo, accelerator.num_processes, str(accelerator.distributed_type))
    ranks = torch.tensor([float(accelerator.process_index)], device=accelerator.device)
    total = accelerator.reduce(ranks, reduction="sum").item()
    expected = topo.world_size * (topo.world_size - 1) / 2
    if total != expected:
        raise RuntimeError(f"all-reduce of the ranks gave {total}, expected {expected}")
    took = time.perf_counter() - started
    accelerator.end_training()
    return (f"connected: {accelerator.num_processes} process(es), {accelerator.distributed_type}, "
            f"all-reduce of the ranks correct; group formed in {took:.2f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mlm_ddp.distributed",
        description="Print what this process would be in a training job (rank, world size, master, "
                    "backend, device, and why). Run it under the same launcher as the job. With --diagnose, "
                    "say which rank of a run stopped first.")
    parser.add_argument("--connect", action="store_true",
                        help="also form the process group and all-reduce across every process")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for the other processes with --connect (default 120)")
    parser.add_argument("--diagnose", metavar="OUTPUT_DIR",
                        help="instead: name the rank of a hung or failed run that stopped advancing first, from "
                             "the heartbeat files in OUTPUT_DIR (run it anywhere that sees the folder)")
    args = parser.parse_args(argv)
    if args.diagnose:
        from mlm_ddp.cluster.heartbeat import diagnose

        line = diagnose(args.diagnose)
        if line is None:
            print(f"mlm_ddp.distributed: error: {args.diagnose} holds no heartbeat files (heartbeat/rank-*.json): "
                  "not an mlm_ddp output folder, or its run never reached training", file=sys.stderr)
            return 2
        print(line, flush=True)
        return 0
    try:
        topo = detect()
        # every rank prints its own view; the prefix keeps interleaved lines apart
        prefix = f"[rank {topo.rank}] " if topo.distributed else ""
        print("\n".join(prefix + line for line in topo.describe().splitlines()), flush=True)
        if args.connect:
            print(f"{prefix}{connect(topo, args.timeout)}", flush=True)
    except RuntimeError as err:
        print(f"mlm_ddp.distributed: error: {err}", file=sys.stderr)
        return 1
    return 0



if __name__ == "__main__":
    sys.exit(main())
