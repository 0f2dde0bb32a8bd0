"""Checkpoints: the whole protocol (every rank saves, all agree, written whole or not at all, found
newest-complete-first, validated before loading, rotated) and its cadence (`Checkpointer.maybe`).

Layout: `output_dir/checkpoints/step-0000500/` holding accelerate's `save_state` files (model in
safetensors, optimizer, RNG states of every rank; all loaded with `weights_only=True`; under FSDP the
model and optimizer are sharded folders, `pytorch_model_fsdp_0/` and `optimizer_0/`),
`scheduler.json`, `trainer_state.json` (counters and data position), the sections of the run's other
resumable parts (`parts.json`, `parts_rank{R}.json`: resumable.py), `config.yaml` (the resolved config of
the run) and, written last, the marker `COMPLETE`. A save goes to `.tmp-step-*` first, is
fsynced, and is renamed into place only when complete, so a crash mid-save never leaves a folder
that `latest` would pick up.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import re
import shutil
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from accelerate.logging import get_logger
from accelerate.utils import OPTIMIZER_NAME, RNG_STATE_NAME, SAFE_WEIGHTS_NAME
from accelerate.utils.constants import FSDP_MODEL_NAME

from mlm_ddp.cluster.collectives import patient_collectives
from mlm_ddp.cluster.durable import fsync_dir, fsync_tree
from mlm_ddp.cluster.heartbeat import PhaseReport, unreported
from mlm_ddp.compat.accelerate import set_micro_batch_count
from mlm_ddp.compat.torch import DCP_METADATA_PRIVATE
from mlm_ddp.config import RunConfig
from mlm_ddp.errors import BadInput, CheckpointWriteError
from mlm_ddp.loop.resumable import Parts, Stateful, rank_file
from mlm_ddp.loop.schedule import check_continuation, continue_schedule

logger = get_logger(__name__)
MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
SCHEDULER_FILE = "scheduler.json"
SAFE_LOADING_TORCH = (2, 4)  # at or below pyproject's torch floor; tests/test_neighbours.py checks it
# what accelerate's save_state writes (accelerate's own names): without FSDP model 0's weights and optimizer 0's
# state, one file each; every rank's RNG states
WEIGHTS_FILE, OPTIMIZER_FILE = SAFE_WEIGHTS_NAME, f"{OPTIMIZER_NAME}.bin"
# FSDP with SHARDED_STATE_DICT: accelerate's folders for model 0 and optimizer 0, each a
# torch.distributed.checkpoint folder
SHARDED_DIRS = (f"{FSDP_MODEL_NAME}_0", f"{OPTIMIZER_NAME}_0")
DCP_METADATA = ".metadata"
DCP_METADATA_GLOBALS = {("pathlib", "PosixPath"), *DCP_METADATA_PRIVATE}
_STEP_DIR = re.compile(r"^step-(\d{7,})$")


@dataclass
class TrainerState:
    """Counters a resumed run continues from, and where each rank's data continues: what the folder policy
    (run/run_folder.py) reads before anything is built. Every other resumable part is a section of
    resumable.py's files."""

    step: int  # optimizer steps done
    epoch: int  # epoch of the next micro-batch to read
    batch_in_epoch: int  # index, within that epoch, of the next micro-batch this rank reads
    tokens_seen: int  # non-padding input tokens, all ranks together
    world_size: int
    # map-style data: slots of that epoch read by all ranks together, and the global micro-batch
    # the epochs are laid out for (data.EpochBatchSampler); None in checkpoints older than both
    block_in_epoch: int | None = None
    layout_batch: int | None = None
    precision: str | None = None  # the mixed precision the job trained in ("no", "bf16", "fp16"); None: older
    # a mixture's: each source's name, blocks, tokens and passes trained so far, all ranks (data/counts.py); None:
    # one source, or a checkpoint older than these counts
    sources: list[dict] | None = None


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / STATE_FILE).is_file()


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found)]


