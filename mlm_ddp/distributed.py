"""The one place that reads launcher environment variables: accelerate launch / torchrun, Slurm, Submitit.

`detect()` turns the environment into a `Topology` (who this process is, where its peers meet, which
Slurm job it belongs to, and why we think so); `requeue()` puts that job back in Slurm's queue;
`export_for_accelerate()` fills in the torchrun-style variables that Accelerate reads
when processes were started by `srun` or Submitit instead of torchrun. `python -m mlm_ddp.distributed`
prints the topology (and, with `--connect`, proves the processes can talk): the first thing to run
when a cluster job misbehaves.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

# Slurm gives every job an id; all nodes of a job derive the same rendezvous port from it, so two jobs
# sharing a node do not collide. Below the Linux ephemeral range (32768+), which outgoing sockets use.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 15000
DEFAULT_PORT = 29500  # torchrun's default


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
        return "\n".join(lines + [f"because       {r}" for r in self.reasons])


def array_task(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(this task's index from 0, the number of tasks) of a Slurm array job (`sbatch --array`), whatever
    its numbering (--array=1-8:2 gives 0..3 of 4); (0, 1) outside one."""
    env = os.environ if env is None else env
    if "SLURM_ARRAY_TASK_ID" not in env:
        return 0, 1
    step = _int(env, "SLURM_ARRAY_TASK_STEP", 1) or 1
    first = _int(env, "SLURM_ARRAY_TASK_MIN", 0)
    return (_int(env, "SLURM_ARRAY_TASK_ID") - first) // step, _int(env, "SLURM_ARRAY_TASK_COUNT", 1)


def detect(env: Mapping[str, str] | None = None, cuda_devices: int | None = None) -> Topology:
    """The topology of this process. Pure in (env, cuda_devices) apart from `scontrol` for a Slurm
    master address that nobody exported."""
    env = os.environ if env is None else env
    reasons: list[str] = []
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
                    cuda_devices=cuda_devices, reasons=tuple(reasons), job_id=env.get("SLURM_JOB_ID") or None)


def forced_cpu(env: Mapping[str, str]) -> bool:
    """accelerate's ACCELERATE_USE_CPU (`accelerate launch --cpu`, `use_cpu: true`), read as accelerate reads it."""
    return env.get("ACCELERATE_USE_CPU", "").strip().lower() in ("1", "true", "yes", "y", "on")


def requeue(topo: Topology) -> None:
    """Put this process's Slurm job back in the queue (`scontrol requeue`); the requeued job starts the
    same tasks again. Call it on one process (rank 0): it requeues the whole job."""
    if topo.job_id is None:
        raise RuntimeError("cannot requeue: this process is not in a Slurm job (no SLURM_JOB_ID)")
    subprocess.run(["scontrol", "requeue", topo.job_id], check=True, timeout=60)


def export_for_accelerate(topo: Topology) -> None:
    """Give Accelerate the torchrun variables it reads when srun or Submitit started the processes.

    Without them a Slurm task initialises no process group and trains alone, silently.
    """
    if topo.launcher not in ("slurm", "submitit") or not topo.distributed:
        return
    values = {"RANK": topo.rank, "WORLD_SIZE": topo.world_size, "LOCAL_RANK": topo.local_rank,
              "LOCAL_WORLD_SIZE": topo.local_world_size, "MASTER_ADDR": topo.master_addr,
              "MASTER_PORT": topo.master_port}
    for name, value in values.items():
        os.environ.setdefault(name, str(value))


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


