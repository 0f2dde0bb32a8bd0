"""A hang names its rank, and a healthy job is never called hung.

End to end, on 2 real processes over gloo:
- rank 1 freezes itself (SIGSTOP) in one phase of step 3, or sticks there alive: the survivor's watchdog
  names that rank, its host and its phase before the process group times out, and
  `python -m mlm_ddp.distributed --diagnose` says the same afterwards;
- in one run, rank 1 joins 10 s after rank 0, runs under libfaketime a minute ahead of it, every
  evaluation lasts longer than --ddp_timeout, and rank 1 finishes long before rank 0's final phase does:
  the run ends with exit 0 and no hang record (the last three each fired the file-based watchdog this one
  replaced).
The watchdog's own judgement on a real TCPStore with simulated time: frozen, behind, finished, never
started, all slow, a long phase without a collective, a store that shows records late, a store and a
file that fail; and its cost per rank at 8 and 64 ranks.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import DistNetworkError, TCPStore

from mlm_ddp import distributed
from mlm_ddp.cluster import heartbeat, watchdog
from mlm_ddp.cluster.heartbeat import ALIVE_EVERY_S, Beat
from mlm_ddp.cluster.watchdog import Watchdog
from tests.conftest import REPO, free_port, run_module, tiny_args, wait_for

PHASES = ["data", "forward/backward", "optimizer", "eval", "checkpoint"]
# --ddp_timeout and --save_timeout of the frozen runs: the watchdog names a frozen rank once its tick has
# not moved for FROZEN_AFTER_S, or at once where its pid is on this host (stopped), and a frozen rank here stops
# 3 s into its phase (fault_driver)
TIMEOUT_S = 20


def start_rank(rank: int, port: int, out: Path, args: list[str], wrap: list[str] | None = None) -> subprocess.Popen:
    """One of two processes started the way torchrun starts them, but by the test, so that the test
    (not a launcher's grace period) kills the frozen one."""
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "FAKETIME_DONT_FAKE_MONOTONIC": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    log = open(out.parent / f"rank{rank}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([*(wrap or []), sys.executable, "-m", "tests.fault_driver", *args],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def frozen_runs(late_and_skewed_started: dict, tiny_model: Path, corpus: dict,
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Phase -> the output folder of a 2-process run whose rank 1 froze there in step 3 ("stuck": stayed
    alive in the data phase); all at once (they mostly wait), and beside the late and skewed run, which
    starts first (its fixture is asked for only so that it does)."""
    runs, procs = {}, {}
    for phase in [*PHASES, "stuck"]:
        out = tmp_path_factory.mktemp(phase.replace("/", "-")) / "run"
        fault = ["--stick", "1:3:data"] if phase == "stuck" else ["--freeze", f"1:3:{phase}"]
        args = tiny_args(tiny_model, corpus, out, "--max_train_steps", "6", "--eval_steps", "3",
                         "--checkpointing_steps", "3", "--max_eval_samples", "16", "--ddp_timeout", str(TIMEOUT_S),
                         "--save_timeout", str(TIMEOUT_S), "--cpu_threads", "1")
        port = free_port()
        runs[phase], procs[phase] = out, [start_rank(rank, port, out, [*fault, *args]) for rank in (0, 1)]
    for phase, (survivor, frozen) in procs.items():
        try:
            assert survivor.wait(timeout=300) == 1, (runs[phase].parent / "rank0.log").read_text()[-3000:]
        finally:
            frozen.kill()  # SIGKILL ends a stopped process too
            frozen.wait()
    return runs


@pytest.mark.parametrize("phase", [*PHASES, "stuck"])
def test_the_survivor_and_diagnose_name_the_stopped_rank_its_host_and_phase(
        phase: str, frozen_runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    out = frozen_runs[phase]
    expected = f"rank 1 on {socket.gethostname()} (pid "
    where = f") stopped in the {'data' if phase == 'stuck' else phase} phase of step 3"
    survivor = (out.parent / "rank0.log").read_text()
    hang = [line for line in survivor.splitlines() if line.startswith("mlm_ddp.train: error: hang: ")]
    assert len(hang) == 1, survivor[-3000:]
    assert expected in hang[0] and where in hang[0], hang[0]
    record = json.loads((out / "heartbeat" / "hang-rank-00000.json").read_text())
    if phase == "stuck":
        # alive and behind: warned about before the timeout, never ended by us; gloo's timeout ends it, and
        # the closing error names the rank from the warning's record
        warned = survivor.split("mlm_ddp.train: warning: rank 0 has waited ")[1:]  # the progress bar runs into it
        assert warned and "its process is alive, still there" in warned[0].splitlines()[0], survivor[-3000:]
        assert record["warning"] and "(warned about by rank 0's watchdog as it waited)" in hang[0]
    else:
        # named by mlm_ddp's watchdog, on no exception of the backend's: NCCL's watchdog would abort the process
        # (SIGABRT) without one; gloo's comes at TIMEOUT_S, after this. The run folder keeps the record.
        assert "its process is stopped (SIGSTOP" in hang[0], hang[0]
        assert "named by mlm_ddp's watchdog before the backend's own timeout" in survivor, survivor[-3000:]
        assert record["hang"] == hang[0].removeprefix("mlm_ddp.train: error: hang: ")
        assert record["waited_s"] < TIMEOUT_S and record["timeout_s"] == TIMEOUT_S
        # the survivor dumped torch's Flight Recorder (gloo writes none of its own)
        assert (out / "flight_recorder" / "rank_0").stat().st_size > 0
    # the command's own main, in this process (test_diagnose_without_heartbeats_says_so starts the command)
    capsys.readouterr()
    code = distributed.main(["--diagnose", str(out)])
    after = capsys.readouterr()
    assert code == 0, after.err
    assert expected in after.out and where in after.out and after.out.count("\n") == 1, after.out


def find_faketime() -> str | None:
    """Debian's faketime (libfaketime), installed where it is missing and we may; None where it cannot be."""
    if shutil.which("faketime") is None and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-qq", "faketime"], env={**os.environ,
                       "DEBIAN_FRONTEND": "noninteractive"}, capture_output=True, timeout=600)
        if shutil.which("faketime") is None:
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=600)
            subprocess.run(["apt-get", "install", "-y", "-qq", "faketime"], env={**os.environ,
                           "DEBIAN_FRONTEND": "noninteractive"}, capture_output=True, timeout=600)
    return shutil.which("faketime")


