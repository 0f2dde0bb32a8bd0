"""`train(cfg)`: masked-LM fine-tuning on Accelerate; `accelerate launch -m mlm_ddp.train [flags]`.

Reads top to bottom: check every input before writing anything, build data and model, then the loop
in the shape of accelerate's complete_nlp_example (prepare, accumulate, clip, step), with evaluation,
checkpoints and metrics in helpers beside it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import datasets
import evaluate
import torch
import yaml
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType, GradientAccumulationPlugin, InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler

from mlm_ddp import checkpoint as ckpt
from mlm_ddp import data as mdata
from mlm_ddp import distributed
from mlm_ddp.config import Config, parse_args
from mlm_ddp.distributed import MainProcessWait, check_fsdp_plugin, patient_main_process_first
from mlm_ddp.errors import (
    EXIT_FAILED,
    EXIT_REQUEUE,
    AlreadyFinished,
    BadInput,
    CheckpointWriteError,
    NonFiniteLoss,
    Preempted,
    RunEnded,
)
from mlm_ddp.masking import EVAL_SPLIT, IGNORE_INDEX, TRAIN_SPLIT, MaskingCollator
from mlm_ddp.model import (
    build_optimizer,
    check_tied,
    configure_fsdp_units,
    inner_state_dict,
    load_model,
    load_model_config,
    load_tokenizer,
    max_positions,
    tied_parameters,
    wrap_model,
)
from mlm_ddp.report import write_report
from mlm_ddp.step import masked_tokens, train_step

logger = get_logger(__name__)
METRIC_MODULE = str(Path(__file__).parent / "metrics" / "masked_lm")
STOPPED_FILE = "stopped.json"  # why a run stopped early; torchrun turns every worker exit code into 1
RUN_OUTPUTS = ("config.yaml", "metrics.jsonl", "summary.json", "final", "checkpoints", "logs", STOPPED_FILE,
               "report.html", "report_plots")
KNOWN_TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # name -> module
TRACKING_PROJECT = "mlm_ddp"  # the wandb project, the MLflow experiment
class StopSignals:
    """Remembers the first stop signal. The handler only sets a flag, so the loop decides when to
    stop (at an optimizer-step boundary, all ranks together) and a second signal during the save
    changes nothing."""

    def __init__(self, names: list[str]) -> None:
        self.names, self.received, self._previous = names, None, {}

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def __enter__(self) -> StopSignals:
        for name in self.names:
            self._previous[name] = signal.signal(getattr(signal, name), self._handle)
        return self

    def __exit__(self, *_exc: Any) -> None:
        for name, handler in self._previous.items():
            signal.signal(getattr(signal, name), handler)



class TrainingClock:
    """Seconds spent training, without evaluation and checkpoint saves, so that tokens/s measures
    the training step alone."""

    def __init__(self) -> None:
        self.training_s, self._lap_start, self._paused_s = 0.0, time.perf_counter(), 0.0

    @contextmanager
    def paused(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._paused_s += time.perf_counter() - start

    def lap(self) -> float:
        """Training seconds since the previous lap."""
        now = time.perf_counter()
        elapsed = max(now - self._lap_start - self._paused_s, 1e-9)
        self.training_s += elapsed
        self._lap_start, self._paused_s = now, 0.0
        return elapsed


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


# ---------------------------------------------------------------------------------------------
# Checks that run before anything is written
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputPlan:
    """What the run does with --output_dir, decided before anything is written."""

    resume_from: Path | None  # the checkpoint to continue from
    clear_earlier: bool  # remove the outputs already there (RUN_OUTPUTS) before starting
    own_checkpoint: bool  # resume_from lies in --output_dir (not another run's folder)


def finished_summary(out: Path) -> dict | None:
    """The summary of a run that finished in `out`; None when there is none or it is torn (a run
    killed while writing it, before it was written atomically, did not finish)."""
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def _earlier_outputs(out: Path) -> list[str]:
    return [name for name in RUN_OUTPUTS if (out / name).exists()]


def _is_same_run(out: Path, cfg: Config) -> bool:
    """`out` holds an attempt of this very run: its config.yaml differs only in settings a resume may
    change (or it died before writing one, leaving no metrics, model or summary behind)."""
    saved_path = out / "config.yaml"
    if not saved_path.is_file():
        return not any((out / name).exists() for name in ("metrics.jsonl", "summary.json", "final"))
    try:
        saved = yaml.safe_load(saved_path.read_text())
    except (OSError, yaml.YAMLError):
        return False
    changes = ckpt.config_changes(saved if isinstance(saved, dict) else {}, cfg.to_dict())
    return all(key in ckpt.RESUMABLE_CHANGES for key in changes)


def check_output_dir(cfg: Config) -> OutputPlan:
    """Refuse to clobber another run unasked, whatever the resume source; say what to resume from."""
    out = Path(cfg.run.output_dir)
    if out.exists() and not out.is_dir():
        raise BadInput(f"--output_dir {out} exists and is not a folder")
    spec, overwrite = cfg.run.resume_from_checkpoint, cfg.run.overwrite_output_dir
    earlier = _earlier_outputs(out)
    if spec == "auto":
        if overwrite:
            raise BadInput("--resume_from_checkpoint auto and --overwrite_output_dir contradict each other")
        if finished_summary(out) is not None:
            raise AlreadyFinished(f"--output_dir {out} holds a finished run: nothing to do")
        done = ckpt.complete_checkpoints(out)
        if done:
            return OutputPlan(done[-1], clear_earlier=False, own_checkpoint=True)
        if earlier and not _is_same_run(out, cfg):
            raise BadInput(
                f"--resume_from_checkpoint auto: --output_dir {out} holds another run ({', '.join(earlier)}; "
                "its config.yaml differs) that saved no checkpoint; choose another --output_dir, or remove "
                "that folder if it is not needed"
            )
        # an earlier attempt of this run died before its first checkpoint: nothing to continue from
        return OutputPlan(None, clear_earlier=bool(earlier), own_checkpoint=False)
    if spec is not None:
        path = ckpt.resolve_resume(spec, out)
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
        return OutputPlan(path, clear_earlier=overwrite and bool(earlier), own_checkpoint=own)
    if earlier and not overwrite:
        if finished_summary(out) is not None or (out / "final").exists():
            raise BadInput(
                f"--output_dir {out} already holds a finished run; pass --overwrite_output_dir to "
                "replace it, or choose another --output_dir"
            )
        done = ckpt.complete_checkpoints(out)
        hint = (f"pass --resume_from_checkpoint latest to continue from {done[-1].name}, or "
                if done else "pass ")
        raise BadInput(
            f"--output_dir {out} already holds an unfinished run ({', '.join(earlier)}); "
            f"{hint}--overwrite_output_dir to start over"
        )
    return OutputPlan(None, clear_earlier=overwrite and bool(earlier), own_checkpoint=False)


def check_trackers(cfg: Config) -> list[str]:
    if not cfg.run.with_tracking:
        return []
    names = list(KNOWN_TRACKERS) if cfg.run.report_to == "all" else cfg.run.report_to.split(",")
    chosen = []
    for name in (n.strip() for n in names):
        if name not in KNOWN_TRACKERS:
            raise BadInput(f"--report_to {name!r}: unknown tracker; use {', '.join(KNOWN_TRACKERS)} or all")
        if importlib.util.find_spec(KNOWN_TRACKERS[name]) is None:
            if cfg.run.report_to == "all":
                continue
            raise BadInput(f"--report_to {name}: the package {name!r} is not installed (pip install {name}, "
                              "or pip install 'mlm_ddp[tracking]' for wandb and MLflow)")
        chosen.append(name)
    return chosen


def tracker_kwargs(out: Path, trackers: list[str]) -> dict[str, dict[str, Any]]:
    """Each tracker names the run after --output_dir and keeps its files in output_dir/logs, unless
    the user's environment (WANDB_DIR, MLFLOW_TRACKING_URI) says where they go."""
    logs, name = out / "logs", out.resolve().name
    logs.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, dict[str, Any]] = {}
    if "wandb" in trackers:
        kwargs["wandb"] = {"name": name, **({} if os.environ.get("WANDB_DIR") else {"dir": str(logs)})}
    if "mlflow" in trackers:
        import mlflow

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # mlflow's own default is a database in the current folder, shared by unrelated runs
            mlflow.set_tracking_uri(f"sqlite:///{(logs / 'mlflow.db').resolve()}")
        kwargs["mlflow"] = {"run_name": name}
    return kwargs


