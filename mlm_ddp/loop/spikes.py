"""--on_loss_spike: the guard that judges each step's loss, and what follows a spike.

`LossSpikeGuard` judges (step.train_step asks it, after the step's loss is all-reduced, so every rank
judges alike). `LossSpikes` owns the response: 'skip' skips the update (counted); 'rollback' reloads
the newest checkpoint of this run, marks the window that spiked, and skips it when the replay reaches
it (`skip_spiked`); where there is nothing to roll back to yet, the update is skipped instead.
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass
from typing import Any

from accelerate.logging import get_logger

from mlm_ddp.config import RunConfig
from mlm_ddp.loop import checkpoint as ckpt

logger = get_logger(__name__)


@dataclass(frozen=True)
class Spike:
    loss: float  # the step's loss, all ranks
    median: float  # the running median it was judged against
    steps: int  # losses in that median


class LossSpikeGuard:
    """A step whose loss (all ranks, all micro-batches) is above `factor` x the median of the last
    `window` accepted steps' losses is a spike, judged once `MIN_HISTORY` of them are known. The
    median, not the mean: one earlier spike or a noisy step does not move it."""

    MIN_HISTORY = 10

    def __init__(self, factor: float, window: int) -> None:
        # a resume or a rollback puts a checkpoint's losses back (LossSpikes.load_state_dict)
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


def window_key(at: Any) -> tuple:
    """A window's place in the data (a data.FeedPosition), the same in a replay: (epoch, micro-batch, slot)."""
    return at.epoch, at.batch_in_epoch, at.block_in_epoch


def _slot(at: Any, words: str) -> str:
    return "" if at.block_in_epoch is None else words.format(at.block_in_epoch)


class LossSpikes:
    """--on_loss_spike's guard and response; `counts` are the steps skipped and the rollbacks."""

    def __init__(self, run: RunConfig) -> None:
        self.mode, self.factor = run.on_loss_spike, run.loss_spike_factor
        self.guard = None if self.mode == "off" else LossSpikeGuard(self.factor, run.loss_spike_window)
        self.counts = {"skipped": 0, "rolled_back": 0}
        self.spiked_windows: set[tuple] = set()  # positions of windows a rollback skips

    def state_dict(self) -> dict[str, list[float]]:
        """A resumable part (loop/resumable.py; registered where the guard is on): the accepted losses the guard
        judges against, so that a resumed run judges its first steps as the uninterrupted run does, and a rollback
        judges the replayed steps against the checkpoint's losses, each joining them once."""
        return {"history": list(self.guard.history)}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.guard.history = collections.deque(state["history"], maxlen=self.guard.history.maxlen)

    def words(self, step: int, spike: Spike) -> str:
        return (f"step {step + 1}: loss {spike.loss:.4f} is {spike.loss / spike.median:.1f}x the median "
                f"{spike.median:.4f} of the last {spike.steps} steps (--loss_spike_factor {self.factor:g})")

    def skip_spiked(self, feed: Any) -> None:
        """Before reading a window: read and drop those that caused a spike before a rollback."""
        while self.spiked_windows and window_key(at := feed.position()) in self.spiked_windows:
            self.spiked_windows.discard(window_key(at))
            feed.next_window()
            logger.info("skipped the micro-batches that caused a loss spike (epoch %d, micro-batch %d%s)", at.epoch,
                        at.batch_in_epoch, _slot(at, ", slot {}"))

    def roll_back(self, step: int, at: Any, spike: Spike, checkpointer: ckpt.Checkpointer, feed: Any,
                  log: Any, accumulation: int) -> int | None:
        """Every rank alike (the loss was all-reduced): reload the newest checkpoint, mark this step's
        window (which started at `at`) to be skipped when the replay reaches it, and return the checkpoint's
        step. None: no rollback (the mode is 'skip', or no checkpoint of this number of processes exists
        yet: another number's data positions are not this run's); the update is skipped instead."""
        if self.mode != "rollback":
            return None
        agreed = checkpointer.agreed_latest()  # every rank decides alike, whatever its view of the folder
        if agreed is None:
            return None
        latest, saved = agreed
        world, rank = checkpointer.accelerator.num_processes, checkpointer.accelerator.process_index
        if saved.world_size != world:
            return None
        checkpointer.restore(latest, {}, saved.step)  # with every registered part: the log's sums, this guard's
        # where the data and the counters continue: the trainer state's, as a resume's start reads them
        feed.seek(saved.epoch, saved.batch_in_epoch, saved.block_in_epoch,
                  None if feed.sampler is not None else ckpt.read_data_state(latest, rank), saved.sources)
        log.rewind(saved.step, saved.tokens_seen)
        self.spiked_windows.add(window_key(at))
        self.counts["rolled_back"] += 1
        logger.warning("%s: rolled back to %s; the step's %d micro-batch(es) from epoch %d, micro-batch %d%s on are "
                       "skipped", self.words(step, spike), latest.name, accumulation, at.epoch, at.batch_in_epoch,
                       _slot(at, " (slot {})"))
        return saved.step

    def skipped(self, step: int, spike: Spike) -> None:
        """A spike whose update was skipped."""
        self.counts["skipped"] += 1
        why = "" if self.mode == "skip" else " (no checkpoint of this run to roll back to yet)"
        logger.warning("%s: update skipped%s", self.words(step, spike), why)

    def reported(self) -> dict[str, int]:
        """The counts summary.json reports ({} when the guard is off)."""
        return dict(self.counts) if self.guard is not None else {}

    def summary(self) -> None:
        if self.guard is not None:
            logger.info("loss spikes: %d update(s) skipped, %d rollback(s)", self.counts["skipped"],
                        self.counts["rolled_back"])
