"""`train(cfg)`: masked-LM fine-tuning on Accelerate; `accelerate launch -m mlm_ddp.train [flags]`.

Reads top to bottom, in four parts:
- `preflight`: every input is checked; nothing is written. `RunFolder.plan` (run_folder.py) decides
  whether the run may use its folder and from which checkpoint it starts: one value, `Start`.
- `build`: the accelerator, the data, the model and optimizer, and the objects that own a concern
  each: `RunFolder`, `RunLog` (run_log.py), `Evaluator` (evaluation.py), `Checkpointer`
  (checkpoint.py), `LossSpikes` (spikes.py), `Heartbeat` (heartbeat.py). The first write happens at
  the end of `build`.
- `fit`: the loop: read a window, agree, step, then log / evaluate / checkpoint, each deciding whether
  this step is its own and reporting its heartbeat phase itself.
- `finish`: the final model, the summary, the report.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NoReturn

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed

import mlm_ddp
from mlm_ddp import compat
from mlm_ddp import data as mdata
from mlm_ddp.cluster import collectives, generation, precision, watchdog
from mlm_ddp.cluster import launcher as distributed
from mlm_ddp.cluster.heartbeat import Beat, Heartbeat
from mlm_ddp.config import Config, parse_args
from mlm_ddp.data.rank import train_feed
from mlm_ddp.errors import EXIT_FAILED, Preempted, RunEnded, say
from mlm_ddp.loop import branch
from mlm_ddp.loop import checkpoint as ckpt
from mlm_ddp.loop.evaluation import Evaluator, characters_note, masked_note, sources_line
from mlm_ddp.loop.optim import prepare_for_training
from mlm_ddp.loop.spikes import LossSpikes
from mlm_ddp.loop.step import SkippedSteps, StepResult, agree_on_step, settle_step, train_step
from mlm_ddp.model.loading import check_fits, load_model, load_model_config, load_tokenizer
from mlm_ddp.run import probing
from mlm_ddp.run.card import model_card
from mlm_ddp.run.hub import check_hub, push
from mlm_ddp.run.run_folder import RunFolder, Start, agree_on_resume
from mlm_ddp.run.run_log import RunLog, check_trackers, describe_start, speed_note, utilisation

logger = get_logger(__name__)


@dataclass
class Hooks:
    """Seams for fault-injection tests (tests/fault_driver.py); no flag sets them."""

    before_checkpoint_marker: Callable[[], None] | None = None  # runs inside every save, before its marker
    on_beat: Callable[[Beat], None] | None = None  # runs after every heartbeat (e.g. to freeze a rank there)
    loss_factor: Callable[[int, int], float] | None = None  # (step, micro-batch) -> its loss multiplied by this
    # (name, part, per rank): resumable parts registered beside the run's own (loop/resumable.py)
    parts: list[tuple[str, Any, bool]] = field(default_factory=list)


@dataclass
class TrainResult:
    """What a finished run did; also written to output_dir/summary.json."""

    steps: int
    tokens_seen: int
    wall_time_s: float
    tokens_per_s: float | None  # None: no step trained (resumed at its last step)
    eval_before: dict[str, float] | None
    eval_after: dict[str, float] | None
    output_dir: str
    final_dir: str
    loss_spikes: dict[str, int] = field(default_factory=dict)  # "skipped", "rolled_back": steps of each
    skipped_steps: dict[str, int] = field(default_factory=dict)  # "nonfinite", "overflow" (fp16): updates skipped
    mfu: float | None = None  # model FLOPs utilisation of the training steps (speed.py)
    probe: dict[str, Any] | None = None  # the downstream probe's "before" and "after" (probing.py)
    sources: list[dict[str, Any]] | None = None  # a mixture's: each source's name, weight, tokens and passes


# ---------------------------------------------------------------------------------------------
# preflight: every input is checked before anything is written
# ---------------------------------------------------------------------------------------------


@dataclass
class Checked:
    """What the preflight found and loaded; nothing is written yet."""

    cfg: Config  # the run's, resolved: --decay_from's end and decay in steps, --global_batch_size's accumulation
    tokenizer: Any
    model_config: Any
    topo: distributed.Topology
    fsdp_plugin: Any
    precision: tuple[str, str]  # (the mixed precision this process chose, why); the run's: Training.precision
    folder: RunFolder
    start: Start  # may it use the folder, from which checkpoint and counters it starts (run_folder.py)
    trackers: list[str]
    hub_repo: str | None  # where --push_to_hub uploads final/ (rank 0, which uploads; None elsewhere)
    raw_train: Any
    raw_eval: Any
    notes: list[str]  # warning lines: inputs taken as given that are likely a mistake (logged once the run starts)


def check_inputs(cfg: Config) -> tuple[Config, Any, Any]:
    """What needs no process and writes nothing (submit checks it too); returns (the config with --decay_from
    resolved, tokenizer, model config)."""
    compat.check()  # the other libraries' internals mlm_ddp reaches are where this release keeps them
    cfg = branch.resolved(cfg)  # --decay_from: the run's end and decay, in steps (branch.py)
    tokenizer = load_tokenizer(cfg.model, needs_word_ids=cfg.data.whole_word_mask)
    model_config = load_model_config(cfg.model, tokenizer)
    check_fits(cfg.data.max_seq_length, model_config, tokenizer)
    probing.check(cfg)  # its warnings (a test set that is the training set) are said when it runs
    return cfg, tokenizer, model_config


def preflight(cfg: Config) -> Checked:
    cfg, tokenizer, model_config = check_inputs(cfg)
    topo = distributed.detect()
    cfg = replace(cfg, training=cfg.training.for_world(topo.world_size))  # --global_batch_size's accumulation
    fsdp_plugin = distributed.fsdp_plugin_from_launcher()
    collectives.check_fsdp_plugin(fsdp_plugin, cuda=bool(topo.cuda_devices))
    chosen = precision.choose_precision(cfg.training.mixed_precision, precision.launcher_precision(),
                                        precision.hardware(topo))
    folder = RunFolder(cfg)
    start = folder.plan(topo.world_size, sharded=fsdp_plugin is not None,
                        stream_bytes=functools.partial(stream_bytes, cfg))
    trackers, hub_repo = check_trackers(cfg.run), check_hub(cfg.run, uploads=topo.rank == 0)
    raw_train, raw_eval = mdata.load_data(cfg.data, cfg.training.seed, tokenizer)  # one source, several, or prepared
    return Checked(cfg, tokenizer, model_config, topo, fsdp_plugin, chosen, folder, start, trackers, hub_repo,
                   raw_train, raw_eval, folder.notes())


def stream_bytes(cfg: Config) -> int | None:
    """What the training stream's local files hold (None: not local files); a stream opens lazily."""
    sizes = mdata.shard_sizes(mdata.load_text(cfg.data, cfg.training.seed)[0])
    return sum(sizes) if sizes else None


