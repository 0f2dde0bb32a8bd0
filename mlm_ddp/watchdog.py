"""The watchdog: a rank that waits in a collective for nearly its timeout names the peer it waits for,
before the backend ends the process (NCCL's watchdog aborts it without a Python exception).

How it judges, so that it cannot call a healthy job hung (DESIGN.md, pitfall 17):
- **Channel.** Every rank publishes a small record (its beat count `seq`, a `tick` counted by its alive
  thread, step, phase, host, pid) every `ALIVE_EVERY_S` to the process group's own key-value store (the
  TCPStore that torchrun, Slurm and Submitit jobs already rendezvous through). A store answers what was
  last set, with no client cache: a shared filesystem (NFS, Lustre) shows another node's file seconds to
  a minute late, and its metadata server would take every rank reading every file. The heartbeat files
  stay, written by each rank for `--diagnose` after the run; the watchdog never reads them.
- **Clock.** Only this rank's monotonic clock measures anything: how long it has waited, and how long a
  peer's published numbers have stayed the same as seen from here. Two hosts' wall clocks are never
  compared (nodes drift by seconds; an NTP step moves `time.time()`).
- **When.** Only while this rank is inside a collective (`waiting_timeout`), only past that collective's
  own timeout less a margin, and only when a peer that has not finished is frozen (its tick has not
  moved for `FROZEN_AFTER_S`) or behind (fewer beats than this rank, not moving either) or never
  published at all. Peers as far as this rank and alive are slow, not stuck: no alarm.
- **Cost.** One `set` of ~130 bytes per rank every `ALIVE_EVERY_S`, whatever the number of ranks; reads
  (one `multi_get` of every record) only in a wait that nears its timeout, once per tick from
  `FROZEN_AFTER_S` before the deadline (`python -m mlm_ddp.bench --watchdog_cost` measures both).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NoReturn, Protocol

from mlm_ddp.durable import write_atomic
from mlm_ddp.errors import say
from mlm_ddp.heartbeat import ALIVE_EVERY_S, FOLDER, Beat

FROZEN_AFTER_S = 3 * ALIVE_EVERY_S  # a live peer publishes every ALIVE_EVERY_S: three missed ticks = frozen
KEY = "mlm_ddp/heartbeat/"
SAVE_PHASES = ("checkpoint", "final save")  # their collectives are on the long-timeout group (--save_timeout)
# phases whose whole body may wait on the peers (DDP's forward broadcasts buffers and its backward
# all-reduces; FSDP gathers and reduces; a checkpoint's and final/'s collectives); any other phase waits
# only where its beat names a collective (the step's all-reduce, the logged sums, evaluation's reduce)
WAITING_PHASES = ("forward/backward", "optimizer", *SAVE_PHASES)
STORE_TIMEOUT_S = 10.0  # a store that does not answer in this time is reported, not waited on


class Store(Protocol):
    """What the watchdog uses of torch.distributed's Store."""

    def set(self, key: str, value: bytes | str) -> None: ...
    def check(self, keys: list[str]) -> bool: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...


@dataclass(frozen=True)
class Record:
    """What a rank publishes: enough to judge it and to name it."""

    rank: int
    seq: int  # beats so far: every rank makes the same beats in the same order
    tick: int  # publications so far: moves while the process runs, whatever its main thread does
    step: int
    phase: str
    collective: str | None
    host: str
    pid: int

    @classmethod
    def of(cls, beat: Beat, tick: int) -> Record:
        return cls(beat.rank, beat.seq, tick, beat.step, beat.phase, beat.collective, beat.host, beat.pid)

    @property
    def where(self) -> str:
        where = f"the {self.phase} phase of step {self.step}"
        return f"{where} (in {self.collective})" if self.collective else where


