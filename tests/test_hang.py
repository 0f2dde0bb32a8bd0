"""A hang names its rank, and a healthy job is never called hung.

End to end, on 2 real processes over gloo:
- rank 1 freezes itself (SIGSTOP) in one phase of step 3, or sticks there alive: the survivor's watchdog
  names that rank, its host and its phase before the process group times out, and
  `python -m mlm_ddp.distributed --diagnose` says the same afterwards;
- rank 1 runs under libfaketime a minute ahead of rank 0, every evaluation lasts longer than
  --ddp_timeout, and rank 1 finishes long before rank 0's final phase does: the run ends with exit 0 and
  no hang record (each of the three fired the file-based watchdog this one replaced).
The watchdog's own judgement on a real TCPStore with simulated time: frozen, behind, finished, never
started, all slow, a long phase without a collective, a store that shows records late, a store and a
file that fail; and its cost per rank at 8 and 64 ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from mlm_ddp import heartbeat, watchdog
from mlm_ddp.heartbeat import ALIVE_EVERY_S, Beat
from mlm_ddp.watchdog import FROZEN_AFTER_S, Watchdog
from tests.conftest import REPO, free_port, run_module, tiny_args

PHASES = ["data", "forward/backward", "optimizer", "eval", "checkpoint"]
# --ddp_timeout and --save_timeout of the frozen runs: the watchdog names a frozen rank once its tick has
# not moved for FROZEN_AFTER_S (6 s), and a frozen rank here stops 3 s into its phase (fault_driver)
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
def frozen_runs(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Phase -> the output folder of a 2-process run whose rank 1 froze there in step 3 ("stuck": stayed
    alive in the data phase); all at once (they mostly wait)."""
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
def test_the_survivor_and_diagnose_name_the_stopped_rank_its_host_and_phase(phase: str,
                                                                            frozen_runs: dict[str, Path]) -> None:
    out = frozen_runs[phase]
    expected = f"rank 1 on {socket.gethostname()} (pid "
    where = f") stopped in the {'data' if phase == 'stuck' else phase} phase of step 3"
    survivor = (out.parent / "rank0.log").read_text()
    hang = [line for line in survivor.splitlines() if line.startswith("mlm_ddp.train: error: hang: ")]
    assert len(hang) == 1, survivor[-3000:]
    how = "still running, stuck there" if phase == "stuck" else "its process stopped running"
    assert expected in hang[0] and where in hang[0] and how in hang[0], hang[0]
    # named by mlm_ddp's watchdog, on no exception of the backend's: NCCL's watchdog would abort the process
    # (SIGABRT) without one; gloo's comes at TIMEOUT_S, after this. The run folder keeps the record.
    assert "named by mlm_ddp's watchdog before the backend's own timeout" in survivor, survivor[-3000:]
    record = json.loads((out / "heartbeat" / "hang-rank-00000.json").read_text())
    assert record["hang"] == hang[0].removeprefix("mlm_ddp.train: error: hang: ")
    assert record["waited_s"] < TIMEOUT_S and record["timeout_s"] == TIMEOUT_S
    after = run_module(["mlm_ddp.distributed", "--diagnose", str(out)], timeout=60)
    assert after.returncode == 0, after.stderr
    assert expected in after.stdout and where in after.stdout and after.stdout.count("\n") == 1, after.stdout


@pytest.fixture(scope="module")
def faketime() -> str:
    """Debian's faketime (libfaketime), installed where it is missing and we may."""
    if shutil.which("faketime") is None and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-qq", "faketime"], env={**os.environ,
                       "DEBIAN_FRONTEND": "noninteractive"}, capture_output=True, timeout=600)
        if shutil.which("faketime") is None:
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=600)
            subprocess.run(["apt-get", "install", "-y", "-qq", "faketime"], env={**os.environ,
                           "DEBIAN_FRONTEND": "noninteractive"}, capture_output=True, timeout=600)
    if shutil.which("faketime") is None:
        pytest.skip("faketime (Debian's package faketime) is not installed and installing it needs root")
    return shutil.which("faketime")


