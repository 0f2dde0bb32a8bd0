"""One optimizer step of masked-LM training: the function `mlm_ddp.train` runs every step and
`mlm_ddp.bench` times, so the benchmark measures the very step that trains.

The loss of a step is normalised by the masked tokens of the WHOLE step (every rank, every
micro-batch), which the caller counts beforehand (`masked_tokens`, reduced across ranks): a rank or
micro-batch with more masked tokens then weighs more, exactly as one big batch would.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from mlm_ddp.checkpoint import StopSignals
from mlm_ddp.errors import NonFiniteLoss
from mlm_ddp.masking import IGNORE_INDEX
from mlm_ddp.model import check_loss_sum
from mlm_ddp.spikes import LossSpikeGuard, LossSpikes, Spike

logger = get_logger(__name__)

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
    `phase` names the heartbeat's phase: "forward/backward" first, "optimizer" when the backward passes
    are done. With a `guard`,
    the step's loss over every rank (one more all-reduce, and a host sync) is judged first: a spike
    skips the update, on every rank alike.
    """
    # DDP averages the gradients over ranks and accumulate() divides each micro-batch's by the
    # accumulation steps: undo both, so that the step's gradient is that of loss sum / masked_total
    scale = accelerator.num_processes * accelerator.gradient_accumulation_steps / masked_total.clamp(min=1)
    if phase is not None:
        phase("forward/backward")
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


def agree_on_step(accelerator: Accelerator, window: list[dict[str, torch.Tensor]], stop: StopSignals,
                  unread: torch.Tensor | None = None) -> tuple[torch.Tensor, list[str], bool]:
    """One all-reduce per step, and its result read once (the step's one host sync on a GPU): the masked
    tokens of the whole optimizer step (all ranks and micro-batches; the loss is normalised by them), the
    stop signals any rank received (a vote per signal, so that every rank knows which, whichever rank it
    reached first), and whether the previous step's update was skipped, where that is still `unread` on
    the device (a bool tensor: the step's `stepped`)."""
    votes = torch.tensor(stop.votes(), dtype=torch.float64, device=accelerator.device)
    skipped = torch.zeros(1, dtype=torch.float64, device=accelerator.device) if unread is None else \
        (~unread).double().reshape(1)
    local = torch.cat([masked_tokens(window).reshape(1), votes, skipped])
    summed = accelerator.reduce(local, reduction="sum")
    values = summed.tolist()
    return summed[0], stop.agreed(values[1:-1]), values[-1] > 0


class SkippedSteps:
    """Steps whose update was skipped, and what follows: an fp16 overflow (counted), a loss spike
    (`LossSpikes` answers), or non-finite gradients, which --on_nonfinite_loss counts ('skip') or stops
    at (every rank alike: the norm is the same). `latest` names the newest checkpoint."""

    def __init__(self, on_nonfinite: str, accelerator: Accelerator, spikes: LossSpikes,
                 latest: Callable[[], Path | None]) -> None:
        self.on_nonfinite, self.accelerator, self.spikes, self.latest = on_nonfinite, accelerator, spikes, latest
        self.nonfinite = self.overflows = 0

    def __call__(self, step: int, result: StepResult) -> None:
        if result.overflow:
            self.overflows += 1
            logger.info("step %d: the fp16 gradients overflowed; the gradient scaler skipped the update and "
                        "lowered its scale to %g (%d so far)", step + 1, self.accelerator.scaler.get_scale(),
                        self.overflows)
        elif result.spike is not None:
            self.spikes.skipped(step, result.spike)
        elif self.on_nonfinite == "skip":
            self.nonfinite += 1
            logger.warning("step %d: gradient norm %s, optimizer step skipped (%d so far)",
                           step + 1, result.grad_norm.item(), self.nonfinite)
        else:
            latest = self.latest()
            raise NonFiniteLoss(
                f"step {step + 1}: the gradient norm is {result.grad_norm.item()} (loss or gradients NaN/inf); "
                + (f"the last good checkpoint is {latest}" if latest else "no checkpoint was saved")
                + ". Lower --learning_rate, check the data, or pass --on_nonfinite_loss skip")

    def summary(self) -> None:
        if self.nonfinite:
            logger.warning("%d optimizer step(s) skipped for non-finite gradients", self.nonfinite)
        self.spikes.summary()
