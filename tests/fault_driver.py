"""`python -m tests.fault_driver [--slow_save_s S] [--freeze RANK:STEP:PHASE] [training flags]`:
`mlm_ddp.train.main` with a fault injected through `train`'s test seam (`Hooks`), never through the
production code's environment:

- `--slow_save_s S`: every checkpoint save sleeps S seconds once its files are durable and before its
  COMPLETE marker, widening the window in which a kill leaves a half-written checkpoint, or in which
  the other ranks wait for the main process.
- `--freeze RANK:STEP:PHASE`: rank RANK stops itself with SIGSTOP 3 s after its heartbeat enters
  PHASE of step STEP (a hung rank, as a dead node leaves it).
- `--slow_shard_write RANK:S`: rank RANK sleeps S seconds in torch.distributed.checkpoint's writing of
  its shards (an FSDP save on a slow disk), while the other ranks wait in the save's collectives.
- `--stick RANK:STEP:PHASE`: rank RANK sleeps (alive: its threads run) right after its heartbeat enters
  PHASE of step STEP (a rank stuck in a read or a deadlock of its own).
- `--slow_eval_s S`: every evaluation sleeps S seconds on every rank before it computes (a large
  validation split: a long phase without a collective).
- `--slow_final_s RANK:S`: rank RANK sleeps S seconds in its final phase, after final/ is saved (a slow
  report or tracker upload), while the other ranks have finished.
- `--slow_state_dict RANK:S`: rank RANK sleeps S seconds before it gathers the model's state dict for
  final/ (under FSDP the others wait in the gather's collectives on the training group).
- `--slow_load RANK:S`: rank RANK sleeps S seconds before it loads a checkpoint (a resume that reads a
  whole DDP checkpoint from a busy network filesystem), while the other ranks have loaded theirs.
- `--kill RANK:STEP`: once per job, rank RANK kills itself with SIGKILL as its heartbeat enters the data
  phase of step STEP (a dead GPU, an OOM kill). Once: it leaves a mark beside the output folder first
  (`OUTPUT_DIR.killed`), as a restart count cannot say: it is each torchrun agent's own, so the worker of
  another node sees 0 after a restart.
- `--kill_node STEP`: as `--kill`, on the process given this flag whatever its rank, and it kills its
  launcher (its parent: torchrun's agent) first, as a node that dies takes its agent with it; an elastic
  job then goes on without that node.
- `--late RANK:S`: once a `--kill` left its mark (in the job's restart), rank RANK sleeps S seconds before
  it starts (a node that comes back slowly).
- `--slow_preflight RANK:S`: rank RANK sleeps S seconds before its preflight (a node that reads its inputs
  from a slow shared filesystem), while the others wait for it in the join.
- `--spike STEP:FACTOR`: the first micro-batch of step STEP has its loss multiplied by FACTOR on every
  rank, once (a replay of that step after a rollback is not spiked again).
- `--tally`: two resumable parts of the test's own (`Tally`, loop/resumable.py), registered beside the run's:
  `tally` (the same on every rank) and `tally_rank` (each rank's own); each holds the steps it saw start.

Runs under `accelerate launch -m tests.fault_driver` too (cwd: the repo).
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import threading
import time
from pathlib import Path


def pause(seconds: float) -> None:
    """time.sleep, but also under libfaketime with its monotonic clock left alone, where time.sleep fails
    with EINVAL (libfaketime 0.9.10: its clock_nanosleep) and a timed wait does not."""
    threading.Event().wait(seconds)


# Under libfaketime every time.sleep in the process fails, not only ours: datasets' file lock sleeps
# while another rank holds the cache's lock, and failed as "--train_file could not be loaded" in CI.
# A cluster node has no such preload, so only the rank the test wraps in faketime gets this.
if "faketime" in os.environ.get("LD_PRELOAD", ""):
    time.sleep = pause

from mlm_ddp.cluster.heartbeat import ALIVE_EVERY_S, Beat  # noqa: E402 - after the patch, for modules that bind sleep
from mlm_ddp.train import Hooks  # noqa: E402
from mlm_ddp.train import main as train_main  # noqa: E402


def freeze_at(where: str, beat: Beat) -> None:
    rank, step, phase = where.split(":", 2)
    if (beat.rank, beat.step, beat.phase, beat.collective) == (int(rank), int(step), phase, None):
        # the alive thread publishes the phase first (it does so once per ALIVE_EVERY_S): a rank frozen in
        # the very microsecond it entered a phase is named where it last published from
        time.sleep(1.5 * ALIVE_EVERY_S)
        os.kill(os.getpid(), signal.SIGSTOP)


def stick_at(where: str, beat: Beat) -> None:
    rank, step, phase = where.split(":", 2)
    if (beat.rank, beat.step, beat.phase, beat.collective) == (int(rank), int(step), phase, None):
        time.sleep(3600)


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def kill_at(where: str, mark: Path, beat: Beat) -> None:
    rank, step = map(int, where.split(":"))
    if not mark.exists() and (beat.rank, beat.step, beat.phase, beat.collective) == (rank, step, "data", None):
        mark.touch()
        os.kill(os.getpid(), signal.SIGKILL)


def kill_node_at(step: int, beat: Beat) -> None:
    if attempt() == 0 and (beat.step, beat.phase, beat.collective) == (step, "data", None):
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def slow_evaluations(seconds: float) -> None:
    from mlm_ddp.loop import evaluation

    evaluate = evaluation.evaluate_mlm

    def slow(*args: object, **kwargs: object) -> object:
        pause(seconds)
        return evaluate(*args, **kwargs)

    evaluation.evaluate_mlm = slow


def delay_on_rank(where: str, owner: object, name: str) -> None:
    """`where` RANK:S: on rank RANK, `owner.name` (a function, or a method of the class `owner`) sleeps S
    seconds before it runs; the other ranks keep it as it is."""
    rank, seconds = where.split(":")
    if os.environ.get("RANK") != rank:
        return
    original = getattr(owner, name)

    @functools.wraps(original)
    def slow(*args: object, **kwargs: object) -> object:
        print(f"fault_driver: rank {rank} delays {name} by {seconds} s", file=sys.stderr, flush=True)
        # through the module, as libraries sleep (filelock): under libfaketime, the patched time.sleep above
        time.sleep(float(seconds))
        return original(*args, **kwargs)

    setattr(owner, name, slow)


class Tally:
    """A resumable part of the test's own: the steps it saw start, in order (`see`, through Hooks.loss_factor).
    A run restored exactly holds 1..N at its step N, every step once; `rank`: a part each rank saves for
    itself, which refuses another rank's state."""

    def __init__(self, rank: int | None = None) -> None:
        self.rank, self.steps = rank, []

    def see(self, step: int, micro_batch: int) -> None:
        if micro_batch == 0:
            self.steps.append(step)

    def state_dict(self) -> dict:
        return {"steps": list(self.steps), **({} if self.rank is None else {"rank": self.rank})}

    def load_state_dict(self, state: dict) -> None:
        if state.get("rank") != self.rank:
            raise ValueError(f"rank {self.rank} was given rank {state.get('rank')}'s tally")
        self.steps = list(state["steps"])