def keep_fsdp_on_cpu(accelerator: Any, plugin: Any) -> bool:
    """Run FSDP on CPU processes (gloo) where accelerate would silently run DDP instead.

    accelerate 1.15's AcceleratorState turns FSDP on only for GPU-like distributed types (MULTI_GPU,
    MULTI_NPU, ...); a CPU group is MULTI_CPU, so the plugin is dropped and `prepare` wraps the model in
    DDP. FSDP2 itself runs on gloo: set the state accelerate would have set for a GPU (its
    distributed type and plugin, which carries `fsdp2_policy` already) before anything is prepared.
    Returns whether it did. FSDP1 needs a GPU: `check_fsdp_plugin` refuses it first.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if plugin is None or accelerator.distributed_type != DistributedType.MULTI_CPU:
        return False
    accelerator.state.fsdp_plugin = plugin
    # both states, as AcceleratorState.__init__ does: every later AcceleratorState() copies PartialState's
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP
    return True


def check_fsdp_plugin(plugin: Any, cuda: bool) -> None:
    """Refuse FSDP settings that cannot run here, or whose checkpoints mlm_ddp cannot validate and resume."""
    if plugin is None:
        return
    from torch.distributed.fsdp import StateDictType

    from mlm_ddp.errors import BadInput

    if plugin.fsdp_version != 2 and not cuda:
        raise BadInput(f"fsdp_version {plugin.fsdp_version} on CPU processes: only FSDP2 runs over gloo; set "
                       "fsdp_version: 2 in the accelerate config (accelerate_configs/fsdp.yaml does)")
    if plugin.state_dict_type != StateDictType.SHARDED_STATE_DICT:
        raise BadInput(f"fsdp_state_dict_type {plugin.state_dict_type.name}: mlm_ddp checkpoints FSDP runs with "
                       "SHARDED_STATE_DICT (each rank writes its shard; final/ is written whole either way); set "
                       "fsdp_state_dict_type: SHARDED_STATE_DICT in the accelerate config")


def network_interfaces() -> list[str]:
    import socket

    return [name for _, name in socket.if_nameindex()]


def gloo_interface(env: Mapping[str, str], backend: str, interfaces: list[str]) -> str | None:
    """The interface (GLOO_SOCKET_IFNAME) for mlm_ddp's gloo side group, which an NCCL job also needs: the
    user's GLOO_SOCKET_IFNAME, checked; on NCCL, else the interface NCCL_SOCKET_IFNAME selects, so that the
    side group takes the network NCCL was told to take (gloo alone resolves this host's name, which on
    many clusters is the loopback or a management network); else None (gloo's own choice).

    NCCL_SOCKET_IFNAME is a list of prefixes ("ib,eth"), of exact names after "=", or of exclusions after
    "^"; exclusions name no interface, so gloo then keeps its own choice. Raises BadInput naming the
    variable when no interface of this host matches.
    """
    from mlm_ddp.errors import BadInput

    host = os.uname().nodename
    if env.get("GLOO_SOCKET_IFNAME"):
        missing = [name for name in env["GLOO_SOCKET_IFNAME"].split(",") if name not in interfaces]
        if missing:
            raise BadInput(f"GLOO_SOCKET_IFNAME={env['GLOO_SOCKET_IFNAME']}: {host} has no interface "
                           f"{', '.join(missing)} (it has {', '.join(interfaces)}); export one of those")
        return env["GLOO_SOCKET_IFNAME"]
    wanted = env.get("NCCL_SOCKET_IFNAME", "").strip()
    if backend != "nccl" or not wanted or wanted.startswith("^"):
        return None
    exact = wanted.startswith("=")
    names = [name.strip() for name in wanted.lstrip("=").split(",") if name.strip()]
    matches = [i for i in interfaces if any(i == n if exact else i.startswith(n) for n in names)]
    if not matches:
        raise BadInput(f"NCCL_SOCKET_IFNAME={wanted}: no interface of {host} matches (it has "
                       f"{', '.join(interfaces)}); NCCL and mlm_ddp's gloo side group would have no network: "
                       "export NCCL_SOCKET_IFNAME (and GLOO_SOCKET_IFNAME) with one of those")
    return matches[0]


def follow_nccl_interface(backend: str) -> None:
    """Set GLOO_SOCKET_IFNAME for the gloo groups created after this (`gloo_interface`)."""
    chosen = gloo_interface(os.environ, backend, network_interfaces())
    if chosen and os.environ.get("GLOO_SOCKET_IFNAME") != chosen:
        os.environ["GLOO_SOCKET_IFNAME"] = chosen


class MainProcessWait:
    """The collectives in which the other processes wait while the main process alone works (the
    files of a checkpoint, final/, removing an earlier run, tokenizing): on a gloo group of their own
    with a long timeout (--save_timeout, --preprocessing_timeout), so that --ddp_timeout can stay
    short for the training collectives (DESIGN.md, pitfall 14). Every rank must call each method at
    the same point."""

    def __init__(self, num_processes: int, timeout_s: int) -> None:
        import torch

        self.group = None
        if num_processes > 1:
            follow_nccl_interface(torch.distributed.get_backend())
            self.group = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def barrier(self) -> None:
        if self.group is not None:
            import torch

            torch.distributed.barrier(group=self.group)

    def close(self) -> None:
        if self.group is not None:
            import torch

            torch.distributed.destroy_process_group(self.group)
            self.group = None

    def broadcast(self, value: Any) -> Any:
        """The main process's `value` (a small picklable object), on every rank."""
        if self.group is None:
            return value
        import torch

        box = [value]
        torch.distributed.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (a small picklable object), in rank order, on every rank."""
        if self.group is None:
            return [value]
        import torch

        values: list[Any] = [None] * torch.distributed.get_world_size(self.group)
        torch.distributed.all_gather_object(values, value, group=self.group)
        return values

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any rank."""
        if self.group is None:
            return flag
        import torch

        votes = torch.tensor([float(flag)])  # gloo: a CPU tensor, also next to NCCL
        torch.distributed.all_reduce(votes, group=self.group)
        return votes.item() > 0


def start_accelerator(topo: Topology, fsdp_plugin: Any, training: Any, precision: str, ddp_timeout: int,
                      trackers: list[str], project_dir: str) -> Any:
    """The Accelerator of this process (the process group forms here), with the training settings of
    the mlm_ddp config whatever the launcher, and `precision` (`choose_precision`'s)."""
    from accelerate import Accelerator
    from accelerate.logging import get_logger
    from accelerate.utils import GradientAccumulationPlugin, InitProcessGroupKwargs

    logger = get_logger(__name__)
    export_for_accelerate(topo)
    if fsdp_plugin is not None and fsdp_plugin.fsdp_version == 2:
        fsdp_plugin.mixed_precision_policy = fsdp2_policy(precision)  # accelerate keeps a policy it is given
    accelerator = Accelerator(
        fsdp_plugin=fsdp_plugin,
        cpu=not topo.cuda_devices,  # else a CPU process started by torchrun or srun trains alone
        mixed_precision=precision,  # from our config, so every launcher trains alike
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=training.gradient_accumulation_steps, sync_with_dataloader=False),
        # fail fast: when a process dies, the others stop within this time instead of hanging
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=ddp_timeout))],
        log_with=trackers or None,
        project_dir=project_dir,
    )
    if keep_fsdp_on_cpu(accelerator, fsdp_plugin):
        logger.info("FSDP on CPU processes: the accelerate config asks for FSDP, which accelerate would run as "
                    "DDP on a CPU; mlm_ddp keeps its FSDP2 plugin (gloo)")
    check_accelerator(topo, accelerator.num_processes, str(accelerator.distributed_type))
    return accelerator