def test_a_rank_that_joins_later_than_ddp_timeout_is_waited_for(tiny_model: Path, corpus: dict,
                                                                 tmp_path: Path) -> None:
    """Rank 1 starts 12 s after rank 0, against a 5 s --ddp_timeout (a node that imports from a slow shared
    filesystem or converts a large raw corpus to Arrow before it joins): the run trains, since the start
    waits --rendezvous_timeout; a rank that never comes is named with that flag once it has passed."""
    out = tmp_path / "run"
    args = tiny_args(tiny_model, corpus, out, "--max_train_steps", "2", "--max_eval_samples", "16", "--ddp_timeout",
                     "5", "--save_timeout", "5", "--cpu_threads", "1", "--report", "false")
    port = free_port()
    first = start_rank(0, port, out, args)
    time.sleep(12)
    ranks = [first, start_rank(1, port, out, args)]
    codes = [proc.wait(timeout=300) for proc in ranks]
    logs = [(out.parent / f"rank{rank}.log").read_text() for rank in (0, 1)]
    assert codes == [0, 0], "\n".join(log[-2000:] for log in logs)
    assert json.loads((out / "summary.json").read_text())["steps"] == 2

    alone = tmp_path / "alone" / "run"
    alone.parent.mkdir()
    lonely = start_rank(0, free_port(), alone, [*tiny_args(tiny_model, corpus, alone, "--ddp_timeout", "2",
                                                           "--rendezvous_timeout", "3")])
    assert lonely.wait(timeout=120) == 1
    said = (alone.parent / "rank0.log").read_text()
    assert "not every process joined within 3 s (--rendezvous_timeout" in said, said[-2000:]


def test_the_rank_under_faketime_can_sleep_as_libraries_do(faketime: str) -> None:
    """libfaketime 0.9.10 with its monotonic clock left alone fails every time.sleep (EINVAL). The run
    below hit it by chance in CI: datasets' file lock sleeps when the other rank holds the cache's lock.
    The driver makes the faked rank's time.sleep a timed wait; this checks it, under a faked clock, the
    way filelock calls it (time.sleep through the module)."""
    code = "import time, tests.fault_driver; time.sleep(0.01); print('slept')"
    done = subprocess.run([faketime, "-f", "+60s", sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "FAKETIME_DONT_FAKE_MONOTONIC": "1"})
    assert done.returncode == 0 and done.stdout.strip() == "slept", done.stderr[-2000:]


