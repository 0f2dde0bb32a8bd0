"""The watchdog: a rank that waits in a collective for nearly its timeout names the peer it waits for,
before the backend ends the process (NCCL's watchdog aborts it without a Python exception). torch's Flight
Recorder (flight.py) says afterwards which collective each rank last entered; this adds, before the
timeout, one line with the host, pid, phase and step of the rank that did not come, and what became of it.

How it judges, so that it cannot call a healthy job hung (docs/design.md, pitfalls 17 and 19):
- **Channel.** The process group's own key-value store (no client cache, unlike a shared filesystem),
  which `collectives.join_process_group` scopes to this start of the job (generation.py): torchrun's agents
  keep one store for every restart. Every call has a hard deadline (`StoreCalls`): under srun and Submitit rank
  0's own process hosts the store, and a frozen host must be named, not waited on forever.
- **Clock.** Only this rank's monotonic clock measures anything: how long it has waited since it entered
  the collective, and how long a peer's published numbers have stayed the same as seen from here.
- **When.** Only while this rank is in a collective (`waiting_timeout`), and only from `FROZEN_AFTER_S`
  before its deadline (the timeout less a margin) on. It ends the process only for a peer that cannot
  arrive: exited, stopped, or silent for `FROZEN_AFTER_S` (or the store's host gone). A peer that is
  alive and behind gets a warning line, never an exit: it may still arrive inside the margin, and the
  backend ends the wait at its own timeout if it does not. A finished peer is not a frozen one.
- **Cost, O(1) per rank per tick whatever the world size.** One `set` of this rank's record per tick;
  in a wait, one `add` once it has lasted a tick (the wait's arrival counter), and from `FROZEN_AFTER_S`
  before the deadline one read of that counter per tick, which also carries the verdict. One rank per
  wait (the first to count itself) reads every record: twice per hang, not every rank every tick.
  `python -m mlm_ddp.bench --watchdog_cost 512 4096 16384` measures it on a real TCPStore.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, Protocol

from mlm_ddp.cluster.durable import write_atomic
from mlm_ddp.cluster.heartbeat import ALIVE_EVERY_S, FOLDER, Beat
from mlm_ddp.compat.torch import default_store
from mlm_ddp.errors import say

# a live peer publishes every ALIVE_EVERY_S from a thread that touches no file: ten missed ticks are a
# stopped process, not a slow write on a network filesystem or a call that holds the GIL for seconds
FROZEN_AFTER_S = 10 * ALIVE_EVERY_S
STORE_DEADLINE_S = 10.0  # a store call that has not answered in this time is not waited on
VERDICT = 1 << 40  # times 1 + the rank named, added to a wait's arrival counter: no count of ranks reaches it
ANOTHER_NAMED = "named by the first rank to arrive (its log line and heartbeat/hang-rank-N.json say how)"
# phases whose waits are on the long-timeout group (--save_timeout): the others wait on the main process
SAVE_PHASES = ("checkpoint", "final save", "probe")
# phases whose whole body may wait on the peers (DDP's forward broadcasts buffers and its backward
# all-reduces; FSDP gathers and reduces; a checkpoint's, final/'s and the probe's waits); any other phase
# waits only where its beat names a collective, which runs on the training group (--ddp_timeout)
WAITING_PHASES = ("forward/backward", "optimizer", *SAVE_PHASES)


class Store(Protocol):
    """What the watchdog uses of torch.distributed's Store."""

    def set(self, key: str, value: bytes | str) -> None: ...
    def add(self, key: str, value: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...


class StoreSilent(Exception):
    """The store has not answered a call for `since_s` seconds."""

    def __init__(self, since_s: float) -> None:
        super().__init__(f"the store has not answered for {since_s:.0f} s")
        self.since_s = since_s


class StoreCalls:
    """A store's calls with a hard deadline: each runs on a daemon thread of its own, and the caller waits
    at most `deadline_s` (a TCPStore's own timeout does not bound `check` or `multi_get` when its host is
    stopped). While a call is stuck, the next ones fail at once, saying since when. `deadline_s` None:
    called inline (a simulation that needs no deadline)."""

    def __init__(self, store: Store, deadline_s: float | None = STORE_DEADLINE_S) -> None:
        self.store, self.deadline_s = store, deadline_s
        self._lock = threading.Lock()
        self._busy_since: float | None = None
        self._job: tuple[Callable[[], Any], list, threading.Event] | None = None
        self._ready = threading.Condition(self._lock)
        if deadline_s is not None:
            threading.Thread(target=self._serve, name="mlm_ddp-store", daemon=True).start()

    def _serve(self) -> None:
        while True:
            with self._ready:
                while self._job is None:
                    self._ready.wait()
                call, box, done = self._job
            try:
                box.append((True, call()))
            except Exception as err:  # noqa: BLE001 - handed to the caller
                box.append((False, err))
            with self._lock:
                self._job, self._busy_since = None, None
            done.set()

    def __call__(self, method: str, *args: Any) -> Any:
        call = getattr(self.store, method)
        if self.deadline_s is None:
            return call(*args)
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        with self._ready:
            if self._busy_since is not None:
                raise StoreSilent(time.monotonic() - self._busy_since)
            self._busy_since = time.monotonic()
            self._job = (lambda: call(*args), box, done)
            self._ready.notify()
        if not done.wait(self.deadline_s):
            raise StoreSilent(self.deadline_s)
        ok, value = box[0]
        if not ok:
            raise value
        return value


def process_space() -> str:
    """What two processes share when their pids mean the same thing: this boot of this machine and this
    pid namespace (two containers on one node have the same host name and other pids)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def process_state(pid: int) -> str:
    """"exited", "stopped" or "running": a process of this pid space, as /proc shows it."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return "exited"
    return {"Z": "exited", "X": "exited", "T": "stopped", "t": "stopped"}.get(fields[0], "running")


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
    space: str = ""  # process_space(): where `pid` can be looked up

    @classmethod
    def of(cls, beat: Beat, tick: int, space: str = "") -> Record:
        return cls(beat.rank, beat.seq, tick, beat.step, beat.phase, beat.collective, beat.host, beat.pid, space)

    @property
    def where(self) -> str:
        where = f"the {self.phase} phase of step {self.step}"
        return f"{where} (in {self.collective})" if self.collective else where


def store_of_process_group() -> tuple[Store, str] | None:
    """A connection of this process's own to the default process group's store, and where it is (None
    without a group): the main thread keeps its connection, and the alive thread never queues behind it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    store = default_store()
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    try:
        store = store.clone()
    except (RuntimeError, NotImplementedError):  # a store without clone: the shared client (its ops lock)
        return store, where
    store.set_timeout(timedelta(seconds=STORE_DEADLINE_S))
    return store, where


@dataclass
class Wait:
    """The collective this rank waits in, as the watchdog follows it."""

    seq: int
    entered: float  # this rank's monotonic clock
    counted: bool = False  # this rank added itself to the wait's arrival counter
    observer: bool = False  # this rank reads every record for this wait (the first to count itself)
    first: dict[int, Record] = field(default_factory=dict)  # the observer's first look, and when
    first_at: float = 0.0
    warned: str | None = None  # the warning said for this wait (a peer alive and behind)


@dataclass(frozen=True)
class Verdict:
    line: str
    final: bool  # the peer cannot arrive: end the process now; else warn and let the backend time out
    rank: int = -1  # the peer named


class Watchdog:
    """Publishes this rank's record and watches its waits (see the module's docstring). `tick` is called by
    the heartbeat's alive thread every ALIVE_EVERY_S with this rank's last beat and the monotonic time it
    was made. `on_stall(line, waited, timeout)` ends the process (a peer that cannot arrive); `on_warn(line)`
    says a peer is alive and behind, and `on_warn(None)` that the wait it warned about ended after all."""

    def __init__(self, store: Store, rank: int, world: int, timeout_s: Callable[[str], float],
                 on_stall: Callable[[str, float, float], None], scope: str = "mlm_ddp/",
                 on_warn: Callable[[str | None], None] | None = None, store_at: str = "its host",
                 deadline_s: float | None = STORE_DEADLINE_S, space: str | None = None) -> None:
        self.calls = StoreCalls(store, deadline_s)
        self.rank, self.world, self.scope, self.store_at = rank, world, scope, store_at
        self.timeout_s, self.on_stall = timeout_s, on_stall
        self.on_warn = on_warn or (lambda line: line and say(f"mlm_ddp: warning: {line}"))
        self.space = process_space() if space is None else space  # "": pids are never looked up
        self.ticks = 0
        self.wait: Wait | None = None
        self.reads = 0  # reads of every record (bench.py prices them)
        self._publishing = threading.Lock()
        self._done = False

    def key(self, *parts: object) -> str:
        return self.scope + "/".join(map(str, parts))

    def waiting_timeout(self, beat: Beat) -> float | None:
        """The timeout of the collective this beat waits in (a named one runs on the training group; a
        whole phase on its own group); None when it waits in none."""
        if beat.phase == "done" or (beat.collective is None and beat.phase not in WAITING_PHASES):
            return None
        return self.timeout_s("collective" if beat.collective is not None else beat.phase)

    def deadline_s(self, timeout: float) -> float:
        """How long this rank may wait before it names the peer: the timeout less a margin of two alive
        ticks (the check runs once per tick) or 5% of it, whichever is larger."""
        return timeout - max(2 * ALIVE_EVERY_S, 0.05 * timeout)

    def publish(self, beat: Beat) -> None:
        """This rank's record; after "done", nothing (an older record never replaces it)."""
        with self._publishing:
            if self._done:
                return
            self._done = beat.phase == "done"
            self.ticks += 1
            self.calls("set", self.key("rank", beat.rank), json.dumps(asdict(Record.of(beat, self.ticks, self.space))))

    def tick(self, beat: Beat, entered: float, now: float | None = None) -> None:
        """Publish, then follow this rank's current wait (if it is in one). A store that does not answer
        while this rank has waited past its deadline is named: its host stopped this collective."""
        now = time.monotonic() if now is None else now
        try:
            self.publish(beat)
            self.follow(beat, entered, now)
        except StoreSilent as silent:
            timeout = self.waiting_timeout(beat)
            if timeout is not None and now - entered >= self.deadline_s(timeout) and \
                    silent.since_s >= (self.calls.deadline_s or 0):
                self.on_stall(f"the process group's store at {self.store_at} has not answered for "
                              f"{silent.since_s:.0f} s while rank {self.rank} waited in {Record.of(beat, 0).where}: "
                              "the process that hosts it (rank 0 under srun and Submitit; torchrun's agent on the "
                              "first node under torchrun or accelerate launch) is stopped or gone, or its node is",
                              now - entered, timeout)
            raise

    def follow(self, beat: Beat, entered: float, now: float) -> None:
        timeout = self.waiting_timeout(beat)
        waited = now - entered
        wait = self.wait
        if wait is not None and (wait.seq, wait.entered) != (beat.seq, entered):
            if wait.warned:
                self.on_warn(None)  # the peer it warned about arrived: the wait ended
            wait = self.wait = None
        if timeout is None or waited < ALIVE_EVERY_S:
            return  # not waiting, or not for long: nothing is counted or read
        if wait is None:
            wait = self.wait = Wait(beat.seq, entered)
        if not wait.counted:  # the first rank to count itself watches this wait for all (reads every record)
            wait.observer = self.calls("add", self.key("arrived", beat.seq), 1) == 1
            wait.counted = True
        deadline = self.deadline_s(timeout)
        if waited < deadline - FROZEN_AFTER_S - ALIVE_EVERY_S:
            return
        arrived = self.calls("add", self.key("arrived", beat.seq), 0)
        if arrived >= VERDICT:  # the observer named the hang (the count carries the rank): end too
            self.on_stall(f"rank {arrived // VERDICT - 1} stopped this rank's wait in {Record.of(beat, 0).where}; "
                          f"{ANOTHER_NAMED}", waited, timeout)
            return
        if arrived >= self.world and beat.collective is not None:
            return  # every rank is in this collective: slow (the backend will say), not stuck
        if not wait.observer:
            return
        if not wait.first:
            wait.first, wait.first_at = self.read_peers(), now
        if waited < deadline or now - wait.first_at < ALIVE_EVERY_S:  # a verdict compares two looks
            return
        verdict = self.judge(beat, wait, self.read_peers(), now)
        if verdict is None:
            return
        if verdict.final:  # the others learn it, and whom, from the count they read
            self.calls("add", self.key("arrived", beat.seq), VERDICT * (1 + verdict.rank))
            self.on_stall(verdict.line, waited, timeout)
        elif wait.warned != verdict.line:
            wait.warned = verdict.line
            self.on_warn(f"rank {self.rank} has waited {waited:.0f} s of {timeout:.0f} s: {verdict.line}")

    def read_peers(self) -> dict[int, Record]:
        """Every record of this attempt but this rank's (a rank that never published is absent)."""
        others = [r for r in range(self.world) if r != self.rank]
        keys = [self.key("rank", r) for r in others]
        if not self.calls("check", keys):  # multi_get would wait for a missing key: read those that exist
            present = [r for r in others if self.calls("check", [self.key("rank", r)])]
            others, keys = present, [self.key("rank", r) for r in present]
        self.reads += 1
        values = self.calls("multi_get", keys) if keys else []
        return {r: Record(**json.loads(value)) for r, value in zip(others, values, strict=True)}

    def judge(self, mine: Beat, wait: Wait, records: dict[int, Record], now: float) -> Verdict | None:
        """Who stopped this rank's wait, and whether it can still come. A peer is suspect when it has not
        finished and has fewer beats than this rank or (in a phase that waits all along) has stopped
        publishing; one whose beats moved since the first look is on its way: no verdict."""
        missing = [r for r in range(self.world) if r != self.rank and r not in records]
        if missing:
            return Verdict(f"rank {missing[0]} never published its heartbeat in this attempt ({len(missing)} of "
                           f"{self.world} missing): it did not reach training; its log says why", False)
        watched = now - wait.first_at
        suspects = []
        for record in records.values():
            before = wait.first.get(record.rank)
            if record.phase == "done" or (before is not None and before.seq != record.seq):
                continue
            quiet = before is not None and before.tick == record.tick  # no publication between the two looks
            silent = quiet and watched >= FROZEN_AFTER_S
            state = process_state(record.pid) if record.space and record.space == self.space else None
            if record.seq < mine.seq or silent or state in ("exited", "stopped"):
                suspects.append((record, silent, state, quiet))
        if not suspects:
            return None
        order = {"exited": 0, "stopped": 1}
        record, silent, state, quiet = min(suspects, key=lambda s: (order.get(s[2], 2 if s[1] else 3), s[0].seq,
                                                                      s[0].rank))
        line = (f"rank {record.rank} on {record.host} (pid {record.pid}) stopped in {record.where}; the others got as "
                f"far as {Record.of(mine, 0).where}")
        if state == "exited":
            return Verdict(line + "; its process has exited (killed, or it failed: the launcher's report or its "
                                  "log says why)", True, record.rank)
        if state == "stopped":
            return Verdict(line + "; its process is stopped (SIGSTOP, or a debugger): check that node", True,
                           record.rank)
        if silent and state is None:
            return Verdict(line + f"; no sign of life for {watched:.0f} s or more as seen from rank {self.rank}: its "
                                  "process exited, was killed or frozen, or its node is gone: check that node", True,
                           record.rank)
        if silent:
            how = f"has not published for {watched:.0f} s although it runs (a call that holds the GIL?)"
        elif quiet:
            how = f"has not published for {watched:.0f} s, too short to call it stopped"
        else:
            how = "is alive, still there"
        return Verdict(line + f"; its process {how} (py-spy dump --pid {record.pid} on {record.host} shows where); "
                              "the backend ends the wait at its timeout unless it arrives", False)