# ---------------------------------------------------------------------------------------------
# Helpers beside the loop: data positions, evaluation, metrics, checkpoints
# ---------------------------------------------------------------------------------------------


def sharded(accelerator: Accelerator) -> bool:
    """FSDP shards the parameters: every forward is a collective and the model is not whole anywhere."""
    return accelerator.distributed_type == DistributedType.FSDP


def eval_batches(loader: DataLoader, accelerator: Accelerator) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's eval batches on its device; under FSDP padded to the same count on every rank."""
    if not sharded(accelerator):
        yield from (mdata.to_device(batch, accelerator.device) for batch in loader)
        return
    batches = list(loader)  # an eval set is small; a stream has no len() to compare across ranks
    count = torch.tensor(len(batches), device=accelerator.device)
    for batch in padded(batches, int(accelerator.reduce(count, reduction="max"))):
        yield mdata.to_device(batch, accelerator.device)


def padded(batches: list[dict[str, torch.Tensor]], total: int) -> Iterator[dict[str, torch.Tensor]]:
    """`batches`, then idle batches up to `total`: one token with nothing to predict, (1, 1), which
    adds 0 to every eval sum."""
    yield from batches
    for _ in range(total - len(batches)):
        yield {"input_ids": torch.zeros(1, 1, dtype=torch.long), "attention_mask": torch.ones(1, 1, dtype=torch.long),
               "labels": torch.full((1, 1), IGNORE_INDEX)}


