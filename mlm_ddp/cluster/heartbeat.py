"""Where every rank is, written cheaply, so that a hang names the rank that stopped first.

Each rank keeps one small file, `output_dir/heartbeat/rank-00003.json`, rewritten in place with one
`pwrite` (no fsync, no collective) whenever it enters a phase of a step (`PHASES`) or a collective:
its step, phase, the collective it entered (if any), the time, and `seq`, the number of beats so far.
Every rank runs the same loop, so it makes the same beats in the same order: `seq` compares progress
across ranks. A daemon thread runs the run's watchdog (watchdog.py) every `ALIVE_EVERY_S`: it publishes
this rank's record to the process group's store, with a tick that tells a frozen process (SIGSTOP, a
dead node) from one alive but stuck, and judges the peers from there, never from these files; it never
writes these files, so a write stuck on a network filesystem cannot silence it.

After a run, `python -m mlm_ddp.distributed --diagnose OUTPUT_DIR` names the rank whose progress
stopped first (`diagnose`): the hang a watchdog named, if one did; else, from the files alone, the
rank with the fewest beats (no two hosts' clocks are compared); and the Flight Recorder's account.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from mlm_ddp.errors import say

FOLDER = "heartbeat"
RECORD_BYTES = 512  # every record is padded to this, so a rewrite in place never leaves a longer one's tail
ALIVE_EVERY_S = 2.0
PHASES = ("start", "data", "forward/backward", "optimizer", "log", "eval", "checkpoint", "final save", "done")
# train.fit's beats per optimizer step: data, its all-reduce, forward/backward, optimizer, log, eval,
# checkpoint (tests/test_spikes.py counts them in a finished run; bench.py prices them)
BEATS_PER_STEP = 7


class PhaseReport(Protocol):
    """What a part of the loop calls as it starts its phase, and as it enters a collective inside it
    (`collective` names it: the watchdog watches a wait only there, or in a phase that may wait all along)."""

    def __call__(self, step: int, phase: str, collective: str | None = None) -> None: ...


def unreported(_step: int, _phase: str, _collective: str | None = None) -> None:
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
    alive: float  # when this rank last beat (time.time(); kept for files of earlier versions)


class Watcher(Protocol):
    """What the alive thread runs every ALIVE_EVERY_S (watchdog.Watchdog): publish this rank's last beat,
    made at `entered` (time.monotonic()), and judge its current wait."""

    def tick(self, beat: Beat, entered: float) -> None: ...
    def publish(self, beat: Beat) -> None: ...


class Heartbeat:
    """This rank's heartbeat file. `beat(step, phase, collective)` costs one pwrite; `on_beat` is a
    test seam called after each beat (train.Hooks); `watch`: the watchdog, run by the alive thread. The
    parts of the loop that do a phase beat it themselves (`train.read_window`, `train.agree`,
    `step.train_step`, `RunLog.maybe`, `Evaluator.maybe`, `Checkpointer.maybe`). `every_s`: the alive
    thread's period; the watchdog's bounds assume ALIVE_EVERY_S, so only a test of the thread itself sets it."""

    def __init__(self, output_dir: str | Path, rank: int, world: int,
                 on_beat: Callable[[Beat], None] | None = None, watch: Watcher | None = None,
                 start: bool = True, every_s: float = ALIVE_EVERY_S) -> None:
        self.output_dir, self.watch, self.on_beat = Path(output_dir), watch, on_beat
        self.every_s = every_s
        self.rank, self.world = rank, world
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._failed: set[str] = set()  # what has failed once and was said (the file, the watchdog)
        if start:
            self.start()

    def start(self) -> None:
        """Create this rank's file and start the alive thread. A run makes its heartbeat before its first
        write (the parts that beat take it then; their beats before this are not recorded) and starts it
        after its folder is prepared."""
        path = rank_file(self.output_dir, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:  # the files of ranks an earlier run of this folder had and this one has not
            for stale in path.parent.glob("rank-*.json"):
                if stale.stem.split("-")[1].isdigit() and int(stale.stem.split("-")[1]) >= self.world:
                    stale.unlink(missing_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        now = time.time()
        self.last = Beat(self.rank, self.world, socket.gethostname(), os.getpid(), 0, "start", None, now, 0, now)
        self.current = (self.last, time.monotonic())  # the last beat and when it was made (monotonic)
        self._write()
        self._publish()  # peers see this rank from its start on, not one alive tick later
        self._thread = threading.Thread(target=self._keep_alive, name="mlm_ddp-heartbeat", daemon=True)
        self._thread.start()

    def beat(self, step: int, phase: str, collective: str | None = None) -> None:
        if self._fd is None:  # not started: a checkpoint restored in `build`, before the first write
            return
        now = time.time()
        with self._lock:
            self.last = Beat(self.last.rank, self.last.world, self.last.host, self.last.pid, step, phase, collective,
                             now, self.last.seq + 1, now)
            self.current = (self.last, time.monotonic())  # one assignment: the alive thread reads both at once
            self._write()
        if phase == "done":
            self._publish()  # at once: a finished rank must never look frozen to those still working
        if self.on_beat is not None:
            self.on_beat(self.last)

    def entering(self, collective: str) -> None:
        """A beat in the current step and phase, naming a collective this rank enters inside it (one the
        phase's own beats do not name: the stream feed's agreement, a skip read before a save); nothing
        before `start`."""
        if self._fd is not None:
            self.beat(self.last.step, self.last.phase, collective)

    def returned(self) -> None:
        """The collective named last has returned: this rank works in its phase again (no beat: the count
        of beats stays the same on every rank). Without this, its wait would seem to go on."""
        if self._fd is not None and self.last.collective is not None:
            with self._lock:
                self.last = replace(self.last, collective=None)
                self.current = (self.last, self.current[1])
                self._write()

    @contextmanager
    def collective(self, name: str) -> Iterator[None]:
        """`entering(name)` for the block, `returned()` after it."""
        self.entering(name)
        yield
        self.returned()

    def _write(self) -> None:
        text = json.dumps(asdict(self.last))
        try:
            os.pwrite(self._fd, text.ljust(RECORD_BYTES - 1).encode()[:RECORD_BYTES - 1] + b"\n", 0)
        except OSError as err:  # ENOSPC, ESTALE on a network filesystem: training and the watchdog go on
            self._say_once("file", f"cannot write the heartbeat file {rank_file(self.output_dir, self.rank)} "
                                   f"({err}); training and the hang watchdog go on without it")

    def _publish(self) -> None:
        if self.watch is None:
            return
        try:
            self.watch.publish(self.last)
        except Exception as err:  # noqa: BLE001 - a store that is gone must not end the rank
            self._say_once("watch", self._watch_failed(err))

    def _keep_alive(self) -> None:
        """Every `every_s` (ALIVE_EVERY_S): the watchdog's tick (publish this rank's record, follow its wait). It never
        touches the heartbeat file: a write stuck on a network filesystem must not stop this rank's
        publications, or its peers would call it silent. Nothing it meets ends it, but the watchdog's own
        verdict (which ends the process)."""
        while not self._closed.wait(self.every_s):
            mine, entered = self.current
            if self.watch is not None:
                try:
                    self.watch.tick(mine, entered)
                except Exception as err:  # noqa: BLE001 - e.g. the store's host is gone: the backend reports it
                    self._say_once("watch", self._watch_failed(err) + "; it keeps trying")

    @staticmethod
    def _watch_failed(err: Exception) -> str:
        """The warning for an error of the watchdog: an unreachable store is said as such, anything else
        (a bug) with its type, never as a store that cannot be reached."""
        import torch

        if isinstance(err, (OSError, torch.distributed.DistError)) or type(err).__name__ == "StoreSilent":
            return f"the hang watchdog cannot reach the process group's store ({err})"
        return f"the hang watchdog failed ({type(err).__name__}: {err})"

    def _say_once(self, what: str, line: str) -> None:
        if what not in self._failed:
            self._failed.add(what)
            say(f"mlm_ddp: warning: rank {self.rank}: {line}")

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


def hang_records(output_dir: str | Path) -> list[dict[str, Any]]:
    """The hangs the watchdogs of a run named (`heartbeat/hang-rank-N.json`): the judging rank's first, then by
    rank."""
    records = []
    for path in sorted((Path(output_dir) / FOLDER).glob("hang-rank-*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    # the rank that judged first: the others' records only point to it
    return sorted(records, key=lambda r: "named by the first rank to arrive" in r.get("hang", ""))


def _where(beat: Beat) -> str:
    where = f"the {beat.phase} phase of step {beat.step}"
    return f"{where} (in {beat.collective})" if beat.collective else where


def diagnose(output_dir: str | Path) -> str | None:
    """One line naming the rank that stopped advancing first, its host and where it was; None when the
    folder holds no heartbeat. From the beats' counts alone: the files' times come from several hosts'
    clocks, which are never compared. torch's Flight Recorder's account follows, where it dumped."""
    from mlm_ddp.cluster.flight import summary

    recorded = summary(output_dir)
    named = hang_records(output_dir)
    if named:  # judged live, from what every rank published: better than these files afterwards
        how = "warned about by" if named[0].get("warning") else "named by"
        line = f"{named[0]['hang']} ({how} rank {named[0]['rank']}'s watchdog as it waited)"
        return line + (f"; {recorded}" if recorded else "")
    beats = read_beats(output_dir)
    if not beats:
        return recorded
    world = max(b.world for b in beats.values())
    beats = {r: b for r, b in beats.items() if b.world == world}  # files of an earlier, larger run: ignored
    missing = [r for r in range(world) if r not in beats]
    if missing:
        return (f"rank {missing[0]} never wrote its heartbeat here ({len(missing)} of {world} missing): it did not "
                "reach training (its log says why), or its node keeps --output_dir on a disk of its own (run "
                "--diagnose on that node too)")
    if all(b.phase == "done" for b in beats.values()):
        return f"all {world} ranks finished (no rank is stopped)"
    working = [b for b in beats.values() if b.phase != "done"]
    first = min(working, key=lambda b: (b.seq, b.rank))  # every rank beats the same sequence
    furthest = max(beats.values(), key=lambda b: b.seq)
    if first.seq == furthest.seq:
        line = (f"all {len(working)} unfinished ranks stopped at the same point, {_where(first)}: no rank is behind; "
                "the collective itself did not complete (the backend or the network)")
    else:
        line = (f"rank {first.rank} on {first.host} (pid {first.pid}) stopped in {_where(first)}; the others got as "
                f"far as {_where(furthest)}")
    return line + (f"; {recorded}" if recorded else "")


def cost_per_beat(folder: str | Path, beats: int = 20000) -> float:
    """Seconds one beat takes here, measured on a heartbeat file in `folder`."""
    heart = Heartbeat(folder, 0, 1)
    started = time.perf_counter()
    for step in range(beats):
        heart.beat(step, "data")
    took = time.perf_counter() - started
    heart.close()
    return took / beats