def on_stall_exit(output_dir: str | Path, rank: int, lost_contact: Callable[[Exception], str], prog: str,
                  exit_code: int, dump: Callable[[], object] | None = None) -> Callable[[str, float, float], NoReturn]:
    """What a run does when its watchdog names a hang: say it (first: NCCL may abort the process any
    moment), record it in `heartbeat/hang-rank-N.json` (`--diagnose` prints it afterwards), dump the
    Flight Recorder (`dump`), and end the process with `exit_code` (the launcher then stops the others).
    `lost_contact` words the cause as a lost peer."""
    def on_stall(line: str, waited: float, timeout: float) -> NoReturn:
        cause = TimeoutError(f"no progress for {waited:.0f} s in a collective that times out after {timeout:.0f} s: "
                             "named by mlm_ddp's watchdog before the backend's own timeout")
        say(f"{prog}: error: {lost_contact(cause)}\n{prog}: error: hang: {line}")
        record = {"rank": rank, "waited_s": round(waited, 1), "timeout_s": timeout, "hang": line, "at": time.time()}
        try:
            write_atomic(Path(output_dir) / FOLDER / f"hang-rank-{rank:05d}.json", json.dumps(record))
        except OSError as err:
            say(f"{prog}: warning: cannot write the hang record ({err})")
        if dump is not None:
            dump()
        os._exit(exit_code)  # the main thread is stuck in the collective: end here, as NCCL would, but named

    return on_stall


