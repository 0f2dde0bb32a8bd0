"""Where every rank is, written cheaply, so that a hang names the rank that stopped first.

Each rank keeps one small file, `output_dir/heartbeat/rank-00003.json`, rewritten in place with one
`pwrite` (no fsync, no collective) whenever it enters a phase of a step (`PHASES`) or a collective:
its step, phase, the collective it entered (if any), the time, and `seq`, the number of beats so far.
Every rank runs the same loop, so it makes the same beats in the same order: `seq` compares progress
across ranks. A daemon thread also rewrites `alive` every `ALIVE_EVERY_S`, so a process that is
frozen (SIGSTOP, a dead node) is told apart from one that is alive but stuck.

When a collective times out, the surviving ranks read every rank's file (`diagnose`) and name the
rank whose progress stopped first: the one frozen, else the one with the fewest beats, else the one
that beat first; `python -m mlm_ddp.distributed --diagnose OUTPUT_DIR` says the same afterwards,
from the files alone (the folder must be shared by the nodes, as checkpoints need anyway).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

from mlm_ddp.errors import say

FOLDER = "heartbeat"
RECORD_BYTES = 512  # every record is padded to this, so a rewrite in place never leaves a longer one's tail
ALIVE_EVERY_S = 2.0
PHASES = ("start", "data", "forward/backward", "optimizer", "log", "eval", "checkpoint", "final save", "done")
# train.fit's beats per optimizer step: data, its all-reduce, forward/backward, optimizer, log, eval,
# checkpoint (tests/test_spikes.py counts them in a finished run; bench.py prices them)
BEATS_PER_STEP = 7


PhaseReport = Callable[[int, str], None]  # (step, phase): what a part of the loop calls as it starts its phase


def unreported(_step: int, _phase: str) -> None:
    """A part of the loop made without a heartbeat (bench, tests) reports its phases nowhere."""


def rank_file(output_dir: str | Path, rank: int) -> Path:
    return Path(output_dir) / FOLDER / f"rank-{rank:05d}.json"


@dataclass
class Beat:
    """One rank's last heartbeat."""

    rank: int
    world: int
    host: str
    pid: int
    step: int  # the step being worked on (1-based; 0: before the first)
    phase: str
    collective: str | None  # the collective entered in this phase, until it returns
    at: float  # when this phase or collective was entered (time.time())
    seq: int  # beats so far: the same on every rank at the same point of the loop
    alive: float  # the last time the process was seen running (the beat, or the alive thread)


@dataclass(frozen=True)
class Watch:
    """The heartbeat's watchdog: a rank that has waited in one phase for nearly that phase's collective
    timeout, while another rank is frozen or behind it, names the hang itself, before the backend ends the
    process. NCCL's watchdog aborts the process (SIGABRT) while the main thread is stuck in a CUDA sync, so
    no Python exception ever arrives there; gloo raises one, which comes after this."""

    timeout_s: Callable[[str], float]  # phase -> the timeout of the collectives it waits in
    on_stall: Callable[[str, float, float], None]  # (the diagnosis, seconds waited, the timeout); ends the process

    def deadline_s(self, phase: str) -> float:
        """How long a phase may last before the watchdog looks: the timeout less a margin of a few alive
        beats (the check runs once per beat) or 5% of it, whichever is larger."""
        timeout = self.timeout_s(phase)
        return timeout - max(1.5 * ALIVE_EVERY_S, 0.05 * timeout)


SAVE_PHASES = ("checkpoint", "final save")  # their waits are on the long-timeout group (--save_timeout)