def evaluate_mlm(model: torch.nn.Module, loader: DataLoader | None, accelerator: Accelerator,
                 metric: Any) -> dict[str, float] | None:
    """Per-token eval loss, perplexity and accuracy: sums reduced across ranks, then divided."""
    if loader is None:
        return None
    # DDP: the plain module, so ranks with different numbers of eval batches run no collectives.
    # FSDP: the forward gathers parameters from every rank, so all ranks run the same number of
    # forwards (eval_batches).
    net = model if sharded(accelerator) else accelerator.unwrap_model(model)
    was_training = net.training
    net.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # loss, masked, correct
    with torch.no_grad(), accelerator.autocast():
        for batch in eval_batches(loader, accelerator):
            loss_sum, masked, correct = net(**batch)
            sums += torch.stack([loss_sum.double(), masked.double(), correct.double()])
    net.train(was_training)
    loss_sum, masked, correct = accelerator.reduce(sums, reduction="sum").tolist()
    if masked == 0:
        return None
    return metric.compute(loss_sum=[loss_sum], num_tokens=[int(masked)], num_correct=[int(correct)])


def read_metrics_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) of each line of a metrics.jsonl. A cut last line (a run killed while writing
    it) is dropped; any other broken line is a BadInput naming it, raised in the preflight on every
    rank alike, never on the main process alone while the others wait in a collective."""
    lines = path.read_text().splitlines()
    kept = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):
                continue
            raise BadInput(f"{path} line {number}: not valid JSON; repair or delete that line, then resume "
                              "again") from None
        if not isinstance(record, dict):
            raise BadInput(f"{path} line {number}: not a JSON object; repair or delete that line")
        kept.append((line, record))
    return kept


class MetricsFile:
    """Appends one JSON object per line to output_dir/metrics.jsonl (main process only)."""

    def __init__(self, path: Path, enabled: bool, resume_step: int | None) -> None:
        self.path, self.enabled = path, enabled
        if enabled and resume_step is not None and path.exists():
            # drop what a crashed run logged after the checkpoint we resume from
            kept = [line for line, record in read_metrics_lines(path) if record.get("step", 0) <= resume_step]
            ckpt.write_atomic(path, "".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as handle:
                handle.write(json.dumps(record) + "\n")

    def first_eval(self) -> dict[str, float] | None:
        if not self.path.exists():
            return None
        for _line, record in read_metrics_lines(self.path):
            if "eval_loss" in record:
                return {"loss": record["eval_loss"], "perplexity": record["perplexity"],
                        "accuracy": record["eval_accuracy"]}
        return None


def save_checkpoint(accelerator: Accelerator, wait: MainProcessWait, cfg: Config, state: ckpt.TrainerState,
                    scheduler: Any, data_state: dict | None = None) -> Path:
    """Every rank writes its part into a temporary folder; the main process completes and renames it.

    If any rank fails to write (disk full, quota, ...), all ranks learn it, the temporary folder is
    removed and CheckpointWriteError names the previous complete checkpoint, which stays usable.
    """
    tmp = ckpt.temp_dir(cfg.run.output_dir, state.step)
    final = ckpt.checkpoints_dir(cfg.run.output_dir) / ckpt.step_dir_name(state.step)
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)  # the leftovers of a save that was interrupted
    wait.barrier()
    error: Exception | None = None
    try:
        accelerator.save_state(str(tmp))
        if data_state is not None:  # this rank's stream position
            (tmp / ckpt.data_state_name(accelerator.process_index)).write_text(json.dumps(data_state))
    except Exception as err:  # safetensors and torch.save report a full disk in their own types
        error = err
    _agree_saved(accelerator, wait, cfg, tmp, final, error)
    if accelerator.is_main_process:
        try:
            # JSON, not a pickle: a resume never unpickles what the user did not write
            (tmp / ckpt.SCHEDULER_FILE).write_text(json.dumps(scheduler.state_dict()))
            final = ckpt.finalize(tmp, state, cfg.to_yaml())
        except Exception as err:
            error = err
    _agree_saved(accelerator, wait, cfg, tmp, final, error)
    if accelerator.is_main_process:
        for gone in ckpt.rotate(cfg.run.output_dir, cfg.run.save_total_limit):
            logger.info("deleted old checkpoint %s (--save_total_limit %s)", gone.name, cfg.run.save_total_limit)
        logger.info("saved checkpoint %s", final)
    wait.barrier()
    return final


def _agree_saved(accelerator: Accelerator, wait: MainProcessWait, cfg: Config, tmp: Path, final: Path,
                 error: Exception | None) -> None:
    """A collective: raise CheckpointWriteError on every rank if the save failed on any rank."""
    if not wait.any(error is not None):
        return
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    done = ckpt.complete_checkpoints(cfg.run.output_dir)
    previous = done[-1] if done else None
    cause = f"{type(error).__name__}: {error}" if error is not None else "failed on another process"
    raise CheckpointWriteError(
        f"checkpoint {final.name} could not be written ({cause}); "
        + (f"the previous checkpoint {previous} is complete and intact: free space or fix the folder, "
           "then resume with --resume_from_checkpoint latest" if previous else "no earlier checkpoint exists")
    )


def save_final(accelerator: Accelerator, wait: MainProcessWait, model: torch.nn.Module, tokenizer: Any,
               out: Path) -> Path:
    """save_pretrained model + tokenizer into out/final, via a temporary folder renamed at the end."""
    final, tmp = out / "final", out / ".tmp-final"
    wait.barrier()
    weights = accelerator.get_state_dict(model)  # every rank: FSDP gathers the shards to rank 0
    if accelerator.is_main_process:
        if tmp.exists():
            shutil.rmtree(tmp)
        inner = accelerator.unwrap_model(model).model  # the transformers model inside MaskedLMLoss
        inner.save_pretrained(tmp, state_dict=inner_state_dict(weights), safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    wait.barrier()
    return final


def preempt(accelerator: Accelerator, wait: MainProcessWait, cfg: Config, position: ckpt.TrainerState,
            scheduler: Any, data_state: dict | None, signal_name: str | None, already_saved: bool) -> None:
    """Every rank: save one checkpoint at this step boundary (unless it exists), note why, raise."""
    path = ckpt.checkpoints_dir(cfg.run.output_dir) / ckpt.step_dir_name(position.step)
    if not already_saved:
        path = save_checkpoint(accelerator, wait, cfg, position, scheduler, data_state)
    reason = f"signal {signal_name}" if signal_name else "a stop signal on another process"
    if accelerator.is_main_process:
        ckpt.write_atomic(Path(cfg.run.output_dir) / STOPPED_FILE, json.dumps(
            {"reason": reason, "step": position.step, "checkpoint": str(path), "exit_code": EXIT_REQUEUE}))
    wait.barrier()
    raise Preempted(f"stopped at step {position.step} on {reason}; checkpoint {path} saved. Requeue the job "
                    "with --resume_from_checkpoint latest to continue", signal_name)


def restore(accelerator: Accelerator, path: Path, scheduler: Any, accepted_changes: dict) -> None:
    """Load a checkpoint that `ckpt.check_resume` accepted. Tensors come from safetensors or from
    `torch.load(weights_only=True)` (accelerate's default), the scheduler from JSON: a folder that
    holds anything else is refused, never executed."""
    for key, (old, new) in accepted_changes.items():
        logger.info("resuming with a changed setting: %s %r -> %r", key, old, new)
    try:
        accelerator.load_state(str(path))
        scheduler.load_state_dict(json.loads((path / ckpt.SCHEDULER_FILE).read_text()))
    except torch.distributed.DistError:
        raise
    except Exception as err:  # safetensors, torch.load and load_state_dict each have their own types
        raise BadInput(f"{path}: cannot be resumed from ({type(err).__name__}: {str(err)[:400]}); it is "
                          "damaged, from another model, or not written by mlm_ddp") from err


def epoch_steps(epochs: float, batches_per_epoch: int, accumulation: int) -> int:
    """Optimizer steps of `epochs` epochs: every micro-batch of them is trained on. When accumulation
    does not divide the epochs' micro-batches, the last step is filled with the first micro-batches of
    the next epoch (rather than dropping the epoch's last ones and never completing it)."""
    return max(1, math.ceil(epochs * batches_per_epoch / accumulation - 1e-9))  # 1e-9: float noise


# ---------------------------------------------------------------------------------------------
# train(cfg)
# ---------------------------------------------------------------------------------------------


def train(cfg: Config) -> TrainResult:
    """Fine-tune as `cfg` says. Raises BadInput (bad input), Preempted (a stop signal: saved),
    NonFiniteLoss, CheckpointWriteError; `main` maps them to exit codes."""
    with StopSignals(cfg.run.signal_names()) as stop, ExitStack() as on_exit:
        return _train(cfg, stop, on_exit)


def _train(cfg: Config, stop: StopSignals, on_exit: ExitStack) -> TrainResult:
    t0 = time.perf_counter()
    out = Path(cfg.run.output_dir)
    # --- 1. every input is checked before anything is written -------------------------------
    tokenizer = load_tokenizer(cfg.model)
    model_config = load_model_config(cfg.model)
    limit = max_positions(model_config, tokenizer)
    if cfg.data.max_seq_length > limit:
        raise BadInput(f"--max_seq_length {cfg.data.max_seq_length} is above the model's maximum of "
                          f"{limit} tokens; use --max_seq_length {limit} or less")
    if len(tokenizer) > model_config.vocab_size:
        raise BadInput(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary only "
                          f"{model_config.vocab_size}; pass the model's own tokenizer")
    topo = distributed.detect()
    fsdp_plugin = distributed.fsdp_plugin_from_launcher()
    check_fsdp_plugin(fsdp_plugin, cuda=bool(topo.cuda_devices))
    plan = check_output_dir(cfg)
    resume_from = plan.resume_from
    state = ckpt.TrainerState(step=0, epoch=0, batch_in_epoch=0, tokens_seen=0, world_size=topo.world_size)
    accepted_changes: dict = {}
    if resume_from is not None:
        state, accepted_changes = ckpt.check_resume(resume_from, cfg.to_dict(), topo.world_size,
                                                    sharded=fsdp_plugin is not None)
        if cfg.data.streaming:
            mdata.check_stream_resume(datasets.__version__)
        if plan.own_checkpoint and (out / "metrics.jsonl").exists():
            read_metrics_lines(out / "metrics.jsonl")  # a damaged line stops every rank here, not rank 0 later
    trackers = check_trackers(cfg)
    raw_train, raw_eval = mdata.load_text(cfg.data, cfg.training.seed)

    # --- 2. processes, data, model -----------------------------------------------------------
    t = cfg.training
    distributed.export_for_accelerate(topo)
    precision = distributed.resolve_precision(t.mixed_precision, cuda=bool(topo.cuda_devices))
    accelerator = Accelerator(
        fsdp_plugin=fsdp_plugin,
        cpu=not topo.cuda_devices,  # else a CPU process started by torchrun or srun trains alone
        mixed_precision=precision,  # from our config, so every launcher trains alike
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=t.gradient_accumulation_steps, sync_with_dataloader=False),
        # fail fast: when a process dies, the others stop within this time instead of hanging
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.run.ddp_timeout))],
        log_with=trackers or None,
        project_dir=str(out / "logs"),  # TensorBoard writes into logs/<TRACKING_PROJECT>/
    )
    if distributed.keep_fsdp_on_cpu(accelerator, fsdp_plugin, precision):
        logger.info("FSDP on CPU processes: the accelerate config asks for FSDP, which accelerate would run as "
                    "DDP on a CPU; mlm_ddp keeps its FSDP2 plugin (gloo)")
    distributed.check_accelerator(topo, accelerator.num_processes, str(accelerator.distributed_type))
    rank, world = accelerator.process_index, accelerator.num_processes
    wait = MainProcessWait(accelerator.num_processes, cfg.run.save_timeout)
    # the model too is checked before anything is written: every rank loads it, and a bad checkpoint or
    # an attention kernel the model lacks is a BadInput on all of them alike
    set_seed(t.seed)  # the fresh MLM head (if any) is initialised identically on every rank
    transformers_model = load_model(cfg.model, model_config)
    if accelerator.device.type == "cpu":
        torch.set_num_threads(distributed.cpu_threads_per_process(t.cpu_threads))
    asked = distributed.launcher_precision()
    if asked is not None and asked != precision:
        logger.warning("the accelerate config asks for mixed precision %s; mlm_ddp trains with "
                       "--mixed_precision %s (training choices come from the mlm_ddp config: pass "
                       "--mixed_precision %s to use it)", asked, precision, asked)

    with patient_main_process_first(accelerator, cfg.run.preprocessing_timeout):
        train_ds = mdata.rank_dataset(raw_train, tokenizer, cfg.data, rank, world, shuffle_seed=t.seed)
        eval_ds = None if raw_eval is None else mdata.rank_dataset(raw_eval, tokenizer, cfg.data, rank, world)
        metric = evaluate.load(METRIC_MODULE)
    collator_args = dict(mlm_probability=cfg.data.mlm_probability, whole_word_mask=cfg.data.whole_word_mask,
                         seed=t.seed)
    train_collator = MaskingCollator.for_tokenizer(tokenizer, split=TRAIN_SPLIT, **collator_args)
    train_dl = mdata.train_loader(train_ds, train_collator, t.per_device_train_batch_size, rank, world,
                                  t.seed, cfg.data.dataloader_num_workers)
    eval_dl = None if eval_ds is None else mdata.eval_loader(
        eval_ds, MaskingCollator.for_tokenizer(tokenizer, split=EVAL_SPLIT, **collator_args),
        t.per_device_eval_batch_size, rank, world, cfg.data.dataloader_num_workers)

    ga = t.gradient_accumulation_steps
    if mdata.is_stream(train_ds):
        total_steps = t.max_train_steps
        data_note = (f"streaming, tokenized on the fly; {mdata.stream_sharding(raw_train.num_shards, world)}; "
                     f"{mdata.plan_stream_split(raw_train, world).note()}")
    else:
        sampler = train_dl.batch_sampler
        total_steps = t.max_train_steps or epoch_steps(t.num_train_epochs, sampler.batches_per_epoch, ga)
        stats = mdata.pack_stats(train_ds, cfg.data.max_seq_length)
        data_note = (f"{stats.blocks} blocks of {cfg.data.max_seq_length} tokens ({stats.tokens} tokens, "
                     f"{stats.short_blocks} shorter tail blocks, {stats.pad_fraction:.2%} padding), "
                     f"{sampler.batches_per_epoch} micro-batches per epoch per rank, {sampler.padding} "
                     "blocks repeated to fill the last global batch; rank r takes slice r of every "
                     "global batch")

    model = wrap_model(transformers_model, cfg.model.mlm_head, t.torch_compile)
    optimizer = build_optimizer(model, t)
    scheduler = get_scheduler(t.lr_scheduler_type, optimizer, num_warmup_steps=t.num_warmup_steps,
                              num_training_steps=total_steps)
    # the scheduler is stepped by us once per optimizer step: not prepared, saved as JSON
    ties = tied_parameters(model.model)
    n_params = sum(p.numel() for p in model.model.parameters())  # before FSDP leaves each rank its shard
    if sharded(accelerator):
        configure_fsdp_units(accelerator.state.fsdp_plugin, cfg.model.fsdp_wrap_classes, model.model)
    model, optimizer = accelerator.prepare(model, optimizer)
    check_tied(accelerator.unwrap_model(model).model, ties)
    if resume_from is not None:
        restore(accelerator, resume_from, scheduler, accepted_changes)
        logger.info("resumed from %s at step %d", resume_from, state.step)
    logger.info("topology: %d process(es) on %d node(s), %s, started by %s (master %s:%s); global batch "
                "%d = %d per device x %d processes x %d accumulation; precision %s; device %s (%d threads)",
                world, topo.num_nodes, accelerator.distributed_type, topo.launcher, topo.master_addr or "-",
                topo.master_port or "-", t.per_device_train_batch_size * world * ga,
                t.per_device_train_batch_size, world, ga,
                precision + (" (auto)" if t.mixed_precision == "auto" else ""), accelerator.device,
                torch.get_num_threads())
    logger.info("data: %s; %d optimizer steps", data_note, total_steps)
    inner = accelerator.unwrap_model(model).model
    logger.info("model: %s, %.1fM parameters; MLM head on %s positions; attention %s; AdamW %s; torch.compile %s",
                type(inner).__name__, n_params / 1e6,
                "masked" if accelerator.unwrap_model(model).masked_only else "all",
                inner.config._attn_implementation, t.optimizer_impl, "on" if t.torch_compile else "off")

    device = accelerator.device
    def any_rank(flag: bool) -> bool:
        """True on every rank when `flag` is true on any rank (a collective)."""
        return accelerator.reduce(torch.tensor(float(flag), device=device), reduction="sum").item() > 0

    def gather(values: list[float]) -> list[list[float]]:
        """Every rank's `values` (the same length on every rank), in rank order (a collective)."""
        return accelerator.gather(torch.tensor(values, dtype=torch.float64, device=device)).view(world, -1).tolist()

    stream_state = ckpt.read_data_state(resume_from, rank) if resume_from else None
    feed = mdata.TrainFeed(train_dl, train_collator, ga, state.epoch, state.batch_in_epoch, any_rank, stream_state,
                           gather)
    if feed.stream and state.step < total_steps:  # only reading tells whether a stream fills a step
        feed.prime()  # before anything is written
    # the first write: every check passed, the checkpoint loaded and the stream fills a step
    if accelerator.is_main_process:
        if plan.clear_earlier:
            why = ("--overwrite_output_dir" if cfg.run.overwrite_output_dir else
                   "--resume_from_checkpoint auto: an earlier attempt of this run saved no checkpoint")
            logger.info("removing the earlier run's %s from %s (%s)", ", ".join(_earlier_outputs(out)), out, why)
            for name in RUN_OUTPUTS:
                target = out / name
                if target.is_dir():
                    shutil.rmtree(target)
                elif target.exists():
                    target.unlink()
        out.mkdir(parents=True, exist_ok=True)
    wait.barrier()
    if accelerator.is_main_process:
        ckpt.write_atomic(out / "config.yaml", cfg.to_yaml())
        (out / STOPPED_FILE).unlink(missing_ok=True)  # this run continues what stopped
        if plan.own_checkpoint and (aside := ckpt.set_aside_later(out, state.step)) is not None:
            logger.warning("resumed from step %d: the later checkpoints of the abandoned run were moved to %s "
                           "(not resumed from, not rotated)", state.step, aside)
    for partial in ckpt.partial_checkpoints(out):
        logger.warning("ignoring %s: an incomplete checkpoint (no %s marker), left by a save that was "
                       "interrupted", partial, ckpt.MARKER)
    metrics = MetricsFile(out / "metrics.jsonl", accelerator.is_main_process,
                          state.step if resume_from else None)
    if trackers:
        skipped = sorted(set(KNOWN_TRACKERS) - set(trackers)) if cfg.run.report_to == "all" else []
        logger.info("tracking with %s: project %s, run %s%s", ", ".join(trackers), TRACKING_PROJECT,
                    out.resolve().name, f"; not installed, so not used: {', '.join(skipped)}" if skipped else "")
        accelerator.init_trackers(TRACKING_PROJECT, init_kwargs=tracker_kwargs(out, trackers),
                                  config={k: v for s in cfg.to_dict().values() for k, v in s.items()
                                          if isinstance(v, (int, float, str, bool))})

    def log_record(record: dict[str, Any]) -> None:
        metrics.write(record)
        if trackers:
            accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    # --- 3. the loop ------------------------------------------------------------------------
    eval_before = metrics.first_eval() if resume_from else None
    if resume_from is None:
        eval_before = evaluate_mlm(model, eval_dl, accelerator, metric)
        if eval_before:
            log_record({"step": 0, "epoch": 0.0, "eval_loss": eval_before["loss"],
                        "perplexity": eval_before["perplexity"], "eval_accuracy": eval_before["accuracy"]})
            logger.info("eval before training: loss %.4f, perplexity %.2f, accuracy %.3f",
                        eval_before["loss"], eval_before["perplexity"], eval_before["accuracy"])

    sums = torch.zeros(3, dtype=torch.float64, device=device)  # since last log: loss, masked, input tokens
    tokens_base, tokens_local = state.tokens_seen, torch.zeros((), dtype=torch.float64, device=device)

    def tokens_total() -> int:
        """Input tokens trained on so far, all ranks (a collective: every rank calls it together)."""
        return int(tokens_base + accelerator.reduce(tokens_local.clone(), reduction="sum").item())

    # closed however the run ends, so that an error message starts a line of its own
    progress = on_exit.enter_context(tqdm(total=total_steps, initial=state.step, desc="training", unit="step",
                                          disable=not accelerator.is_main_process))
    step, clock = state.step, TrainingClock()
    eval_after: dict[str, float] | None = None
    saved_step = state.step if resume_from else None  # newest complete checkpoint of this run
    skipped_steps = 0
    model.train()
    while step < total_steps:
        epoch_before, index_before, stream_before = feed.position()
        micro = [mdata.to_device(b, device) for b in feed.next_window()]
        if stream_state is not None and step == state.step and feed.exact:
            logger.info("stream resumed at epoch %d, chunk %d, block %d: re-read %d raw text(s) to get there "
                        "(one chunk of --shuffle_buffer_size %d at most), not the epoch from its start",
                        stream_state["epoch"], stream_state["chunk"], stream_state["blocks"],
                        train_ds.reread_texts, cfg.data.shuffle_buffer_size)
        if feed.stream and feed.epoch != epoch_before:
            logger.info("step %d: %s", step + 1, feed.last_epoch_end.describe(feed.dropped_batches))
        # one all-reduce per step: the masked tokens of the whole optimizer step (all ranks and
        # micro-batches; the loss is normalised by them) and whether any rank got a stop signal
        local = torch.stack([masked_tokens(micro),
                             torch.tensor(float(stop.received is not None), dtype=torch.float64, device=device)])
        masked, stop_votes = accelerator.reduce(local, reduction="sum")
        if stop_votes > 0:
            position = ckpt.TrainerState(step, epoch_before, index_before, tokens_total(), world)
            preempt(accelerator, wait, cfg, position, scheduler, stream_before, stop.received, saved_step == step)
        result = train_step(accelerator, model, optimizer, micro, masked, t.max_grad_norm)
        window = torch.stack([result.loss_sum, result.masked, result.tokens])
        sums += window
        tokens_local += window[2]
        if not result.stepped and cfg.run.on_nonfinite_loss == "skip":
            skipped_steps += 1
            logger.warning("step %d: gradient norm %s, optimizer step skipped (%d so far)",
                           step + 1, result.grad_norm.item(), skipped_steps)
        elif not result.stepped:
            latest = ckpt.complete_checkpoints(out)
            raise NonFiniteLoss(
                f"step {step + 1}: the gradient norm is {result.grad_norm.item()} (loss or gradients NaN/inf); "
                + (f"the last good checkpoint is {latest[-1]}" if latest else "no checkpoint was saved")
                + ". Lower --learning_rate, check the data, or pass --on_nonfinite_loss skip")
        scheduler.step()
        step += 1
        progress.update(1)
        epoch_float = feed.epoch_float
        # map-style only (streams refuse "epoch"): this step read the last micro-batch of an epoch. A
        # window may run across the epoch end, so this is the first step that completes the epoch.
        epoch_ended = not feed.stream and feed.epoch > epoch_before

        record: dict[str, Any] = {}
        if step % cfg.run.logging_steps == 0 or step == total_steps:
            loss_sum_all, masked_all, tokens_all = accelerator.reduce(sums, reduction="sum").tolist()
            record = {"step": step, "epoch": round(epoch_float, 4), "loss": loss_sum_all / max(masked_all, 1),
                      "lr": scheduler.get_last_lr()[0], "tokens_per_s": tokens_all / clock.lap()}
            sums.zero_()
            progress.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
        if step == total_steps or (cfg.run.eval_steps and step % cfg.run.eval_steps == 0):
            with clock.paused():
                result = evaluate_mlm(model, eval_dl, accelerator, metric)
            if result:
                record.update({"step": step, "epoch": round(epoch_float, 4), "eval_loss": result["loss"],
                               "perplexity": result["perplexity"], "eval_accuracy": result["accuracy"]})
                logger.info("step %d: eval loss %.4f, perplexity %.2f", step, result["loss"], result["perplexity"])
            eval_after = result
        if record:
            record["tokens_seen"] = tokens_total()
            log_record(record)
        every = cfg.run.checkpointing_steps
        if (every == "epoch" and epoch_ended) or (every not in (None, "epoch") and step % int(every) == 0):
            with clock.paused():
                save_checkpoint(accelerator, wait, cfg,
                                ckpt.TrainerState(step, feed.epoch, feed.index, tokens_total(), world), scheduler,
                                feed.stream_state())
            saved_step = step
    progress.close()
    if skipped_steps:
        logger.warning("%d optimizer step(s) skipped for non-finite gradients", skipped_steps)

    # --- 4. outputs --------------------------------------------------------------------------
    tokens_seen = tokens_total()
    final = save_final(accelerator, wait, model, tokenizer, out)
    result = TrainResult(
        steps=step, tokens_seen=tokens_seen, wall_time_s=time.perf_counter() - t0,
        tokens_per_s=(tokens_seen - tokens_base) / max(clock.training_s, 1e-9),
        eval_before=eval_before, eval_after=eval_after, output_dir=str(out), final_dir=str(final),
    )
    if accelerator.is_main_process:
        ckpt.write_atomic(out / "summary.json", json.dumps(asdict(result), indent=1))
    logger.info("%s", summary_line(result))
    if cfg.run.report and accelerator.is_main_process:
        write_run_report(out)
    if trackers:
        accelerator.end_training()
    return result