def partial_checkpoints(output_dir: str | Path) -> list[Path]:
    """Checkpoint folders without their marker: saves that were interrupted."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and _STEP_DIR.match(p.name.removeprefix(".tmp-")) and not is_complete(p))


def set_aside_later(output_dir: str | Path, step: int, also: Sequence[Path] = ()) -> Path | None:
    """Move the complete checkpoints saved after `step` into `checkpoints/abandoned-after-step-N/`.

    A run resumed from an older checkpoint of its own folder starts a new future from `step`; the
    checkpoints of the abandoned one must neither be taken for `latest` nor make `--save_total_limit`
    delete the new saves. They are kept (nothing is deleted unasked), where neither looks. `also`: more
    of the abandoned future's outputs to keep beside them (the caller knows which).
    """
    later = [p for p in complete_checkpoints(output_dir) if int(p.name.split("-")[1]) > step] + list(also)
    if not later:
        return None
    aside = checkpoints_dir(output_dir) / f"abandoned-after-{step_dir_name(step)}"
    if aside.exists():  # a second resume from the same step: keep both abandoned futures apart
        aside = aside.with_name(f"{aside.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    aside.mkdir()
    for path in later:
        os.replace(path, aside / path.name)
    fsync_dir(checkpoints_dir(output_dir))
    return aside


def read_state(path: Path) -> TrainerState:
    try:
        return TrainerState(**json.loads((path / STATE_FILE).read_text()))
    except (ValueError, TypeError) as err:
        raise BadInput(f"{path / STATE_FILE}: unreadable trainer state ({err})") from err


def rng_file(rank: int) -> str:
    """The file of rank `rank`'s RNG states in a checkpoint (accelerate's save_state writes one per rank)."""
    return f"{RNG_STATE_NAME}_{rank}.pkl"


def check_safe_loading(torch_version: str) -> None:
    """Refuse to resume where a checkpoint's pickles would be fully unpickled: accelerate loads
    `optimizer.bin` and `random_states_*.pkl` with `weights_only=True` only from torch 2.4 on."""
    release = tuple(int(part) for part in re.findall(r"\d+", torch_version.split("+")[0])[:2])
    if release < SAFE_LOADING_TORCH:
        raise BadInput(
            f"resuming needs torch >= {'.'.join(map(str, SAFE_LOADING_TORCH))} (installed: {torch_version}): "
            "older versions unpickle checkpoint files without restriction, so a damaged or foreign "
            "checkpoint could run code; upgrade torch"
        )


def state_files(world_size: int, sharded: bool) -> list[str]:
    """The model and optimizer files of a complete checkpoint. DDP: accelerate's safetensors and
    optimizer.bin. FSDP (SHARDED_STATE_DICT): one torch.distributed.checkpoint folder each for the model
    and the optimizer, with its metadata and one shard file per rank."""
    if not sharded:
        return [WEIGHTS_FILE, OPTIMIZER_FILE]
    return [f"{folder}/{name}" for folder in SHARDED_DIRS
            for name in (DCP_METADATA, *(f"__{rank}_0.distcp" for rank in range(world_size)))]


class _MetadataUnpickler(pickle.Unpickler):
    """torch.distributed.checkpoint's `.metadata` is a pickle that torch unpickles without restriction
    (its shard files it loads with weights_only=True): allow only the classes such metadata holds."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        allowed = (module, name) in DCP_METADATA_GLOBALS or module == "torch.distributed.checkpoint.metadata" or (
            module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)))
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of checkpoint metadata")
        return super().find_class(module, name)


def check_dcp_metadata(path: Path) -> None:
    """Refuse a sharded checkpoint whose metadata would run code, or is not metadata, before torch loads it."""
    try:
        with open(path, "rb") as handle:
            _MetadataUnpickler(handle).load()
    except Exception as err:  # noqa: BLE001 - UnpicklingError, EOFError, ValueError...
        raise BadInput(f"{path}: refused ({type(err).__name__}: {err}); the sharded checkpoint is damaged or "
                          "not written by mlm_ddp") from err