def loss_factors(tallies: list[Tally], spike: OneSpike | None, step: int, micro_batch: int) -> float:
    for tally in tallies:
        tally.see(step, micro_batch)
    return 1.0 if spike is None else spike(step, micro_batch)


class OneSpike:
    """Hooks.loss_factor that multiplies one micro-batch's loss, the first time its step runs."""

    def __init__(self, where: str) -> None:
        step, factor = where.split(":")
        self.step, self.factor, self.done = int(step), float(factor), False

    def __call__(self, step: int, micro_batch: int) -> float:
        if self.done or (step, micro_batch) != (self.step, 0):
            return 1.0
        self.done = True
        return self.factor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests.fault_driver", allow_abbrev=False)
    parser.add_argument("--slow_save_s", type=float)
    parser.add_argument("--freeze", metavar="RANK:STEP:PHASE")
    parser.add_argument("--spike", metavar="STEP:FACTOR")
    parser.add_argument("--slow_shard_write", metavar="RANK:S")
    parser.add_argument("--stick", metavar="RANK:STEP:PHASE")
    parser.add_argument("--slow_eval_s", type=float)
    parser.add_argument("--slow_final_s", metavar="RANK:S")
    parser.add_argument("--slow_load", metavar="RANK:S")
    parser.add_argument("--slow_state_dict", metavar="RANK:S")
    parser.add_argument("--kill", metavar="RANK:STEP")
    parser.add_argument("--kill_node", metavar="STEP", type=int)
    parser.add_argument("--late", metavar="RANK:S")
    parser.add_argument("--slow_preflight", metavar="RANK:S")
    parser.add_argument("--tally", action="store_true")
    faults, train_argv = parser.parse_known_args(argv)
    killed = Path(train_argv[train_argv.index("--output_dir") + 1] + ".killed") if faults.kill else None
    if faults.late is not None and killed and killed.exists() and os.environ.get("RANK") == faults.late.split(":")[0]:
        print(f"fault_driver: rank {os.environ['RANK']} starts {faults.late.split(':')[1]} s late", file=sys.stderr,
              flush=True)
        pause(float(faults.late.split(":")[1]))
    if faults.slow_shard_write is not None:
        from torch.distributed.checkpoint import FileSystemWriter

        delay_on_rank(faults.slow_shard_write, FileSystemWriter, "write_data")
    if faults.slow_preflight is not None:
        from mlm_ddp import train

        delay_on_rank(faults.slow_preflight, train, "preflight")
    if faults.slow_eval_s is not None:
        slow_evaluations(faults.slow_eval_s)
    if faults.slow_final_s is not None:  # after final/ is saved, while the other ranks have finished
        from mlm_ddp.run.run_folder import RunFolder

        delay_on_rank(faults.slow_final_s, RunFolder, "write_summary")
    if faults.slow_load is not None:
        from accelerate import Accelerator

        delay_on_rank(faults.slow_load, Accelerator, "load_state")
    if faults.slow_state_dict is not None:
        from accelerate import Accelerator

        delay_on_rank(faults.slow_state_dict, Accelerator, "get_state_dict")
    slow = None if faults.slow_save_s is None else functools.partial(time.sleep, faults.slow_save_s)
    freeze = None if faults.freeze is None else functools.partial(freeze_at, faults.freeze)
    if faults.stick is not None:
        freeze = functools.partial(stick_at, faults.stick)
    if faults.kill is not None:
        freeze = functools.partial(kill_at, faults.kill, killed)
    if faults.kill_node is not None:
        freeze = functools.partial(kill_node_at, faults.kill_node)
    spike = None if faults.spike is None else OneSpike(faults.spike)
    factor, parts = spike, []
    if faults.tally:
        tallies = [Tally(), Tally(int(os.environ.get("RANK", "0")))]
        factor = functools.partial(loss_factors, tallies, spike)
        parts = [("tally", tallies[0], False), ("tally_rank", tallies[1], True)]
    return train_main(train_argv, Hooks(before_checkpoint_marker=slow, on_beat=freeze, loss_factor=factor,
                                        parts=parts))


if __name__ == "__main__":
    sys.exit(main())
