"""A hang names its rank: rank 1 of 2 real processes freezes itself (SIGSTOP) in one phase of step 3;
the survivor's error names that rank, its host and its phase when the process group times out, and
`python -m mlm_ddp.distributed --diagnose` says the same afterwards from the heartbeat files alone.
Plus the heartbeat's own properties: a rank that never beat, stale ranks, a finished run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mlm_ddp import heartbeat
from tests.conftest import REPO, run_module, tiny_args
from tests.test_topology import free_port

PHASES = ["data", "forward/backward", "optimizer", "eval", "checkpoint"]
TIMEOUT_S = 10  # --ddp_timeout and --save_timeout: longer than the heartbeat's frozen test (3 x 2 s)


def start_rank(rank: int, port: int, out: Path, phase: str, args: list[str]) -> subprocess.Popen:
    """One of two processes started the way torchrun starts them, but by the test, so that the test
    (not a launcher's grace period) kills the frozen one."""
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    log = open(out.parent / f"rank{rank}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", "tests.fault_driver", "--freeze", f"1:3:{phase}", *args],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def frozen_runs(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Phase -> the output folder of a 2-process run whose rank 1 froze there in step 3; all phases at
    once (they mostly wait)."""
    runs, procs = {}, {}
    for phase in PHASES:
        out = tmp_path_factory.mktemp(phase.replace("/", "-")) / "run"
        args = tiny_args(tiny_model, corpus, out, "--max_train_steps", "6", "--eval_steps", "3",
                         "--checkpointing_steps", "3", "--max_eval_samples", "16", "--ddp_timeout", str(TIMEOUT_S),
                         "--save_timeout", str(TIMEOUT_S), "--cpu_threads", "1")
        port = free_port()
        runs[phase], procs[phase] = out, [start_rank(rank, port, out, phase, args) for rank in (0, 1)]
    for phase, (survivor, frozen) in procs.items():
        try:
            assert survivor.wait(timeout=300) == 1, (runs[phase].parent / "rank0.log").read_text()[-3000:]
        finally:
            frozen.kill()  # SIGKILL ends a stopped process too
            frozen.wait()
    return runs


@pytest.mark.parametrize("phase", PHASES)
def test_the_survivor_and_diagnose_name_the_frozen_rank_its_host_and_phase(phase: str,
                                                                          frozen_runs: dict[str, Path]) -> None:
    out = frozen_runs[phase]
    expected = f"rank 1 on {socket.gethostname()} (pid "
    where = f") stopped in the {phase} phase of step 3"
    survivor = (out.parent / "rank0.log").read_text()
    hang = [line for line in survivor.splitlines() if line.startswith("mlm_ddp.train: error: hang: ")]
    assert len(hang) == 1, survivor[-3000:]
    assert expected in hang[0] and where in hang[0] and "its process stopped running" in hang[0], hang[0]
    # named by mlm_ddp's watchdog, on no exception of the backend's: NCCL's watchdog would abort the process
    # (SIGABRT) without one; gloo's comes at TIMEOUT_S, after this. The run folder keeps the record.
    assert "named by mlm_ddp's watchdog before the backend's own timeout" in survivor, survivor[-3000:]
    record = json.loads((out / "heartbeat" / "hang-rank-00000.json").read_text())
    assert record["hang"] == hang[0].removeprefix("mlm_ddp.train: error: hang: ")
    assert record["waited_s"] < TIMEOUT_S and record["timeout_s"] == TIMEOUT_S
    after = run_module(["mlm_ddp.distributed", "--diagnose", str(out)], timeout=60)
    assert after.returncode == 0, after.stderr
    assert expected in after.stdout and where in after.stdout and after.stdout.count("\n") == 1, after.stdout


def test_the_watchdog_names_a_stopped_peer_but_not_ranks_that_are_all_slow(tmp_path: Path) -> None:
    beats = [heartbeat.Heartbeat(tmp_path, rank, 2) for rank in range(2)]
    for beat in beats:
        beat.beat(4, "forward/backward")
    mine = beats[0].last
    assert heartbeat.stalled_peer(tmp_path, mine) is None  # both as far and alive: slow, not stuck
    beats[0].beat(4, "optimizer")  # rank 1 never got there: behind
    assert heartbeat.stalled_peer(tmp_path, beats[0].last).startswith("rank 1 on ")
    later = heartbeat.Beat(**{**vars(beats[1].last), "rank": 1, "alive": beats[1].last.alive + 60})
    assert heartbeat.stalled_peer(tmp_path, later) is not None  # rank 0 has not been alive for 60 s: frozen
    watch = heartbeat.Watch(lambda phase: 120.0 if phase == "checkpoint" else 10.0, lambda *_: None)
    assert watch.deadline_s("data") == 7.0 and watch.deadline_s("checkpoint") == 114.0
    for beat in beats:
        beat.stop()


def test_diagnose_without_heartbeats_says_so(tmp_path: Path) -> None:
    proc = run_module(["mlm_ddp.distributed", "--diagnose", str(tmp_path)], timeout=60)
    assert proc.returncode == 2 and "holds no heartbeat files" in proc.stderr


def test_a_rank_that_never_beat_is_named_and_stale_ranks_are_dropped(tmp_path: Path) -> None:
    beats = [heartbeat.Heartbeat(tmp_path, rank, 4) for rank in (0, 1, 3)]
    line = heartbeat.diagnose(tmp_path)
    assert line.startswith("rank 2 never wrote its heartbeat (1 of 4 missing)"), line
    for beat in beats:
        beat.close()
    assert heartbeat.diagnose(tmp_path) == "rank 2 never wrote its heartbeat (1 of 4 missing): it did not reach " \
                                           "training; its log says why"
    # the same folder resumed by 2 processes: rank 0 removes the files of ranks 2 and 3
    again = [heartbeat.Heartbeat(tmp_path, rank, 2) for rank in (0, 1)]
    assert sorted(p.name for p in (tmp_path / "heartbeat").iterdir()) == ["rank-00000.json", "rank-00001.json"]
    for beat in again:
        beat.close()
    assert heartbeat.diagnose(tmp_path) == "all 2 ranks finished (no rank is stopped)"


def test_the_rank_with_the_fewest_beats_is_named_when_all_are_alive(tmp_path: Path) -> None:
    beats = [heartbeat.Heartbeat(tmp_path, rank, 3) for rank in range(3)]
    for beat in beats:
        beat.beat(7, "data")
    for beat in (beats[0], beats[2]):
        beat.beat(7, "data", "the all-reduce of the step's masked tokens and stop votes")
    line = heartbeat.diagnose(tmp_path)
    assert line.startswith(f"rank 1 on {socket.gethostname()} (pid {os.getpid()}) stopped in the data phase of "
                           "step 7, "), line
    assert "the others got as far as the data phase of step 7 (in the all-reduce" in line
    assert "still running, stuck there" in line
    record = json.loads((tmp_path / "heartbeat" / "rank-00001.json").read_text())
    assert (record["step"], record["phase"], record["seq"]) == (7, "data", 1)
    for beat in beats:
        beat.stop()