def watchdog(ddp_timeout: float, save_timeout: float, output_dir: str | Path, rank: int,
             lost_contact: Callable[[Exception], str], prog: str, exit_code: int) -> Watch:
    """The watchdog of a run: it names a hang on every backend, before NCCL's own watchdog aborts the
    process without a word, records it in `heartbeat/hang-rank-N.json`, and ends the process with
    `exit_code` (the run's rank that waits; the launcher then stops the others). `lost_contact` words
    the cause as a lost peer (distributed.lost_contact)."""
    def timeout_s(phase: str) -> float:
        return save_timeout if phase in SAVE_PHASES else ddp_timeout

    def on_stall(line: str, waited: float, timeout: float) -> NoReturn:
        from mlm_ddp.checkpoint import write_atomic  # checkpoint.py reports its phase here: imported late

        cause = TimeoutError(f"no progress for {waited:.0f} s in a phase whose collectives time out after "
                             f"{timeout:.0f} s: named by mlm_ddp's watchdog before the backend's own timeout")
        record = {"rank": rank, "waited_s": round(waited, 1), "timeout_s": timeout, "hang": line, "at": time.time()}
        write_atomic(Path(output_dir) / FOLDER / f"hang-rank-{rank:05d}.json", json.dumps(record))
        say(f"{prog}: error: {lost_contact(cause)}\n{prog}: error: hang: {line}")
        os._exit(exit_code)  # the main thread is stuck in the collective: end here, as NCCL would, but named

    return Watch(timeout_s, on_stall)