def warning_record(output_dir: str | Path, rank: int, prog: str) -> Callable[[str | None], None]:
    """`on_warn` of a run: say the line, and keep it as this rank's hang record while the wait lasts (a
    backend timeout that follows is then named by `--diagnose` and the closing error); `None`: the wait
    ended, the record goes."""
    path = Path(output_dir) / FOLDER / f"hang-rank-{rank:05d}.json"

    def on_warn(line: str | None) -> None:
        try:
            if line is None:
                path.unlink(missing_ok=True)
                return
            say(f"{prog}: warning: {line}")
            write_atomic(path, json.dumps({"rank": rank, "hang": line.split(": ", 1)[1], "at": time.time(),
                                           "warning": True}))
        except OSError:
            pass  # the line was said; the record is a help afterwards

    return on_warn


def for_run(run: Any, topo: Any, output_dir: Path, world: int, scope: str, lost_contact: Callable[[Exception], str],
            exit_code: int) -> Watchdog | None:
    """The watchdog of a training run (`run`: its RunConfig's timeouts), on its own connection to the process
    group's store (scoped to this start by `collectives.join_process_group`), its keys under `scope` (this
    run's); None alone. A hang it names ends the process with `exit_code`, after the Flight Recorder's dump."""
    from mlm_ddp.cluster import flight

    found = store_of_process_group() if world > 1 else None
    if found is None:
        return None

    def timeout_s(phase: str) -> float:
        return run.save_timeout if phase in SAVE_PHASES else run.ddp_timeout

    prog = "mlm_ddp.train"
    on_stall = on_stall_exit(output_dir, topo.rank, lost_contact, prog, exit_code,
                             lambda: flight.dump(os.environ, topo.rank))
    return Watchdog(found[0], topo.rank, world, timeout_s, on_stall, scope, warning_record(output_dir, topo.rank, prog),
                    found[1])
