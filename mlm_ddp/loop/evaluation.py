"""Held-out evaluation: per-token masked-LM loss, perplexity and accuracy, and bits per character (the
loss per character the masked tokens cover, data.surface: comparable across tokenizers), from sums reduced across
ranks and then divided (a mean of per-batch or per-rank means would weigh tokens unequally). The
cadence (--eval_steps, and the last step) is the evaluator's own: the loop calls `maybe(step)`.
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from torch.utils.data import DataLoader

from mlm_ddp import data as mdata
from mlm_ddp.cluster.collectives import sharded
from mlm_ddp.cluster.heartbeat import PhaseReport, unreported
from mlm_ddp.data.masking import CHARACTERS_KEY, IGNORE_INDEX, percent
from mlm_ddp.loop.speed import TrainingClock
from mlm_ddp.model.loading import check_loss_sum

logger = get_logger(__name__)
Batch = dict[str, torch.Tensor]


class EvalLog(Protocol):
    """What the evaluator needs of the run's log (run_log.RunLog): the loop's parts sit below the run's
    outputs, so the evaluator names the two calls it makes instead of importing the log."""

    def first_eval(self) -> dict[str, Any] | None: ...

    def write(self, record: dict[str, Any], with_tokens: bool = True) -> None: ...


def masked_lm_metrics(loss_sum: float, masked: int, correct: int) -> dict[str, float]:
    """Loss (nats per masked token), perplexity and accuracy from the sums over all masked tokens."""
    if masked == 0:
        raise ValueError("masked_lm_metrics: no masked tokens were evaluated")
    loss = loss_sum / masked
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),  # exp overflows float64 past ~709
            "accuracy": correct / masked, "num_tokens": masked}


def per_character(loss_sum: float, characters: float) -> dict[str, float]:
    """Bits per character: the masked tokens' loss (nats) in bits over the characters they cover, and that
    count; {} where the batches counted none (a collator without a character table, bench's)."""
    if characters <= 0:
        return {}
    return {"bits_per_char": loss_sum / math.log(2) / characters, "characters": int(characters)}


# FSDP: evaluation batches each rank reads ahead of its forwards, and so the most it holds at once (plus
# the one in the forward). Each round of this many costs one all-reduce and one host sync.
EVAL_LOOKAHEAD = 4
HELD_OUT = "data.validation_file"  # the setting that names the held-out files, as a resume lists its changes


def idle_batch(device: torch.device) -> Batch:
    """One token with nothing to predict, (1, 1), which adds 0 to every eval sum; made on `device` (no copy
    from the host), with the loss layout `positions.loss_layout` gives it (the model would compute that on
    the device, reading counts back)."""
    zeros = torch.zeros((1, 1), dtype=torch.long, device=device)
    none = torch.zeros(0, dtype=torch.long, device=device)  # no position carries a loss
    return {"input_ids": zeros, "attention_mask": torch.ones_like(zeros),
            "labels": torch.full_like(zeros, IGNORE_INDEX), "loss_positions": none, "loss_order": zeros,
            "loss_slots": none}


def lockstep(batches: Iterator[Batch], most: Callable[[int], int],
             ahead: int = EVAL_LOOKAHEAD) -> Iterator[Batch | None]:
    """`batches` read `ahead` at a time, and None for an idle forward, so that every rank runs the same
    number of forwards (under FSDP each forward gathers parameters from every rank). Each round, every
    rank reads up to `ahead` batches, and `most` (the maximum over ranks: a collective) says how many
    forwards all of them run; a round in which no rank filled `ahead` was the last. A rank holds at most
    `ahead` batches it has read (an eval set's length is not needed: a stream has none)."""
    while True:
        chunk = collections.deque(itertools.islice(batches, ahead))
        forwards = most(len(chunk))
        for _ in range(forwards):
            yield chunk.popleft() if chunk else None
        if forwards < ahead:
            return


def most_over_ranks(accelerator: Accelerator, count: int) -> int:
    """The largest `count` of any rank (an all-reduce, read back: a host sync)."""
    return int(accelerator.reduce(torch.full((1,), count, device=accelerator.device), reduction="max").item())


def eval_batches(loader: DataLoader, accelerator: Accelerator) -> Iterator[Batch]:
    """This rank's eval batches on its device, read as they are used; under FSDP in `lockstep`, padded
    with idle batches to the same count on every rank."""
    if not sharded(accelerator):
        yield from (mdata.to_device(batch, accelerator.device) for batch in loader)
        return
    idle = idle_batch(accelerator.device)
    for batch in lockstep(iter(loader), functools.partial(most_over_ranks, accelerator)):
        yield idle if batch is None else mdata.to_device(batch, accelerator.device)


def local_sums(net: torch.nn.Module, loader: DataLoader, accelerator: Accelerator) -> torch.Tensor:
    """This rank's (loss sum, masked tokens, correct predictions, characters the masked tokens cover) over
    `loader`, on its device: (4,) float64. The characters come counted with the batch (an idle one has none)."""
    sums = torch.zeros(4, dtype=torch.float64, device=accelerator.device)
    no_characters = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    for batch in eval_batches(loader, accelerator):
        characters = batch.pop(CHARACTERS_KEY, no_characters)
        loss_sum, masked, correct = net(**batch)
        sums += torch.stack([check_loss_sum(loss_sum).double(), masked.double(), correct.double(),
                             characters.double()])
    return sums


def evaluate_mlm(model: torch.nn.Module, loader: DataLoader | dict[str, DataLoader] | None, accelerator: Accelerator,
                 reducing: Callable[[], None] | None = None) -> dict[str, Any] | None:
    """Per-token eval loss, perplexity and accuracy: sums reduced across ranks, then divided. `reducing`
    is called as this rank enters that reduce (the heartbeat: the watchdog watches the wait there).
    Several held-out sources ({name: loader}): each is evaluated apart, its sums reduced in the same one
    all-reduce, and the mix's figures are those of all their sums (`result["sources"]`: each one's)."""
    if loader is None:
        return None
    loaders = loader if isinstance(loader, dict) else {"": loader}
    # DDP: the plain module, so ranks with different numbers of eval batches run no collectives.
    # FSDP: the forward gathers parameters from every rank, so all ranks run the same number of
    # forwards (eval_batches), source after source.
    net = model if sharded(accelerator) else accelerator.unwrap_model(model)
    was_training = net.training
    net.eval()
    with torch.no_grad(), accelerator.autocast():
        sums = torch.stack([local_sums(net, each, accelerator) for each in loaders.values()])  # (sources, 4)
    net.train(was_training)
    if reducing is not None:
        reducing()
    rows = accelerator.reduce(sums, reduction="sum").tolist()
    loss_sum, masked, correct, characters = (sum(column) for column in zip(*rows, strict=True))  # one source: its row
    if masked == 0:
        return None
    result: dict[str, Any] = {**masked_lm_metrics(loss_sum, int(masked), int(correct)),
                              **per_character(loss_sum, characters)}
    if isinstance(loader, dict):  # a source without a masked token (a few short texts) has no figures
        result["sources"] = {name: source_metrics(*row) for name, row in zip(loaders, rows, strict=True) if row[1]}
    return result


def source_metrics(loss_sum: float, masked: float, correct: float, characters: float = 0.0) -> dict[str, float]:
    """One held-out source's figures, as metrics.jsonl's "eval_sources" names them."""
    figures = masked_lm_metrics(loss_sum, int(masked), int(correct))
    return {"loss": figures["loss"], "perplexity": figures["perplexity"], "accuracy": figures["accuracy"],
            "masked_tokens": figures["num_tokens"], **per_character(loss_sum, characters)}


class Evaluator:
    """Evaluates the model on the held-out loader before training, every --eval_steps and at the
    last step. Every rank calls `maybe` after every step (evaluation holds collectives)."""

    def __init__(self, eval_steps: int | None, total_steps: int, accelerator: Accelerator,
                 model: torch.nn.Module, loader: DataLoader | None, beat: PhaseReport = unreported, *,
                 mlm_probability: float, then: Callable[[int], dict[str, Any]] | None = None) -> None:
        self.every, self.total_steps, self.accelerator = eval_steps, total_steps, accelerator
        self.model, self.loader, self.beat = model, loader, beat
        self.then = then  # after each evaluation during training: more fields for its line (the probe's)
        self.mlm_probability = mlm_probability  # the loader's masking rate (--eval_mlm_probability), recorded
        self.first: dict[str, float] | None = None  # before training (of the run a resume continues)
        self.last: dict[str, float] | None = None  # the latest evaluation during training
        self.evaluated_at: int | None = None  # the step of `last`

    def before_training(self, step: int, log: EvalLog, start: Any) -> None:
        """The evaluation before training (step 0 of metrics.jsonl); a resumed run takes its own run's,
        unless the held-out files changed since (`start`: run_folder.Start, its accepted changes)."""
        self.beat(step, "eval")
        if start.resume_from is not None:
            self.first = log.first_eval()
            if HELD_OUT in start.accepted_changes:
                old, new = start.accepted_changes[HELD_OUT]
                logger.warning("--validation_file changed since the evaluation before training (%s -> %s): the "
                               "summary compares no figures before and after", old, new)
                self.first = None
            return
        self.first = self.evaluate(step)
        if self.first:
            logger.info("eval before training: loss %.4f, perplexity %.2f, accuracy %.3f%s%s", self.first["loss"],
                        self.first["perplexity"], self.first["accuracy"], characters_note(self.first),
                        sources_note(self.first))
            log.write({"step": 0, "epoch": 0.0, **record_fields(self.first)}, with_tokens=False)

    def maybe(self, step: int, epoch: float, clock: TrainingClock) -> dict[str, Any]:
        """After an optimizer step: on an evaluation step the record's eval fields, else {}."""
        self.beat(step, "eval")
        if step != self.total_steps and not (self.every and step % self.every == 0):
            return {}
        with clock.paused():  # evaluation is not training time
            self.last, self.evaluated_at = self.evaluate(step), step
            more = self.then(step) if self.then is not None else {}
        if not self.last and not more:
            return {}
        if self.last:
            logger.info("step %d: eval loss %.4f, perplexity %.2f%s%s", step, self.last["loss"],
                        self.last["perplexity"], characters_note(self.last), sources_note(self.last))
        return {**more, "step": step, "epoch": round(epoch, 4), **(record_fields(self.last) if self.last else {})}

    def at_end(self, step: int) -> dict[str, float] | None:
        """The evaluation after training: the last step's, or, where this run trained no step (it resumed a
        checkpoint at its last step: a run killed after that save, before its summary), the model's now, so
        that the card and summary.json say how final/ does. Not written to metrics.jsonl: the run that
        trained the last step wrote its line before that checkpoint."""
        if self.evaluated_at != step:
            self.beat(step, "eval")
            self.last, self.evaluated_at = self.evaluate(step), step
            if self.last:
                logger.info("step %d (trained before this resume): eval loss %.4f, perplexity %.2f%s", step,
                            self.last["loss"], self.last["perplexity"], characters_note(self.last))
        return self.last

    def evaluate(self, step: int) -> dict[str, float] | None:
        """`evaluate_mlm`, with the heartbeat's collectives: under FSDP every forward is one (all of the
        evaluation may wait on the peers); otherwise only the final reduce, after a long local phase."""
        if self.loader is not None and sharded(self.accelerator):
            self.beat(step, "eval", "evaluation's forwards (FSDP gathers the parameters)")
        result = evaluate_mlm(self.model, self.loader, self.accelerator,
                              functools.partial(self.beat, step, "eval", "the all-reduce of the evaluation sums"))
        return None if result is None else {**result, "mlm_probability": self.mlm_probability}


def record_fields(result: dict[str, float]) -> dict[str, float]:
    """An evaluation as metrics.jsonl names it, with the masking rate it was measured at (when known)."""
    rate = {"eval_mlm_probability": result["mlm_probability"]} if "mlm_probability" in result else {}
    sources = {"eval_sources": result["sources"]} if "sources" in result else {}
    characters = ({"eval_bits_per_char": result["bits_per_char"], "eval_characters": result["characters"]}
                  if "bits_per_char" in result else {})
    return {"eval_loss": result["loss"], "perplexity": result["perplexity"], "eval_accuracy": result["accuracy"],
            **characters, **rate, **sources}


def characters_note(*results: dict[str, Any] | None) -> str:
    """', 1.2345 bits per character' (or ', 1.4567 -> 1.2345 bits per character' for a before and an after);
    '' where an evaluation has no such figure (a run logged before it was recorded)."""
    figures = [r.get("bits_per_char") for r in results if r]
    if not figures or None in figures:
        return ""
    return f", {' -> '.join(f'{f:.4f}' for f in figures)} bits per character"


def sources_note(result: dict[str, Any]) -> str:
    """'; general loss 2.1234, domain loss 3.4567': each held-out source's loss, for a log line."""
    sources = result.get("sources") or {}
    return "".join(f"{'; ' if i == 0 else ', '}{name} loss {each['loss']:.4f}"
                   for i, (name, each) in enumerate(sources.items()))


def sources_line(before: dict[str, Any] | None, after: dict[str, Any] | None) -> str:
    """The closing line's part for several held-out sources: each one's loss and perplexity before -> after
    ('' with one source)."""
    then, now = (before or {}).get("sources") or {}, (after or {}).get("sources") or {}
    parts = []
    for name, each in now.items():
        was = then.get(name)
        loss, perplexity = f"{each['loss']:.4f}", f"{each['perplexity']:.2f}"
        if was:  # a source the evaluation before training scored too
            loss, perplexity = f"{was['loss']:.4f} -> {loss}", f"{was['perplexity']:.2f} -> {perplexity}"
        parts.append(f"{name} loss {loss}, perplexity {perplexity}")
    return f"; per source: {'; '.join(parts)}" if parts else ""


def masked_note(*results: dict[str, float] | None) -> str:
    """' (15% masked)': the masking rate the evaluations were measured at, or each one's where they differ
    (a resume may change --eval_mlm_probability); '' where no result says (a run logged before the rate was
    recorded evaluated at its training rate)."""
    rates = [r.get("mlm_probability") for r in results if r]
    if not rates or None in rates:
        return ""
    if len(set(rates)) == 1:
        return f" ({percent(rates[0])} masked)"
    return f" ({' -> '.join(percent(r) for r in rates)} masked)"


def source_rows(before: dict[str, Any] | None, after: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The model card's rows for several held-out sources: each one's perplexity before -> after."""
    then = (before or {}).get("sources") or {}
    return [(f"held-out perplexity on {name}", (f"{then[name]['perplexity']:.2f} -> " if name in then else "")
             + f"{each['perplexity']:.2f}") for name, each in ((after or {}).get("sources") or {}).items()]