class Heartbeat:
    """This rank's heartbeat file. `beat(step, phase, collective)` costs one pwrite; `on_beat` is a
    test seam called after each beat (train.Hooks); `watch`: the watchdog (`Watch`). The parts of the
    loop that do a phase beat it themselves (`train.read_window`, `train.agree`, `step.train_step`,
    `RunLog.maybe`, `Evaluator.maybe`, `Checkpointer.maybe`)."""

    def __init__(self, output_dir: str | Path, rank: int, world: int,
                 on_beat: Callable[[Beat], None] | None = None, watch: Watch | None = None, start: bool = True) -> None:
        self.output_dir, self.watch, self.on_beat = Path(output_dir), watch, on_beat
        self.rank, self.world = rank, world
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        if start:
            self.start()

    def start(self) -> None:
        """Create this rank's file and start the alive thread. A run makes its heartbeat before its first
        write (the parts that beat take it then) and starts it after its folder is prepared."""
        path = rank_file(self.output_dir, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:  # the files of ranks an earlier run of this folder had and this one has not
            for stale in path.parent.glob("rank-*.json"):
                if stale.stem.split("-")[1].isdigit() and int(stale.stem.split("-")[1]) >= self.world:
                    stale.unlink(missing_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        now = time.time()
        self.last = Beat(self.rank, self.world, socket.gethostname(), os.getpid(), 0, "start", None, now, 0, now)
        self._write()
        self._thread = threading.Thread(target=self._keep_alive, name="mlm_ddp-heartbeat", daemon=True)
        self._thread.start()

    def beat(self, step: int, phase: str, collective: str | None = None) -> None:
        if self._fd is None:
            raise RuntimeError("Heartbeat.beat before Heartbeat.start")
        now = time.time()
        with self._lock:
            self.last = Beat(self.last.rank, self.last.world, self.last.host, self.last.pid, step, phase, collective,
                             now, self.last.seq + 1, now)
            self._write()
        if self.on_beat is not None:
            self.on_beat(self.last)

    def _write(self) -> None:
        text = json.dumps(asdict(self.last))
        os.pwrite(self._fd, text.ljust(RECORD_BYTES - 1).encode()[:RECORD_BYTES - 1] + b"\n", 0)

    def _keep_alive(self) -> None:
        while not self._closed.wait(ALIVE_EVERY_S):
            with self._lock:
                if self._closed.is_set():
                    return
                self.last.alive = time.time()
                self._write()
                mine = self.last
            if self.watch is not None and mine.alive - mine.at > self.watch.deadline_s(mine.phase):
                line = stalled_peer(self.output_dir, mine)
                if line is not None:
                    self.watch.on_stall(line, mine.alive - mine.at, self.watch.timeout_s(mine.phase))

    def close(self) -> None:
        """The last beat of a finished run; the file stays, saying where this rank ended."""
        if not self._closed.is_set() and self._fd is not None:
            self.beat(self.last.step, "done")
        self.stop()

    def stop(self) -> None:
        """No more beats; the file keeps the last one (after an error: where it happened)."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            if self._fd is not None:  # started
                os.close(self._fd)


def read_beats(output_dir: str | Path) -> dict[int, Beat]:
    """Every rank's last heartbeat in the folder, by rank (a file being rewritten is read again)."""
    beats = {}
    for path in sorted((Path(output_dir) / FOLDER).glob("rank-*.json")):
        for _ in range(3):
            try:
                beat = Beat(**json.loads(path.read_text()))
                beats[beat.rank] = beat
                break
            except (ValueError, TypeError):
                time.sleep(0.01)
    return beats


def _where(beat: Beat) -> str:
    where = f"the {beat.phase} phase of step {beat.step}"
    return f"{where} (in {beat.collective})" if beat.collective else where


def diagnose(output_dir: str | Path, now: float | None = None,
             frozen_after_s: float = 3 * ALIVE_EVERY_S) -> str | None:
    """One line naming the rank that stopped advancing first, its host and where it was; None when
    the folder holds no heartbeat."""
    beats = read_beats(output_dir)
    if not beats:
        return None
    now = time.time() if now is None else now
    world = max(b.world for b in beats.values())
    beats = {r: b for r, b in beats.items() if b.world == world}  # files of an earlier, larger run: ignored
    missing = [r for r in range(world) if r not in beats]
    if missing:
        return (f"rank {missing[0]} never wrote its heartbeat ({len(missing)} of {world} missing): it did not reach "
                "training; its log says why")
    if all(b.phase == "done" for b in beats.values()):
        return f"all {world} ranks finished (no rank is stopped)"
    newest = max(b.alive for b in beats.values())
    frozen = [b for b in beats.values() if newest - b.alive > frozen_after_s]
    # the frozen first; then the fewest beats (every rank beats the same sequence); then the earliest
    first = min(beats.values(), key=lambda b: (b not in frozen, b.seq, b.at))
    others = [b for b in beats.values() if b.rank != first.rank]
    line = f"rank {first.rank} on {first.host} (pid {first.pid}) stopped in {_where(first)}"
    if others:
        ahead = min(b.at for b in others) - first.at
        waiting = max(others, key=lambda b: b.seq)
        line += f", {max(ahead, 0.0):.1f} s before the others' last heartbeat"
        line += f"; the others got as far as {_where(waiting)}"
    if first in frozen:
        line += (f"; its process stopped running {newest - first.alive:.0f} s before theirs (stopped, killed, or "
                 "its node is gone): check that node")
    elif now - newest <= frozen_after_s:
        line += "; its process is still running, stuck there (py-spy dump --pid on its host shows where)"
    return line


def stalled_peer(output_dir: str | Path, mine: Beat, frozen_after_s: float = 3 * ALIVE_EVERY_S) -> str | None:
    """`diagnose`'s line when another rank has stopped: frozen (its process no longer runs) or behind
    `mine` (fewer beats: it never reached the collective this rank waits in). None when every other rank
    is alive and as far: then they are all slow, not stuck, and no backend times out."""
    beats = {r: b for r, b in read_beats(output_dir).items() if b.world == mine.world and b.rank != mine.rank}
    if len(beats) < mine.world - 1:
        return diagnose(output_dir)  # a rank that never beat: it never reached training
    if any(mine.alive - b.alive > frozen_after_s or b.seq < mine.seq for b in beats.values()):
        return diagnose(output_dir, now=mine.alive, frozen_after_s=frozen_after_s)
    return None


def cost_per_beat(folder: str | Path, beats: int = 20000) -> float:
    """Seconds one beat takes here, measured on a heartbeat file in `folder`."""
    heart = Heartbeat(folder, 0, 1)
    started = time.perf_counter()
    for step in range(beats):
        heart.beat(step, "data")
    took = time.perf_counter() - started
    heart.close()
    return took / beats
