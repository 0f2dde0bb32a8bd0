"""What the hang watchdog costs the process group's store, measured on a real TCPStore with thousands of
simulated ranks (`python -m mlm_ddp.bench --watchdog_cost 512 4096 16384`; docs/scale.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from mlm_ddp.cluster.heartbeat import ALIVE_EVERY_S, Beat
from mlm_ddp.cluster.watchdog import Store, Watchdog


class CountingStore:
    """A Store that counts the requests and bytes that reach the server through it (for `cost`)."""

    def __init__(self, store: Store) -> None:
        self.store, self.ops, self.bytes = store, 0, 0

    def _count(self, sent: int, received: int = 0) -> None:
        self.ops, self.bytes = self.ops + 1, self.bytes + sent + received

    def set(self, key: str, value: bytes | str) -> None:
        self._count(len(key) + len(value))
        self.store.set(key, value)

    def add(self, key: str, value: int) -> int:
        self._count(len(key) + 8, 8)
        return self.store.add(key, value)

    def check(self, keys: list[str]) -> bool:
        self._count(sum(map(len, keys)), 1)
        return self.store.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self.store.multi_get(keys)
        self._count(sum(map(len, keys)), sum(map(len, values)))
        return values


def cost(ranks: Sequence[int], timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """`measure` at each number of ranks, priced with the server's measured rate (`server_rate`)."""
    rate = server_rate()
    return [{**measure(world, timeout_s), "server_requests_per_s": rate} for world in ranks]


def server_rate(clients: int = 4, requests: int = 20000) -> float:
    """Requests per second one libuv TCPStore server answers here: `clients` connections, each in a thread
    of its own (a store call releases the GIL), each call an `add`, which waits for the server's answer (a
    client's `set` does not, so a rate of sets would time the client alone)."""
    import threading

    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    def client(index: int) -> None:
        store = TCPStore("127.0.0.1", server.port, is_master=False)
        for n in range(requests // clients):
            store.add(f"bench/{index}/{n % 64}", 1)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return requests / (time.perf_counter() - started)


def measure(world: int, timeout_s: float) -> dict[str, Any]:
    """The watchdog's requests to the store server per tick, on a real TCPStore with `world` simulated
    ranks (time is simulated, every request is real): a healthy run (every rank in an evaluation longer
    than the timeout, then all in one collective past its deadline), and a hang (one rank frozen, every
    other one waiting for it until the observer names it). Per phase, the mean and the heaviest tick."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    named: list[str] = []
    counting = CountingStore(server)
    dogs = [Watchdog(counting, r, world, lambda _phase: timeout_s, lambda line, *_: named.append(line),
                     scope=f"mlm_ddp/bench-{world}/", on_warn=lambda _line: None, deadline_s=None, space="")
            for r in range(world)]
    clock = 0.0

    def run(beats: dict[int, Beat], entered: float) -> list[tuple[int, int]]:
        """(requests, bytes) of each tick until the timeout or a hang is named."""
        nonlocal clock
        end, ticks = clock + timeout_s, []
        while clock < end and not named:
            clock += ALIVE_EVERY_S
            ops, sent = counting.ops, counting.bytes
            for rank, made in beats.items():
                dogs[rank].tick(made, entered, now=clock)
            ticks.append((counting.ops - ops, counting.bytes - sent))
        return ticks

    def beat(rank: int, seq: int, phase: str, collective: str | None) -> Beat:
        return Beat(rank, world, "node", 1000 + rank, 7, phase, collective, 0.0, seq, 0.0)

    healthy = run({r: beat(r, 40, "eval", None) for r in range(world)}, clock)
    healthy += run({r: beat(r, 41, "data", "the step's all-reduce") for r in range(world)}, clock)
    entered = clock  # rank 0 freezes at seq 41; the others move on to seq 42 (a collective) and wait
    hang = run({r: beat(r, 42, "data", "the step's all-reduce") for r in range(1, world)}, entered)
    del server
    row: dict[str, Any] = {"ranks": world, "tick_s": ALIVE_EVERY_S, "timeout_s": timeout_s}
    for name, ticks in (("healthy", healthy), ("hang", hang)):
        row[f"{name}_requests_per_tick"] = sum(o for o, _ in ticks) / len(ticks)
        row[f"{name}_bytes_per_tick"] = sum(b for _, b in ticks) / len(ticks)
        row[f"{name}_heaviest_tick_requests"] = max(o for o, _ in ticks)
        row[f"{name}_heaviest_tick_bytes"] = max(b for _, b in ticks)
    row["reads_of_every_record"] = sum(d.reads for d in dogs)
    row["hang_named_after_s"] = clock - entered
    row["named"] = bool(named) and named[0].startswith("rank 0 ")
    return row


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The table docs/scale.md shows: per world size, the store server's requests and bytes per tick, and
    its heaviest tick's share of the tick at the server's measured rate."""
    lines = ["| ranks | healthy: requests / tick (per rank) | bytes / tick | hang: requests / tick (per rank) | "
             "bytes / tick | heaviest tick: requests | its server time, share of the tick | reads of every record | "
             "named after |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        heaviest = max(r["healthy_heaviest_tick_requests"], r["hang_heaviest_tick_requests"])
        busy = heaviest / r["server_requests_per_s"]
        lines.append(
            f"| {r['ranks']} | {r['healthy_requests_per_tick']:.0f} "
            f"({r['healthy_requests_per_tick'] / r['ranks']:.2f}) | {r['healthy_bytes_per_tick']:.0f} | "
            f"{r['hang_requests_per_tick']:.0f} "
            f"({r['hang_requests_per_tick'] / r['ranks']:.2f}) | {r['hang_bytes_per_tick']:.0f} | {heaviest} | "
            f"{busy:.3f} s, {busy / r['tick_s']:.1%} | {r['reads_of_every_record']} | "
            f"{r['hang_named_after_s']:.0f} s of a {r['timeout_s']:.0f} s timeout |")
    rate = rows[0]["server_requests_per_s"] if rows else 0
    return "\n".join(lines + [f"(server rate measured here: {rate:.0f} requests/s, 4 client connections)"])