NO_FAKETIME = "faketime (Debian's package faketime) is not installed and installing it needs root"


@pytest.fixture(scope="module")
def late_and_skewed_started(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory
                            ) -> Iterator[dict]:
    """One healthy 2-process run that meets four things a cluster does, each longer than --ddp_timeout (5 s)
    or --save_timeout (5 s): rank 1 reaches the join 10 s after rank 0 (it sleeps before its preflight, as a
    node that imports from a slow shared filesystem or converts a large raw corpus to Arrow before it
    joins); every evaluation (before training, at steps 2 and 4) lasts 7 s without a collective until its
    reduce; rank 1's wall clock is 60 s ahead of rank 0's (libfaketime; its monotonic clock is left alone,
    as a host's own: libfaketime 0.9.10's faked one stalls timed waits of threads); rank 0 spends 9 s in its
    final phase after rank 1 finished. Without faketime the run keeps the rest, and the clock's test skips.
    Beside it, at the same time (all three mostly wait): one rank of a 2-process job whose peer never comes.
    Started here, waited for by late_and_skewed, so that the frozen runs wait at the same time."""
    found = find_faketime()
    out = tmp_path_factory.mktemp("late_and_skewed") / "run"
    args = tiny_args(tiny_model, corpus, out, "--max_train_steps", "4", "--eval_steps", "2", "--max_eval_samples",
                     "16", "--ddp_timeout", "5", "--save_timeout", "5", "--cpu_threads", "1", "--report", "false")
    port = free_port()
    faults = ["--slow_preflight", "1:10", "--slow_eval_s", "7"]
    ranks = [start_rank(0, port, out, [*faults, "--slow_final_s", "0:9", *args]),
             start_rank(1, port, out, [*faults, *args], wrap=[found, "-f", "+60s"] if found else [])]
    alone = tmp_path_factory.mktemp("alone") / "run"
    lonely = start_rank(0, free_port(), alone, [*tiny_args(tiny_model, corpus, alone, "--ddp_timeout", "2",
                                                           "--rendezvous_timeout", "3")])
    try:
        yield {"out": out, "ranks": ranks, "skewed": found is not None, "alone": alone, "lonely": lonely}
    finally:
        for proc in [*ranks, lonely]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def late_and_skewed(late_and_skewed_started: dict) -> dict:
    started = late_and_skewed_started
    out, ranks, alone = started["out"], started["ranks"], started["alone"]
    try:  # a rank that fails leaves its peer waiting in the join for --rendezvous_timeout: stop it then
        wait_for(lambda: all(proc.poll() is not None for proc in ranks) or any(proc.poll() for proc in ranks), 300,
                 "the late and skewed run")
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
    codes = [proc.wait() for proc in ranks]
    logs = [(out.parent / f"rank{rank}.log").read_text() for rank in (0, 1)]
    return {"out": out, "codes": codes, "logs": logs, "skewed": started["skewed"],
            "alone": {"code": started["lonely"].wait(timeout=120), "log": (alone.parent / "rank0.log").read_text()}}


