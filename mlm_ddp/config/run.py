"""The run section of the config tree: outputs, cadences, resuming, timeouts, the probe."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Literal

from mlm_ddp.config import checks
from mlm_ddp.config.sections import _doc
from mlm_ddp.errors import BadInput


@dataclass
class RunConfig:
    """Where outputs go, how often to log, evaluate and checkpoint, and resuming."""

    output_dir: str = _doc(
        "Folder for config.yaml, metrics.jsonl, checkpoints/, logs/, final/ and summary.json.",
        default="mlm_ddp_output",
    )
    overwrite_output_dir: bool = _doc(
        "Delete the outputs of an earlier run in --output_dir before starting (never done unasked).",
        default=False,
    )
    logging_steps: int = _doc("Write a metrics.jsonl line every this many optimizer steps.", default=10)
    eval_steps: int | None = _doc(
        "Evaluate every this many optimizer steps (always at the start and the end).", default=None
    )
    checkpointing_steps: str | None = _doc(
        "Save a checkpoint every N optimizer steps, or 'epoch' at each epoch end.", default=None
    )
    save_total_limit: int | None = _doc("Keep only the newest K complete checkpoints.", default=None)
    resume_from_checkpoint: str | None = _doc(
        "'latest' (the newest complete checkpoint in --output_dir), a checkpoint folder, or 'auto': "
        "latest if there is one, else start (what a requeued job passes; a finished run is left as "
        "it is).",
        default=None,
    )
    decay_from: str | None = _doc(
        "A decay branch: a checkpoint folder (OUT/checkpoints/step-N) of a warmup_stable_decay run in its stable "
        "phase, continued in --output_dir (another folder: the source is only read, and its run can go on) with "
        "a decay of --num_decay_steps (a fraction: of this run's N + decay steps) that starts at step N; the run "
        "ends at N + decay steps with its own final/ and evaluation. Other settings as the source's (its "
        "config.yaml); add --resume_from_checkpoint auto to continue a branch that stopped.",
        default=None,
    )
    allow_lr_jump: bool = _doc(
        "Resume even when this run's schedule sets another learning rate at the checkpoint's step than the "
        "checkpoint's run had (a longer --max_train_steps or --num_train_epochs moves a decay under way, or a "
        "warm-up given as a fraction). Without it such a resume is refused; with it the rate jumps and the run "
        "records that it was allowed.",
        default=False,
    )
    with_tracking: bool = _doc("Log metrics to the trackers of --report_to.", default=False)
    report_to: str = _doc(
        "Trackers for --with_tracking: 'tensorboard', 'wandb', 'mlflow', a comma list, or 'all'.",
        default="tensorboard",
    )
    report: bool = _doc(
        "At the end of training, write report.html and its plots (report_plots/) into --output_dir, "
        "as `python -m mlm_ddp.report OUTPUT_DIR` does ('--report false' to skip).",
        default=True,
    )
    stop_signals: str = _doc(
        "Signals (comma list) on which every process saves one checkpoint at the next optimizer step "
        "and exits with code 75, to be requeued and resumed; '' to keep the default actions.",
        default="SIGTERM,SIGUSR1,SIGUSR2",
    )
    ddp_timeout: int = _doc(
        "Seconds a collective waits for the other processes before the run fails: when a process "
        "dies, the others stop within this time instead of hanging.",
        default=120,
    )
    rendezvous_timeout: int = _doc(
        "Seconds the processes wait for each other when they start: the first to join the process group "
        "waits this long for the last (a node that starts late, imports from a slow shared filesystem, or "
        "converts a large raw corpus to Arrow before it joins; --ddp_timeout where that is longer); "
        "--ddp_timeout applies from then on. Also how long the others wait when one fails before it "
        "joins and the launcher does not stop them.",
        default=900,
    )
    preprocessing_timeout: int = _doc(
        "Seconds the other processes wait for the main process to tokenize a map-style data set "
        "into the datasets cache (a large corpus takes longer than --ddp_timeout).",
        default=10800,
    )
    save_timeout: int = _doc(
        "Seconds the other processes wait while the main process alone writes a checkpoint or the "
        "final model, or removes an earlier run (--overwrite_output_dir): a large model on a network "
        "filesystem takes longer than --ddp_timeout, which stays short for the training collectives.",
        default=1800,
    )
    push_to_hub: bool = _doc(
        "At the end, upload final/ (model, tokenizer and model card) to the Hugging Face Hub repository "
        "--hub_model_id; checked before training starts (network and login), so it never fails a run late.",
        default=False,
    )
    hub_model_id: str | None = _doc(
        "The Hub repository for --push_to_hub, 'user/name'. Default: your user / the --output_dir folder name.",
        default=None,
    )
    hub_token: str | None = _doc(
        "Hub token for --push_to_hub (default: the login of `hf auth login` or HF_TOKEN). Never written to "
        "config.yaml, checkpoints or trackers.",
        default=None,
    )
    on_nonfinite_loss: Literal["stop", "skip"] = _doc(
        "A step whose loss or gradients are NaN/inf: 'stop' the run (exit 3, naming the last good checkpoint) or "
        "'skip' its update (counted; 10 in a row, or a run with no update, stop it too). fp16 overflows (every "
        "rank's loss finite) are the gradient scaler's: counted apart, fatal once its scale falls below 1.",
        default="stop",
    )
    peak_tflops: float | None = _doc(
        "Peak TFLOP/s of one device at the training precision, for the MFU in the log and "
        "metrics.jsonl (achieved matmul FLOP/s over it). Default: measured at start-up (1 s of matmuls "
        "the way the model runs them). Give your GPU's datasheet number to compare with published MFUs.",
        default=None,
    )
    on_loss_spike: Literal["off", "skip", "rollback"] = _doc(
        "A loss spike: a step whose loss is above --loss_spike_factor x the median of the last "
        "--loss_spike_window steps' losses. 'skip' drops that step's update (the step counts); 'rollback' "
        "reloads the newest checkpoint (needs --checkpointing_steps), skips the spike's micro-batches and "
        "trains on (before the first checkpoint: as 'skip'). Both are counted in summary.json. Off by "
        "default: judging costs one more all-reduce and a host sync per step.",
        default="off",
    )
    loss_spike_factor: float = _doc("A step's loss above this multiple of the running median is a spike.",
                                    default=2.0)
    loss_spike_window: int = _doc(
        "Steps in the running median of --on_loss_spike (judging starts after 10 of them).", default=100)
    # the downstream probe (mlm_ddp.probe), before training and on final/: its own flags, prefixed
    probe_train_file: str | None = _doc("Labeled texts to train the downstream probe on (csv, json, jsonl or "
                                        "parquet); with --probe_test_file.", default=None)
    probe_test_file: str | None = _doc("Labeled texts the probe is scored on.", default=None)
    probe_text_column: str = _doc("The probe files' text column.", default="text")
    probe_label_column: str = _doc("The probe files' label column.", default="label")
    probe_mode: Literal["linear", "finetune"] = _doc(
        "linear: frozen features + logistic regression; finetune: a sequence classifier trained briefly.",
        default="linear")
    probe_protocol: Literal["default", "mteb"] = _doc(
        "default: every labeled training text; mteb: MTEB's classification protocol exactly (docs/probe.md).",
        default="default")
    probe_max_train_per_label: int | None = _doc("A cap on the probe's training texts per label and seed "
                                                 "(default: all; mteb: 8).", default=None)
    probe_seeds: int | None = _doc("The probe's seeds (subsamples) averaged over (default 10; finetune 3).",
                                   default=None)
    probe_every_eval: bool = _doc(
        "Also probe at each evaluation (--eval_steps), to see where the downstream score peaks: the model as it "
        "is then is written beside final/ and probed there, and the one of the best probe accuracy is kept as "
        "best_probe/ (its step and figures in best_probe/probe.json). Each costs a save of the model and a probe.",
        default=False)

    def probing(self) -> bool:
        return self.probe_train_file is not None or self.probe_test_file is not None

    def __post_init__(self) -> None:
        if self.probing() and (self.probe_train_file is None or self.probe_test_file is None):
            raise BadInput("the probe needs both --probe_train_file and --probe_test_file")
        if self.probe_every_eval and not self.probing():
            raise BadInput("--probe_every_eval probes at each evaluation: give --probe_train_file and "
                           "--probe_test_file too")
        if self.probe_every_eval and self.eval_steps is None:
            raise BadInput("--probe_every_eval probes at each evaluation, and without --eval_steps there is only the "
                           "last: set --eval_steps N")
        if not self.output_dir:
            raise BadInput("--output_dir must not be empty")
        for name in ("logging_steps", "eval_steps", "save_total_limit"):
            checks.at_least(f"--{name}", getattr(self, name), 1)
        if self.checkpointing_steps is not None:
            value = str(self.checkpointing_steps)
            if value != "epoch" and not (value.isdigit() and int(value) > 0):
                raise BadInput(
                    f"--checkpointing_steps must be a positive integer or 'epoch', got {value!r}"
                )
            self.checkpointing_steps = value
        for name in self.signal_names():
            if not hasattr(signal, name) or name in ("SIGKILL", "SIGSTOP"):
                raise BadInput(f"--stop_signals: {name!r} is not a signal that can be caught; "
                                  "use names like SIGTERM,SIGUSR1")
        timeouts = {"--ddp_timeout": self.ddp_timeout, "--preprocessing_timeout": self.preprocessing_timeout,
                    "--save_timeout": self.save_timeout, "--rendezvous_timeout": self.rendezvous_timeout}
        for flag, value in timeouts.items():
            checks.at_least(flag, value, 1, " second")
        checks.above("--peak_tflops", self.peak_tflops, 0)
        checks.above("--loss_spike_factor", self.loss_spike_factor, 1)
        checks.at_least("--loss_spike_window", self.loss_spike_window, 10, " steps")
        if self.on_loss_spike == "rollback" and self.checkpointing_steps is None:
            raise BadInput("--on_loss_spike rollback reloads the newest checkpoint: set --checkpointing_steps, "
                           "or use --on_loss_spike skip")

    def signal_names(self) -> list[str]:
        return [n.strip().upper() for n in self.stop_signals.split(",") if n.strip()]