def check_files(path: Path, world_size: int, sharded: bool) -> tuple[TrainerState, dict]:
    """A checkpoint folder checked before anything loads it: written by this kind of run (sharded or
    not; an FSDP one on this number of processes), every file present, sharded metadata that runs no
    code. Returns its state and the config it was written with (run_folder.check_resume decides
    whether this run may continue it)."""
    import torch

    check_safe_loading(torch.__version__)
    state = read_state(path)
    written_sharded = (path / SHARDED_DIRS[0]).is_dir()
    if written_sharded != sharded:
        raise BadInput(
            f"{path} was written by a{'n FSDP' if written_sharded else ' DDP'} run (sharded state) and this run "
            f"{'shards the model with FSDP' if sharded else 'does not shard the model'}: resume it with the "
            "accelerate config that wrote it"
        )
    if sharded and state.world_size != world_size:
        raise BadInput(
            f"{path} is an FSDP checkpoint written by {state.world_size} process(es) and this run has "
            f"{world_size}: sharded checkpoints resume on the number of processes that wrote them; resume "
            f"with {state.world_size} process(es), or train with DDP to resume on another number"
        )
    expected = [STATE_FILE, SCHEDULER_FILE, "config.yaml", *state_files(state.world_size, sharded),
                *(rng_file(rank) for rank in range(state.world_size))]
    missing = [name for name in expected if not (path / name).is_file()]
    if missing:
        raise BadInput(f"{path}: not a checkpoint of this mlm_ddp version, or damaged: missing "
                          f"{', '.join(missing)}")
    if sharded:
        for folder in SHARDED_DIRS:
            check_dcp_metadata(path / folder / DCP_METADATA)
    try:
        saved = yaml.safe_load((path / "config.yaml").read_text())
    except yaml.YAMLError as err:
        raise BadInput(f"{path / 'config.yaml'}: unreadable ({err})") from err
    return state, saved if isinstance(saved, dict) else {}


def data_state_name(rank: int) -> str:
    return f"data_state_{rank}.json"


def read_data_state(path: Path, rank: int) -> dict | None:
    """Rank `rank`'s stream position in checkpoint `path` (None: map-style, or saved without one)."""
    file = path / data_state_name(rank)
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except ValueError as err:
        raise BadInput(f"{file}: unreadable stream position ({err})") from err