# ---------------------------------------------------------------------------------------------
# build: processes, data, model, and the objects beside the loop
# ---------------------------------------------------------------------------------------------


@dataclass
class Training:
    """Everything `build` made, which `fit` and `finish` use."""

    cfg: Config
    checked: Checked
    accelerator: Accelerator
    precision: tuple[str, str]  # (the mixed precision the run trains in, why): every process's, agreed at start-up
    wait: collectives.MainProcessWait  # the long-timeout group in which ranks wait for the main process
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
    spikes: LossSpikes  # --on_loss_spike
    skips: SkippedSteps  # what follows a step whose update was skipped
    every: probing.EveryEval  # --probe_every_eval

    @property
    def start(self) -> ckpt.TrainerState:
        return self.checked.start.state


def build(cfg: Config, checked: Checked, hooks: Hooks) -> Training:
    start, path = checked.start, checked.folder.path
    timeouts = collectives.Timeouts(cfg.run.ddp_timeout, cfg.run.save_timeout, cfg.run.rendezvous_timeout)
    started = collectives.start_accelerator(checked.topo, checked.fsdp_plugin, cfg.training, checked.precision,
                                            timeouts, checked.trackers, path)
    accelerator, wait = started.accelerator, started.wait
    agree_on_resume(start.resume_from, wait)
    set_seed(cfg.training.seed)  # the fresh MLM head (if any) is initialised identically on every rank
    transformers_model = load_model(cfg.model, checked.model_config)  # on every rank before anything is written
    data = mdata.rank_data(cfg.data, cfg.training, checked.tokenizer, checked.raw_train, checked.raw_eval,
                           accelerator, cfg.run.preprocessing_timeout, start.state.layout_batch)
    model, optimizer, scheduler, n_params = prepare_for_training(accelerator, transformers_model, cfg,
                                                                 data.total_steps)
    # made now, written once the folder is prepared: the parts of the loop report their phases to it
    heartbeat = Heartbeat(path, accelerator.process_index, accelerator.num_processes, hooks.on_beat,
                          watchdog.for_run(cfg.run, checked.topo, path, accelerator.num_processes, started.scope,
                                           functools.partial(collectives.lost_contact, checked.topo), EXIT_FAILED),
                          start=False)
    checkpointer = ckpt.Checkpointer(cfg.run, accelerator, wait, scheduler, cfg.to_yaml(),
                                     start.saved_step, hooks.before_checkpoint_marker,
                                     heartbeat.beat)
    stream_state = checkpointer.resume(start, started.precision)
    describe_start(cfg, checked.topo, started.precision, accelerator,
                   f"{data.note}; {data.total_steps} optimizer steps", model, n_params)
    feed = train_feed(data, cfg.training.gradient_accumulation_steps, start.state, stream_state, accelerator,
                      heartbeat.collective)
    # the first write: every check passed, the checkpoint loaded and the stream fills a step
    checked.folder.prepare(accelerator, wait, start)
    heartbeat.start()
    usage = utilisation(checked.model_config, cfg.data.max_seq_length, cfg.run.peak_tflops, accelerator, model)
    log = RunLog(cfg, accelerator, checked.trackers, start.state.step, data.total_steps, start.resume_from is not None,
                 start.state.tokens_seen, usage, heartbeat.beat)
    every = probing.EveryEval(cfg, accelerator, wait, checked.folder, model, checked.tokenizer, heartbeat.beat)
    evaluator = Evaluator(cfg.run.eval_steps, data.total_steps, accelerator, model, data.eval_loader, heartbeat.beat,
                          mlm_probability=cfg.data.eval_mlm_probability, then=every.at_eval)
    spikes = LossSpikes(cfg.run)
    # what a resume (read above) and a rollback put back besides the model, the optimizer and the counters; each
    # part gets its section as it registers
    checkpointer.register("log", log)
    if spikes.guard is not None:
        checkpointer.register("loss_spike_guard", spikes)
    for name, part, per_rank in hooks.parts:
        checkpointer.register(name, part, per_rank)
    skips = SkippedSteps(cfg.run.on_nonfinite_loss, accelerator, spikes, checkpointer.latest)
    return Training(cfg, checked, accelerator, started.precision, wait, data, model, optimizer, scheduler, feed,
                    stream_state, log, evaluator, checkpointer, heartbeat, hooks, spikes, skips, every)