def sharded(accelerator: Any) -> bool:
    """FSDP shards the parameters: every forward is a collective and the model is not whole anywhere."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def any_rank(accelerator: Any, flag: bool) -> bool:
    """True on every rank when `flag` is true on any rank (a collective of the training group)."""
    import torch

    return accelerator.reduce(torch.tensor(float(flag), device=accelerator.device), reduction="sum").item() > 0


def gather_rows(accelerator: Any, values: list[float]) -> list[list[float]]:
    """Every rank's `values` (the same length on every rank), in rank order (a collective)."""
    import torch

    rows = accelerator.gather(torch.tensor(values, dtype=torch.float64, device=accelerator.device))
    return rows.view(accelerator.num_processes, -1).tolist()


@contextmanager
def patient_collectives(timeout_s: int, usual_s: int) -> Iterator[None]:
    """The training group's collectives wait up to `timeout_s` inside the block (a checkpoint's save or
    load: FSDP's and torch.distributed.checkpoint's collectives run on that group, and one slow shard write
    must not trip --ddp_timeout, after which NCCL's watchdog ends every process), `usual_s` again after."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    change = getattr(distributed_c10d, "_set_pg_timeout", None)  # torch >= 2.2; without it: --ddp_timeout
    if not dist.is_initialized() or change is None or timeout_s <= usual_s:
        yield
        return
    change(timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        change(timedelta(seconds=usual_s))


@contextmanager
def patient_main_process_first(accelerator: Any, timeout_s: int) -> Iterator[None]:
    """Like accelerate's main_process_first, but the others wait on a group of their own with a long
    timeout: tokenizing a large corpus must not trip --ddp_timeout (transformers #17106)."""
    wait = MainProcessWait(accelerator.num_processes, timeout_s)
    if not accelerator.is_main_process:
        wait.barrier()
    yield
    if accelerator.is_main_process:
        wait.barrier()
    wait.close()


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


def parent_command_line() -> list[str]:
    """The command line of the process that started this one (accelerate launch, or torchrun inside it)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as handle:
            return [part.decode(errors="replace") for part in handle.read().split(b"\0") if part]
    except OSError:  # not Linux: only an explicit bf16/fp16 is seen
        return []


def said_no(argv: list[str]) -> str | None:
    """Where an accelerate launch command line `argv` says mixed_precision "no": its flag, its
    --config_file, or the default config file of `accelerate config`; None if it does not."""
    import yaml

    starts = [i for i, part in enumerate(argv) if part == "launch" or part.endswith("accelerate.commands.launch")]
    if not starts:
        return None
    from accelerate.commands.launch import launch_command_parser

    try:  # accelerate's own parser: the training script's flags (ours) come after its script or -m module
        launch, _ = launch_command_parser().parse_known_args(argv[starts[0] + 1:])
    except SystemExit:
        return None
    if launch.mixed_precision == "no":
        return "accelerate launch --mixed_precision no"
    config = launch.config_file
    if config is None:
        from accelerate.commands.config import default_config_file

        config = default_config_file
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
    import platform

    import torch

    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        avx512_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
        amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        return bool(avx512_bf16() or amx())
    # oneDNN's own test on Arm: the bf16 instructions (it emulates nothing there)
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


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


def is_collective_failure(err: RuntimeError) -> bool:
    """A peer died, or hung past --ddp_timeout (how gloo and NCCL say so)."""
    markers = ("gloo", "NCCL", "Connection reset by peer", "Connection closed by peer", "ProcessGroup")
    import torch

    return isinstance(err, torch.distributed.DistError) or any(m in str(err) for m in markers)


def lost_contact(topo: Topology, err: Exception) -> str:
    others = [r for r in range(topo.world_size) if r != topo.rank]
    who = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {', '.join(map(str, others))}"
    return (f"rank {topo.rank} lost contact with the other process(es) ({who}): a process died, was killed, "
            f"or hung for longer than --ddp_timeout; the launcher's report or that process's log says which "
            f"and why. Cause: {type(err).__name__}: {str(err).strip()[:300]}")


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
        from mlm_ddp.heartbeat import diagnose

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
