"""The training section of the config tree: batch sizes, the optimizer, the schedule, precision."""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass
from typing import Literal

from mlm_ddp.config import checks
from mlm_ddp.config.sections import _doc
from mlm_ddp.errors import BadInput

# transformers' schedules stepped once per optimizer step, from (warm-up, total steps) and the flags below
SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "warmup_stable_decay", "cosine_with_min_lr", "cosine_warmup_with_min_lr")
# transformers' other names, each refused with its reason
SCHEDULERS_REFUSED = {
    "reduce_lr_on_plateau": "it steps on an evaluation metric, not once per optimizer step",
    "greedy": "it steps on an evaluation metric, not once per optimizer step",
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
    num_warmup_steps: float = _doc(
        "Optimizer steps of linear warm-up, or a fraction below 1 of the run's steps (as transformers' "
        "warmup_steps takes it; e.g. 0.06).", default=10)
    num_decay_steps: float | None = _doc(
        "warmup_stable_decay: optimizer steps of the decay that ends the run, or a fraction below 1 of the run's "
        "steps (0.1: the last 10%%); 0: no decay, the rate stays at its peak after the warm-up however long the "
        "run goes on, and a decay branch (--decay_from) decays from any of its checkpoints. Required with it.",
        default=None,
    )
    decay_type: Literal["linear", "cosine", "1-sqrt"] = _doc(
        "warmup_stable_decay: the decay's shape (transformers' get_wsd_schedule); ModernBERT's is 1-sqrt.",
        default="cosine",
    )
    min_lr_ratio: float = _doc(
        "warmup_stable_decay: the rate the decay ends at, as a fraction of the peak (the warm-up starts there "
        "too); cosine_with_min_lr, cosine_warmup_with_min_lr: their floor (transformers' min_lr_rate).",
        default=0.0,
    )
    num_train_epochs: float = _doc("Passes over the training data (ignored if --max_train_steps is set).", default=1.0)
    max_train_steps: int | None = _doc(
        "Total optimizer steps; overrides --num_train_epochs. Required with --streaming.", default=None
    )
    gradient_accumulation_steps: int = _doc("Micro-batches per optimizer step.", default=1)
    global_batch_size: int | None = _doc(
        "Sequences per optimizer step over all processes; --gradient_accumulation_steps is then derived from it "
        "at every start (global / (per-device batch x processes)), so a job restarted on another number of "
        "processes (torchrun's elastic restart, a requeue on fewer nodes) keeps its global batch and resumes. "
        "Must be a multiple of the per-device batch x processes. Default: not set (the accumulation as given).",
        default=None,
    )
    lr_reference_batch: int | None = _doc(
        "The global batch (sequences per optimizer step) that --learning_rate was tuned for. When this run's "
        "global batch B (per device x processes x accumulation) differs, the learning rates are multiplied by "
        "sqrt(B / this), the square-root rule for Adam-type optimizers (Malladi et al. 2022), and the run says so. "
        "The shipped recipes set it; a --learning_rate given as a flag beside a recipe unsets it (your rate is "
        "used as given). The rule is this project's choice, not its sources' (docs/recipes.md); a batch more than "
        "8x from the reference gets a warning, since the rule was checked only near it.",
        default=None,
    )
    lr_reference_seq_length: int | None = _doc(
        "The sequence length (--max_seq_length) of the reference batch: with it the square-root rule compares "
        "tokens per optimizer step (batch x --max_seq_length against reference batch x this), so a recipe run at "
        "128 tokens instead of its 512 counts a quarter of the tokens per sequence. Default: not set "
        "(sequences are compared).",
        default=None,
    )
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = _doc(
        "Mixed precision, passed to Accelerator(...) explicitly. 'auto': what `accelerate launch` was given "
        "(--mixed_precision, its config file), else chosen for the device the run uses, native only: bf16 on "
        "GPUs of compute capability 8.0+ and on CPUs with AVX512-BF16 or AMX, fp16 with a gradient scaler on "
        "capability 7.x (V100, T4), else 'no' (fp32). A value here that disagrees with the launcher's stops the "
        "run. fp16 needs a GPU. Under FSDP the loss sums and gradient reductions stay fp32.",
        default="auto",
    )
    optimizer: Literal["adamw", "stableadamw"] = _doc(
        "'adamw': torch's AdamW; --weight_decay is coupled to the learning rate (each step decays weights by "
        "lr x weight_decay). 'stableadamw': optimi's StableAdamW (pip install \"mlm_ddp[stableadamw]\"), "
        "ModernBERT's optimizer: AdamW whose step on each tensor is divided by max(1, RMS of grad^2 / "
        "max(exp_avg_sq, eps^2)), with --weight_decay fully decoupled from the learning rate's size: each step "
        "decays weights by weight_decay x lr / peak lr of their group (ModernBERT: 1e-5; 1e-3 and more are "
        "refused). Both: the same --adam_beta1/2 and --adam_epsilon (ModernBERT: 0.9, 0.98, 1e-6), no decay "
        "on biases and norms, --max_grad_norm still clips the global norm first (ModernBERT: 0, off). Cost in "
        "waits for the device per step, beside the loop's one: the gradient norm's finiteness (a fused AdamW "
        "skips on the device instead), and on optimi's foreach and for-loop paths (a CPU, FSDP2) one per "
        "parameter tensor, its RMS; its Triton kernels (--optimizer_impl fused, CUDA) read none. Cannot "
        "change on resume (docs/performance.md 'The optimizer').",
        default="adamw",
    )
    optimizer_impl: Literal["fused", "foreach", "for-loop"] = _doc(
        "Optimizer implementation: 'fused' (AdamW: one kernel for all parameters; StableAdamW: optimi's choice, "
        "its Triton kernels where the parameters are plain tensors on a CUDA device and triton imports, else "
        "its for-loop), 'foreach' (batched tensor ops) or 'for-loop' (per-parameter reference, torch's CPU "
        "default). All compute the same update.",
        default="fused",
    )
    torch_compile: bool = _doc(
        "torch.compile the encoder's repeated layer (one graph, reused by every layer), the last layer on "
        "the masked positions and the MLM head, in place (checkpoints keep their keys). Costs a compilation "
        "at the first step and one more when shapes first change; dropout then draws from Inductor's "
        "generator (other masks than eager, resumed exactly). docs/performance.md has its measured effect.",
        default=False,
    )
    torch_compile_backend: str = _doc(
        "With --torch_compile: torch.compile's backend, as in transformers' TrainingArguments ('inductor'; "
        "'aot_eager' traces and runs the same graphs without generating kernels).",
        default="inductor",
    )
    torch_compile_mode: str | None = _doc(
        "With --torch_compile: torch.compile's mode ('default', 'reduce-overhead': CUDA graphs, "
        "'max-autotune'); None is torch's default.",
        default=None,
    )
    seed: int = _doc("Seed of the data order, the masks and the model's random initialisation.", default=42)
    cpu_threads: int | None = _doc(
        "CPU runs: intra-op threads per process. Default: this node's cores divided by its processes "
        "(accelerate launch alone would set 1).",
        default=None,
    )

    def __post_init__(self) -> None:
        checks.at_least("--lr_reference_batch", self.lr_reference_batch, 1, " sequence")
        checks.at_least("--lr_reference_seq_length", self.lr_reference_seq_length, 1, " token")
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            checks.at_least(f"--{name}", getattr(self, name), 1)
        if self.global_batch_size is not None and (self.global_batch_size < 1 or self.gradient_accumulation_steps != 1):
            raise BadInput(f"--global_batch_size {self.global_batch_size} with --gradient_accumulation_steps "
                           f"{self.gradient_accumulation_steps}: give one of them (the accumulation is derived from "
                           "the global batch), and a global batch of at least 1 sequence")
        if self.lr_scheduler_type not in SCHEDULERS:
            why = SCHEDULERS_REFUSED.get(self.lr_scheduler_type, "not a schedule transformers knows")
            raise BadInput(f"--lr_scheduler_type {self.lr_scheduler_type}: {why}; use one of {', '.join(SCHEDULERS)}")
        self.check_schedule()
        for name in ("learning_rate", "head_learning_rate"):
            checks.positive(f"--{name}", getattr(self, name))
        for name in ("adam_beta1", "adam_beta2"):  # torch's AdamW refuses them later, with a traceback
            checks.within(f"--{name}", getattr(self, name), 0, 1,
                          hint="; the usual values are 0.9 and 0.999 (0.98 for ModernBERT's recipe)")
        checks.not_negative("--adam_epsilon", self.adam_epsilon, hint="; the usual value is 1e-8")
        checks.not_negative("--seed", self.seed)  # numpy's generators take no negative seed
        for name in ("weight_decay", "max_grad_norm", "num_warmup_steps"):
            checks.not_negative(f"--{name}", getattr(self, name))
        if self.num_warmup_steps >= 1 and self.num_warmup_steps != int(self.num_warmup_steps):
            raise BadInput(f"--num_warmup_steps must be whole steps or a fraction below 1, got {self.num_warmup_steps}")
        if self.optimizer == "stableadamw":
            check_stableadamw(self.weight_decay)
        checks.positive("--num_train_epochs", self.num_train_epochs)
        checks.at_least("--cpu_threads", self.cpu_threads, 1)
        checks.at_least("--max_train_steps", self.max_train_steps, 1)

    def accumulation_for(self, world: int) -> int:
        """Micro-batches per optimizer step on `world` processes (--global_batch_size, else as given)."""
        if self.global_batch_size is None:
            return self.gradient_accumulation_steps
        per_step = self.per_device_train_batch_size * world
        if self.global_batch_size % per_step:
            raise BadInput(f"--global_batch_size {self.global_batch_size} is not a multiple of "
                           f"--per_device_train_batch_size {self.per_device_train_batch_size} x {world} process(es) = "
                           f"{per_step}: give a multiple of it, or another --per_device_train_batch_size")
        return self.global_batch_size // per_step

    def for_world(self, world: int) -> TrainingConfig:
        """This section as a run on `world` processes trains it: a copy whose --gradient_accumulation_steps is
        `accumulation_for(world)`. Copied, not built anew: a built section refuses an accumulation given beside
        --global_batch_size, and this one is derived from it."""
        resolved = copy.copy(self)
        resolved.gradient_accumulation_steps = self.accumulation_for(world)
        return resolved

    def check_schedule(self) -> None:
        """The warmup_stable_decay flags: given with it, and not without it."""
        wsd, decay = self.lr_scheduler_type == "warmup_stable_decay", self.num_decay_steps
        if wsd and decay is None:
            raise BadInput("--lr_scheduler_type warmup_stable_decay needs --num_decay_steps: steps (e.g. 2000), a "
                           "fraction of the run below 1 (e.g. 0.1), or 0 for a stable phase without decay")
        if not wsd and (decay is not None or self.decay_type != "cosine"):
            raise BadInput(f"--num_decay_steps and --decay_type shape warmup_stable_decay's decay; "
                           f"--lr_scheduler_type is {self.lr_scheduler_type}: drop them or use warmup_stable_decay")
        if decay is not None and (decay < 0 or (decay >= 1 and decay != int(decay))):
            raise BadInput(f"--num_decay_steps must be whole steps, a fraction in (0, 1), or 0; got {decay}")
        checks.within("--min_lr_ratio", self.min_lr_ratio, 0, 1)
        if self.min_lr_ratio and not (wsd or self.lr_scheduler_type.endswith("with_min_lr")):
            raise BadInput(f"--min_lr_ratio sets the floor of warmup_stable_decay, cosine_with_min_lr and "
                           f"cosine_warmup_with_min_lr; --lr_scheduler_type is {self.lr_scheduler_type}")


# optimi warns from here: fully decoupled decay of 1e-3 shrinks every weight by 0.1% per step at peak LR
STABLEADAMW_MAX_DECAY = 1e-3


def check_stableadamw(weight_decay: float) -> None:
    """--optimizer stableadamw: its package installed, and a weight decay meant to be fully decoupled."""
    if importlib.util.find_spec("optimi") is None:
        raise BadInput('--optimizer stableadamw needs torch-optimi: pip install "mlm_ddp[stableadamw]" '
                       "(or pip install torch-optimi), or use --optimizer adamw")
    if weight_decay >= STABLEADAMW_MAX_DECAY:
        raise BadInput(f"--weight_decay {weight_decay:g} with --optimizer stableadamw: its weight decay is fully "
                       f"decoupled from the learning rate, so each step would shrink every weight by "
                       f"{weight_decay:.2%} at the peak learning rate; pass --weight_decay below "
                       f"{STABLEADAMW_MAX_DECAY:g} (ModernBERT: 1e-5)")