# ---------------------------------------------------------------------------------------------
# fit: the loop
# ---------------------------------------------------------------------------------------------


def fit(run: Training, stop: ckpt.StopSignals) -> int:
    """Train from the start step to the last; returns the steps done. Each step: read a window, agree,
    step, then log / evaluate / checkpoint (each decides whether the step is its own). Every rank runs
    the same collectives in the same order: one all-reduce per step, plus those of the steps that log,
    evaluate or save."""
    step = run.start.step
    run.evaluator.before_training(step, run.log, run.checked.start)
    run.log.begin()
    run.model.train()
    unread: tuple[int, StepResult] | None = None  # a step whose skip (a device tensor) is not read yet
    while step < run.data.total_steps:
        window, at = read_window(run, step)
        masked = agree(run, step, window, at, stop, unread)
        result = train_step(run.accelerator, run.model, run.optimizer, window, masked, run.cfg.training.max_grad_norm,
                            functools.partial(run.heartbeat.beat, step + 1), run.spikes.guard,
                            loss_factors(run, step, len(window)))
        if result.spike is not None and (back_to := run.spikes.roll_back(
                step, at, result.spike, run.checkpointer, run.feed, run.log,
                run.cfg.training.gradient_accumulation_steps)) is not None:
            step, unread = back_to, None
            continue
        unread = took(run, step, result)
        step += 1
        unread = after_step(run, step, at, unread)
    if unread is not None:
        settle(run, unread)
    run.log.close()
    run.skips.summary(run.start.step, step)
    return step


