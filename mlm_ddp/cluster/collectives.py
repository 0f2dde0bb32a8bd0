"""The process group and its collectives: the Accelerator (the group forms there, with the job's agreed
precision), FSDP kept on CPU processes, the gloo side groups in which ranks wait for the main process with
a patient timeout, and the small collectives the loop uses; how a lost peer is worded.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from mlm_ddp.cluster import flight
from mlm_ddp.cluster.generation import KEY_ROOT, agree_generation, stop_now_on
from mlm_ddp.cluster.heartbeat import diagnose
from mlm_ddp.cluster.launcher import Topology, check_accelerator, cpu_threads_per_process, detect, export_for_accelerate
from mlm_ddp.cluster.precision import agree_precision, fsdp2_policy
from mlm_ddp.compat import accelerate as compat_accelerate
from mlm_ddp.compat import torch as compat_torch


def keep_fsdp_on_cpu(accelerator: Any, plugin: Any) -> bool:
    """Run FSDP on CPU processes (gloo) where accelerate would silently run DDP instead.

    accelerate 1.15's AcceleratorState turns FSDP on only for GPU-like distributed types (MULTI_GPU,
    MULTI_NPU, ...); a CPU group is MULTI_CPU, so the plugin is dropped and `prepare` wraps the model in
    DDP. FSDP2 itself runs on gloo: set the state accelerate would have set for a GPU (its
    distributed type and plugin, which carries `fsdp2_policy` already) before anything is prepared.
    Returns whether it did. FSDP1 needs a GPU: `check_fsdp_plugin` refuses it first.
    """
    from accelerate.utils import DistributedType

    if plugin is None or accelerator.distributed_type != DistributedType.MULTI_CPU:
        return False
    compat_accelerate.train_fsdp(accelerator, plugin)
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


def tear_down_after(ended: type[BaseException], accelerator: Any, wait: MainProcessWait,
                    exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
    """An ExitStack exit callback: after a run that ended early on purpose (`ended`: preempted and saved, a
    non-finite loss, ... on every rank alike), destroy the process groups, as `end_training` does after a
    finished run. Left to the interpreter's exit, a gloo group's threads can abort the process (SIGABRT,
    'terminate called without an active exception'), which loses the exit code: 75 would not be requeued.
    Other errors (a lost peer) leave the groups alone. Never suppresses the exception."""
    if exc_type is not None and issubclass(exc_type, ended):
        wait.close()
        accelerator.state.destroy_process_group()
    return False


class MainProcessWait:
    """The collectives in which the other processes wait while the main process alone works (the
    files of a checkpoint, final/, removing an earlier run, tokenizing): on a gloo group of their own
    with a long timeout (--save_timeout, --preprocessing_timeout), so that --ddp_timeout can stay
    short for the training collectives (docs/design.md, pitfall 14). Every rank must call each method at
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

    def set_timeout(self, timeout_s: int) -> None:
        """The timeout of this group's later collectives."""
        if self.group is not None:
            compat_torch.set_group_timeout(timedelta(seconds=timeout_s), self.group)

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


@dataclass
class Started:
    """What `start_accelerator` made: the Accelerator, the job's precision, the long-timeout group in which
    ranks wait for the main process, and this run's scope of the store (`join_process_group`)."""

    accelerator: Any
    precision: tuple[str, str]
    wait: MainProcessWait
    scope: str  # "mlm_ddp/GEN/run-ID/": this run's keys (the group's store is under "mlm_ddp/GEN/", GEN the start's)


def start_accelerator(topo: Topology, fsdp_plugin: Any, training: Any, precision: tuple[str, str],
                      timeouts: Timeouts, trackers: list[str], output_dir: Path) -> Started:
    """The Accelerator of this process (the process group forms here), with the training settings of
    the mlm_ddp config whatever the launcher, and the job's precision: rank 0's choice (`choose_precision`'s
    on each rank), agreed before the Accelerator is made (`agree_precision`). torch's Flight Recorder
    records the collectives of every group formed here, and dumps into `output_dir` (flight.py)."""
    from accelerate import Accelerator
    from accelerate.logging import get_logger
    from accelerate.utils import GradientAccumulationPlugin, InitProcessGroupKwargs

    logger = get_logger(__name__)
    export_for_accelerate(topo)
    flight.configure(os.environ, output_dir)
    wait, scope = MainProcessWait(1, timeouts.save), f"{KEY_ROOT}alone/run-0/"
    if topo.distributed:
        # the process group first, as the Accelerator below would form it (it takes this one over), and the
        # start-up group, over which every rank's precision is gathered before the Accelerator fixes one
        wait, scope = join_process_group(topo, timeouts)
        precision = agree_precision(precision, topo.rank, wait.gather)
    if fsdp_plugin is not None and fsdp_plugin.fsdp_version == 2:
        fsdp_plugin.mixed_precision_policy = fsdp2_policy(precision[0])  # accelerate keeps a policy it is given
    accelerator = Accelerator(
        fsdp_plugin=fsdp_plugin,
        cpu=not topo.cuda_devices,  # else a CPU process started by torchrun or srun trains alone
        mixed_precision=precision[0],  # from our config, so every launcher trains alike
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=training.gradient_accumulation_steps, sync_with_dataloader=False),
        # fail fast: when a process dies, the others stop within this time instead of hanging
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=timeouts.ddp))],
        log_with=trackers or None,
        project_dir=str(output_dir / "logs"),  # TensorBoard writes into logs/<TRACKING_PROJECT>/
    )
    if keep_fsdp_on_cpu(accelerator, fsdp_plugin):
        logger.info("FSDP on CPU processes: the accelerate config asks for FSDP, which accelerate would run as "
                    "DDP on a CPU; mlm_ddp keeps its FSDP2 plugin (gloo)")
    check_accelerator(topo, accelerator.num_processes, str(accelerator.distributed_type))
    if accelerator.device.type == "cpu":
        import torch

        torch.set_num_threads(cpu_threads_per_process(training.cpu_threads))
    return Started(accelerator, precision, wait, scope)