def write_run_report(out: Path) -> None:
    """report.html and its plots in the output folder (main process only)."""
    try:
        page, summary = write_report([out])
    except Exception as err:  # noqa: BLE001 - the model and metrics are saved: a plot must not fail the run
        logger.warning("the run report was not written (%s: %s); run python -m mlm_ddp.report %s to retry",
                       type(err).__name__, err, out)
        return
    logger.info("report: %s\n%s", page, summary)


def summary_line(result: TrainResult) -> str:
    line = (f"done: {result.steps} steps, {result.tokens_seen} tokens in {result.wall_time_s:.0f} s "
            f"({result.tokens_per_s:.0f} tokens/s while training)")
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


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    try:
        train(parse_args(argv))
    except RunEnded as err:
        say(err.line("mlm_ddp.train"))
        return err.exit_code
    except RuntimeError as err:  # DistError is one; gloo inside DDP's backward raises a plain one
        topo = distributed.detect(cuda_devices=0)
        if not (topo.distributed and is_collective_failure(err)):
            raise
        say(f"mlm_ddp.train: error: {lost_contact(topo, err)}")
        return EXIT_FAILED
    return 0


def is_collective_failure(err: RuntimeError) -> bool:
    """A peer died, or hung past --ddp_timeout (how gloo and NCCL say so)."""
    markers = ("gloo", "NCCL", "Connection reset by peer", "Connection closed by peer", "ProcessGroup")
    return isinstance(err, torch.distributed.DistError) or any(m in str(err) for m in markers)


def lost_contact(topo: distributed.Topology, err: Exception) -> str:
    others = [r for r in range(topo.world_size) if r != topo.rank]
    who = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {', '.join(map(str, others))}"
    return (f"rank {topo.rank} lost contact with the other process(es) ({who}): a process died, was killed, "
            f"or hung for longer than --ddp_timeout; the launcher's report or that process's log says which "
            f"and why. Cause: {type(err).__name__}: {str(err).strip()[:300]}")


if __name__ == "__main__":
    sys.exit(main())