def read_window(run: Training, step: int) -> tuple[list[dict[str, torch.Tensor]], mdata.FeedPosition]:
    """This rank's micro-batches of the next optimizer step, on its device, and where they start."""
    feed = run.feed
    run.heartbeat.beat(step + 1, "data")
    run.spikes.skip_spiked(feed)
    at = feed.position()
    window = [mdata.to_device(batch, run.accelerator.device) for batch in feed.next_window()]
    if run.stream_state is not None and step == run.start.step and feed.exact:
        logger.info("stream resumed at epoch %d, chunk %d, block %d: re-read %d raw text(s) to get there "
                    "(one chunk of --shuffle_buffer_size %d at most), not the epoch from its start",
                    run.stream_state["epoch"], run.stream_state["chunk"], run.stream_state["blocks"],
                    run.data.train_ds.reread_texts, run.cfg.data.shuffle_buffer_size)
    if feed.stream and feed.epoch != at.epoch:
        logger.info("step %d: %s", step + 1, feed.last_epoch_end.describe(feed.dropped_batches))
    return window, at


def agree(run: Training, step: int, window: list[dict[str, torch.Tensor]], at: mdata.FeedPosition,
          stop: ckpt.StopSignals, unread: tuple[int, StepResult] | None) -> torch.Tensor:
    """The step's one all-reduce (`agree_on_step`) and what it brings: the masked tokens of the whole step
    (returned), the previous step's skip where it was still on the device, and a stop signal (every rank
    saves and stops here, raising Preempted)."""
    run.heartbeat.beat(step + 1, "data", "the all-reduce of the step's masked tokens and stop votes")
    masked, signals, skipped = agree_on_step(run.accelerator, window, stop, unread and unread[1])
    if skipped is not None:
        run.skips(unread[0], skipped)
    if signals:
        stop_here(run, trainer_state(run, step, at), at.stream, signals)
    return masked


def took(run: Training, step: int, result: StepResult) -> tuple[int, StepResult] | None:
    """Count a step that was taken (or skipped); returns it when its skip is still on the device."""
    run.log.add(result)
    run.feed.count_trained()  # a mixture's sources, counted on the host as tokens_seen counts the step
    unread = None
    if isinstance(result.stepped, torch.Tensor):
        unread = (step, result)  # read with the next step's all-reduce, or after the last step
    elif not result.stepped:
        run.skips(step, result)
    run.scheduler.step()
    return unread


def after_step(run: Training, step: int, at: mdata.FeedPosition,
               unread: tuple[int, StepResult] | None) -> tuple[int, StepResult] | None:
    """After `step`: the log, the evaluator and the checkpointer, each on its own cadence; returns the
    step whose skip is still unread (none, after a save: no checkpoint after a skipped step is taken for
    a good one)."""
    feed = run.feed
    # map-style only (streams refuse "epoch"): this step read the last micro-batch of an epoch. A
    # window may run across the epoch end, so this is the first step that completes the epoch.
    epoch_ended = not feed.stream and feed.epoch > at.epoch
    record = run.log.maybe(step, feed.epoch_float, run.scheduler.get_last_lr()[0])
    record.update(run.evaluator.maybe(step, feed.epoch_float, run.log.clock))
    run.log.write(record)
    if unread is not None and run.checkpointer.due(step, epoch_ended):
        settle(run, unread)
        unread = None
    with run.log.clock.paused():
        run.checkpointer.maybe(step, epoch_ended, functools.partial(position_after, run, step))
    return unread


def settle(run: Training, unread: tuple[int, StepResult]) -> None:
    """Read a step's on-device skip now (an all-reduce and a host sync, every rank alike) and act on it,
    where no next step's all-reduce will bring it."""
    with run.heartbeat.collective("the all-reduce of the last step's skip"):
        skipped = settle_step(run.accelerator, unread[1])
    if skipped is not None:
        run.skips(unread[0], skipped)


def trainer_state(run: Training, step: int, at: mdata.FeedPosition) -> ckpt.TrainerState:
    """The counters a checkpoint after `step` saves, the data at `at` (a collective: every rank's tokens, and a
    mixture's counts of each source)."""
    sampler = run.feed.sampler
    return ckpt.TrainerState(
        step=step, epoch=at.epoch, batch_in_epoch=at.batch_in_epoch, tokens_seen=run.log.tokens_total(),
        world_size=run.accelerator.num_processes, block_in_epoch=at.block_in_epoch,
        layout_batch=None if sampler is None else sampler.layout_batch, precision=run.precision[0],
        sources=run.feed.counted())