@dataclass(frozen=True)
class Timeouts:
    """The seconds the process group's waits may take (the config's --ddp_timeout, --save_timeout,
    --rendezvous_timeout)."""

    ddp: int
    save: int
    rendezvous: int


def backend_for(topo: Topology, env: Mapping[str, str]) -> str:
    """The backend accelerate 1.15's PartialState would choose for this process group (which it takes over
    when one exists): gloo on CPU processes; on GPUs NCCL, with gloo beside it for CPU tensors where FSDP
    offloads parameters or gathers a full state dict."""
    if not topo.cuda_devices:
        return "gloo"
    fsdp = env.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    offloads = env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true"
    full = env.get("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT") == "FULL_STATE_DICT"
    return "cuda:nccl,cpu:gloo" if fsdp and (offloads or full) else "nccl"


def join_process_group(topo: Topology, timeouts: Timeouts) -> tuple[MainProcessWait, str]:
    """Form the process group (accelerate's PartialState takes it over) on a store scoped to this start of
    the job, and return once every process has joined it, waiting up to --rendezvous_timeout (or --ddp_timeout
    where longer); then set its collectives and its store to --ddp_timeout. Returns the gloo group of the waits
    on the main process (with --save_timeout from then on) and the run's scope of the store.

    torchrun's agents keep one store for every start, with no prefix, and torch names the gloo groups the
    same in every start (a count): a group formed in a restart read the dead workers' addresses. So the
    whole process group, every group made from it and every key of ours live under `mlm_ddp/GEN/`, GEN the
    generation every worker of this start agrees on first (generation.py; not TORCHELASTIC_RESTART_COUNT,
    which differs between nodes).

    Each process loads and checks its inputs before it joins (preflight), and a node that imports from a
    slow shared filesystem arrives minutes after the others: the join is the barrier, with that patient
    timeout. While a process waits in it, SIGTERM and SIGINT end it at once (`stop_now_on`)."""
    import uuid

    import torch.distributed as dist
    from accelerate import PartialState

    # never shorter than before this flag existed: a user who raised --ddp_timeout for a slow start keeps it
    waited = max(timeouts.rendezvous, timeouts.ddp)
    patient = timedelta(seconds=waited)
    scope = f"{KEY_ROOT}kept/"  # a process that trains again keeps its group, as accelerate does
    try:
        with stop_now_on():
            if not dist.is_initialized():
                store, rank, world = next(dist.rendezvous("env://", topo.rank, topo.world_size, timeout=patient))
                scope = f"{KEY_ROOT}{agree_generation(store, rank, world, waited)}/"
                dist.init_process_group(backend_for(topo, os.environ), store=dist.PrefixStore(scope, store),
                                         rank=rank, world_size=world, timeout=patient)
            PartialState(cpu=not topo.cuda_devices, timeout=patient)
            wait = MainProcessWait(topo.world_size, waited)
            # and a run of its own inside the start: a process that trains twice must not read its last keys
            scope += f"run-{wait.broadcast(uuid.uuid4().hex[:12])}/"
    except (dist.DistError, RuntimeError) as err:
        raise dist.DistError(f"not every process joined within {waited} s (--rendezvous_timeout, or --ddp_timeout "
                             f"where longer): {type(err).__name__}: {str(err).strip()[:200]}") from err
    wait.set_timeout(timeouts.save)
    compat_torch.default_store().set_timeout(timedelta(seconds=timeouts.ddp))
    compat_torch.set_group_timeout(timedelta(seconds=timeouts.ddp))
    return wait, scope


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

    if not dist.is_initialized() or timeout_s <= usual_s:
        yield
        return
    compat_torch.set_group_timeout(timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        compat_torch.set_group_timeout(timedelta(seconds=usual_s))


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


def is_collective_failure(err: RuntimeError) -> bool:
    """A peer died, or hung past --ddp_timeout (how gloo and NCCL say so)."""
    markers = ("gloo", "NCCL", "Connection reset by peer", "Connection closed by peer", "ProcessGroup")
    import torch

    return isinstance(err, torch.distributed.DistError) or any(m in str(err) for m in markers)


def lost_contact(topo: Topology, err: Exception) -> str:
    others = [r for r in range(topo.world_size) if r != topo.rank]
    who = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {', '.join(map(str, others))}"
    return (f"rank {topo.rank} lost contact with the other process(es) ({who}): a process died, was killed, "
            "or hung for longer than --ddp_timeout (--rendezvous_timeout while starting); the launcher's report "
            f"or that process's log says which and why. Cause: {type(err).__name__}: {str(err).strip()[:300]}")


def failure_line(err: RuntimeError, output_dir: str | None, prog: str) -> str | None:
    """The error line of a collective that failed in a distributed job (None: `err` is not one): whom this
    rank lost contact with and, from the heartbeats in `output_dir`, the rank that hung first."""
    topo = detect(cuda_devices=0)
    if not (topo.distributed and is_collective_failure(err)):
        return None
    if output_dir is not None:  # gloo writes no Flight Recorder dump of its own
        flight.dump(os.environ, topo.rank)
    first = diagnose(output_dir) if output_dir is not None else None
    return f"{prog}: error: {lost_contact(topo, err)}" + (f"\n{prog}: error: hang: {first}" if first else "")
