"""`train(cfg)`: masked-LM fine-tuning on Accelerate; `accelerate launch -m mlm_ddp.train [flags]`.

Reads top to bottom, in four parts:
- `preflight`: every input is checked; nothing is written.
- `build`: the accelerator, the data, the model and optimizer, and the objects that own a concern
  each: `RunFolder` (run_folder.py), `RunLog` (run_log.py), `Evaluator` (evaluation.py),
  `Checkpointer` (checkpoint.py). The first write happens at the end of `build`.
- `fit`: the loop, in the shape of accelerate's complete_nlp_example. After each step, the log, the
  evaluator and the checkpointer each decide whether this step is theirs.
- `finish`: the final model, the summary, the report.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import datasets
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed

from mlm_ddp import checkpoint as ckpt
from mlm_ddp import data as mdata
from mlm_ddp import distributed, speed
from mlm_ddp.config import Config, parse_args
from mlm_ddp.errors import EXIT_FAILED, BadInput, NonFiniteLoss, Preempted, RunEnded
from mlm_ddp.evaluation import Evaluator, record_fields
from mlm_ddp.heartbeat import Beat, Heartbeat, Watch, diagnose
from mlm_ddp.hub import check_hub, push
from mlm_ddp.model import (
    load_model,
    load_model_config,
    load_tokenizer,
    max_positions,
    prepare_for_training,
)
from mlm_ddp.run_folder import OutputPlan, RunFolder, model_card
from mlm_ddp.run_log import RunLog, Utilisation, check_trackers, read_metrics_lines
from mlm_ddp.step import LossSpikeGuard, Spike, StepResult, masked_tokens, train_step

logger = get_logger(__name__)


@dataclass
class Hooks:
    """Seams for fault-injection tests (tests/fault_driver.py); no flag sets them."""

    before_checkpoint_marker: Callable[[], None] | None = None  # runs inside every save, before its marker
    on_beat: Callable[[Beat], None] | None = None  # runs after every heartbeat (e.g. to freeze a rank there)
    loss_factor: Callable[[int, int], float] | None = None  # (step, micro-batch) -> its loss multiplied by this


@dataclass
class TrainResult:
    """What a finished run did; also written to output_dir/summary.json."""

    steps: int
    tokens_seen: int
    wall_time_s: float
    tokens_per_s: float
    eval_before: dict[str, float] | None
    eval_after: dict[str, float] | None
    output_dir: str
    final_dir: str
    loss_spikes: dict[str, int] = field(default_factory=dict)  # "skipped", "rolled_back": steps of each
    mfu: float | None = None  # model FLOPs utilisation of the training steps (speed.py)


# ---------------------------------------------------------------------------------------------
# preflight: every input is checked before anything is written
# ---------------------------------------------------------------------------------------------


@dataclass
class Checked:
    """What the preflight found and loaded; nothing is written yet."""

    tokenizer: Any
    model_config: Any
    topo: distributed.Topology
    fsdp_plugin: Any
    precision: tuple[str, str]  # (the mixed precision it trains in, why)
    folder: RunFolder
    plan: OutputPlan
    start: ckpt.TrainerState  # where training starts: step 0, or the checkpoint's counters
    accepted_changes: dict  # settings the resumed checkpoint was written with that this run changes
    written_by: int  # processes that wrote the resumed checkpoint (this run's, when starting afresh)
    trackers: list[str]
    hub_repo: str | None  # where --push_to_hub uploads final/ (rank 0, which uploads; None elsewhere)
    raw_train: Any
    raw_eval: Any
    resume_note: str | None = None  # what a stream resumed on another number of processes skips

    @property
    def elastic(self) -> bool:
        """Resuming a checkpoint that another number of processes wrote."""
        return self.written_by != self.topo.world_size


def preflight(cfg: Config) -> Checked:
    tokenizer = load_tokenizer(cfg.model, needs_word_ids=cfg.data.whole_word_mask)
    model_config = load_model_config(cfg.model, tokenizer)
    limit = max_positions(model_config, tokenizer)
    if cfg.data.max_seq_length > limit:
        raise BadInput(f"--max_seq_length {cfg.data.max_seq_length} is above the model's maximum of "
                       f"{limit} tokens; use --max_seq_length {limit} or less")
    if len(tokenizer) > model_config.vocab_size:
        raise BadInput(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary only "
                       f"{model_config.vocab_size}; pass the model's own tokenizer")
    topo = distributed.detect()
    fsdp_plugin = distributed.fsdp_plugin_from_launcher()
    distributed.check_fsdp_plugin(fsdp_plugin, cuda=bool(topo.cuda_devices))
    precision = distributed.choose_precision(cfg.training.mixed_precision, distributed.launcher_precision(),
                                             distributed.hardware(topo))
    folder = RunFolder(cfg)
    plan = folder.plan()
    start = ckpt.TrainerState(step=0, epoch=0, batch_in_epoch=0, tokens_seen=0, world_size=topo.world_size)
    accepted_changes: dict = {}
    if plan.resume_from is not None:
        start, accepted_changes = ckpt.check_resume(plan.resume_from, cfg.to_dict(), topo.world_size,
                                                    sharded=fsdp_plugin is not None)
        if cfg.data.streaming:
            mdata.check_stream_resume(datasets.__version__)
        metrics = folder.path / "metrics.jsonl"
        if plan.own_checkpoint and metrics.exists():
            read_metrics_lines(metrics)  # a damaged line stops every rank here, not rank 0 later
    trackers, hub_repo = check_trackers(cfg.run), check_hub(cfg.run, uploads=topo.rank == 0)
    raw_train, raw_eval = mdata.load_text(cfg.data, cfg.training.seed)
    written_by, note = start.world_size, None
    if cfg.data.streaming and written_by != topo.world_size:
        sizes = mdata.shard_sizes(raw_train)
        start, note = ckpt.elastic_stream_start(plan.resume_from, start, topo.world_size, sum(sizes) if sizes else None)
    return Checked(tokenizer, model_config, topo, fsdp_plugin, precision, folder, plan, start, accepted_changes,
                   written_by, trackers, hub_repo, raw_train, raw_eval, note)


# ---------------------------------------------------------------------------------------------
# build: processes, data, model, and the objects beside the loop
# ---------------------------------------------------------------------------------------------


def load_weights(cfg: Config, checked: Checked, accelerator: Accelerator) -> Any:
    """The transformers model, loaded on every rank before anything is written: a bad checkpoint or an
    attention kernel the model lacks is a BadInput on all of them alike."""
    set_seed(cfg.training.seed)  # the fresh MLM head (if any) is initialised identically on every rank
    transformers_model = load_model(cfg.model, checked.model_config)
    if accelerator.device.type == "cpu":
        torch.set_num_threads(distributed.cpu_threads_per_process(cfg.training.cpu_threads))
    return transformers_model


@dataclass
class Training:
    """Everything `build` made, which `fit` and `finish` use."""

    cfg: Config
    checked: Checked
    accelerator: Accelerator
    wait: distributed.MainProcessWait  # the long-timeout group in which ranks wait for the main process
    data: mdata.RankData
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    feed: mdata.TrainFeed
    stream_state: dict | None  # this rank's saved stream position, when resuming a stream
    log: RunLog
    evaluator: Evaluator
    checkpointer: ckpt.Checkpointer
    heartbeat: Heartbeat
    hooks: Hooks
    guard: LossSpikeGuard | None  # --on_loss_spike
    skipped_steps: int = field(default=0)  # optimizer steps skipped for non-finite gradients
    overflows: int = field(default=0)  # fp16: updates the gradient scaler skipped while the losses were finite
    spikes: dict[str, int] = field(default_factory=lambda: {"skipped": 0, "rolled_back": 0})
    spiked_windows: set[tuple] = field(default_factory=set)  # positions of windows a rollback skips

    @property
    def start(self) -> ckpt.TrainerState:
        return self.checked.start


def build(cfg: Config, checked: Checked, hooks: Hooks) -> Training:
    accelerator = distributed.start_accelerator(
        checked.topo, checked.fsdp_plugin, cfg.training, checked.precision[0], cfg.run.ddp_timeout, checked.trackers,
        project_dir=str(checked.folder.path / "logs"))  # TensorBoard writes into logs/<TRACKING_PROJECT>/
    wait = distributed.MainProcessWait(accelerator.num_processes, cfg.run.save_timeout)
    agree_on_resume(checked.plan.resume_from, wait)
    transformers_model = load_weights(cfg, checked, accelerator)
    data = mdata.rank_data(cfg.data, cfg.training, checked.tokenizer, checked.raw_train, checked.raw_eval,
                           accelerator, cfg.run.preprocessing_timeout, checked.start.layout_batch)
    model, optimizer, scheduler, n_params = prepare_for_training(accelerator, transformers_model, cfg.model,
                                                                 cfg.training, data.total_steps)
    resume_from, start = checked.plan.resume_from, checked.start
    checkpointer = ckpt.Checkpointer(cfg.run, accelerator, wait, scheduler, cfg.to_yaml(),
                                     start.step if resume_from else None, hooks.before_checkpoint_marker)
    if resume_from is not None:
        checkpointer.restore(resume_from, checked.accepted_changes, start.step)
        logger.info("resumed from %s at step %d%s", resume_from, start.step,
                    f", written by {checked.written_by} process(es)" if checked.elastic else "")
        if checked.resume_note:
            logger.warning("%s", checked.resume_note)
    describe(cfg, checked, accelerator, data, model, n_params)
    # a stream position is this rank's part's: another number of processes has other parts
    stream_state = (ckpt.read_data_state(resume_from, accelerator.process_index)
                    if resume_from and not checked.elastic else None)
    feed = mdata.TrainFeed(data.train_loader, data.train_collator, cfg.training.gradient_accumulation_steps,
                           start.epoch, start.batch_in_epoch, functools.partial(distributed.any_rank, accelerator),
                           stream_state, functools.partial(distributed.gather_rows, accelerator),
                           start.block_in_epoch)
    if feed.stream and start.step < data.total_steps:  # only reading tells whether a stream fills a step
        feed.prime()  # before anything is written
    # the first write: every check passed, the checkpoint loaded and the stream fills a step
    checked.folder.prepare(accelerator, wait, checked.plan, start.step)
    log = RunLog(cfg, accelerator, checked.trackers, start.step, data.total_steps, resume_from is not None,
                 start.tokens_seen, utilisation(cfg, checked, accelerator, model))
    evaluator = Evaluator(cfg.run.eval_steps, data.total_steps, accelerator, model, data.eval_loader)
    heartbeat = Heartbeat(checked.folder.path, accelerator.process_index, accelerator.num_processes, hooks.on_beat,
                          watchdog(cfg, checked) if accelerator.num_processes > 1 else None)
    guard = None if cfg.run.on_loss_spike == "off" else LossSpikeGuard(cfg.run.loss_spike_factor,
                                                                      cfg.run.loss_spike_window)
    return Training(cfg, checked, accelerator, wait, data, model, optimizer, scheduler, feed, stream_state, log,
                    evaluator, checkpointer, heartbeat, hooks, guard)


SAVE_PHASES = ("checkpoint", "final save")  # their waits are on the long-timeout group (--save_timeout)


def watchdog(cfg: Config, checked: Checked) -> Watch:
    """The heartbeat's watchdog (heartbeat.Watch): it names a hang on every backend, before NCCL's own
    watchdog aborts the process without a word, records it in the run folder, and ends the process with
    exit 1 (the run's rank that waits; the launcher then stops the others)."""
    def timeout_s(phase: str) -> float:
        return cfg.run.save_timeout if phase in SAVE_PHASES else cfg.run.ddp_timeout

    def on_stall(line: str, waited: float, timeout: float) -> NoReturn:
        topo = checked.topo
        cause = TimeoutError(f"no progress for {waited:.0f} s in a phase whose collectives time out after "
                             f"{timeout:.0f} s: named by mlm_ddp's watchdog before the backend's own timeout")
        record = {"rank": topo.rank, "waited_s": round(waited, 1), "timeout_s": timeout, "hang": line,
                  "at": time.time()}
        ckpt.write_atomic(checked.folder.path / "heartbeat" / f"hang-rank-{topo.rank:05d}.json", json.dumps(record))
        say(f"mlm_ddp.train: error: {distributed.lost_contact(topo, cause)}\nmlm_ddp.train: error: hang: {line}")
        os._exit(EXIT_FAILED)  # the main thread is stuck in the collective: end here, as NCCL would, but named

    return Watch(timeout_s, on_stall)


def agree_on_resume(resume_from: Path | None, wait: distributed.MainProcessWait) -> None:
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


def utilisation(cfg: Config, checked: Checked, accelerator: Accelerator, model: torch.nn.Module) -> Utilisation | None:
    """What the log's MFU is computed from (None, with a line, when the model's FLOPs are not counted)."""
    if not speed.flops_known(checked.model_config):
        logger.info("MFU not logged: %s names its sizes otherwise than %s", type(checked.model_config).__name__,
                    ", ".join(speed.FLOP_FIELDS))
        return None
    peak = speed.peak_flops(cfg.run.peak_tflops, accelerator)
    logger.info("MFU against %.3f TFLOP/s per device (%s)", peak / 1e12,
                "--peak_tflops" if cfg.run.peak_tflops else "measured now: a matmul at the training precision")
    wrapper = accelerator.unwrap_model(model)
    return Utilisation(functools.partial(speed.training_flops_per_token, checked.model_config, cfg.data.max_seq_length),
                       wrapper.masked_only, peak, wrapper.last_layer_subset)


def describe(cfg: Config, checked: Checked, accelerator: Accelerator, data: mdata.RankData,
             model: torch.nn.Module, n_params: int) -> None:
    """The start-up lines: topology, data, model."""
    training, topo, world = cfg.training, checked.topo, accelerator.num_processes
    accumulation = training.gradient_accumulation_steps
    logger.info("topology: %d process(es) on %d node(s), %s, started by %s (master %s:%s); global batch "
                "%d = %d per device x %d processes x %d accumulation; precision %s (%s); device %s (%d threads)",
                world, topo.num_nodes, accelerator.distributed_type, topo.launcher, topo.master_addr or "-",
                topo.master_port or "-", training.per_device_train_batch_size * world * accumulation,
                training.per_device_train_batch_size, world, accumulation,
                *checked.precision, accelerator.device,
                torch.get_num_threads())
    logger.info("data: %s; %d optimizer steps", data.note, data.total_steps)
    wrapper = accelerator.unwrap_model(model)
    logger.info("model: %s, %.1fM parameters; MLM head on %s positions; last layer on %s positions; attention "
                "%s; dropout %s; AdamW %s; torch.compile %s",
                type(wrapper.model).__name__, n_params / 1e6, "masked" if wrapper.masked_only else "all",
                "masked" if wrapper.last_layer_subset else "all", wrapper.model.config._attn_implementation,
                "16-bit draws" if wrapper.draws16 else "torch's", training.optimizer_impl,
                "on" if training.torch_compile else "off")


# ---------------------------------------------------------------------------------------------
# fit: the loop
# ---------------------------------------------------------------------------------------------


def fit(run: Training, stop: ckpt.StopSignals) -> int:
    """Train from the start step to the last; returns the steps done. Every rank runs the same
    collectives in the same order: one all-reduce per step, plus those of the steps that log,
    evaluate or save."""
    accelerator, feed, log, beat = run.accelerator, run.feed, run.log, run.heartbeat.beat
    step = run.start.step
    beat(step, "eval")
    evaluate_before(run)
    log.begin()
    run.model.train()
    unread: tuple[int, StepResult] | None = None  # a step whose skip (a device tensor) is not read yet
    while step < run.data.total_steps:
        beat(step + 1, "data")
        skip_spiked(run)
        before = feed.position()
        window = read_window(run, step, before.epoch)
        beat(step + 1, "data", "the all-reduce of the step's masked tokens and stop votes")
        masked, signals, skipped = agree_on_step(accelerator, window, stop, unread and unread[1].stepped)
        if unread is not None and skipped:
            on_skipped(run, *unread)
        unread = None
        if signals:
            beat(step, "checkpoint")
            stop_here(run, trainer_state(run, step, before), before.stream, signals)
        beat(step + 1, "forward/backward")
        result = train_step(accelerator, run.model, run.optimizer, window, masked, run.cfg.training.max_grad_norm,
                            functools.partial(beat, step + 1), run.guard, loss_factors(run, step, len(window)))
        if result.spike is not None and (back_to := roll_back(run, step, before, result.spike)) is not None:
            step = back_to
            continue
        log.add(result)
        if isinstance(result.stepped, torch.Tensor):
            unread = (step, result)  # read with the next step's all-reduce, or after the last step
        elif not result.stepped:
            on_skipped(run, step, result)
        run.scheduler.step()
        step += 1
        # map-style only (streams refuse "epoch"): this step read the last micro-batch of an epoch. A
        # window may run across the epoch end, so this is the first step that completes the epoch.
        epoch_ended = not feed.stream and feed.epoch > before.epoch
        beat(step, "log")
        record = log.maybe(step, feed.epoch_float, run.scheduler.get_last_lr()[0])
        beat(step, "eval")
        record.update(run.evaluator.maybe(step, feed.epoch_float, log.clock))
        log.write(record)
        beat(step, "checkpoint")
        if unread is not None and run.checkpointer.due(step, epoch_ended):  # a step that saves may read it now:
            settle(run, unread)  # no checkpoint after a skipped step is taken for a good one
            unread = None
        with log.clock.paused():
            run.checkpointer.maybe(step, epoch_ended, functools.partial(position_after, run, step))
    if unread is not None:
        settle(run, unread)
    log.close()
    if run.skipped_steps:
        logger.warning("%d optimizer step(s) skipped for non-finite gradients", run.skipped_steps)
    if run.guard is not None:
        logger.info("loss spikes: %d update(s) skipped, %d rollback(s)", run.spikes["skipped"],
                    run.spikes["rolled_back"])
    return step


def settle(run: Training, unread: tuple[int, StepResult]) -> None:
    """Read a step's on-device skip now (a host sync) and act on it, where no all-reduce will bring it."""
    if not bool(unread[1].stepped):
        on_skipped(run, *unread)


def evaluate_before(run: Training) -> None:
    """The evaluation before training (step 0 of metrics.jsonl); a resumed run takes its own run's."""
    if run.checked.plan.resume_from is not None:
        run.evaluator.first = run.log.first_eval()
        return
    run.evaluator.first = run.evaluator.before_training()
    if run.evaluator.first:
        run.log.write({"step": 0, "epoch": 0.0, **record_fields(run.evaluator.first)}, with_tokens=False)


def read_window(run: Training, step: int, epoch_before: int) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches of the next optimizer step, on its device."""
    feed = run.feed
    window = [mdata.to_device(batch, run.accelerator.device) for batch in feed.next_window()]
    if run.stream_state is not None and step == run.start.step and feed.exact:
        logger.info("stream resumed at epoch %d, chunk %d, block %d: re-read %d raw text(s) to get there "
                    "(one chunk of --shuffle_buffer_size %d at most), not the epoch from its start",
                    run.stream_state["epoch"], run.stream_state["chunk"], run.stream_state["blocks"],
                    run.data.train_ds.reread_texts, run.cfg.data.shuffle_buffer_size)
    if feed.stream and feed.epoch != epoch_before:
        logger.info("step %d: %s", step + 1, feed.last_epoch_end.describe(feed.dropped_batches))
    return window


def agree_on_step(accelerator: Accelerator, window: list[dict[str, torch.Tensor]], stop: ckpt.StopSignals,
                  unread: torch.Tensor | None = None) -> tuple[torch.Tensor, list[str], bool]:
    """One all-reduce per step, and its result read once (the step's one host sync on a GPU): the masked
    tokens of the whole optimizer step (all ranks and micro-batches; the loss is normalised by them), the
    stop signals any rank received (a vote per signal, so that every rank knows which, whichever rank it
    reached first), and whether the previous step's update was skipped, where that is still `unread` on
    the device (a bool tensor: the step's `stepped`)."""
    votes = torch.tensor(stop.votes(), dtype=torch.float64, device=accelerator.device)
    skipped = torch.zeros(1, dtype=torch.float64, device=accelerator.device) if unread is None else \
        (~unread).double().reshape(1)
    local = torch.cat([masked_tokens(window).reshape(1), votes, skipped])
    summed = accelerator.reduce(local, reduction="sum")
    values = summed.tolist()
    return summed[0], stop.agreed(values[1:-1]), values[-1] > 0


def trainer_state(run: Training, step: int, at: mdata.FeedPosition) -> ckpt.TrainerState:
    """The counters a checkpoint after `step` saves, the data at `at` (a collective: every rank's tokens)."""
    sampler = run.feed.sampler
    return ckpt.TrainerState(step, at.epoch, at.batch_in_epoch, run.log.tokens_total(), run.accelerator.num_processes,
                             at.block_in_epoch, None if sampler is None else sampler.layout_batch)


def position_after(run: Training, step: int) -> tuple[ckpt.TrainerState, dict | None]:
    """What a checkpoint after `step` saves (a collective: the tokens of every rank)."""
    at = run.feed.position()
    return trainer_state(run, step, at), at.stream


def stop_here(run: Training, state: ckpt.TrainerState, data_state: dict | None, signals: list[str]) -> NoReturn:
    """Every rank: save one checkpoint at this step boundary (unless it exists), note why, raise."""
    path = run.checkpointer.save_for_stop(state, data_state)
    reason = f"signal{'s' if len(signals) > 1 else ''} {','.join(signals)}"
    run.checked.folder.write_stopped(run.accelerator.is_main_process, reason, state.step, path)
    run.wait.barrier()
    raise Preempted(f"stopped at step {state.step} on {reason}; checkpoint {path} saved. Requeue the job "
                    "with --resume_from_checkpoint latest to continue", ",".join(signals))


def loss_factors(run: Training, step: int, micro_batches: int) -> list[float] | None:
    """The test seam's loss multipliers of this step's micro-batches (None: no seam)."""
    if run.hooks.loss_factor is None:
        return None
    return [run.hooks.loss_factor(step + 1, index) for index in range(micro_batches)]


def window_key(at: mdata.FeedPosition) -> tuple:
    """A window's place in the data, the same in a replay: (epoch, micro-batch, slot)."""
    return at.epoch, at.batch_in_epoch, at.block_in_epoch


def skip_spiked(run: Training) -> None:
    """Before reading a window: read and drop those that caused a spike before a rollback."""
    while run.spiked_windows and window_key(at := run.feed.position()) in run.spiked_windows:
        run.spiked_windows.discard(window_key(at))
        run.feed.next_window()
        logger.info("skipped the micro-batches that caused a loss spike (epoch %d, micro-batch %d%s)", at.epoch,
                    at.batch_in_epoch, "" if at.block_in_epoch is None else f", slot {at.block_in_epoch}")


def roll_back(run: Training, step: int, at: mdata.FeedPosition, spike: Spike) -> int | None:
    """--on_loss_spike rollback (every rank alike: the loss was all-reduced): reload the newest
    checkpoint, mark this step's window to be skipped when the replay reaches it, and return the
    checkpoint's step. None: no rollback (the mode is 'skip', or no checkpoint of this number of
    processes exists yet: another number's data positions are not this run's); the update is
    skipped instead."""
    if run.cfg.run.on_loss_spike != "rollback":
        return None
    agreed = run.checkpointer.agreed_latest()  # every rank decides alike, whatever its view of the folder
    if agreed is None:
        return None
    latest, saved = agreed
    if saved.world_size != run.accelerator.num_processes:
        return None
    run.checkpointer.restore(latest, {}, saved.step)
    run.feed.seek(saved.epoch, saved.batch_in_epoch, saved.block_in_epoch,
                  None if run.feed.sampler is not None else ckpt.read_data_state(latest, run.accelerator.process_index))
    run.log.rewind(saved.step, saved.tokens_seen)
    run.spiked_windows.add(window_key(at))
    run.spikes["rolled_back"] += 1
    logger.warning("%s: rolled back to %s; the step's %d micro-batch(es) from epoch %d, micro-batch %d%s on are "
                   "skipped", spike_words(run, step, spike), latest.name, run.cfg.training.gradient_accumulation_steps,
                   at.epoch, at.batch_in_epoch, "" if at.block_in_epoch is None else f" (slot {at.block_in_epoch})")
    return saved.step


def spike_words(run: Training, step: int, spike: Spike) -> str:
    return (f"step {step + 1}: loss {spike.loss:.4f} is {spike.loss / spike.median:.1f}x the median {spike.median:.4f} "
            f"of the last {spike.steps} steps (--loss_spike_factor {run.cfg.run.loss_spike_factor:g})")


def on_skipped(run: Training, step: int, result: StepResult) -> None:
    """A step whose update was skipped: a loss spike (counted), or non-finite gradients, where
    --on_nonfinite_loss counts it or stops (every rank alike: the norm is the same)."""
    if result.overflow:
        run.overflows += 1
        logger.info("step %d: the fp16 gradients overflowed; the gradient scaler skipped the update and lowered "
                    "its scale to %g (%d so far)", step + 1, run.accelerator.scaler.get_scale(), run.overflows)
        return
    if result.spike is not None:
        run.spikes["skipped"] += 1
        why = "" if run.cfg.run.on_loss_spike == "skip" else " (no checkpoint of this run to roll back to yet)"
        logger.warning("%s: update skipped%s", spike_words(run, step, result.spike), why)
        return
    if run.cfg.run.on_nonfinite_loss == "skip":
        run.skipped_steps += 1
        logger.warning("step %d: gradient norm %s, optimizer step skipped (%d so far)",
                       step + 1, result.grad_norm.item(), run.skipped_steps)
        return
    latest = run.checkpointer.latest()
    raise NonFiniteLoss(
        f"step {step + 1}: the gradient norm is {result.grad_norm.item()} (loss or gradients NaN/inf); "
        + (f"the last good checkpoint is {latest}" if latest else "no checkpoint was saved")
        + ". Lower --learning_rate, check the data, or pass --on_nonfinite_loss skip")


# ---------------------------------------------------------------------------------------------
# finish, train(cfg), main
# ---------------------------------------------------------------------------------------------


def finish(run: Training, steps: int, started: float) -> TrainResult:
    """The final model, summary.json, the summary line and the report."""
    accelerator, log, folder = run.accelerator, run.log, run.checked.folder
    tokens_seen = log.tokens_total()
    card = model_card(run.cfg, steps, tokens_seen, run.evaluator.first, run.evaluator.last,
                      run.checked.model_config.model_type)
    run.heartbeat.beat(steps, "final save")
    final = folder.save_final(accelerator, run.wait, run.model, run.checked.tokenizer, card)
    tokens_per_s = (tokens_seen - run.start.tokens_seen) / max(log.clock.training_s, 1e-9)
    result = TrainResult(
        steps=steps, tokens_seen=tokens_seen, wall_time_s=time.perf_counter() - started, tokens_per_s=tokens_per_s,
        eval_before=run.evaluator.first, eval_after=run.evaluator.last, output_dir=str(folder.path),
        final_dir=str(final), loss_spikes=dict(run.spikes) if run.guard else {}, mfu=log.run_mfu(tokens_per_s),
    )
    folder.write_summary(accelerator.is_main_process, asdict(result))
    logger.info("%s", summary_line(result))
    if run.cfg.run.report and accelerator.is_main_process:
        folder.write_report()
    log.end()
    run.heartbeat.close()
    if run.checked.hub_repo and accelerator.is_main_process:
        logger.info("uploaded %s to the Hub: %s", final, push(final, run.checked.hub_repo, run.cfg.run, steps))
    return result


def train(cfg: Config, hooks: Hooks | None = None) -> TrainResult:
    """Fine-tune as `cfg` says. Raises a `RunEnded` (errors.py) when the run ends otherwise:
    BadInput, Preempted (a stop signal: saved), NonFiniteLoss, CheckpointWriteError, AlreadyFinished."""
    started = time.perf_counter()
    with ckpt.StopSignals(cfg.run.signal_names()) as stop, ExitStack() as on_exit:
        run = build(cfg, preflight(cfg), hooks or Hooks())
        on_exit.callback(run.log.close)  # however the run ends, so that an error message starts a line of its own
        on_exit.callback(run.heartbeat.stop)  # an error leaves the last beat where it happened
        steps = fit(run, stop)
        return finish(run, steps, started)


def summary_line(result: TrainResult) -> str:
    line = (f"done: {result.steps} steps, {result.tokens_seen} tokens in {result.wall_time_s:.0f} s "
            f"({result.tokens_per_s:.0f} tokens/s while training"
            + (f", MFU {result.mfu:.1%}" if result.mfu is not None else "") + ")")
    before, after = result.eval_before, result.eval_after
    if before and after:
        line += (f"; eval loss {before['loss']:.4f} -> {after['loss']:.4f}, "
                 f"perplexity {before['perplexity']:.2f} -> {after['perplexity']:.2f}, "
                 f"accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}")
    return line + f"; model in {result.final_dir}"


def setup_logging() -> None:
    """Timestamped INFO lines on stderr (accelerate's logger keeps them to the main process)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", level=logging.INFO)


def say(line: str) -> None:
    """One line on stderr in one write: every rank may print its error at the same moment into the
    launcher's one pipe, and print() writes the text and its newline apart (unbuffered stderr), so
    two ranks' lines could run into one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None, hooks: Hooks | None = None) -> int:
    setup_logging()
    cfg = None
    try:
        cfg = parse_args(argv)
        train(cfg, hooks)
    except RunEnded as err:
        say(err.line("mlm_ddp.train"))
        return err.exit_code
    except RuntimeError as err:  # DistError is one; gloo inside DDP's backward raises a plain one
        topo = distributed.detect(cuda_devices=0)
        if not (topo.distributed and distributed.is_collective_failure(err)):
            raise
        first = diagnose(cfg.run.output_dir) if cfg is not None else None
        say(f"mlm_ddp.train: error: {distributed.lost_contact(topo, err)}"
            + (f"\nmlm_ddp.train: error: hang: {first}" if first else ""))
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
