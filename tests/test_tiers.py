"""The fast tier (tests/tiers.py): `--fast` skips a test at the first process it would start, whether through
subprocess or multiprocessing, in the test or in its fixture, and runs every test that stays in process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import REPO

SUITE = """
import multiprocessing
import subprocess

import pytest


@pytest.fixture
def started():
    subprocess.run(["true"])


def test_spawns():
    subprocess.run(["true"])
    raise AssertionError("ran past the process it started")


def test_forks():
    child = multiprocessing.get_context("fork").Process(target=print)
    child.start()
    raise AssertionError("ran past the child it started")


def test_reads_a_fixture_that_spawns(started):
    raise AssertionError("ran with a fixture that started a process")


def test_stays():
    assert sum(range(4)) == 6
"""


def run(suite: Path, *flags: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", *flags, str(suite)],
                          cwd=suite, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, capture_output=True,
                          text=True, timeout=120)
    return proc.stdout


def test_fast_skips_a_test_at_the_first_process_it_would_start_and_runs_the_rest(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text("from tests.tiers import pytest_addoption, pytest_configure  # noqa: F401\n")
    (suite / "test_a.py").write_text(textwrap.dedent(SUITE))
    fast = run(suite, "--fast")
    assert "1 passed, 3 skipped" in fast and "starts a process (--fast" in fast, fast[-3000:]
    # without --fast the same tests start their processes (and fail here, by design of the synthetic suite)
    whole = run(suite)
    assert "3 failed, 1 passed" in whole, whole[-3000:]
