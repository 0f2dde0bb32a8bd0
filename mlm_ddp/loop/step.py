"""One optimizer step of masked-LM training: the function `mlm_ddp.train` runs every step and
`mlm_ddp.bench` times, so the benchmark measures the very step that trains.

The loss of a step is normalised by the masked tokens of the WHOLE step (every rank, every
micro-batch), which the caller counts beforehand (`masked_tokens`, reduced across ranks): a rank or
micro-batch with more masked tokens then weighs more, exactly as one big batch would.

Whether a step's update was skipped is decided from the step's own numbers, never from whether
`optimizer.step` was called: a fused AdamW is always called and skips on the device (`found_inf`),
under an fp16 gradient scaler too (docs/design.md, pitfall 18).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from mlm_ddp.compat.torch import loss_scale, skipped_where_found_inf
from mlm_ddp.data.masking import IGNORE_INDEX
from mlm_ddp.errors import NonFiniteLoss
from mlm_ddp.loop.checkpoint import StopSignals
from mlm_ddp.loop.spikes import LossSpikeGuard, LossSpikes, Spike
from mlm_ddp.model.loading import check_loss_sum

logger = get_logger(__name__)

Batch = dict[str, torch.Tensor]

# --on_nonfinite_loss skip drops a step now and then whose loss or gradients are NaN/inf (a bad batch).
# This many in a row is no such step: the forward itself overflows or the weights are broken, and the
# run would end "done" with a model that stopped training there. It stops as 'stop' would (exit 3).
NONFINITE_IN_A_ROW = 10
# fp16: the gradient scaler halves its scale at each overflow. Below 1 the loss is scaled down, not up:
# the fp16 gradients overflow at their true size, and no scale will make the next step fit (DeepSpeed's
# default min_loss_scale is 1 for the same reason). The run stops (exit 3) instead of skipping forever.
MIN_LOSS_SCALE = 1.0


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did on this rank; the tensors are float64 scalars on its device (no
    host sync until someone reads them)."""

    loss_sum: torch.Tensor  # summed cross-entropy (nats) over this rank's masked tokens
    masked: torch.Tensor  # this rank's masked tokens
    tokens: torch.Tensor  # this rank's non-padding input tokens
    grad_norm: torch.Tensor  # before clipping, unscaled; the same on every rank (the gradients are all-reduced)
    # False: the update was skipped (gradients not finite, an fp16 overflow, a loss spike). A bool tensor on the
    # device where the decision stayed there (fused AdamW's found_inf, the fp16 gradient scaler): it is read
    # with the next step's all-reduce (`agree_on_step`) or by `settle_step`, which give the step back judged
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
    `found_inf`) and no gradient scaler (which sets its own). FSDP2's DTensor parameters too: DTensor runs
    the fused kernel on each shard and replicates the scalar `found_inf` (since torch 2.4, pytorch#126750,
    the project's floor); every rank gets the same flag, from the whole gradient's norm."""
    inner = getattr(optimizer, "optimizer", optimizer)
    # recent torch makes AdamW an Adam, older releases a class of its own: both read found_inf when fused
    return (accelerator.scaler is None and isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))
            and all(group.get("fused") for group in inner.param_groups))


def train_step(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               window: list[Batch], masked_total: torch.Tensor, max_grad_norm: float | None,
               phase: Callable[[str], None] | None = None, guard: LossSpikeGuard | None = None,
               loss_factors: list[float] | None = None) -> StepResult:
    """Forward and backward of `window` (this rank's micro-batches of the step), clip, step, zero.

    `masked_total`: the masked tokens of the whole step, all ranks. Gradients that are not finite skip
    the optimizer step (`stepped` False); under fp16 the gradient scaler skips, and `stepped` says
    whether its scale went down (what it does exactly when it skips).
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
    # the gradients are the same on every rank after DDP's all-reduce (FSDP reduces the norm itself), so is
    # this norm: every rank takes the same decision below without another collective. Under fp16 accelerate
    # unscales the gradients first: the norm is the true one
    norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)
    # under FSDP2 the norm is a DTensor: the whole norm as a plain tensor, the same on every rank (no host
    # sync: a replicated one's local value, or an all-reduce of a partial one), as the log reads it
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    stepped: bool | torch.Tensor
    if accelerator.scaler is not None:
        # fp16: the scaler skips the update when the gradients hold inf/NaN, and then halves its scale. With a
        # fused AdamW it calls optimizer.step anyway and the kernel skips (found_inf), so accelerate's
        # step_was_skipped stays False: the scale tells. It stays on the device, read with the next step's
        # all-reduce, which also tells an overflow (every rank's loss finite) from a non-finite loss. The scale is
        # torch's GradScaler's own tensor (accelerate's scaler for DDP and FSDP2 alike): `get_scale()` is a host sync
        before = loss_scale(accelerator.scaler).clone()
        optimizer.step()
        stepped = loss_scale(accelerator.scaler) >= before
    elif skips_on_device(accelerator, optimizer):
        # fused AdamW leaves the parameters and its state as they are when `found_inf` is set (what a gradient
        # scaler gives it): the decision stays on the device, and nothing is read back here
        finite = torch.isfinite(norm)
        with skipped_where_found_inf(optimizer.optimizer, (~finite).float()):
            optimizer.step()
        stepped = finite
    else:
        stepped = bool(torch.isfinite(norm))
        if stepped:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss_sum, masked, tokens = sums.unbind()
    return StepResult(loss_sum, masked, tokens, norm, stepped)


def skip_votes(result: StepResult | None, device: torch.device) -> torch.Tensor:
    """For a step whose skip is still on the device (`stepped` a tensor): (update skipped, this rank's loss
    not finite), float64 (2,), to be summed over ranks; zeros for None."""
    if result is None:
        return torch.zeros(2, dtype=torch.float64, device=device)
    stepped = result.stepped.reshape(1)  # () from the norm, or the shape of the scaler's scale
    return torch.cat([(~stepped).double(), (~torch.isfinite(result.loss_sum)).double().reshape(1)])


def judged(accelerator: Accelerator, result: StepResult | None, votes: list[float]) -> StepResult | None:
    """`result` as a skipped step (`overflow` set: fp16, and every rank's loss was finite), from the
    summed `skip_votes`; None where its update was taken."""
    if result is None or not votes[0]:
        return None
    return dataclasses.replace(result, stepped=False, overflow=accelerator.scaler is not None and not votes[1])


def agree_on_step(accelerator: Accelerator, window: list[dict[str, torch.Tensor]], stop: StopSignals,
                  unread: StepResult | None = None) -> tuple[torch.Tensor, list[str], StepResult | None]:
    """One all-reduce per step, and its result read once (the step's one host sync on a GPU): the masked
    tokens of the whole optimizer step (all ranks and micro-batches; the loss is normalised by them), the
    stop signals any rank received (a vote per signal, so that every rank knows which, whichever rank it
    reached first), and the previous step, where its skip is still `unread` on the device: returned judged
    (`judged`) if its update was skipped, else None."""
    # filled in on the device: torch.tensor(votes, device=...) would copy them from pageable host memory,
    # which waits for the device (docs/design.md, pitfall 15). A signal is rare: the fill of a vote is too
    ballot = stop.votes()
    votes = torch.zeros(len(ballot), dtype=torch.float64, device=accelerator.device)
    for index, vote in enumerate(ballot):
        if vote:
            votes[index].fill_(vote)
    local = torch.cat([masked_tokens(window).reshape(1), votes, skip_votes(unread, accelerator.device)])
    summed = accelerator.reduce(local, reduction="sum")
    values = summed.tolist()
    return summed[0], stop.agreed(values[1:-2]), judged(accelerator, unread, values[-2:])


def settle_step(accelerator: Accelerator, result: StepResult) -> StepResult | None:
    """A step whose skip is still on the device, read now (an all-reduce and a host sync: every rank
    calls it at the same step), where no next step's all-reduce will bring it: judged, or None."""
    votes = accelerator.reduce(skip_votes(result, accelerator.device), reduction="sum").tolist()
    return judged(accelerator, result, votes)


class SkippedSteps:
    """Steps whose update was skipped, and what follows: an fp16 overflow (counted; the run stops once
    the scale falls below MIN_LOSS_SCALE), a loss spike (`LossSpikes` answers), or non-finite gradients,
    which --on_nonfinite_loss counts ('skip'; the run stops after NONFINITE_IN_A_ROW of them in a row)
    or stops at (every rank alike: the norm is the same). `latest` names the newest checkpoint."""

    def __init__(self, on_nonfinite: str, accelerator: Accelerator, spikes: LossSpikes,
                 latest: Callable[[], Path | None]) -> None:
        self.on_nonfinite, self.accelerator, self.spikes, self.latest = on_nonfinite, accelerator, spikes, latest
        self.nonfinite = self.overflows = 0
        self.last: int | None = None  # the newest skipped step
        self.in_a_row = 0  # skipped steps in a row up to `last`, whatever the reason
        self.nonfinite_in_a_row = 0  # non-finite ones in a row up to `last`

    def __call__(self, step: int, result: StepResult) -> None:
        follows = self.last is not None and step == self.last + 1
        self.last, self.in_a_row = step, self.in_a_row + 1 if follows else 1
        kind = "overflow" if result.overflow else "spike" if result.spike is not None else "nonfinite"
        self.nonfinite_in_a_row = (self.nonfinite_in_a_row + 1 if follows else 1) if kind == "nonfinite" else 0
        if kind == "overflow":
            self.overflows += 1
            scale = self.accelerator.scaler.get_scale()
            logger.info("step %d: the fp16 gradients overflowed; the gradient scaler skipped the update and "
                        "lowered its scale to %g (%d so far)", step + 1, scale, self.overflows)
            if scale < MIN_LOSS_SCALE:
                self.stop(step, f"the fp16 gradients overflowed {self.in_a_row} step(s) in a row and the loss scale "
                          f"fell to {scale:g}: they overflow fp16 at their true size",
                          "Train in bf16 (--mixed_precision bf16, on compute capability 8.0+) or fp32 "
                          "(--mixed_precision no), or lower --learning_rate")
        elif kind == "spike":
            self.spikes.skipped(step, result.spike)
        elif self.on_nonfinite == "skip":
            self.nonfinite += 1
            logger.warning("step %d: gradient norm %s, optimizer step skipped (%d so far)",
                           step + 1, result.grad_norm.item(), self.nonfinite)
            if self.nonfinite_in_a_row >= NONFINITE_IN_A_ROW:
                self.stop(step, f"the loss or gradients were NaN/inf {self.nonfinite_in_a_row} steps in a row "
                          "(--on_nonfinite_loss skip skips a step now and then, not a run that no longer trains)",
                          "Lower --learning_rate or check the data and the model's weights")
        else:
            # the first step's gradients come from the weights loaded and the data alone: no rate has acted yet
            self.stop(step, f"the gradient norm is {result.grad_norm.item()} (loss or gradients NaN/inf)",
                      "Lower --learning_rate, check the data, or pass --on_nonfinite_loss skip" if step > 0 else
                      "It was the first step, before any update, so not the learning rate: check the model (its "
                      "weights, --config_overrides, --attn_implementation) and the data")

    def stop(self, step: int, what: str, fix: str) -> None:
        """Raise NonFiniteLoss for `step`, naming the newest checkpoint."""
        latest = self.latest()
        raise NonFiniteLoss(f"step {step + 1}: {what}; "
                            + (f"the last good checkpoint is {latest}" if latest else "no checkpoint was saved")
                            + f". {fix}")

    def reported(self) -> dict[str, int]:
        """The counts summary.json reports: updates skipped for non-finite gradients, fp16 overflows."""
        return {"nonfinite": self.nonfinite, "overflow": self.overflows}

    def summary(self, first: int, end: int) -> None:
        """After the last step (`end`, this run started after step `first`): the counts in the log. A run
        none of whose updates was taken (every step from `first` to `end` skipped, non-finite or
        overflowed) raises NonFiniteLoss: it did not train, and must not end as done."""
        if self.overflows:
            logger.info("%d fp16 overflow(s): the gradient scaler skipped those updates and lowered its scale "
                        "(now %g)", self.overflows, self.accelerator.scaler.get_scale())
        if self.nonfinite:
            logger.warning("%d optimizer step(s) skipped for non-finite gradients", self.nonfinite)
        self.spikes.summary()
        if end > first and self.last == end - 1 and self.in_a_row >= end - first:
            self.stop(end - 1, f"not one of this run's {end - first} update(s) was taken (the loss or gradients "
                      "were NaN/inf, or overflowed fp16, at every step)",
                      "Lower --learning_rate, check the data and the model's weights")