def temp_dir(output_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(output_dir) / f".tmp-{step_dir_name(step)}"


def written_by_rank(path: Path, rank: int) -> bool:
    """The files of a checkpoint that rank `rank` writes: its RNG states, its stream position, its own
    parts' sections, its FSDP shards. On a network filesystem only the writer's fsync makes them durable,
    so each rank fsyncs its own before the main process marks the checkpoint complete."""
    return path.name in (rng_file(rank), data_state_name(rank), rank_file(rank), f"__{rank}_0.distcp")


def finalize(tmp: Path, state: TrainerState, config_yaml: str,
             before_marker: Callable[[], None] | None = None) -> Path:
    """Main process, after every rank wrote into tmp: add state and config, fsync, mark, rename.
    `before_marker` runs when every file but the marker is durable (tests widen that window)."""
    (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
    (tmp / "config.yaml").write_text(config_yaml)
    fsync_tree(tmp)
    if before_marker is not None:
        before_marker()
    (tmp / MARKER).write_text("ok\n")
    fsync_tree(tmp)
    final = tmp.parent / step_dir_name(state.step)
    if final.exists():  # a save of the same step from an earlier, superseded attempt
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)  # the rename itself is durable before rotation deletes an older save
    return final


def rotate(output_dir: str | Path, keep: int | None) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints; returns what was deleted."""
    if keep is None:
        return []
    doomed = complete_checkpoints(output_dir)[:-keep]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


class StopSignals:
    """Remembers the first stop signal (--stop_signals). The handler only sets a flag, so the loop
    decides when to stop (at an optimizer-step boundary, all ranks together, after one last save) and
    a second signal during the save changes nothing."""

    def __init__(self, names: list[str]) -> None:
        self.names, self.received, self._previous = names, None, {}

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def end_if_received(self, names: tuple[str, ...] = ("SIGTERM", "SIGINT")) -> None:
        """Before the process joins the job, there is no one to agree with and nothing to save: end it as
        `names`' default action would if one of them came already (a launcher stopping its workers, a
        cancel). Called just before the join, which then ends the process at once on them itself."""
        if self.received in names:
            signum = getattr(signal, self.received)
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    def votes(self) -> list[float]:
        """This process's vote for the step's all-reduce: 1 in the slot of the signal it received."""
        return [float(name == self.received) for name in self.names]

    def agreed(self, summed: list[float]) -> list[str]:
        """The signals any process received, from the summed votes, in --stop_signals order."""
        return [name for name, votes in zip(self.names, summed, strict=True) if votes > 0]

    def __enter__(self) -> StopSignals:
        for name in self.names:
            self._previous[name] = signal.signal(getattr(signal, name), self._handle)
        return self

    def __exit__(self, *_exc: Any) -> None:
        for name, handler in self._previous.items():
            signal.signal(getattr(signal, name), handler)


Position = Callable[[], "tuple[TrainerState, dict | None]"]  # the state to save, and this rank's stream position


class Checkpointer:
    """The all-ranks half of the protocol and its cadence: a save every --checkpointing_steps steps,
    or at the first step that completes each epoch ('epoch'), and one more on a stop signal; rotation
    (--save_total_limit); restoring. Every rank calls every method at the same point: they hold
    collectives (the waits on the main process run on `wait`'s long-timeout group)."""

    def __init__(self, run: RunConfig, accelerator: Any, wait: Any, scheduler: Any, config_yaml: str,
                 resumed_step: int | None, before_marker: Callable[[], None] | None = None,
                 beat: PhaseReport = unreported) -> None:
        self.out, self.every, self.keep = Path(run.output_dir), run.checkpointing_steps, run.save_total_limit
        # saves and loads: their collectives (FSDP, torch.distributed.checkpoint) wait --save_timeout
        self.patient = functools.partial(patient_collectives, run.save_timeout, run.ddp_timeout)
        self.accelerator, self.wait, self.scheduler = accelerator, wait, scheduler
        self.config_yaml, self.before_marker, self.beat = config_yaml, before_marker, beat
        self.saved_step = resumed_step  # the step of this run's newest complete checkpoint
        self.allow_lr_jump = run.allow_lr_jump
        self.parts = Parts(accelerator.process_index)

    def register(self, name: str, part: Stateful, per_rank: bool = False) -> None:
        """A part every checkpoint saves and every resume and rollback restores (resumable.py)."""
        self.parts.register(name, part, per_rank)

    def due(self, step: int, epoch_ended: bool) -> bool:
        every = self.every
        return (every == "epoch" and epoch_ended) or (every not in (None, "epoch") and step % int(every) == 0)

    def maybe(self, step: int, epoch_ended: bool, position: Position) -> None:
        """After an optimizer step: save if this step is due. `position` is called only then (it may
        hold a collective)."""
        self.beat(step, "checkpoint")
        if self.due(step, epoch_ended):
            self.save(*position())

    def latest(self) -> Path | None:
        done = complete_checkpoints(self.out)
        return done[-1] if done else None

    def agreed_latest(self) -> tuple[Path, TrainerState] | None:
        """The newest complete checkpoint and its state as the main process reads them, on every rank (a
        collective on the long-timeout group). Each rank listing the folder itself could disagree on a
        filesystem with client caching (NFS) just after a save: some ranks would reload and others not,
        and their collectives would go out of step."""
        found = None
        if self.accelerator.is_main_process and (latest := self.latest()) is not None:
            found = (latest, read_state(latest))
        return self.wait.broadcast(found)

    def save(self, state: TrainerState, data_state: dict | None = None) -> Path:
        """Every rank writes its part into a temporary folder; the main process completes and renames it.

        If any rank fails to write (disk full, quota, ...), all ranks learn it, the temporary folder is
        removed and CheckpointWriteError names the previous complete checkpoint, which stays usable.
        """
        accelerator, is_main = self.accelerator, self.accelerator.is_main_process
        tmp, final = temp_dir(self.out, state.step), checkpoints_dir(self.out) / step_dir_name(state.step)
        parts = self.parts.collect()  # every rank at once: a part's state may be a collective (the log's sums)
        if is_main and tmp.exists():
            shutil.rmtree(tmp)  # the leftovers of a save that was interrupted
        self.wait.barrier()
        error: Exception | None = None
        try:
            with self.patient():
                accelerator.save_state(str(tmp))
            self.parts.write(tmp, parts, is_main)
            if data_state is not None:  # this rank's stream position
                (tmp / data_state_name(accelerator.process_index)).write_text(json.dumps(data_state))
            if not is_main:  # the main process fsyncs the whole folder in `finalize`
                fsync_tree(tmp, functools.partial(written_by_rank, rank=accelerator.process_index))
        except Exception as err:  # safetensors and torch.save report a full disk in their own types
            error = err
        self._agree_saved(tmp, final, error)
        if is_main:
            try:
                # JSON, not a pickle: a resume never unpickles what the user did not write
                (tmp / SCHEDULER_FILE).write_text(json.dumps(self.scheduler.state_dict()))
                final = finalize(tmp, state, self.config_yaml, self.before_marker)
            except Exception as err:
                error = err
        self._agree_saved(tmp, final, error)
        if is_main:
            for gone in rotate(self.out, self.keep):
                logger.info("deleted old checkpoint %s (--save_total_limit %s)", gone.name, self.keep)
            logger.info("saved checkpoint %s", final)
        self.wait.barrier()
        self.saved_step = state.step
        return final

    def _agree_saved(self, tmp: Path, final: Path, error: Exception | None) -> None:
        """A collective: raise CheckpointWriteError on every rank if the save failed on any rank."""
        if not self.wait.any(error is not None):
            return
        if self.accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = self.latest()
        cause = f"{type(error).__name__}: {error}" if error is not None else "failed on another process"
        raise CheckpointWriteError(
            f"checkpoint {final.name} could not be written ({cause}); "
            + (f"the previous checkpoint {previous} is complete and intact: free space or fix the folder, "
               "then resume with --resume_from_checkpoint latest" if previous else "no earlier checkpoint exists")
        )

    def save_for_stop(self, state: TrainerState, data_state: dict | None) -> Path:
        """The checkpoint of a stop at this step boundary: saved now, unless this step's exists."""
        self.beat(state.step, "checkpoint")
        if self.saved_step == state.step:
            return checkpoints_dir(self.out) / step_dir_name(state.step)
        return self.save(state, data_state)

    def resume(self, start: Any, precision: tuple[str, str]) -> dict | None:
        """Restore the start's checkpoint (`start`: run_folder.Start; a fresh run has none) and say what differs
        from it; returns this rank's saved stream position (None: nothing saved, or saved by another number
        of processes, whose ranks read other parts of the stream)."""
        if start.resume_from is None:
            return None
        self.restore(start.resume_from, start.accepted_changes, start.state.step,
                     same_world=start.written_by == start.world_size)
        logger.info("resumed from %s at step %d%s", start.resume_from, start.state.step,
                    f", written by {start.written_by} process(es)" if start.elastic else "")
        if start.note:
            logger.warning("%s", start.note)
        if start.state.precision not in (None, precision[0]):
            logger.warning("the precision changed: the checkpoint trained in %s, this run trains in %s (%s)",
                           start.state.precision, *precision)
        return None if start.elastic else read_data_state(start.resume_from, self.accelerator.process_index)

    def restore(self, path: Path, accepted_changes: dict, step: int, same_world: bool = True) -> None:
        """Load a checkpoint that `run_folder.check_resume` accepted, and restore every registered part
        (`same_world`: this number of processes wrote it). Tensors come from safetensors or from
        `torch.load(weights_only=True)` (accelerate's default), the scheduler and the parts from JSON: a folder
        that holds anything else is refused, never executed."""
        import torch

        from mlm_ddp.loop.optim import implementation, restore_implementation

        for key, (old, new) in accepted_changes.items():
            logger.info("resuming with a changed setting: %s %r -> %r", key, old, new)
        self.beat(step, "checkpoint")  # a rollback's load: its collectives wait up to --save_timeout
        try:
            schedule = json.loads((path / SCHEDULER_FILE).read_text())
            jump = check_continuation(self.scheduler, schedule, accepted_changes, self.allow_lr_jump)
            if jump:
                logger.warning(jump)
            # the optimizer the schedule steps, the one accelerate prepared (and load_state loads): this run's
            # --optimizer_impl is put back over the checkpoint's
            optimizer = self.scheduler.optimizer
            flags = implementation(optimizer)
            with self.patient():
                self.accelerator.load_state(str(path))
                # every rank waits here for the slowest load (a whole DDP checkpoint from a busy network
                # filesystem), under --save_timeout: the first collective after it waits only --ddp_timeout
                self.accelerator.wait_for_everyone()
            restore_implementation(optimizer, flags)
            # its step count only: this run's schedule (schedule.py) sets the rate from there
            continue_schedule(self.scheduler, schedule)
            # accelerate restores its micro-batch counter, which decides the micro-batch that all-reduces
            # the gradients: recount it for this run's accumulation (a resume may change it)
            set_micro_batch_count(self.accelerator, step * self.accelerator.gradient_accumulation_steps)
            self.parts.load(path, same_world)
        except (torch.distributed.DistError, BadInput):
            raise
        except Exception as err:  # safetensors, torch.load and load_state_dict each have their own types
            raise BadInput(f"{path}: cannot be resumed from ({type(err).__name__}: {str(err)[:400]}); it is "
                           "damaged, from another model, or not written by mlm_ddp") from err