def test_a_rank_that_joins_later_than_ddp_timeout_is_waited_for(late_and_skewed: dict) -> None:
    """The late rank of the shared run: it trains, since the start waits --rendezvous_timeout; a rank that
    never comes is named with that flag once it has passed."""
    out = late_and_skewed["out"]
    assert late_and_skewed["codes"] == [0, 0], "\n".join(log[-2000:] for log in late_and_skewed["logs"])
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    alone = late_and_skewed["alone"]
    assert alone["code"] == 1, alone["log"][-2000:]
    assert "not every process joined within 3 s (--rendezvous_timeout" in alone["log"], alone["log"][-2000:]


def test_clocks_a_minute_apart_long_evaluations_and_a_finished_peer_raise_no_alarm(late_and_skewed: dict) -> None:
    """The shared run is healthy: exit 0 on both, and no hang record. Its rank 1 slept its 10 s before the
    preflight through the time module under libfaketime, as a library does (datasets' file lock sleeps when the
    other rank holds the cache's lock): libfaketime 0.9.10 with its monotonic clock left alone fails every
    time.sleep (EINVAL), and tests/fault_driver makes the faked rank's time.sleep a timed wait; without it rank 1
    ends with exit 1 there."""
    if not late_and_skewed["skewed"]:
        pytest.skip(NO_FAKETIME)
    out, logs = late_and_skewed["out"], late_and_skewed["logs"]
    assert late_and_skewed["codes"] == [0, 0], "\n".join(log[-2000:] for log in logs)
    assert not list((out / "heartbeat").glob("hang-rank-*.json")) and "hang:" not in "".join(logs)
    # rank 1 did run a minute ahead, and the run was as long as the injected waits make it
    beats = {rank: json.loads((out / "heartbeat" / f"rank-0000{rank}.json").read_text()) for rank in (0, 1)}
    assert beats[1]["at"] - beats[0]["at"] > 30, beats
    assert {b["phase"] for b in beats.values()} == {"done"}


# ---------------------------------------------------------------------------------------------
# the watchdog's judgement, on a real TCPStore, with time simulated
# ---------------------------------------------------------------------------------------------


class Peers:
    """`world` ranks' watchdogs on one real TCPStore; `run` ticks them all every ALIVE_EVERY_S from `now`,
    each with the beat its function gives (None: that rank is frozen, it does not tick). Pids are made up,
    so none is looked up (space "")."""

    def __init__(self, world: int, timeout_s: float = 60.0, store: object = None, scope: str = "mlm_ddp/0-a/",
                 server: TCPStore | None = None) -> None:
        self.server = server or TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.named: list[tuple[int, str]] = []
        self.named_at: list[float] = []
        self.warned: list[tuple[int, str | None]] = []
        self.dogs = [Watchdog(store(self.server) if store else self.server, rank, world, lambda _p: timeout_s,
                              self.on_stall(rank), scope, functools.partial(self.on_warn, rank), space="")
                     for rank in range(world)]
        self.now = 0.0

    def on_stall(self, rank: int):
        def named(line: str, *_: float) -> None:
            self.named.append((rank, line))
            self.named_at.append(self.now)
        return named

    def on_warn(self, rank: int, line: str | None) -> None:
        self.warned.append((rank, line))

    def run(self, seconds: float, beats: dict, entered: float = 0.0) -> None:
        end = self.now + seconds
        while self.now < end:
            self.now += ALIVE_EVERY_S
            for rank, beat in beats.items():
                made = beat(self.now) if callable(beat) else beat
                if made is not None:
                    self.dogs[rank].tick(made, entered, now=self.now)


