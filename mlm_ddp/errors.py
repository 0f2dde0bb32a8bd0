"""How a run ends when it does not simply finish: one exception type per outcome, each carrying the
exit code `main` returns for it, so that launchers and schedulers can act on the code alone.

A leaf module: it imports nothing from the package, and every other module may raise from it.
"""

from __future__ import annotations

import sys

# Exit codes of `python -m mlm_ddp.train` and of each Submitit task (docs/checkpoints.md "Exit codes").
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_NONFINITE = 0, 1, 2, 3
EXIT_REQUEUE = 75  # sysexits' EX_TEMPFAIL: "try again later", the one code a scheduler should requeue on


class RunEnded(Exception):
    """A run that ended early, for a reason one line can say. `line(prog)` is that line."""

    exit_code = EXIT_FAILED
    is_error = True  # the line reads "prog: error: ..."; False for outcomes that are no failure

    def line(self, prog: str) -> str:
        return f"{prog}: {'error: ' if self.is_error else ''}{self}"


class BadInput(RunEnded, ValueError):
    """Input a user can fix, found before or during the run: a flag, a recipe, a data file, a model
    folder, a damaged or foreign checkpoint. The message names the thing and the fix."""

    exit_code = EXIT_BAD_INPUT


class NonFiniteLoss(RunEnded):
    """Gradients were NaN or inf and --on_nonfinite_loss is 'stop'."""

    exit_code = EXIT_NONFINITE


class CheckpointWriteError(RunEnded):
    """A checkpoint could not be written (disk full, ...); the previous complete one is intact."""


class Preempted(RunEnded):
    """A stop signal arrived; every process saved the same checkpoint; the job may be requeued.

    `signal_name` names the signals the processes received, agreed by all of them (several: comma-
    separated), so that every rank, rank 0 included, knows whether the scheduler's warning signal
    came (requeue) or only a cancel's SIGTERM (do not), whichever process it reached first."""

    exit_code, is_error = EXIT_REQUEUE, False

    def __init__(self, message: str, signal_name: str | None = None) -> None:
        super().__init__(message)
        self.signal_name = signal_name

    def line(self, prog: str) -> str:
        return f"{super().line(prog)} (exit {self.exit_code})"


class AlreadyFinished(RunEnded):
    """--resume_from_checkpoint auto on a run that finished: nothing to do, a success."""

    exit_code, is_error = EXIT_OK, False


def say(line: str) -> None:
    """One line on stderr in one write: every rank may print its error at the same moment into the
    launcher's one pipe, and print() writes the text and its newline apart (unbuffered stderr), so
    two ranks' lines could run into one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