def store_of_process_group() -> Store | None:
    """A connection of this process's own to the default process group's store (None without one): the
    main thread keeps its connection, and the alive thread never queues behind it."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        return None
    store = distributed_c10d._get_default_store()
    try:
        store = store.clone()
    except (RuntimeError, NotImplementedError):  # a store without clone: the shared client (its ops lock)
        return store
    store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    return store


@dataclass
class Seen:
    """A peer's published numbers as this rank saw them, and since when (this rank's monotonic clock)."""

    record: Record
    tick_since: float
    seq_since: float


class Watchdog:
    """Publishes this rank's record and watches its peers' (see the module's docstring). `tick` is called
    by the heartbeat's alive thread every ALIVE_EVERY_S with this rank's last beat and the monotonic time
    it was made; it calls `on_stall(line, waited, timeout)` when a peer stopped this rank's collective."""

    def __init__(self, store: Store, rank: int, world: int, timeout_s: Callable[[str], float],
                 on_stall: Callable[[str, float, float], None]) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.timeout_s, self.on_stall = timeout_s, on_stall
        self.ticks = 0
        self.keys = [f"{KEY}{r}" for r in range(world)]
        self.seen: dict[int, Seen] = {}
        # ((seq, entered), first look) of the wait being watched: its beat, and when the peers were first read
        self.watching: tuple[tuple[int, float], float] | None = None
        self.reads = 0  # multi_gets made (bench.py prices them)

    def waiting_timeout(self, beat: Beat) -> float | None:
        """The timeout of the collective this beat waits in; None when it waits in none."""
        if beat.phase == "done" or (beat.collective is None and beat.phase not in WAITING_PHASES):
            return None
        return self.timeout_s(beat.phase)

    def deadline_s(self, timeout: float) -> float:
        """How long this rank may wait before it names the peer: the timeout less a margin of two alive
        ticks (the check runs once per tick) or 5% of it, whichever is larger."""
        return timeout - max(2 * ALIVE_EVERY_S, 0.05 * timeout)

    def publish(self, beat: Beat) -> None:
        self.ticks += 1
        record = Record.of(beat, self.ticks)
        self.store.set(self.keys[self.rank], json.dumps(record.__dict__))

    def tick(self, beat: Beat, entered: float, now: float | None = None) -> None:
        """Publish, then judge this rank's current wait (if it is in one): the peers are read at every
        tick from FROZEN_AFTER_S before the deadline on, so that what has not moved is known at it."""
        now = time.monotonic() if now is None else now
        self.publish(beat)
        timeout = self.waiting_timeout(beat)
        waited = now - entered
        if timeout is None or waited < self.deadline_s(timeout) - FROZEN_AFTER_S - ALIVE_EVERY_S:
            self.watching = None  # not waiting, or not for long: nothing is read
            return
        if self.watching is None or self.watching[0] != (beat.seq, entered):
            self.watching, self.seen = ((beat.seq, entered), now), {}
        self.observe(self.read_peers(), now)
        if waited >= self.deadline_s(timeout):
            line = self.stalled(beat, now)
            if line is not None:
                self.on_stall(line, waited, timeout)

    def read_peers(self) -> dict[int, Record]:
        """Every published record but this rank's (a rank that never published is absent)."""
        others = [r for r in range(self.world) if r != self.rank]
        keys = [self.keys[r] for r in others]
        if not self.store.check(keys):  # multi_get would wait for a missing key: read those that exist
            present = [r for r in others if self.store.check([self.keys[r]])]
            others, keys = present, [self.keys[r] for r in present]
        self.reads += 1
        values = self.store.multi_get(keys) if keys else []
        return {r: Record(**json.loads(value)) for r, value in zip(others, values, strict=True)}

    def observe(self, records: dict[int, Record], now: float) -> None:
        for rank, record in records.items():
            before = self.seen.get(rank)
            if before is None:
                self.seen[rank] = Seen(record, now, now)
                continue
            tick_since = before.tick_since if record.tick == before.record.tick else now
            seq_since = before.seq_since if record.seq == before.record.seq else now
            self.seen[rank] = Seen(record, tick_since, seq_since)

    def stalled(self, mine: Beat, now: float) -> str | None:
        """The line naming the peer that stopped this rank's collective, or None when every peer not
        finished is alive and as far as this rank (slow, not stuck). Frozen: its tick has not moved for
        FROZEN_AFTER_S. Behind: fewer beats than this rank, in a record it published while this rank
        waited (its tick moved since the first look: not an old record)."""
        missing = [r for r in range(self.world) if r != self.rank and r not in self.seen]
        if missing:
            return (f"rank {missing[0]} never published its heartbeat ({len(missing)} of {self.world} missing): it "
                    "did not reach training; its log says why")
        first_look = self.watching[1] if self.watching is not None else now
        live = [s for s in self.seen.values() if s.record.phase != "done"]  # a finished peer is not a frozen one
        frozen = [s for s in live if now - s.tick_since >= FROZEN_AFTER_S]
        behind = [s for s in live if s.record.seq < mine.seq and s.tick_since > first_look]
        if not frozen and not behind:
            return None
        first = min(frozen or behind, key=lambda s: (s.record.seq, s.record.rank))
        record = first.record
        ahead = max([Record.of(mine, 0)] + [s.record for s in self.seen.values() if s is not first],
                    key=lambda r: r.seq)
        line = f"rank {record.rank} on {record.host} (pid {record.pid}) stopped in {record.where}"
        line += f"; the others got as far as {ahead.where}"
        if first in frozen:
            line += (f"; its process stopped running: no sign of life for {now - first.tick_since:.0f} s or more as "
                     f"seen from rank {self.rank} (stopped, killed, or its node is gone): check that node")
        else:
            line += (f"; its process is still running, stuck there (py-spy dump --pid {record.pid} on {record.host} "
                     "shows where)")
        return line


def on_stall_exit(output_dir: str | Path, rank: int, lost_contact: Callable[[Exception], str], prog: str,
                  exit_code: int) -> Callable[[str, float, float], NoReturn]:
    """What a run does when its watchdog names a hang: record it in `heartbeat/hang-rank-N.json`
    (`--diagnose` prints it afterwards), say it, and end the process with `exit_code` (the launcher then
    stops the others). `lost_contact` words the cause as a lost peer."""
    def on_stall(line: str, waited: float, timeout: float) -> NoReturn:
        cause = TimeoutError(f"no progress for {waited:.0f} s in a collective that times out after {timeout:.0f} s: "
                             "named by mlm_ddp's watchdog before the backend's own timeout")
        record = {"rank": rank, "waited_s": round(waited, 1), "timeout_s": timeout, "hang": line, "at": time.time()}
        try:
            write_atomic(Path(output_dir) / FOLDER / f"hang-rank-{rank:05d}.json", json.dumps(record))
        except OSError as err:  # the line below still says it
            say(f"{prog}: warning: cannot write the hang record ({err})")
        say(f"{prog}: error: {lost_contact(cause)}\n{prog}: error: hang: {line}")
        os._exit(exit_code)  # the main thread is stuck in the collective: end here, as NCCL would, but named

    return on_stall


class CountingStore:
    """A Store that counts the operations and bytes that pass through it (for `cost`)."""

    def __init__(self, store: Store) -> None:
        self.store, self.ops, self.bytes = store, 0, 0

    def set(self, key: str, value: bytes | str) -> None:
        self.ops, self.bytes = self.ops + 1, self.bytes + len(key) + len(value)
        self.store.set(key, value)

    def check(self, keys: list[str]) -> bool:
        self.ops, self.bytes = self.ops + 1, self.bytes + sum(map(len, keys))
        return self.store.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self.store.multi_get(keys)
        self.ops, self.bytes = self.ops + 1, self.bytes + sum(map(len, keys)) + sum(map(len, values))
        return values


def cost(ranks: Sequence[int], timeout_s: float = 120.0) -> list[dict[str, float]]:
    """The watchdog's store traffic per rank, measured on a real TCPStore with `ranks` simulated ranks:
    while healthy (every rank in a long phase, then all in one collective), and in a hang (one rank frozen,
    every other one waiting for it until its watchdog names it). Time is simulated, the traffic is real."""
    from torch.distributed import TCPStore

    rows = []
    for world in ranks:
        server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
        named: list[str] = []
        dogs = [Watchdog(CountingStore(server), r, world, lambda _phase: timeout_s,
                         lambda line, *_, named=named: named.append(line)) for r in range(world)]
        beats = [Beat(r, world, "node", 1000 + r, 7, "eval", None, 0.0, 40, 0.0) for r in range(world)]
        healthy_s = 2 * timeout_s  # a phase twice as long as the timeout (an evaluation, a compile)
        clock = 0.0
        while clock < healthy_s:
            clock += ALIVE_EVERY_S
            for beat, dog in zip(beats, dogs, strict=True):
                dog.tick(beat, entered=0.0, now=clock)
        healthy = [(d.store.ops, d.store.bytes) for d in dogs]
        # the hang: rank 0 freezes at seq 41; the others move on to seq 42 (a collective) and wait
        entered, clock = clock, clock
        while not named and clock < entered + timeout_s:
            clock += ALIVE_EVERY_S
            for r, dog in enumerate(dogs[1:], start=1):
                dog.tick(Beat(r, world, "node", 1000 + r, 8, "data", "the step's all-reduce", 0.0, 42, 0.0),
                         entered=entered, now=clock)
        hang = [(d.store.ops - h[0], d.store.bytes - h[1]) for d, h in zip(dogs[1:], healthy[1:], strict=True)]
        rows.append({
            "ranks": world,
            "healthy_ops_per_s": sum(o for o, _ in healthy) / world / healthy_s,
            "healthy_bytes_per_s": sum(b for _, b in healthy) / world / healthy_s,
            "hang_s": clock - entered,
            "hang_reads_per_rank": sum(d.reads for d in dogs[1:]) / (world - 1),
            "hang_ops_per_rank": sum(o for o, _ in hang) / (world - 1),
            "hang_bytes_per_rank": sum(b for _, b in hang) / (world - 1),
            "named": bool(named) and named[0].startswith("rank 0 "),
        })
        del server
    return rows
