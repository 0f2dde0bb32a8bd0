"""The fast tier: `python -m pytest --fast` runs what stays in pytest's process (config, data, masking, the
step, checkpoint files, refusals, in-process runs of the loop) and skips a test at the first process it would
start: a `subprocess` child (subprocess.run and check_output start one too: a 2-rank gloo job, a torchrun
agent, a Slurm job, `accelerate launch`) or a `multiprocessing` one (prepare's pool, DataLoader workers).
Nobody marks which test is which, so no mark can be forgotten: the skip comes from what the test does. A
test that reads a fixture whose processes ran is skipped with that fixture's first process.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true",
                     help="the fast tier: only what runs in pytest's own process; a test skips at the first "
                          "process it would start (docs/development.md)")


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("fast", False):
        return

    def skipped_start(*_args: Any, **_kwargs: Any) -> None:
        pytest.skip("starts a process (--fast runs only what stays in pytest's process)")

    subprocess.Popen.__init__ = skipped_start  # type: ignore[method-assign, assignment]
    multiprocessing.process.BaseProcess.start = skipped_start  # type: ignore[method-assign, assignment]
