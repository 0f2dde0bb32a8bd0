"""The optimizer of the loss wrapper (AdamW or StableAdamW; its parameter groups: no weight decay on biases
and norms, the MLM head's own learning rate), the learning-rate schedule, and `prepare_for_training`, which builds
both and hands model and optimizer to accelerate with the checks FSDP2 needs."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import torch
from accelerate.logging import get_logger
from transformers import PreTrainedModel

from mlm_ddp.cluster.collectives import sharded
from mlm_ddp.config import Config, TrainingConfig
from mlm_ddp.loop.schedule import build_scheduler
from mlm_ddp.model.loading import (
    FRESH_HEAD,
    HEAD_LR_FACTOR,
    MaskedLMLoss,
    check_tied,
    configure_fsdp_units,
    tied_parameters,
    wrap_model,
)

logger = get_logger(__name__)


def head_learning_rate(model: MaskedLMLoss, training: TrainingConfig) -> float:
    """--head_learning_rate, else HEAD_LR_FACTOR x --learning_rate for a head initialised fresh on a
    pretrained encoder (it starts from noise and must catch up), else --learning_rate."""
    if training.head_learning_rate is not None:
        return training.head_learning_rate
    fresh = getattr(model.model, FRESH_HEAD, False)
    return training.learning_rate * (HEAD_LR_FACTOR if fresh else 1.0)


def head_parameters(model: PreTrainedModel) -> list[torch.nn.Parameter]:
    """The masked-LM head's own parameters: the model's that are neither its encoder's (`base_model`)
    nor tied to the input embeddings (the decoder weight that BERT, RoBERTa, DistilBERT, ELECTRA and
    ModernBERT share with the word embeddings). Found by ownership, not by the head's attribute name,
    which differs between families (cls, lm_head, vocab_transform + vocab_projector, head + decoder...)."""
    encoder = {id(p) for p in model.base_model.parameters()} if model.base_model is not model else set()
    tied = {id(p) for p in model.get_input_embeddings().parameters()}
    return [p for p in model.parameters() if id(p) not in encoder and id(p) not in tied]


def build_optimizer(model: MaskedLMLoss, training: TrainingConfig) -> torch.optim.Optimizer:
    """--optimizer (AdamW or StableAdamW) in --optimizer_impl; biases and normalisation weights (tensors
    with < 2 dims) get no weight decay; the MLM head's own parameters (`head_parameters`) train at
    `head_learning_rate` when it differs from --learning_rate."""
    params = [p for p in model.parameters() if p.requires_grad]
    head_lr = head_learning_rate(model, training)
    head: set[int] = set()
    if head_lr != training.learning_rate:
        head = {id(p) for p in head_parameters(model.model)}
        if not head:
            logger.warning("%s has no parameters beside its encoder and the tied embeddings: every parameter "
                           "trains at --learning_rate %g, none at the head's %g", type(model.model).__name__,
                           training.learning_rate, head_lr)
    groups = []
    for in_head, lr in ((False, training.learning_rate), (True, head_lr)):
        part = [p for p in params if (id(p) in head) == in_head]
        groups += [{"params": [p for p in part if p.ndim >= 2], "weight_decay": training.weight_decay, "lr": lr},
                   {"params": [p for p in part if p.ndim < 2], "weight_decay": 0.0, "lr": lr}]
    groups = [group for group in groups if group["params"]]
    if training.optimizer == "stableadamw":
        return stable_adamw(groups, training)
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
    return torch.optim.AdamW(groups, lr=training.learning_rate, betas=(training.adam_beta1, training.adam_beta2),
                             eps=training.adam_epsilon, **impl[training.optimizer_impl])


def stable_adamw(groups: list[dict[str, Any]], training: TrainingConfig) -> torch.optim.Optimizer:
    """optimi's StableAdamW on `groups`, with fully decoupled weight decay (`decouple_lr`): a step decays
    weights by weight_decay x lr / max_lr, max_lr being the group's peak (the head's own, when it has one),
    so the schedule scales the decay and the size of the learning rate does not.

    --optimizer_impl fused leaves the choice to optimi: its Triton kernels where every parameter is a plain
    tensor on a CUDA or XPU device and triton imports (they read no value on the host), else its for-loop
    (a CPU, FSDP2's DTensors); its foreach and for-loop paths read each tensor's update RMS with `.item()`."""
    from optimi import StableAdamW  # the optional extra: TrainingConfig checked that it is installed

    for group in groups:
        group["max_lr"] = group["lr"]
    impl = {"fused": {"triton": None, "foreach": None}, "foreach": {"triton": False, "foreach": True},
            "for-loop": {"triton": False, "foreach": False}}
    with warnings.catch_warnings():
        # optimi deprecates foreach in favour of Triton, which a CPU has not; --optimizer_impl says which
        warnings.filterwarnings("ignore", "Parameter `foreach` is deprecated", DeprecationWarning)
        return StableAdamW(groups, lr=training.learning_rate, betas=(training.adam_beta1, training.adam_beta2),
                           eps=training.adam_epsilon, weight_decay=training.weight_decay, decouple_lr=True,
                           **impl[training.optimizer_impl])


# where torch's AdamW and optimi keep --optimizer_impl: in each parameter group, which load_state_dict
# replaces with the checkpoint's; a resume that changes --optimizer_impl (RESUMABLE_CHANGES) puts them back
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "triton")


def implementation(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's implementation flags, to put back after a checkpoint's load."""
    return [{key: group[key] for key in IMPLEMENTATION_KEYS if key in group} for group in optimizer.param_groups]


def restore_implementation(optimizer: torch.optim.Optimizer, flags: list[dict[str, Any]]) -> None:
    """This run's implementation flags (`implementation`) over the ones a checkpoint's load restored. AdamW's
    step counts move to where this implementation creates them: a float32 tensor on the parameter's device
    when fused (or capturable), else a CPU one, which the foreach and for-loop paths read without waiting for
    the device."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    for group, own in zip(inner.param_groups, flags, strict=True):
        group.update(own)
        if not isinstance(inner, torch.optim.AdamW):
            continue
        device_steps = group.get("fused") or group.get("capturable")
        for param in group["params"]:
            step = inner.state.get(param, {}).get("step")
            if torch.is_tensor(step):
                inner.state[param]["step"] = step.to(dtype=torch.float32,
                                                     device=param.device if device_steps else "cpu")


FAR = 8.0  # a batch this many times from the reference, either way: the square-root rule is not checked there


def for_this_batch(training: TrainingConfig, world_size: int, seq_length: int | None = None) -> TrainingConfig:
    """The training section with its learning rates scaled to this run's global batch (--lr_reference_batch:
    by sqrt(batch / reference), in tokens where --lr_reference_seq_length and `seq_length` are given); as it
    is without a reference or at the reference batch."""
    reference = training.lr_reference_batch
    batch = training.per_device_train_batch_size * world_size * training.gradient_accumulation_steps
    if reference is None:
        return training
    ratio, unit = batch / reference, "sequences"
    if training.lr_reference_seq_length is not None and seq_length is not None:
        ratio, unit = ratio * seq_length / training.lr_reference_seq_length, "tokens"
    if ratio == 1:
        return training
    factor = math.sqrt(ratio)
    head = None if training.head_learning_rate is None else training.head_learning_rate * factor
    tokens = (f" of {seq_length} tokens, the recipe's {reference} of {training.lr_reference_seq_length}"
              if unit == "tokens" else f", the recipe's is {reference}")
    line = (f"the global batch is {batch} sequences ({training.per_device_train_batch_size} per device x {world_size} "
            f"processes x {training.gradient_accumulation_steps} accumulation){tokens}: the learning rate is scaled "
            f"by sqrt({ratio:.4g}) (the ratio of {unit}) = {factor:.3f}, to {training.learning_rate * factor:.3g} "
            "(--lr_reference_batch; give --learning_rate to use a rate as given)")
    if max(ratio, 1 / ratio) > FAR:
        logger.warning("%s. This batch is %.0fx %s the recipe's: the square-root rule is this project's choice and "
                       "was checked only near the reference batch (docs/recipes.md measured it 33%% worse at 8 "
                       "sequences); consider --gradient_accumulation_steps to come nearer, or your own "
                       "--learning_rate", line, max(ratio, 1 / ratio), "above" if ratio > 1 else "below",
                       main_process_only=True)
    else:
        logger.info(line, main_process_only=True)
    return dataclasses.replace(training, learning_rate=training.learning_rate * factor, head_learning_rate=head)


def prepare_for_training(accelerator: Any, transformers_model: PreTrainedModel, cfg: Config,
                         total_steps: int) -> tuple[Any, torch.optim.Optimizer, Any, int]:
    """The model in its loss wrapper, its optimizer and scheduler, prepared; and the parameter count."""
    model_cfg = cfg.model
    training = for_this_batch(cfg.training, accelerator.num_processes, cfg.data.max_seq_length)
    model = wrap_model(transformers_model, model_cfg, training.torch_compile, accelerator.device,
                       compile_options={"backend": training.torch_compile_backend, "mode": training.torch_compile_mode})
    materialize_meta(model)  # before the optimizer takes the parameters
    optimizer = build_optimizer(model, training)
    # the scheduler is stepped by us once per optimizer step: not prepared, saved as JSON
    scheduler = build_scheduler(optimizer, training, total_steps)  # schedule.py
    ties = tied_parameters(model.model)
    n_params = sum(p.numel() for p in model.model.parameters())  # before FSDP leaves each rank its shard
    if sharded(accelerator):
        configure_fsdp_units(accelerator.state.fsdp_plugin, model_cfg.fsdp_wrap_classes, model.model)
        check_distinct_storage(model)
    model, optimizer = accelerator.prepare(model, optimizer)
    check_tied(accelerator.unwrap_model(model).model, ties)
    check_optimizer_holds_each_parameter_once(model, optimizer)
    return model, optimizer, scheduler, n_params


def materialize_meta(model: torch.nn.Module) -> None:
    """Give every parameter left on the meta device an (uninitialised) CPU tensor.

    Under FSDP's CPU-RAM-efficient loading, transformers loads the checkpoint on rank 0 only and leaves
    the weights the checkpoint lacks (a fresh MLM head) on the meta device on every other rank. accelerate
    then maps the optimizer's parameters to the sharded ones by `data_ptr()`, which is 0 for every meta
    tensor: on those ranks the fresh head's parameters all became one, so the optimizer updated that one
    several times and the others never (the loss left DDP's at the first update), and its state dict
    failed at the first checkpoint. The values do not matter: rank 0's are broadcast when the model is
    sharded. Tied parameters stay one tensor.
    """
    made: dict[int, torch.nn.Parameter] = {}  # id of a meta parameter -> its CPU one: ties stay one tensor
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                if id(param) not in made:
                    made[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="cpu"),
                                                         requires_grad=param.requires_grad)
                setattr(module, name, made[id(param)])


def check_distinct_storage(model: torch.nn.Module) -> None:
    """Refuse two parameters that are different tensors at one address: accelerate's FSDP2 prepare
    tells parameters apart by `data_ptr()`, and would hand the optimizer one of them twice."""
    seen: dict[int, str] = {}
    for name, param in model.named_parameters():
        address = param.data_ptr()
        if address in seen:
            raise RuntimeError(f"parameters {seen[address]} and {name} share the address {address:#x} without "
                               "being one tensor: FSDP would train one of them twice and the other never")
        seen[address] = name


def check_optimizer_holds_each_parameter_once(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """After prepare: the optimizer updates exactly the model's trainable parameters, each once."""
    held = [p for group in optimizer.param_groups for p in group["params"]]
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if len(held) != len({id(p) for p in held}) or {id(p) for p in held} != trainable:
        names = {id(p): n for n, p in model.named_parameters()}
        twice = sorted({names.get(id(p), "?") for p in held if sum(q is p for q in held) > 1})
        never = sorted(names[i] for i in trainable - {id(p) for p in held})
        raise RuntimeError(f"the prepared optimizer does not hold each trainable parameter once (twice: "
                           f"{', '.join(twice) or '-'}; never: {', '.join(never) or '-'})")