def beat(rank: int, seq: int, phase: str = "data", collective: str | None = "the step's all-reduce",
         step: int = 5, at: float = 0.0, pid: int | None = None) -> Beat:
    return Beat(rank, 3, "node", 100 + rank if pid is None else pid, step, phase, collective, at, seq, at)


def test_a_frozen_peer_is_named_before_the_timeout_and_one_alive_behind_only_warned_about() -> None:
    peers = Peers(3)
    peers.run(10, {r: beat(r, 40, "forward/backward", None) for r in range(3)})  # all in a step: healthy
    assert peers.named == []
    # rank 2 freezes in forward/backward; ranks 0 and 1 go on to the next step's all-reduce and wait there
    start = peers.now
    peers.run(60, {0: beat(0, 42), 1: beat(1, 42)}, entered=start)
    assert len({rank for rank, _ in peers.named}) >= 1, "nobody named the frozen rank"
    rank, line = peers.named[0]
    assert line.startswith("rank 2 on node (pid 102) stopped in the forward/backward phase of step 5; the others got "
                           "as far as the data phase of step 5 (in the step's all-reduce); no sign of life for "), line
    assert peers.named_at[0] - start <= 60 - 2 * ALIVE_EVERY_S  # before the timeout, with its margin
    # the first to arrive named it; the other waiting rank learns whom from the arrival count, and ends too
    assert {r for r, _ in peers.named} == {0, 1}
    other = [line for r, line in peers.named if line != peers.named[0][1]]
    assert other and other[0].startswith("rank 2 stopped this rank's wait in the data phase of step 5 (in the step's "
                                         "all-reduce); named by the first rank to arrive"), other
    # alive but behind (its tick moves, its beats do not): a warning, never an exit; the backend times out
    peers = Peers(2)
    peers.run(60, {0: beat(0, 42), 1: beat(1, 41, "data", None)})
    assert peers.named == [] and peers.warned[0][0] == 0
    assert "rank 1 on node (pid 101) stopped in the data phase of step 5; the others got as far as the data phase of " \
           "step 5 (in the step's all-reduce); its process is alive, still there" in peers.warned[0][1]


def test_a_peer_one_step_behind_that_arrives_inside_the_margin_is_never_named() -> None:
    """Finding 3: rank 1 is alive and one beat behind until after rank 0's deadline, then arrives; the
    collective completes before its timeout. The old watchdog ended the job at the deadline."""
    peers = Peers(2, timeout_s=60.0)
    deadline = peers.dogs[0].deadline_s(60.0)
    peers.run(deadline + ALIVE_EVERY_S, {0: beat(0, 42), 1: beat(1, 41, "data", None)})
    peers.run(10, {0: beat(0, 43, "forward/backward", None), 1: beat(1, 43, "forward/backward", None)},
              entered=peers.now)
    assert peers.named == []
    assert [line is None for _, line in peers.warned] == [False, True]  # the warning is taken back


def test_a_peer_silent_for_less_than_the_frozen_time_is_not_called_stopped() -> None:
    """A 20 s timeout leaves 14 s between the two looks, less than FROZEN_AFTER_S: a peer on another host
    that stopped publishing is warned about as silent for that long, neither named nor called alive."""
    peers = Peers(2, timeout_s=20.0)
    peers.run(4, {1: beat(1, 41, "data", None)})
    peers.run(20, {0: beat(0, 42)}, entered=peers.now)
    assert peers.named == [] and "too short to call it stopped" in peers.warned[0][1], peers.warned


