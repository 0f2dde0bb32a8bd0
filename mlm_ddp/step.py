"""One optimizer step of masked-LM training: the function `mlm_ddp.train` runs every step and
`mlm_ddp.bench` times, so the benchmark measures the very step that trains.

The loss of a step is normalised by the masked tokens of the WHOLE step (every rank, every
micro-batch), which the caller counts beforehand (`masked_tokens`, reduced across ranks): a rank or
micro-batch with more masked tokens then weighs more, exactly as one big batch would.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
from accelerate import Accelerator

from mlm_ddp.masking import IGNORE_INDEX
from mlm_ddp.model import check_loss_sum

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did on this rank; the tensors are float64 scalars on its device (no
    host sync until someone reads them)."""

    loss_sum: torch.Tensor  # summed cross-entropy (nats) over this rank's masked tokens
    masked: torch.Tensor  # this rank's masked tokens
    tokens: torch.Tensor  # this rank's non-padding input tokens
    grad_norm: torch.Tensor  # before clipping; the same on every rank (the gradients are all-reduced)
    # False: the gradients were not finite, or the loss spiked, and the update was skipped. A bool tensor on
    # the device where fused AdamW decided that itself (`skips_on_device`): read it with a later sync
    stepped: bool | torch.Tensor
    spike: Spike | None = None  # the loss spike judged by `LossSpikeGuard`, if this step was one
    # fp16: the gradient scaler skipped the update for an overflow of the scaled gradients while every
    # rank's loss was finite (routine while the scaler finds its scale; not --on_nonfinite_loss's business)
    overflow: bool = False


@dataclass(frozen=True)
class Spike:
    loss: float  # the step's loss, all ranks
    median: float  # the running median it was judged against
    steps: int  # losses in that median


class LossSpikeGuard:
    """--on_loss_spike: a step whose loss (all ranks, all micro-batches) is above `factor` x the
    median of the last `window` accepted steps' losses is a spike, judged once `MIN_HISTORY` of them
    are known. The median, not the mean: one earlier spike or a noisy step does not move it."""

    MIN_HISTORY = 10

    def __init__(self, factor: float, window: int) -> None:
        self.factor, self.history = factor, collections.deque(maxlen=window)

    def judge(self, loss: float) -> Spike | None:
        """The spike `loss` is, or None (then it joins the history). A NaN or inf loss is not judged:
        --on_nonfinite_loss decides about it."""
        if not math.isfinite(loss):
            return None
        if len(self.history) >= self.MIN_HISTORY:
            median = statistics.median(self.history)
            if loss > self.factor * median:
                return Spike(loss, median, len(self.history))
        self.history.append(loss)
        return None


def masked_tokens(window: list[Batch]) -> torch.Tensor:
    """Masked tokens of this rank's micro-batches, float64 ()."""
    return sum((batch["labels"] != IGNORE_INDEX).sum() for batch in window).double()


def forward_backward(accelerator: Accelerator, model: torch.nn.Module, window: list[Batch],
                     scale: torch.Tensor, loss_factors: list[float] | None = None) -> torch.Tensor:
    """Forward and backward of one optimizer step's micro-batches, gradients summed (DDP all-reduces
    on the last one); returns (loss sum, masked tokens, input tokens) over them, float64 (3,).
    `loss_factors`: one per micro-batch, multiplying its loss (tests inject loss spikes this way)."""
    sums = torch.zeros(3, dtype=torch.float64, device=accelerator.device)
    for index, batch in enumerate(window):
        with accelerator.accumulate(model):
            loss_sum, n_masked, _ = model(**batch)
            check_loss_sum(loss_sum)
            if loss_factors is not None:
                loss_sum = loss_sum * loss_factors[index]
            accelerator.backward(loss_sum * scale)
        sums += torch.stack([loss_sum.detach().double(), n_masked.double(), batch["attention_mask"].sum().double()])
    return sums


def skips_on_device(accelerator: Accelerator, optimizer: torch.optim.Optimizer) -> bool:
    """Whether a non-finite update can be skipped without reading the norm back: a fused AdamW (it takes
    `found_inf`), no gradient scaler (which sets its own), parameters not sharded (FSDP's are DTensors)."""
    from mlm_ddp.distributed import sharded

    inner = getattr(optimizer, "optimizer", optimizer)
    # recent torch makes AdamW an Adam, older releases a class of its own: both read found_inf when fused
    return (accelerator.scaler is None and isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))
            and not sharded(accelerator)
            and all(group.get("fused") for group in inner.param_groups))


def train_step(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               window: list[Batch], masked_total: torch.Tensor, max_grad_norm: float | None,
               phase: Callable[[str], None] | None = None, guard: LossSpikeGuard | None = None,
               loss_factors: list[float] | None = None) -> StepResult:
    """Forward and backward of `window` (this rank's micro-batches of the step), clip, step, zero.

    `masked_total`: the masked tokens of the whole step, all ranks. Gradients that are not finite skip
    the optimizer step (`stepped` False); under fp16 the gradient scaler makes that decision itself.
    `phase("optimizer")` is called when the backward passes are done (the heartbeat). With a `guard`,
    the step's loss over every rank (one more all-reduce, and a host sync) is judged first: a spike
    skips the update, on every rank alike.
    """
    # DDP averages the gradients over ranks and accumulate() divides each micro-batch's by the
    # accumulation steps: undo both, so that the step's gradient is that of loss sum / masked_total
    scale = accelerator.num_processes * accelerator.gradient_accumulation_steps / masked_total.clamp(min=1)
    sums = forward_backward(accelerator, model, window, scale, loss_factors)
    if phase is not None:
        phase("optimizer")
    if guard is not None:
        loss = accelerator.reduce(sums[0].clone(), reduction="sum") / masked_total.clamp(min=1)
        spike = guard.judge(loss.item())
        if spike is not None:
            optimizer.zero_grad(set_to_none=True)
            loss_sum, masked, tokens = sums.unbind()
            return StepResult(loss_sum, masked, tokens, torch.full_like(loss_sum, math.nan), False, spike)
    # the gradients are the same on every rank after DDP's all-reduce, so is this norm: every rank
    # takes the same decision below without another collective
    norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)
    overflow = False
    if skips_on_device(accelerator, optimizer):
        # fused AdamW leaves the parameters and its state as they are when `found_inf` is set (what a gradient
        # scaler gives it): the decision stays on the device, and nothing is read back here
        finite = torch.isfinite(norm)
        optimizer.optimizer.found_inf = (~finite).float()
        try:
            optimizer.step()
        finally:
            del optimizer.optimizer.found_inf
        stepped = finite
    elif accelerator.scaler is None:
        stepped = bool(torch.isfinite(norm))
        if stepped:
            optimizer.step()
    else:
        # fp16: the scaler steps unless the gradients hold inf/NaN, then lowers its scale (the same on
        # every rank: the gradients are). Whether that was an overflow of the scaled gradients or a loss
        # that was not finite on some rank, the ranks learn together: one more all-reduce, fp16 only
        optimizer.step()
        stepped = not optimizer.step_was_skipped
        if not stepped:
            finite = accelerator.reduce(torch.isfinite(sums[0]).double(), reduction="sum")
            overflow = int(finite.item()) == accelerator.num_processes
    optimizer.zero_grad(set_to_none=True)
    loss_sum, masked, tokens = sums.unbind()
    return StepResult(loss_sum, masked, tokens, norm, stepped, overflow=overflow)