def test_clocks_a_minute_apart_long_evaluations_and_a_finished_peer_raise_no_alarm(
        tiny_model: Path, corpus: dict, tmp_path: Path, faketime: str) -> None:
    """Every evaluation (before training, at steps 2 and 4) lasts 7 s, longer than --ddp_timeout (5 s),
    without a collective until its reduce; rank 1's wall clock is 60 s ahead of rank 0's (libfaketime;
    its monotonic clock is left alone, as a host's own: libfaketime 0.9.10's faked one stalls timed waits
    of threads); rank 0 spends 9 s in its final phase after rank 1 finished (longer than
    --save_timeout). A healthy run: exit 0 on both, and no hang record."""
    out = tmp_path / "run"
    args = tiny_args(tiny_model, corpus, out, "--max_train_steps", "4", "--eval_steps", "2", "--max_eval_samples",
                     "16", "--ddp_timeout", "5", "--save_timeout", "5", "--cpu_threads", "1", "--report", "false")
    port = free_port()
    ranks = [start_rank(0, port, out, ["--slow_eval_s", "7", "--slow_final_s", "0:9", *args]),
             start_rank(1, port, out, ["--slow_eval_s", "7", *args], wrap=[faketime, "-f", "+60s"])]
    codes = [proc.wait(timeout=300) for proc in ranks]
    logs = [(out.parent / f"rank{rank}.log").read_text() for rank in (0, 1)]
    assert codes == [0, 0], "\n".join(log[-2000:] for log in logs)
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
    each with the beat its function gives (None: that rank is frozen, it does not tick)."""

    def __init__(self, world: int, timeout_s: float = 60.0, store: object = None) -> None:
        self.server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.named: list[tuple[int, str]] = []
        self.named_at: list[float] = []
        self.dogs = [Watchdog(store(self.server) if store else self.server, rank, world, lambda _p: timeout_s,
                              self.on_stall(rank)) for rank in range(world)]
        self.now = 0.0

    def on_stall(self, rank: int):
        def named(line: str, *_: float) -> None:
            self.named.append((rank, line))
            self.named_at.append(self.now)
        return named

    def run(self, seconds: float, beats: dict, entered: float = 0.0) -> None:
        end = self.now + seconds
        while self.now < end:
            self.now += ALIVE_EVERY_S
            for rank, beat in beats.items():
                made = beat(self.now) if callable(beat) else beat
                if made is not None:
                    self.dogs[rank].tick(made, entered, now=self.now)


def beat(rank: int, seq: int, phase: str = "data", collective: str | None = "the step's all-reduce",
         step: int = 5, at: float = 0.0) -> Beat:
    return Beat(rank, 3, "node", 100 + rank, step, phase, collective, at, seq, at)


def test_a_frozen_peer_is_named_before_the_timeout_and_a_behind_one_as_still_running() -> None:
    peers = Peers(3)
    peers.run(10, {r: beat(r, 40, "forward/backward", None) for r in range(3)})  # all in a step: healthy
    assert peers.named == []
    # rank 2 freezes in forward/backward; ranks 0 and 1 go on to the next step's all-reduce and wait there
    start = peers.now
    peers.run(60, {0: beat(0, 42), 1: beat(1, 42)}, entered=start)
    assert peers.named, "nobody named the frozen rank"
    rank, line = peers.named[0]
    assert line.startswith("rank 2 on node (pid 102) stopped in the forward/backward phase of step 5; the others got "
                           "as far as the data phase of step 5 (in the step's all-reduce); its process stopped running")
    assert peers.named_at[0] - start <= 60 - 2 * ALIVE_EVERY_S + ALIVE_EVERY_S  # before the timeout, with a margin
    # alive but behind: its tick moves, its beats do not
    peers = Peers(2)
    peers.run(60, {0: beat(0, 42), 1: beat(1, 41, "data", None)})
    assert peers.named and "rank 1 on node (pid 101) stopped in the data phase of step 5; the others got as far " \
                           "as the data phase of step 5 (in the step's all-reduce); its process is still running, " \
                           "stuck there" in peers.named[0][1]


def test_no_alarm_in_a_long_phase_without_a_collective_among_slow_peers_or_for_a_finished_one() -> None:
    # an evaluation twice as long as the timeout (no collective until its reduce), one rank frozen: not
    # this rank's wait, so nothing is even read
    peers = Peers(2)
    peers.run(120, {0: beat(0, 42, "eval", None)})
    assert peers.named == [] and peers.dogs[0].reads == 0
    # every rank in the same collective and alive past its timeout: slow (the backend will say), not stuck
    peers = Peers(3)
    peers.run(120, {r: beat(r, 42) for r in range(3)})
    assert peers.named == [] and peers.dogs[0].reads > 0
    # rank 1 finished long ago; rank 0's final save outlasts the (save) timeout
    peers = Peers(2)
    peers.run(4, {1: beat(1, 50, "done", None)})
    peers.run(120, {0: beat(0, 49, "final save", None)})
    assert peers.named == []


def test_a_rank_that_never_published_is_named() -> None:
    peers = Peers(3)
    peers.run(60, {0: beat(0, 42), 1: beat(1, 42)})
    assert peers.named[0][1].startswith("rank 2 never published its heartbeat (1 of 3 missing)")


class LateStore:
    """A store that shows every record `lag_s` seconds (simulated) after it was set: what a shared folder
    does to files. Reads go through `now`, set by the test."""

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


def test_records_shown_late_raise_no_alarm_on_healthy_waits() -> None:
    """Peers that arrive late at a collective (an uneven evaluation), seen 30 s late: the wait ends before
    the deadline, so nothing is named; a finished peer seen late is not frozen either."""
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


class Broken:
    def set(self, key: str, value: str) -> None:
        raise RuntimeError("Connection reset by peer")

    check = multi_get = set


def test_the_alive_thread_survives_a_file_and_a_store_that_fail_and_says_so_once(tmp_path: Path, capfd) -> None:
    (tmp_path / "heartbeat").mkdir()
    (tmp_path / "heartbeat" / "rank-00000.json").symlink_to("/dev/full")  # every write: ENOSPC
    dog = Watchdog(Broken(), 0, 2, lambda _p: 60.0, lambda *_: None)
    heart = heartbeat.Heartbeat(tmp_path, 0, 2, watch=dog)
    heart.beat(1, "data", "the step's all-reduce")
    time.sleep(3 * ALIVE_EVERY_S)
    assert heart._thread.is_alive() and dog.ticks >= 3  # it went on ticking through both failures
    heart.close()
    err = capfd.readouterr().err
    assert err.count("cannot write the heartbeat file") == 1 and err.count("cannot reach the process group's") == 1


def test_the_cost_per_rank_is_the_same_at_8_and_64_ranks() -> None:
    small, large = watchdog.cost([8, 64])
    assert small["named"] and large["named"]
    assert small["healthy_ops_per_s"] == large["healthy_ops_per_s"] == 1 / ALIVE_EVERY_S
    assert small["hang_reads_per_rank"] == large["hang_reads_per_rank"] <= (FROZEN_AFTER_S + 3 * ALIVE_EVERY_S) / 2


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
    assert line.startswith(f"rank 1 on {socket.gethostname()} (pid {os.getpid()}) stopped in the data phase of "
                           "step 7, "), line
    assert "the others got as far as the data phase of step 7 (in the all-reduce" in line
    assert "still running, stuck there" in line
    record = json.loads((tmp_path / "heartbeat" / "rank-00001.json").read_text())
    assert (record["step"], record["phase"], record["seq"]) == (7, "data", 1)
    for beat_ in beats:
        beat_.stop()
