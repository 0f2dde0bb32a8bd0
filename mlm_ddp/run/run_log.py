"""What a run reports while it trains: `metrics.jsonl`, the trackers (TensorBoard, wandb, MLflow),
the progress bar, the training clock, and the loss and token counts since the last log line. The
cadence (--logging_steps) is the log's own: the loop calls `maybe(step)` every step.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from tqdm.auto import tqdm

from mlm_ddp.cluster.durable import write_atomic
from mlm_ddp.cluster.heartbeat import PhaseReport, unreported
from mlm_ddp.compat import transformers as compat_transformers
from mlm_ddp.config import Config, RunConfig
from mlm_ddp.errors import BadInput
from mlm_ddp.loop import branch, speed
from mlm_ddp.loop.speed import TrainingClock
from mlm_ddp.loop.step import StepResult

logger = get_logger(__name__)
KNOWN_TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # name -> module
TRACKING_PROJECT = "mlm_ddp"  # the wandb project, the MLflow experiment
METRICS_FILE = "metrics.jsonl"


@dataclass
class StepSums:
    """Sums over optimizer steps, this rank's until `reduced`: float64 scalars on the device, so
    adding a step costs no host sync."""

    loss_sum: torch.Tensor  # cross-entropy over the masked tokens
    masked: torch.Tensor  # masked tokens
    tokens: torch.Tensor  # non-padding input tokens

    @classmethod
    def zeros(cls, device: torch.device) -> StepSums:
        return cls(*torch.zeros(3, dtype=torch.float64, device=device).unbind())

    def add(self, result: StepResult) -> None:
        self.loss_sum = self.loss_sum + result.loss_sum
        self.masked = self.masked + result.masked
        self.tokens = self.tokens + result.tokens

    def reduced(self, accelerator: Accelerator, *local: torch.Tensor) -> list[float]:
        """(loss sum, masked, tokens) of every rank, then this rank's `local` scalars as they are: one all-reduce
        (a collective) and one read back to the host for all of them."""
        total = accelerator.reduce(torch.stack([self.loss_sum, self.masked, self.tokens]), reduction="sum")
        return torch.cat([total, *(value.reshape(1).to(total) for value in local)]).tolist()


def clipped(grad_norm: float, max_grad_norm: float) -> bool:
    """Whether --max_grad_norm scaled this step's gradients down: torch's clip_grad_norm_ scales by
    max_norm / (norm + 1e-6) where that is below 1 (no clipping at 0, which the step turns into inf)."""
    return max_grad_norm > 0 and grad_norm + 1e-6 > max_grad_norm


def tracked(record: dict[str, Any]) -> dict[str, float]:
    """A record as the trackers take it: numbers only (a tag such as the probe's "before" is for metrics.jsonl;
    MLflow takes no text), each held-out source's figures as 'eval_loss/NAME', 'perplexity/NAME' and
    'eval_accuracy/NAME' (a tracker takes one level of names)."""
    flat = {k: v for k, v in record.items() if k not in ("step", "eval_sources") and not isinstance(v, str)}
    for name, each in (record.get("eval_sources") or {}).items():
        flat.update({f"eval_loss/{name}": each["loss"], f"perplexity/{name}": each["perplexity"],
                     f"eval_accuracy/{name}": each["accuracy"],
                     **({f"bits_per_char/{name}": each["bits_per_char"]} if "bits_per_char" in each else {})})
    return flat


def tracker_config(cfg: Config) -> dict[str, Any]:
    """The settings as the trackers take them: flat, scalars only; a list (--validation_file's files) as one
    string, so that one file is logged as it was before the flag took several."""
    values = {k: v for section in cfg.to_dict().values() for k, v in section.items()}
    return {k: ", ".join(map(str, v)) if isinstance(v, list) else v for k, v in values.items()
            if isinstance(v, (int, float, str, bool, list))}


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


def check_trackers(run: RunConfig) -> list[str]:
    """The trackers --report_to names, each installed (with 'all': those that are)."""
    if not run.with_tracking:
        return []
    names = list(KNOWN_TRACKERS) if run.report_to == "all" else run.report_to.split(",")
    chosen = []
    for name in (n.strip() for n in names):
        if name not in KNOWN_TRACKERS:
            raise BadInput(f"--report_to {name!r}: unknown tracker; use {', '.join(KNOWN_TRACKERS)} or all")
        if importlib.util.find_spec(KNOWN_TRACKERS[name]) is None:
            if run.report_to == "all":
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


@dataclass(frozen=True)
class Utilisation:
    """What MFU is computed from: FLOPs per token for a share of tokens that go through the head, and
    one device's peak FLOP/s."""

    flops_per_token: Callable[[float, float], float]  # head, last-layer fractions -> matmul FLOPs per token
    masked_only: bool  # the head runs on the masked tokens only
    peak: float
    last_layer_subset: bool = False  # so does the last encoder layer, but for its keys and values
    measured: bool = True  # the peak was measured at the start (False: --peak_tflops)

    def mfu(self, tokens_per_s_per_device: float, masked: float, tokens: float) -> float:
        share = masked / max(tokens, 1)
        flops = self.flops_per_token(share if self.masked_only else 1.0, share if self.last_layer_subset else 1.0)
        return tokens_per_s_per_device * flops / self.peak


def utilisation(model_config: Any, seq_len: int, peak_tflops: float | None, accelerator: Accelerator,
                model: torch.nn.Module) -> Utilisation | None:
    """What the log's MFU is computed from (None, with a line, when the model's FLOPs are not counted)."""
    if not speed.flops_known(model_config):
        logger.info("MFU not logged: %s names its sizes otherwise than %s", type(model_config).__name__,
                    ", ".join(speed.FLOP_FIELDS))
        return None
    peak = speed.peak_flops(peak_tflops, accelerator)
    logger.info("MFU against %.3f TFLOP/s per device (%s)", peak / 1e12,
                "--peak_tflops" if peak_tflops else "measured now: a matmul at the training precision")
    wrapper = accelerator.unwrap_model(model)
    return Utilisation(functools.partial(speed.training_flops_per_token, model_config, seq_len),
                       wrapper.masked_only, peak, wrapper.last_layer_subset, measured=not peak_tflops)


def describe_start(cfg: Config, topo: Any, precision: tuple[str, str], accelerator: Accelerator, data: str,
                   model: torch.nn.Module, n_params: int) -> None:
    """The start-up lines: topology (distributed.Topology), data, model."""
    training, world = cfg.training, accelerator.num_processes
    accumulation = training.gradient_accumulation_steps
    logger.info("topology: %d process(es) on %d node(s), %s, started by %s (master %s:%s); global batch "
                "%d = %d per device x %d processes x %d accumulation; precision %s (%s); device %s (%d threads)",
                world, topo.num_nodes, accelerator.distributed_type, topo.launcher, topo.master_addr or "-",
                topo.master_port or "-", training.per_device_train_batch_size * world * accumulation,
                training.per_device_train_batch_size, world, accumulation,
                *precision, accelerator.device,
                torch.get_num_threads())
    logger.info("data: %s", data)
    wrapper = accelerator.unwrap_model(model)
    logger.info("model: %s, %.1fM parameters; MLM head on %s positions; last layer on %s positions; attention "
                "%s; dropout %s; AdamW %s; torch.compile %s",
                type(wrapper.model).__name__, n_params / 1e6, "masked" if wrapper.masked_only else "all",
                "masked" if wrapper.last_layer_subset else "all",
                compat_transformers.attn_implementation(wrapper.model.config),
                "16-bit draws" if wrapper.draws16 else "torch's", training.optimizer_impl,
                "on" if training.torch_compile else "off")


class RunLog:
    """metrics.jsonl (main process), the trackers and the progress bar of one run. Every rank
    calls every method at the same point: `maybe`, `write` and `tokens_total` hold collectives."""

    def __init__(self, cfg: Config, accelerator: Accelerator, trackers: list[str], start_step: int,
                 total_steps: int, resumed: bool, tokens_before: int, usage: Utilisation | None = None,
                 beat: PhaseReport = unreported) -> None:
        self.accelerator, self.trackers, self.every = accelerator, trackers, cfg.run.logging_steps
        self.max_grad_norm = cfg.training.max_grad_norm  # 0: no clipping
        self.beat = beat
        self.total_steps, self.tokens_before = total_steps, tokens_before
        out = Path(cfg.run.output_dir)
        self.path, self.enabled = out / METRICS_FILE, accelerator.is_main_process
        self.source = branch.source_metrics(cfg.run.decay_from)  # a decay branch's source run's metrics.jsonl
        if resumed:
            self._trim(start_step)
        if trackers:
            skipped = sorted(set(KNOWN_TRACKERS) - set(trackers)) if cfg.run.report_to == "all" else []
            logger.info("tracking with %s: project %s, run %s%s", ", ".join(trackers), TRACKING_PROJECT,
                        out.resolve().name, f"; not installed, so not used: {', '.join(skipped)}" if skipped else "")
            accelerator.init_trackers(TRACKING_PROJECT, init_kwargs=tracker_kwargs(out, trackers),
                                      config=tracker_config(cfg))
        # the sums since the last metrics line; a resume puts a checkpoint's back (`load_state_dict`)
        self.since_log, self.carried_tokens = StepSums.zeros(accelerator.device), 0.0
        self.trained = torch.zeros((), dtype=torch.float64, device=accelerator.device)  # this rank's tokens
        # the last step's gradient norm before clipping, on the device (the same on every rank)
        self.grad_norm = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        self.start_step = start_step
        self.clock, self.progress = TrainingClock(), None
        self.usage = usage  # None: MFU not logged (a model whose FLOPs are not counted)
        self.over_peak = False  # an MFU above 100% was met: the peak measured again (once), or a line said
        self.run_masked = self.run_tokens = 0.0  # all ranks, over the logged steps: the run's head share

    def _trim(self, step: int) -> None:
        """Drop what was logged after `step` (a crashed run's lines, or those a rollback replays)."""
        if self.enabled and self.path.exists():
            kept = [line for line, record in read_metrics_lines(self.path) if record.get("step", 0) <= step]
            write_atomic(self.path, "".join(line + "\n" for line in kept))

    def state_dict(self) -> dict[str, float]:
        """A resumable part (loop/resumable.py): the sums of every rank since the last metrics line
        (--logging_steps > 1), which the first line after a resume adds in (a collective)."""
        loss_sum, masked, tokens = self.since_log.reduced(self.accelerator)
        return {"loss_sum": loss_sum, "masked": masked, "tokens": tokens}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """A checkpoint's sums, held by the main process alone since `maybe` adds the ranks up; and their tokens,
        which the record's tokens/s leaves out (they were trained before the clock started). So the first line
        after a resume or a rollback covers the same steps as an uninterrupted run's."""
        sums = StepSums.zeros(self.accelerator.device)
        if self.accelerator.is_main_process:
            sums = StepSums(*torch.tensor([state["loss_sum"], state["masked"], state["tokens"]], dtype=torch.float64,
                                          device=self.accelerator.device).unbind())
        self.since_log, self.carried_tokens = sums, float(state["tokens"])

    def rewind(self, step: int, tokens_seen: int) -> None:
        """Back to a checkpoint's `step` (a loss-spike rollback): its lines, counts and progress (its sums since
        the last metrics line are the part `load_state_dict` restores)."""
        self._trim(step)
        self.tokens_before, self.start_step = tokens_seen, step
        self.trained = torch.zeros_like(self.trained)
        if self.progress is not None:
            self.progress.n = step
            self.progress.refresh()

    def begin(self) -> None:
        """The loop starts: the progress bar appears and the training clock starts (after the
        evaluation before training, which is not training time)."""
        self.clock = TrainingClock()
        self.progress = tqdm(total=self.total_steps, initial=self.start_step, desc="training", unit="step",
                             disable=not self.accelerator.is_main_process)

    def tokens_total(self) -> int:
        """Input tokens trained on so far, all ranks (a collective: every rank calls it together)."""
        return int(self.tokens_before + self.accelerator.reduce(self.trained.clone(), reduction="sum").item())

    def add(self, result: StepResult) -> None:
        self.since_log.add(result)
        self.trained = self.trained + result.tokens
        self.grad_norm = result.grad_norm

    def maybe(self, step: int, epoch: float, lr: float) -> dict[str, Any]:
        """Called after every optimizer step: on a logging step (and the last) the training record
        since the previous one (a collective), else {}."""
        logs = not (step % self.every and step != self.total_steps)
        self.beat(step, "log", "the all-reduce of the logged sums" if logs else None)  # one beat either way
        self.progress.update(1)
        if not logs:
            return {}
        loss_sum, masked, tokens, grad_norm = self.since_log.reduced(self.accelerator, self.grad_norm)
        record = {"step": step, "epoch": round(epoch, 4), "loss": loss_sum / max(masked, 1), "lr": lr,
                  "tokens_per_s": (tokens - self.carried_tokens) / self.clock.lap(),
                  "grad_norm": grad_norm, "grad_clipped": clipped(grad_norm, self.max_grad_norm)}
        self.since_log, self.carried_tokens = StepSums.zeros(self.accelerator.device), 0.0
        self.run_masked, self.run_tokens = self.run_masked + masked, self.run_tokens + tokens
        shown = {"loss": f"{record['loss']:.4f}", "tok_s": f"{record['tokens_per_s']:.0f}"}
        mfu = self._mfu(record["tokens_per_s"], masked, tokens)
        if mfu is not None:
            record["mfu"] = mfu
            shown["mfu"] = f"{mfu:.1%}"
        self.progress.set_postfix(shown)
        return record

    def run_speed(self, tokens_seen: int) -> tuple[float | None, float | None]:
        """This run's tokens/s (all ranks, training time only) and MFU; None for both where it trained no
        step (resumed at its last step): no figure, where 0.0 would read as a run that stalled."""
        if tokens_seen == self.tokens_before:
            return None, None
        tokens_per_s = (tokens_seen - self.tokens_before) / max(self.clock.training_s, 1e-9)
        return tokens_per_s, self.run_mfu(tokens_per_s)

    def run_mfu(self, tokens_per_s: float) -> float | None:
        """The MFU of a whole run that trained `tokens_per_s` (all ranks)."""
        return self._mfu(tokens_per_s, self.run_masked, self.run_tokens)

    def _mfu(self, tokens_per_s: float, masked: float, tokens: float) -> float | None:
        """MFU of all ranks' `tokens_per_s` (each device trains its share); None where not counted."""
        if self.usage is None:
            return None
        mfu = self.usage.mfu(tokens_per_s / self.accelerator.num_processes, masked, tokens)
        if mfu <= 1 or self.over_peak:  # once per run: a re-measurement costs 1 s, and would at every log
            return mfu
        self.over_peak = True
        if self.usage.measured:
            # above the peak: the 1 s measured at the start shared the cores with other work (a busy CPU,
            # another job on the GPU). Measured again, outside the training clock, the higher one kept
            with self.clock.paused():
                try:
                    again = speed.measure_peak(self.accelerator)
                except torch.OutOfMemoryError:  # a GPU filled by training: no room for the matmul's operands
                    again = 0.0  # the line below says the figure is above the peak
            if again > self.usage.peak:
                logger.warning("MFU %.1f%% is above 100%%: the peak measured at the start, %.3f TFLOP/s, was "
                               "low (the device was busy then); measured again: %.3f TFLOP/s, which MFU is "
                               "against from here on", 100 * mfu, self.usage.peak / 1e12, again / 1e12)
                self.usage = replace(self.usage, peak=again)
                mfu = self.usage.mfu(tokens_per_s / self.accelerator.num_processes, masked, tokens)
        if mfu > 1:
            logger.warning("MFU %.1f%% is above 100%% of %.3f TFLOP/s (%s): that peak is too low for this "
                           "device; give its real one with --peak_tflops", 100 * mfu, self.usage.peak / 1e12,
                           "measured" if self.usage.measured else "--peak_tflops")
        return mfu

    def write(self, record: dict[str, Any], with_tokens: bool = True) -> None:
        """Append `record` (if any) to metrics.jsonl and the trackers, with the tokens seen so far (a
        collective) unless `with_tokens` is False."""
        if not record:
            return
        if with_tokens:
            record["tokens_seen"] = self.tokens_total()
        if self.enabled:
            with open(self.path, "a") as handle:
                handle.write(json.dumps(record) + "\n")
        if self.trackers:
            self.accelerator.log(tracked(record), step=record["step"])

    def origins(self) -> list[Path]:
        """Where the records before training of the run this one resumes are: its own metrics.jsonl, then, for
        a decay branch, its source run's."""
        return [path for path in (self.path, self.source) if path is not None and path.exists()]

    def first_eval(self) -> dict[str, Any] | None:
        """The evaluation before training of the run this one resumes (its step-0 line)."""
        for path in self.origins():
            for _line, record in read_metrics_lines(path):
                if "eval_loss" in record:
                    return {"loss": record["eval_loss"], "perplexity": record["perplexity"],
                            "accuracy": record["eval_accuracy"],
                            **({"bits_per_char": record["eval_bits_per_char"], "characters": record["eval_characters"]}
                               if "eval_bits_per_char" in record else {}),
                            **({"mlm_probability": record["eval_mlm_probability"]}
                               if "eval_mlm_probability" in record else {}),
                            **({"sources": record["eval_sources"]} if "eval_sources" in record else {})}
        return None

    def close(self) -> None:
        """Close the progress bar, also when the run fails: an error message then starts a line of its own."""
        if self.progress is not None:
            self.progress.close()

    def end(self) -> None:
        if self.trackers:
            self.accelerator.end_training()


def speed_note(tokens_per_s: float | None, mfu: float | None) -> str:
    """The closing line's speed: tokens/s while training and MFU, or that this start trained no step."""
    if tokens_per_s is None:
        return "(no step trained: resumed at its last step)"
    return f"({tokens_per_s:.0f} tokens/s while training" + (f", MFU {mfu:.1%}" if mfu is not None else "") + ")"
