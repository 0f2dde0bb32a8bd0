"""The run's folder, --output_dir, and the one home of its policy: may this run use the folder (never
another run's outputs unasked), and from which checkpoint, with which counters, does it start.
`RunFolder(cfg).plan(...)` answers both before anything is written, as one value (`Start`) that the
run passes on; `prepare` is the run's first write.

Also what the run writes at its top level: `config.yaml`, `stopped.json`, `summary.json`, `final/`,
`report.html` (whether the run there finished: `finished.py`). Checkpoint files (`checkpoints/`: write,
validate, rotate, restore) are `checkpoint.py`'s; metrics and logs `run_log.py`'s.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import datasets
from accelerate import Accelerator
from accelerate.logging import get_logger

from mlm_ddp import data as mdata
from mlm_ddp.cluster import flight
from mlm_ddp.cluster.collectives import MainProcessWait, patient_collectives
from mlm_ddp.cluster.durable import unwritable, write_atomic
from mlm_ddp.config import Config
from mlm_ddp.errors import EXIT_REQUEUE, AlreadyFinished, BadInput
from mlm_ddp.loop import branch
from mlm_ddp.loop import checkpoint as ckpt
from mlm_ddp.loop.evaluation import HELD_OUT
from mlm_ddp.model.loading import inner_state_dict
from mlm_ddp.run import st_files
from mlm_ddp.run.finished import (
    PREVIOUS_SUMMARY,
    SUMMARY_FILE,
    end_if_finished,
    finished_summary,
    saved_config,
    set_aside,
)
from mlm_ddp.run.report import write_report
from mlm_ddp.run.run_log import read_metrics_lines

logger = get_logger(__name__)
STOPPED_FILE = "stopped.json"  # why a run stopped early; torchrun turns every worker exit code into 1
# everything a run writes into its folder: what --overwrite_output_dir removes
BEST_PROBE = "best_probe"  # --probe_every_eval: the model of the best downstream probe score (probing.py)
BEST_PROBE_FILE = "probe.json"  # in best_probe/: its step and figures
RUN_OUTPUTS = ("config.yaml", "metrics.jsonl", SUMMARY_FILE, PREVIOUS_SUMMARY, "final", "checkpoints", "logs",
               STOPPED_FILE, "report.html", "report_plots", BEST_PROBE, "probe_before.json", flight.FOLDER)


# Settings that may differ on resume: they change what is logged or kept and how long the run goes,
# not what an optimizer step computes. Any other change is refused.
RESUMABLE_CHANGES = {
    "run.output_dir", "run.overwrite_output_dir", "run.logging_steps", "run.eval_steps",
    "run.checkpointing_steps", "run.save_total_limit", "run.resume_from_checkpoint", "run.with_tracking",
    "run.report_to", "run.report", "run.stop_signals", "run.ddp_timeout", "run.rendezvous_timeout",
    "run.preprocessing_timeout", "training.torch_compile_backend", "training.torch_compile_mode",
    "run.save_timeout", "run.allow_lr_jump", "run.on_nonfinite_loss", "run.on_loss_spike", "run.loss_spike_factor",
    "run.loss_spike_window", "run.peak_tflops", "training.max_train_steps", "training.num_train_epochs",
    "training.cpu_threads",
    "data.allow_source_changes",  # says whether the sources may change, changes nothing a step computes
    "data.preprocessing_num_workers", "model.mlm_head", "model.fsdp_wrap_classes", "training.optimizer_impl",
    "training.torch_compile", "run.push_to_hub", "run.hub_model_id", "run.hub_token", "data.overwrite_cache",
    "model.trust_remote_code", "model.low_cpu_mem_usage", "model.gradient_checkpointing",
    # the downstream probe reads the model; it changes nothing a step computes
    "run.probe_train_file", "run.probe_test_file", "run.probe_text_column", "run.probe_label_column",
    # what is evaluated, not what a step computes (held-out files: not whether there are any, see check_resume)
    "data.eval_mlm_probability", HELD_OUT,
    "run.probe_mode", "run.probe_max_train_per_label", "run.probe_seeds", "run.probe_every_eval", "run.probe_protocol",
}
# how the global batch is split: may change on resume when the product with the processes is kept
BATCH_SPLIT = {"training.per_device_train_batch_size", "training.gradient_accumulation_steps",
               "training.global_batch_size"}


@dataclass(frozen=True)
class Start:
    """Where this run starts, decided before anything is written (`RunFolder.plan`): the one value the
    rest of the run takes its start from."""

    state: ckpt.TrainerState  # the counters it continues from: step 0's, or the checkpoint's
    world_size: int  # this run's processes
    resume_from: Path | None = None  # the checkpoint to continue from
    clear_earlier: bool = False  # remove the outputs already there (RUN_OUTPUTS) before starting
    own_checkpoint: bool = False  # resume_from lies in --output_dir (not another run's folder)
    accepted_changes: dict = field(default_factory=dict)  # settings the checkpoint was written with that change
    written_by: int = 0  # processes that wrote resume_from (this run's when starting afresh)
    note: str | None = None  # what a stream resumed on another number of processes skips; what older counts hold
    stale_stream: bool = False  # the checkpoint's stream positions are of an earlier layout (data.stream)

    @property
    def saved_step(self) -> int | None:
        """The step of the checkpoint already in this run's checkpoints/, where a stop at that step saves none;
        a checkpoint of another run's folder is not in this one's."""
        return self.state.step if self.own_checkpoint else None

    @property
    def elastic(self) -> bool:
        """Resuming a checkpoint whose saved stream positions this run does not use: another number of
        processes wrote it, or an earlier version in another layout; its stream goes on at the next epoch."""
        return self.written_by != self.world_size or self.stale_stream


def resolve_resume(spec: str, output_dir: str | Path) -> Path:
    """'latest' -> the newest complete checkpoint of output_dir; else the folder given, checked."""
    if spec == "latest":
        found = ckpt.complete_checkpoints(output_dir)
        if not found:
            raise BadInput(
                f"--resume_from_checkpoint latest: no complete checkpoint in {ckpt.checkpoints_dir(output_dir)}"
            )
        return found[-1]
    path = Path(spec)
    if not path.is_dir():
        raise BadInput(f"--resume_from_checkpoint {spec}: no such folder")
    if not ckpt.is_complete(path):
        raise BadInput(
            f"--resume_from_checkpoint {spec}: not a complete mlm_ddp checkpoint (no {ckpt.MARKER} marker "
            f"or {ckpt.STATE_FILE}); it may be a save that was interrupted"
        )
    return path


def config_changes(saved: dict, current: dict) -> dict[str, tuple[object, object]]:
    """'section.key' -> (saved value, current value) for every setting that differs. A setting the saved
    config lacks (written by an mlm_ddp without that flag) counts as the flag's default: the older run
    behaved as the default does."""
    defaults = Config().to_dict()
    changes = {}
    for section in sorted(set(saved) | set(current)):
        old, new = saved.get(section) or {}, current.get(section) or {}
        for key in sorted(set(old) | set(new)):
            before = old[key] if key in old else defaults.get(section, {}).get(key)
            if isinstance(before, str) and isinstance(new.get(key), list):  # a single value, before lists
                before = [before]
            if before != new.get(key):
                changes[f"{section}.{key}"] = (before, new.get(key))
    return changes


def check_resume(path: Path, current: dict, world_size: int, sharded: bool = False,
                 accepted: frozenset[str] = frozenset(),
                 check_saved: Callable[[dict], None] | None = None) -> tuple[ckpt.TrainerState, dict]:
    """The state to continue from, after checking that this run may continue it; also returns the
    accepted config changes (to be logged). Refusals name what differs. Another number of processes
    is accepted when the global batch is kept (`check_global_batch`); `accepted`: more settings that
    may change (a decay branch's: branch.BRANCH_CHANGES); `check_saved`: a last check of the config the
    checkpoint was written with (a decay branch's source: branch.check_source)."""
    state, saved = ckpt.check_files(path, world_size, sharded)
    old_batch, old_accumulation = _batch_split(saved)
    check_global_batch(path, (old_batch, state.world_size, old_accumulation), (*_batch_split(current), world_size))
    changes = config_changes(saved, current)
    # without --validation_file a share of the training text is held out: adding or dropping one changes training
    refused = {k: v for k, v in changes.items()
               if k not in RESUMABLE_CHANGES | BATCH_SPLIT | accepted or (k == HELD_OUT and None in v)}
    if refused:
        listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in refused.items())
        raise BadInput(
            f"{path} was written with other settings ({listed}). They change what a step computes, so "
            "the resumed run would not continue the same training: resume with the checkpoint's "
            "settings (its config.yaml), or start a new run in another --output_dir"
        )
    if state.layout_batch is None:  # written before layouts were saved: its own micro-batch
        state.layout_batch = old_batch * state.world_size
    if state.block_in_epoch is None:
        state.block_in_epoch = state.batch_in_epoch * state.layout_batch
    if check_saved is not None:
        check_saved(saved)
    return state, changes


def _batch_split(config: dict) -> tuple[int, int]:
    """(per-device batch, accumulation) of a config dict."""
    training = config.get("training") or {}
    return int(training.get("per_device_train_batch_size") or 0), int(training.get("gradient_accumulation_steps") or 1)


def check_global_batch(path: Path, written: tuple[int, int, int], now: tuple[int, int, int]) -> None:
    """Refuse a resume whose global batch (per-device batch x processes x accumulation) differs from
    the checkpoint's, with the arithmetic and the flags that would keep it."""
    (old_batch, old_world, old_accumulation), (batch, world, accumulation) = written, now
    kept = old_batch * old_world * old_accumulation
    if batch * world * accumulation == kept:
        return
    if kept % world:
        fix = (f"{kept} sequences do not split over {world} processes: resume on a number of processes that "
               f"divides {kept}")
    else:
        per_process = kept // world
        options = ([f"--gradient_accumulation_steps {per_process // batch}"] if per_process % batch == 0 else []) + (
            [f"--per_device_train_batch_size {per_process // accumulation}"] if per_process % accumulation == 0 else [])
        options = options or [f"--per_device_train_batch_size {per_process} --gradient_accumulation_steps 1"]
        fix = (f"with {world} process(es), per-device batch x accumulation must be {per_process}: use "
               + " or ".join(options))
    raise BadInput(
        f"{path} was written with a global batch of {kept} sequences per optimizer step ({old_batch} per device x "
        f"{old_world} process(es) x {old_accumulation} accumulation) and this run's is {batch * world * accumulation} "
        f"({batch} x {world} x {accumulation}); another global batch would change what every step computes. "
        f"Keep it: {fix}"
    )


def elastic_stream_start(path: Path, state: ckpt.TrainerState, world_size: int,
                         file_bytes: int | None, stale: bool = False) -> tuple[ckpt.TrainerState, str]:
    """Where a stream checkpoint of another number of processes resumes: each rank's saved position
    is in its own part of the stream, which another number of processes splits differently, so the
    run goes on at the next epoch's start; returns that state and the log line saying what is skipped
    (`file_bytes`: the stream's files' size, when they are local files). So too a checkpoint whose
    positions are `stale` (data.stream.stale_stream_position: an earlier version's layout)."""
    written = ("was written by an earlier mlm_ddp, which read a stream as one where this one reads its files one "
               "by one (docs/data.md, \"Which texts a stream holds out\"): its saved positions name no text here"
               if stale else f"was written by {state.world_size} process(es) and this run has {world_size}: their "
               "parts of the stream differ")
    if state.batch_in_epoch == 0:
        return replace(state, world_size=world_size), (
            f"the stream resumes at the start of epoch {state.epoch} on {world_size} process(es) "
            f"(written by {state.world_size}); nothing is skipped")
    reads = [ckpt.read_data_state(path, rank) or {} for rank in range(state.world_size)]
    blocks = sum(r.get("epoch_blocks", 0) for r in reads)
    texts, text_bytes = sum(r.get("texts", 0) for r in reads), sum(r.get("bytes", 0) for r in reads)
    line = (f"the stream checkpoint {path.name} {written}, so training goes on at the start of epoch "
            f"{state.epoch + 1}; the rest of epoch {state.epoch} is skipped. Its {state.world_size} part(s) had "
            f"trained on {blocks} packed block(s) of it, from {texts} text(s) ({text_bytes / 1e6:.1f} MB) before "
            "each part's current chunk and part of that chunk")
    if file_bytes:
        skipped = max(file_bytes - text_bytes, 0)
        line += (f"; the stream's files hold {file_bytes / 1e6:.1f} MB, so at most {skipped / 1e6:.1f} MB "
                 f"({skipped / file_bytes:.0%}) of the epoch is skipped")
    return replace(state, epoch=state.epoch + 1, batch_in_epoch=0, block_in_epoch=0, world_size=world_size), line


FolderPlan = tuple[Path | None, bool, bool]  # (resume from, clear the earlier outputs, a checkpoint of this folder)


def agree_on_resume(resume_from: Path | None, wait: MainProcessWait) -> None:
    """Every rank found the same checkpoint to resume from (each resolved `latest`/`auto` from its own view
    of the folder, before the processes could talk), or every rank stops here, before anything is written
    (a collective on the long-timeout group)."""
    views = wait.gather(None if resume_from is None else str(resume_from))
    if len(set(views)) > 1:
        seen = "; ".join(f"rank {rank}: {view or 'none (a fresh start)'}" for rank, view in enumerate(views)
                         if view != views[0] or rank == 0)
        raise BadInput(f"the processes found different checkpoints to resume from ({seen}): the output folder "
                       "looks different from different nodes (a filesystem that caches listings, or a copy per "
                       "node); let it settle and launch again, or pass --resume_from_checkpoint with one folder")


class RunFolder:
    """--output_dir of one run. `plan()` decides before anything is written; `prepare()` is the
    run's first write; the rest write the run's top-level files (main process; every rank calls)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg, self.path = cfg, Path(cfg.run.output_dir)

    def earlier_outputs(self) -> list[str]:
        return [name for name in RUN_OUTPUTS if (self.path / name).exists()]

    def notes(self) -> list[str]:
        """Warning lines about what this run will write from and into (the run goes on): the data flags'
        (`data_notes`), and --output_dir holding files of no run (the user's own). Those are warned, not refused as
        prepare refuses them: a run touches only its own names (RUN_OUTPUTS, which alone --overwrite_output_dir
        removes), and a run's folder often holds files before its first start (submit's submitit/, a job's log)."""
        notes = mdata.data_notes(self.cfg.data)
        if not self.path.is_dir() or self.earlier_outputs():
            return notes
        theirs = sorted(p.name for p in self.path.iterdir() if p.name != "submitit" and not p.name.startswith("."))
        shown = ", ".join(theirs[:5]) + (f" and {len(theirs) - 5} more" if len(theirs) > 5 else "")
        return notes + ([f"--output_dir {self.path} holds files of no run ({shown}): the run's files go beside them "
                         "(not removed, not even by --overwrite_output_dir); choose an empty --output_dir to keep them "
                         "apart"] if theirs else [])

    def _is_same_run(self) -> bool:
        """The folder holds an attempt of this very run: its config.yaml differs only in settings a
        resume may change (or it died before writing one, leaving no metrics, model or summary behind)."""
        if not (self.path / "config.yaml").is_file():
            return not any((self.path / name).exists() for name in ("metrics.jsonl", SUMMARY_FILE, "final"))
        if not (saved := saved_config(self.path)):
            return False
        changes = config_changes(saved, self.cfg.to_dict())
        return all(key in RESUMABLE_CHANGES for key in changes)

    def plan(self, world_size: int, sharded: bool, stream_bytes: Callable[[], int | None]) -> Start:
        """May this run use --output_dir, and where does it start: refuse to clobber another run unasked,
        whatever the resume source; find the checkpoint and check that this run may continue it (the same
        settings and global batch; a stream on another number of processes goes on at the next epoch,
        `stream_bytes`: what its local files hold, or None). Nothing is written."""
        st_files.check(self.cfg.model)  # final/ must be writable whole: refuse damaged pipeline files now
        path, clear_earlier, own = self._folder_plan()
        if path is None:
            fresh = ckpt.TrainerState(step=0, epoch=0, batch_in_epoch=0, tokens_seen=0, world_size=world_size)
            return Start(fresh, world_size, None, clear_earlier, written_by=world_size)
        data, branching = self.cfg.data, self.cfg.run.decay_from is not None and not own
        accepted = (branch.BRANCH_CHANGES if branching else frozenset()) | mdata.source_changes(data)
        # a decay branch starts from another run's checkpoint of the stable phase
        source = functools.partial(branch.check_source, path) if branching else None
        state, changes = check_resume(path, self.cfg.to_dict(), world_size, sharded=sharded, accepted=accepted,
                                      check_saved=source)
        if data.streaming:
            mdata.check_stream_resume(datasets.__version__)
        metrics = self.path / "metrics.jsonl"
        if own and metrics.exists():
            read_metrics_lines(metrics)  # a damaged line stops every rank here, not rank 0 later
        written_by, note = state.world_size, None
        stale = data.streaming and mdata.stale_stream_position(ckpt.read_data_state(path, 0))
        if data.streaming and (written_by != world_size or stale):
            state, note = elastic_stream_start(path, state, world_size, stream_bytes(), stale)
        note = mdata.uncounted_note(data, state, changes, written_by != world_size or stale, note)
        return Start(state, world_size, path, clear_earlier, own, changes, written_by, note, stale)

    def _folder_plan(self) -> FolderPlan:
        """The folder's part of the plan: what to resume from, whether to clear what is there."""
        out, run = self.path, self.cfg.run
        if (problem := unwritable(out)) is not None:  # a read-only place failed the first write with a traceback
            raise BadInput(f"--output_dir {out}: {problem}; choose another --output_dir")
        earlier = self.earlier_outputs()
        if run.decay_from is not None:
            return self._plan_branch(earlier)
        if run.resume_from_checkpoint == "auto":
            return self._plan_auto(earlier)
        if run.resume_from_checkpoint is not None:
            return self._plan_resume(run.resume_from_checkpoint, earlier)
        if earlier and not run.overwrite_output_dir:
            if finished_summary(out) is not None or (out / "final").exists():
                raise BadInput(f"--output_dir {out} already holds a finished run; pass --overwrite_output_dir to "
                               "replace it, or choose another --output_dir")
            done = ckpt.complete_checkpoints(out)
            hint = (f"pass --resume_from_checkpoint latest to continue from {done[-1].name}, or "
                    if done else "pass ")
            raise BadInput(f"--output_dir {out} already holds an unfinished run ({', '.join(earlier)}); "
                           f"{hint}--overwrite_output_dir to start over")
        return None, run.overwrite_output_dir and bool(earlier), False

    def _plan_auto(self, earlier: list[str]) -> FolderPlan:
        out = self.path
        if self.cfg.run.overwrite_output_dir:
            raise BadInput("--resume_from_checkpoint auto and --overwrite_output_dir contradict each other")
        if finished_summary(out) is not None:
            raise AlreadyFinished(f"--output_dir {out} holds a finished run: nothing to do")
        done = ckpt.complete_checkpoints(out)
        if done:
            return done[-1], False, True
        if earlier and not self._is_same_run():
            raise BadInput(
                f"--resume_from_checkpoint auto: --output_dir {out} holds another run ({', '.join(earlier)}; "
                "its config.yaml differs) that saved no checkpoint; choose another --output_dir, or remove "
                "that folder if it is not needed"
            )
        # an earlier attempt of this run died before its first checkpoint: nothing to continue from
        return None, bool(earlier), False

    def _plan_branch(self, earlier: list[str]) -> FolderPlan:
        """--decay_from: start from the source checkpoint, or (--resume_from_checkpoint) continue the
        branch's own checkpoints; 'auto': its own newest, else the source."""
        run, out, source = self.cfg.run, self.path, Path(self.cfg.run.decay_from)
        spec = run.resume_from_checkpoint
        if spec == "auto":
            path, clear, own = self._plan_auto(earlier)
            if path is not None:
                return path, clear, own
        elif spec is not None:
            path, clear, own = self._plan_resume(spec, earlier)
            if not own:
                raise BadInput(f"--resume_from_checkpoint {spec} with --decay_from: it continues this branch's own "
                               f"checkpoints, in --output_dir {out}; --decay_from names where the branch starts")
            return path, clear, own
        if not source.is_dir():
            raise BadInput(f"--decay_from {source}: no such folder")
        branch.check_outside(source, out)
        path, clear, own = self._plan_resume(str(source), [] if spec == "auto" else earlier)
        return path, clear or (spec == "auto" and bool(earlier)), own

    def _plan_resume(self, spec: str, earlier: list[str]) -> FolderPlan:
        out, overwrite = self.path, self.cfg.run.overwrite_output_dir
        path = resolve_resume(spec, out)
        own = out.resolve() in path.resolve().parents
        if own and overwrite:
            raise BadInput(f"--resume_from_checkpoint {spec} lies in --output_dir {out}, which "
                           "--overwrite_output_dir would delete: drop one of the two")
        if not own and earlier and not overwrite:
            raise BadInput(
                f"--output_dir {out} holds another run ({', '.join(earlier)}); continuing {path} there would "
                "overwrite its metrics, checkpoints and model: choose an empty --output_dir, or pass "
                "--overwrite_output_dir to replace that run"
            )
        if own and not overwrite:
            end_if_finished(self.cfg, path)  # a finished run resumed at its end: nothing to do, as with auto
        return path, overwrite and bool(earlier), own

    def prepare(self, accelerator: Accelerator, wait: MainProcessWait, start: Start) -> None:
        """The run's first write, after every check passed: remove what the plan replaces, write
        config.yaml, and set aside the checkpoints of a future a resume abandons."""
        out = self.path
        if accelerator.is_main_process:
            if start.clear_earlier:
                why = ("--overwrite_output_dir" if self.cfg.run.overwrite_output_dir else
                       "--resume_from_checkpoint auto: an earlier attempt of this run saved no checkpoint")
                logger.info("removing the earlier run's %s from %s (%s)", ", ".join(self.earlier_outputs()), out, why)
                for name in RUN_OUTPUTS:
                    target = out / name
                    if target.is_dir():
                        shutil.rmtree(target)
                    elif target.exists():
                        target.unlink()
            out.mkdir(parents=True, exist_ok=True)
        wait.barrier()
        if (line := branch.describe(self.cfg)) is not None:
            logger.info("%s", line)
        if accelerator.is_main_process:
            if start.own_checkpoint:  # trained further, the run is no longer finished (finished.py)
                set_aside(out)
            write_atomic(out / "config.yaml", self.cfg.to_yaml())
            flight.make_folder(os.environ)  # NCCL writes its Flight Recorder dumps there on a timeout
            (out / STOPPED_FILE).unlink(missing_ok=True)  # this run continues what stopped
            later = self._later_best(start.state.step) if start.own_checkpoint else []
            if start.own_checkpoint and (aside := ckpt.set_aside_later(out, start.state.step, later)) is not None:
                logger.warning("resumed from step %d: the later checkpoints%s of the abandoned run were moved to %s "
                               "(not resumed from, not rotated)", start.state.step,
                               f" and {BEST_PROBE}/ (chosen after that step)" if later else "", aside)
        for partial in ckpt.partial_checkpoints(out):
            logger.warning("ignoring %s: an incomplete checkpoint (no %s marker), left by a save that was "
                           "interrupted", partial, ckpt.MARKER)

    def _later_best(self, step: int) -> list[Path]:
        """best_probe/ where an evaluation after `step` chose it: a model of the future that a resume from `step`
        abandons. Left in place, it would stay this run's best unless the new future beat it, and be reported
        (even scored on the test set as final/, at the same step number) for a model this run never trained."""
        try:
            chosen = json.loads((self.path / BEST_PROBE / BEST_PROBE_FILE).read_text()).get("step")
        except (OSError, ValueError, AttributeError):
            return []
        return [self.path / BEST_PROBE] if isinstance(chosen, int) and chosen > step else []

    def write_stopped(self, is_main: bool, reason: str, step: int, checkpoint: Path) -> None:
        """Why the run stopped early, for the scheduler's logs and the next attempt (main process)."""
        if is_main:
            write_atomic(self.path / STOPPED_FILE, json.dumps(
                {"reason": reason, "step": step, "checkpoint": str(checkpoint), "exit_code": EXIT_REQUEUE}))

    def write_summary(self, is_main: bool, summary: dict[str, Any]) -> None:
        if is_main:
            write_atomic(self.path / SUMMARY_FILE, json.dumps(summary, indent=1))

    def save_final(self, accelerator: Accelerator, wait: MainProcessWait, model: Any, tokenizer: Any,
                   card: str) -> Path:
        """save_pretrained model + tokenizer, the model card (README.md) and a sentence-transformers
        source's pipeline files (st_files.py) into final/, via a temporary folder renamed at the end."""
        final, tmp = self.path / "final", self.path / ".tmp-final"
        wait.barrier()
        self.write_model(accelerator, model, tokenizer, card, tmp)
        if accelerator.is_main_process:
            replace_folder(tmp, final)
        wait.barrier()
        return final

    def write_model(self, accelerator: Accelerator, model: Any, tokenizer: Any, card: str, tmp: Path) -> None:
        """Every rank (FSDP gathers the shards to rank 0); the main process writes the model as final/ holds
        it into the folder `tmp`, which it empties first."""
        # FSDP gathers the shards on the training group: a slow rank here waits --save_timeout, as in a save
        with patient_collectives(self.cfg.run.save_timeout, self.cfg.run.ddp_timeout):
            weights = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            if tmp.exists():
                shutil.rmtree(tmp)
            inner = accelerator.unwrap_model(model).model  # the transformers model inside MaskedLMLoss
            inner.save_pretrained(tmp, state_dict=inner_state_dict(weights), safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            (tmp / "README.md").write_text(card)
            st_files.copy_into(self.cfg.model, tmp)  # a sentence-transformers source's pipeline files

    def write_report(self) -> None:
        """report.html and its plots (main process only)."""
        try:
            page, summary = write_report([self.path])
        except Exception as err:  # noqa: BLE001 - the model and metrics are saved: a plot must not fail the run
            logger.warning("the run report was not written (%s: %s); run python -m mlm_ddp.report %s to retry",
                           type(err).__name__, err, self.path)
            return
        logger.info("report: %s\n%s", page, summary)


def replace_folder(tmp: Path, target: Path) -> None:
    """`tmp`, complete, becomes `target`. An earlier `target` is moved aside first and removed last, so
    that a crash in between leaves one of the two whole."""
    aside = target.with_name(f".old-{target.name}")
    if aside.exists():
        shutil.rmtree(aside)
    if target.exists():
        target.rename(aside)
    tmp.rename(target)
    if aside.exists():
        shutil.rmtree(aside)