def test_no_alarm_in_a_long_phase_without_a_collective_among_slow_peers_or_for_a_finished_one() -> None:
    # an evaluation twice as long as the timeout (no collective until its reduce), one rank frozen: not
    # this rank's wait, so nothing is even read
    peers = Peers(2)
    peers.run(120, {0: beat(0, 42, "eval", None)})
    assert peers.named == peers.warned == [] and peers.dogs[0].reads == 0
    # every rank in the same collective and alive past its timeout: slow (the backend will say), not stuck;
    # all arrived, so no record is read at all
    peers = Peers(3)
    peers.run(120, {r: beat(r, 42) for r in range(3)})
    assert peers.named == peers.warned == [] and sum(d.reads for d in peers.dogs) == 0
    # every rank in a forward/backward longer than the timeout, alive: read, and nobody is suspect
    peers = Peers(3)
    peers.run(120, {r: beat(r, 42, "forward/backward", None) for r in range(3)})
    assert peers.named == peers.warned == [] and sum(d.reads for d in peers.dogs) > 0
    # rank 1 finished long ago; rank 0's final save outlasts the (save) timeout
    peers = Peers(2)
    peers.run(4, {1: beat(1, 50, "done", None)})
    peers.run(120, {0: beat(0, 49, "final save", None)})
    assert peers.named == peers.warned == []


def test_a_rank_that_never_published_in_this_attempt_is_warned_about_not_read_from_the_last_one() -> None:
    """Finding 1: attempt 0's records stay in torchrun's store. Rank 2 published there, then the job
    restarted; in attempt 1 it has not published yet: it is missing, not an old record of a dead pid."""
    before = Peers(3, scope="mlm_ddp/0-a/")
    before.run(4, {r: beat(r, 90, "forward/backward", None) for r in range(3)})
    peers = Peers(3, scope="mlm_ddp/1-b/", server=before.server)
    peers.run(60, {0: beat(0, 42), 1: beat(1, 42)})
    assert peers.named == [] and peers.warned[0][1].split(": ", 1)[1].startswith(
        "rank 2 never published its heartbeat in this attempt (1 of 3 missing)")


def test_a_store_that_shows_records_late_raises_no_alarm_on_healthy_waits() -> None:
    """Peers that arrive late at a collective (an uneven evaluation), their records seen 30 s late: the
    wait ends before the deadline, so nothing is named; a finished peer seen late is not frozen either."""
    clock, shared = [0.0], []

    def late(server: TCPStore) -> LateStore:  # one for all ranks, as a shared folder is
        shared[:] = shared or [LateStore(server, 30.0, clock)]
        return shared[0]

    peers = Peers(2, store=late)

    def at(rank: int, seq: int, phase: str, collective: str | None = None):
        def made(now: float) -> Beat:
            clock[0] = now
            return beat(rank, seq, phase, collective)
        return made

    peers.run(40, {0: at(0, 10, "eval", None), 1: at(1, 10, "eval", None)})
    start = peers.now  # rank 0 reaches evaluation's reduce; rank 1 takes 50 s more (60 s timeout)
    peers.run(50, {0: at(0, 11, "eval", "the evaluation's all-reduce"), 1: at(1, 10, "eval", None)}, entered=start)
    peers.run(20, {0: at(0, 12, "log", None), 1: at(1, 12, "log", None)})
    start = peers.now  # rank 1 finishes; rank 0 spends twice the timeout in its final save
    peers.run(4, {1: at(1, 13, "done")})
    peers.run(120, {0: at(0, 13, "final save")}, entered=start)
    assert peers.named == [] and peers.dogs[0].reads > 0


class LateStore:
    """A store that shows every record `lag_s` seconds (simulated) after it was set: what a shared folder
    does to files. Counters are the store's own."""

    def __init__(self, store: TCPStore, lag_s: float, clock: list[float]) -> None:
        self.store, self.lag_s, self.clock, self.history = store, lag_s, clock, {}

    def set(self, key: str, value: str) -> None:
        self.history.setdefault(key, []).append((self.clock[0], value))
        self.store.set(key, value)

    def visible(self, key: str) -> str | None:
        shown = [v for at, v in self.history.get(key, []) if at <= self.clock[0] - self.lag_s]
        return shown[-1] if shown else None

    def check(self, keys: list[str]) -> bool:
        return all(self.visible(k) is not None for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.visible(k).encode() for k in keys]

    def add(self, key: str, value: int) -> int:
        return self.store.add(key, value)