def position_after(run: Training, step: int) -> tuple[ckpt.TrainerState, dict | None]:
    """What a checkpoint after `step` saves (a collective: the tokens of every rank)."""
    at = run.feed.position()
    with run.heartbeat.collective("the all-reduce of the tokens seen"):  # on the training group: --ddp_timeout
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


# ---------------------------------------------------------------------------------------------
# finish, train(cfg), main
# ---------------------------------------------------------------------------------------------


def finish(run: Training, steps: int, started: float, probed_before: dict | None) -> TrainResult:
    """The final model, summary.json, the summary line and the report."""
    accelerator, log, folder = run.accelerator, run.log, run.checked.folder
    tokens_seen = log.tokens_total()
    card = model_card(run.cfg, steps, tokens_seen, run.evaluator.first, run.evaluator.at_end(steps),
                      run.checked.model_config, run.scheduler.base_lrs[0])
    run.heartbeat.beat(steps, "final save")
    final = folder.save_final(accelerator, run.wait, run.model, run.checked.tokenizer, card)
    probed = run.every.after_training(log, steps, final, probed_before)
    tokens_per_s, mfu = log.run_speed(tokens_seen)
    result = TrainResult(
        steps=steps, tokens_seen=tokens_seen, wall_time_s=time.perf_counter() - started, tokens_per_s=tokens_per_s,
        eval_before=run.evaluator.first, eval_after=run.evaluator.last, output_dir=str(folder.path),
        final_dir=str(final), loss_spikes=run.spikes.reported(), skipped_steps=run.skips.reported(),
        mfu=mfu, probe=probed, sources=run.feed.sources(),
    )
    folder.write_summary(accelerator.is_main_process, asdict(result))
    logger.info("%s%s", summary_line(result), branch.closing(run.cfg))
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
    generation.die_with_agent(os.environ, mlm_ddp.STARTED_BY)  # no worker outlives its torchrun agent
    with ckpt.StopSignals(cfg.run.signal_names()) as stop, ExitStack() as on_exit:
        checked = preflight(cfg)
        stop.end_if_received()  # a SIGTERM during preflight: the launcher stops this start
        run = build(checked.cfg, checked, hooks or Hooks())
        for note in checked.notes:  # warned once the accelerator's logger is up: on the main process only
            logger.warning("%s", note)
        # runs last: after the heartbeat stopped using the process group's store
        on_exit.push(functools.partial(collectives.tear_down_after, RunEnded, run.accelerator, run.wait))
        on_exit.callback(run.log.close)  # however the run ends, so that an error message starts a line of its own
        on_exit.callback(run.heartbeat.stop)  # an error leaves the last beat where it happened
        probed_before = run.every.before_training(run.log, run.start.step, run.checked.start.resume_from is not None)
        steps = fit(run, stop)
        return finish(run, steps, started, probed_before)


def summary_line(result: TrainResult) -> str:
    line = (f"done: {result.steps} steps, {result.tokens_seen} tokens in {result.wall_time_s:.0f} s "
            + speed_note(result.tokens_per_s, result.mfu))
    before, after = result.eval_before, result.eval_after
    if before and after:
        line += (f"; eval{masked_note(before, after)} loss {before['loss']:.4f} -> {after['loss']:.4f}, "
                 f"perplexity {before['perplexity']:.2f} -> {after['perplexity']:.2f}, "
                 f"accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}{characters_note(before, after)}")
    elif after:  # no evaluation before training on record (e.g. --validation_split_percentage changed)
        line += (f"; eval{masked_note(after)} loss {after['loss']:.4f}, perplexity {after['perplexity']:.2f}, "
                 f"accuracy {after['accuracy']:.3f}{characters_note(after)}")
    return (line + sources_line(before, after) + mdata.sources_read_line(result.sources) + probing.line(result.probe)
            + f"; model in {result.final_dir}")


def setup_logging() -> None:
    """Timestamped INFO lines on stderr (accelerate's logger keeps them to the main process)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", level=logging.INFO)


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
        line = collectives.failure_line(err, cfg.run.output_dir if cfg is not None else None, "mlm_ddp.train")
        if line is None:
            raise
        say(line)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
