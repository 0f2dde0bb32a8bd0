"""`python -m mlm_ddp.bench`: training throughput of transformers' MLM recipe against mlm_ddp's step.

Both recipes train copies of the SAME model (identical initial weights, checked) on the SAME packed
blocks, in one process, alternating (a) and (b) `--repeats` times after a warm-up, so that a noisy,
shared machine slows both alike; the ratio is what to read, never one absolute number.

(a) the standard Hugging Face recipe, as `run_mlm_no_trainer.py` does it: `AutoModelForMaskedLM`
    with its head over the whole vocabulary at every position, `DataCollatorForLanguageModeling`,
    `model(**batch).loss`, `accelerator.backward`, torch's default AdamW.
(b) mlm_ddp's training step with its defaults: the functions `mlm_ddp.train` runs (MaskedLMLoss,
    MaskingCollator, build_optimizer and `mlm_ddp.loop.step.train_step`, gradient clipping included).

After training, both models are evaluated on the same held-out blocks with the same masks.
A benchmark, not a test: nothing here asserts a speed.

Each recipe's steps wait for the device only where the program they stand for does: (a) never in its own
code (transformers' mask builder reads the all-ones mask back, as in the script), (b) once per step, the
read of the step's all-reduce that `mlm_ddp.train` makes (`agree_on_step`). Their masked tokens stay on
the device until the timing ends, and a GPU times the steps with CUDA events (`device_seconds`); so the
host prepares the next batch while the device computes, as in training (tests/test_bench.py counts the
waits on the CPU).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoModelForMaskedLM, DataCollatorForLanguageModeling, HfArgumentParser

from mlm_ddp import compat
from mlm_ddp import data as mdata
from mlm_ddp.cluster import heartbeat, precision, watchdog_cost
from mlm_ddp.cluster import launcher as distributed
from mlm_ddp.config import ModelConfig, _doc, checks, from_dict, parse_exactly
from mlm_ddp.data.epochs import loader_workers, own_generator, worker_options
from mlm_ddp.data.masking import EVAL_SPLIT, IGNORE_INDEX, TRAIN_SPLIT, MaskingCollator
from mlm_ddp.errors import BadInput, say
from mlm_ddp.loop import timing
from mlm_ddp.loop.checkpoint import StopSignals
from mlm_ddp.loop.optim import build_optimizer
from mlm_ddp.loop.speed import measure_peak, synchronize, training_flops_per_token
from mlm_ddp.loop.step import StepResult, agree_on_step, train_step
from mlm_ddp.loop.timing import device_seconds, max_known, peak_memory, reset_peak_memory, time_to_quality
from mlm_ddp.model.loading import (
    MaskedLMLoss,
    load_model,
    load_model_config,
    load_tokenizer,
    max_positions,
    resolve_model_path,
    wrap_model,
)

PRECISIONS = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}  # bench name -> Accelerator(mixed_precision=)
# On an H200 (docs/gpu.md, Figures) (b)'s first steps each met a new last-layer query length (2-3 in a run,
# rounded to 8's), and each first meeting took ~150 ms for cuDNN's attention plan against ~20-30 ms a step
GPU_WARMUP = 10


# --variants: each a (b) with these of its settings
VARIANTS = {"thread": {"workers": 0, "torch_compile": False}, "workers": {"workers": 2, "torch_compile": False},
            "compiled": {"workers": 0, "torch_compile": True},
            "compiled_workers": {"workers": 2, "torch_compile": True}}


@dataclass
class BenchConfig:
    """What to benchmark. The data is the embedded corpus (Python's documentation), packed."""

    model: str | None = _doc("Model folder; default: the embedded all-MiniLM-L6-v2.", default=None)
    config_overrides: str | None = _doc(
        "Model config overrides for BOTH recipes, e.g. 'num_hidden_layers=12,hidden_size=768,"
        "num_attention_heads=12,intermediate_size=3072' for a randomly initialised bert-base size.",
        default=None,
    )
    random_init: bool = _doc("Initialise the model from its config instead of loading weights.", default=False)
    steps: int = _doc("Timed optimizer steps of each recipe per repeat.", default=2)
    repeats: int = _doc("Alternations of (a) and (b); the median and spread are over these.", default=3)
    warmup: int | None = _doc(
        "Untimed steps of each recipe first (allocator, kernels, compilation, and on a GPU the cuDNN attention plan "
        "of each of (b)'s last-layer query lengths, ~150 ms each); default 10 on a GPU, 1 on a CPU.", default=None)
    seq: int = _doc("Tokens per block.", default=128)
    batch: int = _doc("Blocks per optimizer step.", default=32)
    precision: Literal["fp32", "bf16", "fp16"] = _doc("Precision of both recipes (autocast).", default="fp32")
    learning_rate: float = _doc("Constant learning rate of both recipes.", default=1e-4)
    eval_blocks: int = _doc("Held-out blocks for the perplexity comparison.", default=64)
    seed: int = _doc("Seed of the head initialisation, data order and masks.", default=0)
    torch_compile: bool = _doc("Run (b) with --torch_compile.", default=False)
    workers: int | None = _doc(
        "(b)'s --dataloader_num_workers: its batches collated in DataLoader workers, ahead of the step, as "
        "mlm_ddp.train collates them. Default: what mlm_ddp.train picks here (2 on a CUDA device, 0 on a CPU).",
        default=None)
    mlm_head: Literal["masked", "all"] = _doc("(b)'s --mlm_head, to measure what the masked-only head buys.",
                                              default="masked")
    last_layer_subset: bool = _doc("(b)'s --last_layer_subset.", default=True)
    dropout_draws: Literal["auto", "16bit", "torch"] = _doc("(b)'s --dropout_draws.", default="auto")
    optimizer_impl: Literal["fused", "foreach", "for-loop"] = _doc("(b)'s --optimizer_impl.", default="fused")
    variants: list[str] | None = _doc(
        "More (b)s, timed in the same alternation: 'thread' (collated in the training thread), 'workers' (in 2 "
        "DataLoader workers), 'compiled' (--torch_compile, in the thread), 'compiled_workers'; each reported with "
        "its ratio to (a), so that what collation and compilation buy on this device is read from one run.",
        default=None)
    profile: bool = _doc("Print a torch.profiler table of (b)'s top operations after the timing.", default=False)
    watchdog_cost: list[int] | None = _doc(
        "Instead of the recipes: the hang watchdog's work at the process group's store per tick, healthy and in a "
        "hang, at these numbers of simulated ranks (e.g. 512 4096 16384), on a real TCPStore.", default=None)

    def __post_init__(self) -> None:
        for name in ("steps", "repeats", "seq", "batch", "eval_blocks"):
            checks.at_least(f"--{name}", getattr(self, name), 1)
        unknown = sorted(set(self.variants or []) - set(VARIANTS))
        if unknown:
            raise BadInput(f"--variants {' '.join(unknown)}: not a variant; choose from {', '.join(VARIANTS)}")
        for name in ("warmup", "workers"):
            checks.not_negative(f"--{name}", getattr(self, name))
        for ranks in self.watchdog_cost or []:  # a rank count: 0 or fewer simulate nothing
            checks.at_least("--watchdog_cost", ranks, 1, " rank")


# ---------------------------------------------------------------------------------------------
# the two recipes
# ---------------------------------------------------------------------------------------------


@dataclass
class Recipe:
    """One recipe's model (its transformers model inside), optimizer step and per-step times."""

    model: torch.nn.Module
    transformers_model: torch.nn.Module
    collate: Callable[[list[dict]], dict]  # blocks -> a masked batch on the device (host work and the copy)
    train: Callable[[dict], torch.Tensor]  # one optimizer step on a batch; its masked tokens, on the device
    times: list[float]
    host_times: list[float] = field(default_factory=list)  # the host's seconds to queue each repeat's steps
    masked: int = 0
    tokens: int = 0
    peak_memory: int | None = None  # bytes: peak RSS during its steps (CPU), peak allocated (GPU)
    curve: list[tuple[float, float]] = field(default_factory=list)  # (training seconds, held-out perplexity)
    last_layer_subset: bool = False  # (b)'s last layer ran on the masked positions only
    workers: int = 0  # DataLoader workers collating (b)'s batches
    random_state: list[torch.Tensor] = field(default_factory=list)  # its own stream of torch's generators

    @contextlib.contextmanager
    def own_random_state(self) -> Iterator[None]:
        """Within it, torch's default generators (the CPU's, the GPU's) are this recipe's own: dropout and
        (a)'s masks draw from them, so that a recipe draws the same whichever recipes run beside it. Each
        recipe starts from the state the bench seeded."""
        cuda = torch.cuda.is_available()
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
            if self.random_state:
                torch.set_rng_state(self.random_state[0])
                if cuda:
                    torch.cuda.set_rng_state(self.random_state[1])
            yield
            self.random_state = [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if cuda else [])


def hf_recipe(model: torch.nn.Module, tokenizer: Any, cfg: BenchConfig, accelerator: Accelerator) -> Recipe:
    """run_mlm_no_trainer.py's step: full-vocabulary head at every position, mean loss, default AdamW."""
    no_decay = ("bias", "LayerNorm.weight")
    weight_decay = 0.0  # run_mlm_no_trainer's default --weight_decay, also (b)'s in this bench
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate)  # torch's default implementation
    prepared, optimizer = accelerator.prepare(model, optimizer)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, return_tensors="pt")

    def collate(blocks: list[dict]) -> dict:
        # run_mlm_no_trainer's group_texts keeps the tokenizer's attention_mask (all ones once packed)
        batch = collator([{"input_ids": b["input_ids"], "attention_mask": [1] * len(b["input_ids"])}
                          for b in blocks])
        return mdata.to_device(batch, accelerator.device)

    def train(batch: dict) -> torch.Tensor:
        loss = prepared(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return (batch["labels"] != IGNORE_INDEX).sum()  # not read here: the script does not count them

    return Recipe(prepared, model, collate, train, [])


def mlm_ddp_recipe(model: torch.nn.Module, tokenizer: Any, cfg: BenchConfig, accelerator: Accelerator,
                   schedule: list[list[dict]] | None = None) -> Recipe:
    """mlm_ddp.train's step, through the same functions and defaults. `schedule`: the blocks of every step
    (b) will take, in order, which its DataLoader workers (--workers) collate ahead; without it (b) collates
    in the training thread."""
    train_cfg = from_dict({
        "mlm_head": cfg.mlm_head, "last_layer_subset": cfg.last_layer_subset, "dropout_draws": cfg.dropout_draws,
        "max_seq_length": cfg.seq, "per_device_train_batch_size": cfg.batch,
        # both recipes at the one learning rate, the head included: the comparison is of the step
        "learning_rate": cfg.learning_rate, "head_learning_rate": cfg.learning_rate, "weight_decay": 0.0,
        "mixed_precision": PRECISIONS[cfg.precision],
        "torch_compile": cfg.torch_compile, "optimizer_impl": cfg.optimizer_impl, "seed": cfg.seed,
    })
    wrapped = wrap_model(model, train_cfg.model, cfg.torch_compile, accelerator.device)
    optimizer = build_optimizer(wrapped, train_cfg.training)
    prepared, optimizer = accelerator.prepare(wrapped, optimizer)
    collator = MaskingCollator.for_tokenizer(tokenizer, split=TRAIN_SPLIT, seed=cfg.seed)
    max_norm = train_cfg.training.max_grad_norm
    stop = StopSignals(train_cfg.run.signal_names())  # its vote slots only: no handler is installed
    unread: list[StepResult | None] = [None]  # the previous step, where its skip is still on the device

    workers = loader_workers(cfg.workers, accelerator.device.type, False, distributed.usable_cores()) if schedule else 0
    # as mlm_ddp.train's loader: one collated batch per item of the schedule, page-locked on a CUDA device; its
    # own generator, so that starting workers draws nothing from the one dropout (and (a)'s masks) draw from
    pin = accelerator.device.type == "cuda"
    ahead = iter(DataLoader(schedule, batch_size=None, collate_fn=collator, pin_memory=pin, generator=own_generator(0),
                            **worker_options(workers, persistent=True))) if workers else None

    def collate(blocks: list[dict]) -> dict:
        # with workers, the loader's next batch: the schedule is the order in which (b) asks for them
        return mdata.to_device(collator(blocks) if ahead is None else next(ahead), accelerator.device)

    def train(batch: dict) -> torch.Tensor:
        # what mlm_ddp.train does each step: the all-reduce of the step's masked tokens (with the stop and
        # skip votes), read once (`agree_on_step`), then the step itself
        window = [batch]
        masked, _, _ = agree_on_step(accelerator, window, stop, unread[0])
        result = train_step(accelerator, prepared, optimizer, window, masked, max_norm)
        unread[0] = result if isinstance(result.stepped, torch.Tensor) else None
        return masked

    return Recipe(prepared, model, collate, train, [], last_layer_subset=wrapped.last_layer_subset, workers=workers)


def load_base_model(model_cfg: ModelConfig, model_config: Any, random_init: bool, seed: int) -> torch.nn.Module:
    """The model both recipes start from: the checkpoint, or a random init; a missing head is seeded."""
    torch.manual_seed(seed)
    if random_init:
        return AutoModelForMaskedLM.from_config(model_config, attn_implementation=model_cfg.attn_implementation)
    return load_model(model_cfg, model_config)


@torch.no_grad()
def perplexity(model: torch.nn.Module, blocks: list[dict], collator: MaskingCollator, batch: int,
               accelerator: Accelerator) -> float:
    """Held-out perplexity: exp(per-token loss over the masked tokens), the same masks for every model."""
    net = MaskedLMLoss(model).eval()
    loss_sum, masked = 0.0, 0
    with accelerator.autocast():
        for i in range(0, len(blocks), batch):
            s, n, _ = net(**mdata.to_device(collator(blocks[i : i + batch]), accelerator.device))
            loss_sum, masked = loss_sum + float(s), masked + int(n)
    model.train()
    return math.exp(loss_sum / max(masked, 1))


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------


def bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run the benchmark; returns what the JSON line holds."""
    model_cfg = ModelConfig(model_name_or_path=cfg.model, config_overrides=cfg.config_overrides)
    tokenizer = load_tokenizer(model_cfg)
    model_config = load_model_config(model_cfg, tokenizer)
    if cfg.seq > (limit := max_positions(model_config, tokenizer)):  # the embedding would index past its table
        raise BadInput(f"--seq {cfg.seq} is above the model's maximum of {limit} tokens; use --seq {limit} or less")
    cuda = torch.cuda.is_available()
    if cfg.precision == "fp16" and not cuda:
        raise BadInput("--precision fp16 needs a CUDA GPU (on a CPU accelerate would run fp32): use bf16 or fp32")
    accelerator = Accelerator(cpu=not cuda, mixed_precision=PRECISIONS[cfg.precision])
    if cfg.warmup is None:  # a GPU's first steps meet what a CPU's do not (the --warmup help)
        cfg = replace(cfg, warmup=GPU_WARMUP if cuda else 1)
    device = accelerator.device
    if device.type == "cpu":
        torch.set_num_threads(distributed.usable_cores())
        if cfg.precision == "bf16" and not precision.cpu_computes_bf16():
            print("note: this CPU has no native bf16 (AVX512-BF16/AMX): bf16 matmuls are emulated, slower than fp32; "
                  "mlm_ddp's --mixed_precision auto trains in fp32 here", file=sys.stderr)

    packed = mdata.tokenize_and_pack(mdata.embedded_corpus(), tokenizer, cfg.seq)["input_ids"]
    blocks = [{"input_ids": ids} for ids in packed if len(ids) == cfg.seq]  # equal shapes: no padding anywhere
    if len(blocks) < cfg.eval_blocks + cfg.batch:
        raise BadInput(f"the embedded corpus makes {len(blocks)} blocks of {cfg.seq} tokens: too few for "
                          f"--eval_blocks {cfg.eval_blocks} plus one --batch {cfg.batch}; lower them")
    held_out, train_blocks = blocks[: cfg.eval_blocks], blocks[cfg.eval_blocks :]
    order = torch.randperm(len(train_blocks), generator=torch.Generator().manual_seed(cfg.seed)).tolist()

    def batch_at(step: int) -> list[dict]:
        start = step * cfg.batch
        return [train_blocks[order[(start + i) % len(order)]] for i in range(cfg.batch)]

    base = load_base_model(model_cfg, model_config, cfg.random_init, cfg.seed)
    hf = hf_recipe(copy.deepcopy(base), tokenizer, cfg, accelerator)  # copies: the same start for both
    timed = cfg.warmup + cfg.repeats * cfg.steps  # (b)'s steps, in order, then the profile's 2 of one batch
    schedule = [batch_at(i) for i in range(timed)] + ([batch_at(timed)] * 2 if cfg.profile else [])
    ours = mlm_ddp_recipe(copy.deepcopy(base), tokenizer, cfg, accelerator, schedule)
    variants = {name: mlm_ddp_recipe(copy.deepcopy(base), tokenizer, replace(cfg, **VARIANTS[name]), accelerator,
                                     schedule[:timed]) for name in cfg.variants or []}
    recipes = {"hf": hf, "mlm_ddp": ours, **{f"variant:{name}": recipe for name, recipe in variants.items()}}
    eval_collator = MaskingCollator.for_tokenizer(tokenizer, split=EVAL_SPLIT, seed=cfg.seed)
    ppl_start = perplexity(base.to(device), held_out, eval_collator, cfg.batch, accelerator)
    del base

    seeded = [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if cuda else [])
    for recipe in recipes.values():
        recipe.model.train()
        recipe.random_state = [state.clone() for state in seeded]
    steps_done = 0
    for recipe in recipes.values():  # warm-up: the same first batches for all
        with recipe.own_random_state():
            for i in range(cfg.warmup):
                recipe.train(recipe.collate(batch_at(i)))
    steps_done += cfg.warmup
    peaks = []  # one per round, the highest kept: one measured while other work shared the device reads low
    for _ in range(cfg.repeats):
        peaks.append(measure_peak(accelerator))
        for recipe in recipes.values():
            was_reset = reset_peak_memory(device)
            masked: list[torch.Tensor] = []  # read after the timing: a read in it would wait for the device
            batches = [batch_at(steps_done + i) for i in range(cfg.steps)]
            with recipe.own_random_state():
                recipe.times.append(device_seconds(device, functools.partial(run_steps, recipe, batches, masked),
                                                   recipe.host_times))
            recipe.masked += int(sum(masked))
            recipe.tokens += cfg.steps * cfg.batch * cfg.seq
            recipe.peak_memory = max_known(recipe.peak_memory, peak_memory(device, was_reset))
            # untimed: the held-out perplexity after this repeat, for the time-to-quality
            recipe.curve.append((sum(recipe.times), perplexity(recipe.transformers_model, held_out, eval_collator,
                                                               cfg.batch, accelerator)))
        steps_done += cfg.steps

    peaks.append(measure_peak(accelerator))
    peak = max(peaks)
    with tempfile.TemporaryDirectory() as scratch:
        beat_s = heartbeat.cost_per_beat(scratch)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu ({torch.get_num_threads()} threads, "
                                                                   f"{torch.backends.cpu.get_cpu_capability()})",
        "torch": torch.__version__, "config": asdict(cfg), "model": resolve_model_path(model_cfg),
        "model_type": model_config.model_type, "trained_tokens": steps_done * cfg.batch * cfg.seq,
        "peak_tflops": peak / 1e12, "peak_tflops_measured": [p / 1e12 for p in peaks],
        "perplexity_start": ppl_start, "workers": ours.workers,
        "memory": "peak allocated" if cuda else "peak RSS of the process during its steps",
    }
    for key, recipe in recipes.items():
        rates = [cfg.steps * cfg.batch * cfg.seq / t for t in recipe.times]
        share = recipe.masked / recipe.tokens
        flops = training_flops_per_token(model_config, cfg.seq, 1.0 if key == "hf" or cfg.mlm_head == "all" else share,
                                         share if recipe.last_layer_subset else 1.0)
        median = statistics.median(rates)
        where = result.setdefault("variants", {}) if key.startswith("variant:") else result
        where[key.removeprefix("variant:")] = {
            "tokens_per_s": median, "tokens_per_s_min": min(rates), "tokens_per_s_max": max(rates),
            "flops_per_token": flops, "tflops": median * flops / 1e12, "mfu": median * flops / peak,
            "perplexity": recipe.curve[-1][1], "peak_memory_bytes": recipe.peak_memory,
            "host_s_per_step": statistics.median(recipe.host_times) / cfg.steps,
            "device_s_per_step": statistics.median(recipe.times) / cfg.steps,
        }
    result["ratio"] = result["mlm_ddp"]["tokens_per_s"] / result["hf"]["tokens_per_s"]
    for figures in result.get("variants", {}).values():
        figures["ratio"] = figures["tokens_per_s"] / result["hf"]["tokens_per_s"]
    result["time_to_quality"] = time_to_quality(hf.curve, ours.curve)
    step_s = cfg.batch * cfg.seq / result["mlm_ddp"]["tokens_per_s"]
    result["heartbeat"] = {"us_per_beat": beat_s * 1e6, "beats_per_step": heartbeat.BEATS_PER_STEP,
                           "share_of_step": beat_s * heartbeat.BEATS_PER_STEP / step_s}
    result["perplexity_ratio"] = result["mlm_ddp"]["perplexity"] / result["hf"]["perplexity"]
    if cfg.profile:
        result["profile"], result["seconds_by_kind"] = profile_table(ours, batch_at(steps_done), device)
    return result


def run_steps(recipe: Recipe, batches: list[list[dict]], masked: list[torch.Tensor]) -> None:
    """One optimizer step of `recipe` per batch of blocks, collated as it goes; each step's masked tokens
    (on the device) appended to `masked`."""
    for blocks in batches:
        masked.append(recipe.train(recipe.collate(blocks)))


def profile_table(recipe: Recipe, blocks: list[dict], device: torch.device, steps: int = 2
                  ) -> tuple[str, dict[str, float]]:
    """torch.profiler's table of the operations (b) spends its time in, by self time, and its self time per
    step by kind of kernel (`timing.seconds_by_kind`)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            recipe.train(recipe.collate(blocks))
        synchronize(device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    kinds = {kind: seconds / steps for kind, seconds in timing.seconds_by_kind(events, device).items()}
    return events.table(sort_by=sort, row_limit=15, max_name_column_width=60), kinds


def format_table(result: dict[str, Any]) -> str:
    cfg, memory_name = result["config"], result["memory"]
    collates = f"in {result['workers']} DataLoader workers" if result["workers"] else "in the training thread"
    lines = [
        f"mlm_ddp.bench: {result['model_type']} {result['model']}, {cfg['precision']}, seq {cfg['seq']}, "
        f"batch {cfg['batch']}, {cfg['repeats']} x {cfg['steps']} timed steps per recipe after {cfg['warmup']} "
        f"warm-up, on {result['device']}, torch {result['torch']}; (b) collates {collates}",
        "",
        f"| recipe | tokens/s (median) | spread (min-max) | training MFLOP/token | TFLOP/s | MFU | "
        f"held-out perplexity after {result['trained_tokens']} tokens | {memory_name} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = [(result["hf"], "(a) transformers recipe"), (result["mlm_ddp"], "(b) mlm_ddp")]
    rows += [(r, f"(b) {name}: {r['ratio']:.2f}x (a)") for name, r in result.get("variants", {}).items()]
    for r, name in rows:
        memory = "n/a" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**30:.2f} GiB"
        lines.append(
            f"| {name} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s_min']:,.0f}-{r['tokens_per_s_max']:,.0f} | "
            f"{r['flops_per_token'] / 1e6:.1f} | {r['tflops']:.3f} | {r['mfu']:.1%} | {r['perplexity']:.2f} | "
            f"{memory} |"
        )
    ttq = result["time_to_quality"]
    reached = (f"(b) reaches it after {ttq['mlm_ddp_s']:.1f} s: {ttq['ratio']:.2f}x" if ttq["ratio"] else
               "(b) does not reach it within the bench's steps")
    lines += [
        "",
        f"ratio (b)/(a): {result['ratio']:.2f}x tokens/s; perplexity (b)/(a): {result['perplexity_ratio']:.4f} "
        f"(both started at {result['perplexity_start']:.1f})",
        f"time to quality: (a) reaches perplexity {ttq['target_perplexity']:.2f} after {ttq['hf_s']:.1f} s of "
        f"training; {reached} (evaluated every {cfg['steps']} steps, at the same learning rate)",
        f"peak: {result['peak_tflops']:.3f} TFLOP/s ({cfg['precision']} matmul, the highest of "
        f"{len(result['peak_tflops_measured'])} measured in this run, one per round); MFU counts "
        "the matmul FLOPs each recipe computes, so (b) does fewer FLOPs per token for the same loss",
        f"heartbeat (hang localisation): {result['heartbeat']['beats_per_step']} beats per step x "
        f"{result['heartbeat']['us_per_beat']:.1f} us = {result['heartbeat']['share_of_step']:.3%} of (b)'s step",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = HfArgumentParser(BenchConfig, prog="mlm_ddp.bench", description=__doc__.split("\n")[0],
                              allow_abbrev=False)
    try:
        (cfg,) = parse_exactly(parser, argv)  # a bad value is refused by BenchConfig itself, here
        compat.check()
        if cfg.watchdog_cost:
            rows = watchdog_cost.cost(cfg.watchdog_cost)
            print(watchdog_cost.format_rows(rows))
            print(json.dumps({"bench": "watchdog", "rows": rows}))
            return 0
        result = bench(cfg)
    except BadInput as err:
        say(err.line("mlm_ddp.bench"))
        return 2
    profile = result.pop("profile", None)
    print(format_table(result))
    if profile is not None:
        print(f"\ntop operations of (b), {cfg.batch} x {cfg.seq} tokens per step, 2 steps:\n{profile}")
        print("(b)'s self time per step by kind of kernel: " + ", ".join(
            f"{kind} {seconds * 1e3:.2f} ms" for kind, seconds in sorted(result["seconds_by_kind"].items())))
    print(json.dumps({"bench": "mlm_ddp", **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