def test_a_peer_that_exited_is_named_as_exited_and_one_stopped_as_stopped() -> None:
    """Finding: a SIGKILLed rank on this host was said to be "still running, stuck there". Its pid is
    looked up where the record says it shares this pid space: gone (or a zombie) is "exited"."""
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead.kill()
        dead.wait()
        os.kill(stopped.pid, signal.SIGSTOP)
        for pid, how in ((dead.pid, "its process has exited"), (stopped.pid, "its process is stopped (SIGSTOP")):
            server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            named: list[str] = []
            dogs = [Watchdog(server, r, 2, lambda _p: 20.0, lambda line, *_, named=named: named.append(line),
                             "mlm_ddp/x/", lambda _line: None) for r in range(2)]
            dogs[1].tick(beat(1, 41, "data", None, pid=pid), 0.0, now=0.0)  # its last record, then it died
            clock = 0.0
            while not named and clock < 20:
                clock += ALIVE_EVERY_S
                dogs[0].tick(beat(0, 42, pid=os.getpid()), 0.0, now=clock)
            assert named and f"rank 1 on node (pid {pid}) stopped in the data phase" in named[0] and how in named[0]
            assert clock < 20
    finally:
        stopped.kill()
        stopped.wait()


def test_a_store_whose_host_is_stopped_is_named_within_the_deadline_of_one_call() -> None:
    """Finding 2: with the store's host stopped (SIGSTOP; under srun rank 0's own process hosts it), a
    TCPStore's reads blocked for minutes, and the waiting rank's watchdog with them. Every call now has
    a deadline; past this rank's own deadline the silent store is named."""
    port = free_port()
    host = subprocess.Popen([sys.executable, "-c", "import sys, time; from torch.distributed import TCPStore; "
                             f"s = TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False); "
                             "print('up', flush=True); time.sleep(300)"], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout.readline().strip() == "up"
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        named: list[str] = []
        dog = Watchdog(client, 1, 2, lambda _p: 20.0, lambda line, *_: named.append(line), "mlm_ddp/x/",
                       lambda _line: None, store_at=f"127.0.0.1:{port}", deadline_s=2.0)
        dog.tick(beat(1, 42), 0.0, now=1.0)  # answered
        os.kill(host.pid, signal.SIGSTOP)
        started, silent = time.monotonic(), 0
        while not named and time.monotonic() - started < 30:
            try:
                dog.tick(beat(1, 42), 0.0, now=dog.deadline_s(20.0) + 1)
            except watchdog.StoreSilent:
                silent += 1
        assert named and named[0].startswith(f"the process group's store at 127.0.0.1:{port} has not answered for "), \
            named
        assert "rank 0 under srun and Submitit" in named[0] and silent >= 1
        assert time.monotonic() - started < 3 * 2.0 + 5  # a few deadlines of one call, not the store's 60 s
    finally:
        host.kill()
        host.wait()


class Broken:
    def set(self, key: str, value: str) -> None:
        raise DistNetworkError("Connection reset by peer")

    add = check = multi_get = get = set


# the alive thread's period in the tests of the thread itself (no watchdog bound is judged there), and how long
# its ticks may take to come: a tick that needs what a stuck write holds never comes
TICK_S = 0.05
TICKS_WITHIN_S = 30


class Buggy(Broken):
    def set(self, key: str, value: str) -> None:
        raise TypeError("a bug of ours")


def test_the_alive_thread_survives_a_file_and_a_store_that_fail_and_says_which_once(tmp_path: Path, capfd) -> None:
    (tmp_path / "heartbeat").mkdir()
    (tmp_path / "heartbeat" / "rank-00000.json").symlink_to("/dev/full")  # every write: ENOSPC
    dog = Watchdog(Broken(), 0, 2, lambda _p: 60.0, lambda *_: None)
    heart = heartbeat.Heartbeat(tmp_path, 0, 2, watch=dog, every_s=TICK_S)
    heart.beat(1, "data", "the step's all-reduce")
    wait_for(lambda: dog.ticks >= 3, TICKS_WITHIN_S, "3 ticks")  # it goes on ticking through both failures
    assert heart._thread.is_alive()
    heart.close()
    err = capfd.readouterr().err
    assert err.count("cannot write the heartbeat file") == 1 and err.count("cannot reach the process group's") == 1
    # a bug is not a store that cannot be reached (finding 6)
    heart = heartbeat.Heartbeat(tmp_path / "b", 0, 2, watch=Watchdog(Buggy(), 0, 2, lambda _p: 60.0, lambda *_: None))
    heart.close()
    err = capfd.readouterr().err
    assert "the hang watchdog failed (TypeError: a bug of ours)" in err and "cannot reach" not in err


def test_publications_go_on_while_a_heartbeat_write_is_stuck_and_done_is_never_overwritten(tmp_path: Path) -> None:
    """Finding 3: a heartbeat-file write stuck on a network filesystem held the lock the alive thread
    needed to publish, and the rank looked frozen; close() raced the alive thread, whose older record
    could replace "done"."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dog = Watchdog(server, 0, 2, lambda _p: 60.0, lambda *_: None, "mlm_ddp/x/")
    heart = heartbeat.Heartbeat(tmp_path, 0, 2, watch=dog, every_s=TICK_S)
    heart.beat(1, "data")
    with heart._lock:  # what a pwrite stuck on NFS does to the main thread's beat
        ticks = dog.ticks
        wait_for(lambda: dog.ticks >= ticks + 2, TICKS_WITHIN_S, "2 ticks with the heartbeat's lock held")
    write, stuck = heart._write, threading.Event()
    heart._write = lambda: stuck.wait(60)  # every write of the file hangs, whichever thread makes it
    ticks = dog.ticks
    wait_for(lambda: dog.ticks >= ticks + 2, TICKS_WITHIN_S, "2 ticks with every file write stuck")
    stuck.set()
    heart._write = write
    older = heart.current[0]
    heart.close()
    dog.publish(older)  # the alive thread's record of before, arriving late
    assert json.loads(server.get("mlm_ddp/x/rank/0"))["phase"] == "done"


def test_a_collective_that_returned_is_no_longer_waited_in(tmp_path: Path) -> None:
    """Finding 6: `collective` stayed set after the collective returned, so the rest of the phase counted
    as a wait."""
    heart = heartbeat.Heartbeat(tmp_path, 0, 2)
    heart.beat(3, "data")
    seq = heart.last.seq
    with heart.collective("the all-reduce of the stream's ran-out flags"):
        assert heart.current[0].collective == "the all-reduce of the stream's ran-out flags"
    assert heart.current[0].collective is None and heart.current[0].seq == seq + 1
    dog = Watchdog(Broken(), 0, 2, lambda _p: 60.0, lambda *_: None)
    assert dog.waiting_timeout(heart.current[0]) is None
    heart.stop()


def test_each_phase_is_judged_at_the_timeout_of_the_group_it_waits_on() -> None:
    """Finding 5: the checkpoint's token all-reduce runs on the training group (--ddp_timeout) but was
    judged at --save_timeout; the probe phase, where the others wait on rank 0, was not watched."""
    timeouts = {"checkpoint": 1800.0, "final save": 1800.0, "probe": 1800.0}
    dog = Watchdog(Broken(), 0, 2, lambda phase: timeouts.get(phase, 120.0), lambda *_: None)
    assert dog.waiting_timeout(beat(0, 5, "checkpoint", "the all-reduce of the tokens seen")) == 120.0
    assert dog.waiting_timeout(beat(0, 5, "checkpoint", None)) == 1800.0
    assert dog.waiting_timeout(beat(0, 5, "probe", None)) == 1800.0
    assert dog.waiting_timeout(beat(0, 5, "log", None)) is None


def test_the_store_work_per_rank_and_tick_is_the_same_at_8_and_64_ranks() -> None:
    """Finding 4: every waiting rank read every record each tick (N² at the store). Now each rank's
    requests per tick do not depend on the world size, and two reads of every record name a hang."""
    from mlm_ddp.cluster.watchdog_cost import measure

    small, large = measure(8, 30.0), measure(64, 30.0)
    assert small["named"] and large["named"]
    for phase in ("healthy", "hang"):
        per_rank = [row[f"{phase}_requests_per_tick"] / row["ranks"] for row in (small, large)]
        assert abs(per_rank[0] - per_rank[1]) <= 0.5, (phase, per_rank)  # the observer's one extra request
    assert small["reads_of_every_record"] == large["reads_of_every_record"] == 2


# ---------------------------------------------------------------------------------------------
# the files, for --diagnose afterwards
# ---------------------------------------------------------------------------------------------


def test_diagnose_without_heartbeats_says_so(tmp_path: Path) -> None:
    proc = run_module(["mlm_ddp.distributed", "--diagnose", str(tmp_path)], timeout=60)
    assert proc.returncode == 2 and "holds no heartbeat files" in proc.stderr


def test_a_rank_that_never_beat_is_named_and_stale_ranks_are_dropped(tmp_path: Path) -> None:
    beats = [heartbeat.Heartbeat(tmp_path, rank, 4) for rank in (0, 1, 3)]
    line = heartbeat.diagnose(tmp_path)
    assert line.startswith("rank 2 never wrote its heartbeat here (1 of 4 missing)"), line
    for beat_ in beats:
        beat_.close()
    assert "did not reach training (its log says why), or its node keeps --output_dir on a disk of its own" in \
        heartbeat.diagnose(tmp_path)
    # the same folder resumed by 2 processes: rank 0 removes the files of ranks 2 and 3
    again = [heartbeat.Heartbeat(tmp_path, rank, 2) for rank in (0, 1)]
    assert sorted(p.name for p in (tmp_path / "heartbeat").iterdir()) == ["rank-00000.json", "rank-00001.json"]
    for beat_ in again:
        beat_.close()
    assert heartbeat.diagnose(tmp_path) == "all 2 ranks finished (no rank is stopped)"


def test_the_rank_with_the_fewest_beats_is_named_when_all_are_alive(tmp_path: Path) -> None:
    beats = [heartbeat.Heartbeat(tmp_path, rank, 3) for rank in range(3)]
    for beat_ in beats:
        beat_.beat(7, "data")
    for beat_ in (beats[0], beats[2]):
        beat_.beat(7, "data", "the all-reduce of the step's masked tokens and stop votes")
    line = heartbeat.diagnose(tmp_path)
    # from the counts of beats alone (finding 6: no two hosts' clocks compared)
    assert line == (f"rank 1 on {socket.gethostname()} (pid {os.getpid()}) stopped in the data phase of step 7; "
                    "the others got as far as the data phase of step 7 (in the all-reduce of the step's masked "
                    "tokens and stop votes)"), line
    record = json.loads((tmp_path / "heartbeat" / "rank-00001.json").read_text())
    assert (record["step"], record["phase"], record["seq"]) == (7, "data", 1)
    beats[1].beat(7, "data", "the all-reduce of the step's masked tokens and stop votes")  # it arrives
    for beat_ in beats:
        beat_.beat(8, "forward/backward")
    assert heartbeat.diagnose(tmp_path).startswith("all 3 unfinished ranks stopped at the same point, the "
                                                   "forward/backward phase of step 8: no rank is behind")
    for beat_ in beats:
        beat_.stop()


def test_the_hang_line_is_said_before_its_record_is_written(tmp_path: Path) -> None:
    """Finding 6: the record was written (and fsynced) first; on a network filesystem that stalls, NCCL's
    own abort came before the line. Here the record's write never returns: the line is out all the same."""
    code = ("import time, sys; from mlm_ddp.cluster import watchdog; "
            "watchdog.write_atomic = lambda *a, **k: time.sleep(600); "
            f"stall = watchdog.on_stall_exit({str(tmp_path)!r}, 0, lambda err: f'lost: {{err}}', 'prog', 1); "
            "stall('rank 1 on n2 (pid 7) stopped in the data phase of step 3', 18.0, 20.0)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE, text=True)
    guard = threading.Timer(120, proc.kill)  # with the old order no line ever comes: end the read, then fail
    guard.start()
    try:
        said = [proc.stderr.readline() for _ in range(2)]  # the lost-contact line, then the hang line
        assert proc.poll() is None  # still writing the record: the line came first
    finally:
        guard.cancel()
        proc.kill()
        proc.wait()
    assert said[1].startswith("prog: error: hang: rank 1 on n2 (pid 7) stopped in the data phase of step 3"), said
