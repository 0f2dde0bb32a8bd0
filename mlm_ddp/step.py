"""One optimizer step of masked-LM training: the function `mlm_ddp.train` runs every step and
`mlm_ddp.bench` times, so the benchmark measures the very step that trains.

The loss of a step is normalised by the masked tokens of the WHOLE step (every rank, every
micro-batch), which the caller counts beforehand (`masked_tokens`, reduced across ranks): a rank or
micro-batch with more masked tokens then weighs more, exactly as one big batch would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from accelerate import Accelerator

from mlm_ddp.masking import IGNORE_INDEX

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did on this rank; the tensors are float64 scalars on its device (no
    host sync until someone reads them)."""

    loss_sum: torch.Tensor  # summed cross-entropy (nats) over this rank's masked tokens
    masked: torch.Tensor  # this rank's masked tokens
    tokens: torch.Tensor  # this rank's non-padding input tokens
    grad_norm: torch.Tensor  # before clipping; the same on every rank (the gradients are all-reduced)
    stepped: bool  # False: the gradients were not finite and the optimizer step was skipped


def masked_tokens(window: list[Batch]) -> torch.Tensor:
    """Masked tokens of this rank's micro-batches, float64 ()."""
    return sum((batch["labels"] != IGNORE_INDEX).sum() for batch in window).double()


def forward_backward(accelerator: Accelerator, model: torch.nn.Module, window: list[Batch],
                     scale: torch.Tensor) -> torch.Tensor:
    """Forward and backward of one optimizer step's micro-batches, gradients summed (DDP all-reduces
    on the last one); returns (loss sum, masked tokens, input tokens) over them, float64 (3,)."""
    sums = torch.zeros(3, dtype=torch.float64, device=accelerator.device)
    for batch in window:
        with accelerator.accumulate(model):
            loss_sum, n_masked, _ = model(**batch)
            accelerator.backward(loss_sum * scale)
        sums += torch.stack([loss_sum.detach().double(), n_masked.double(), batch["attention_mask"].sum().double()])
    return sums


def train_step(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               window: list[Batch], masked_total: torch.Tensor, max_grad_norm: float | None) -> StepResult:
    """Forward and backward of `window` (this rank's micro-batches of the step), clip, step, zero.

    `masked_total`: the masked tokens of the whole step, all ranks. Gradients that are not finite skip
    the optimizer step (`stepped` False); under fp16 the gradient scaler makes that decision itself.
    """
    # DDP averages the gradients over ranks and accumulate() divides each micro-batch's by the
    # accumulation steps: undo both, so that the step's gradient is that of loss sum / masked_total
    scale = accelerator.num_processes * accelerator.gradient_accumulation_steps / masked_total.clamp(min=1)
    sums = forward_backward(accelerator, model, window, scale)
    # the gradients are the same on every rank after DDP's all-reduce, so is this norm: every rank
    # takes the same decision below without another collective
    norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)
    stepped = accelerator.scaler is not None or bool(torch.isfinite(norm))
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss_sum, masked, tokens = sums.unbind()
    return StepResult(loss_sum, masked, tokens, norm, stepped)
