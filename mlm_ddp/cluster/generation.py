"""One start of a job: the generation every worker of it agrees on before the process group forms, and the
signals a worker obeys at once while it waits to join.

Why a generation of our own (docs/design.md, pitfall 19): torchrun's agents share one store across restarts
(with c10d, the rank-0 agent hosts it and every start gets the same MASTER_PORT) and add no per-start prefix,
so a key written by the last start is read by the next: gloo's addresses of the workers that died
("Connection refused", or a connect timeout minutes later). `TORCHELASTIC_RESTART_COUNT` cannot scope
them: it is each agent's own counter. The agent whose worker failed counts a restart; another node's agent
restarts its healthy worker for the membership change and does not, so one start's workers see 1 and 0.

What every worker of one start does know: its rank and the world size, and that the workers of every
earlier start are gone (an agent stops its workers before it joins the next rendezvous, and the next start
begins only when every agent has joined). Rank 0 opens the start:

1. rank 0 writes `mlm_ddp/start` = "GEN WORLD", GEN new (random);
2. every other rank reads it and counts itself in: `add(mlm_ddp/GEN/arrived, 1)`; the rank whose count
   completes WORLD - 1 writes `mlm_ddp/GEN/all`;
3. rank 0 waits for `all`, then writes `mlm_ddp/GEN/go`; a rank that counted itself in waits for `go`.

A rank may read an earlier start's GEN, written before this start's rank 0 wrote its own. An earlier start
that completed has all WORLD - 1 counted already: this rank's count exceeds it, so it knows the GEN is
stale. One that never completed never got its `go` (its rank 0 waited for `all`, then died). Either way
the rank keeps reading `mlm_ddp/start` until this start's rank 0 replaces it, about once a second: per
rank O(1) store calls, with no read of every rank's keys. Under srun and Submitit the store is new for
every job step and the same steps cost a few calls.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

KEY_ROOT = "mlm_ddp/"  # every key mlm_ddp puts in a store starts with it, then the start's generation
START_KEY = KEY_ROOT + "start"
POLL_S = 1.0  # how often a rank that read a stale generation looks for this start's


class JoinTimeout(RuntimeError):
    """The workers of this start did not all arrive before the deadline."""


def agree_generation(store: Any, rank: int, world: int, timeout_s: float, poll_s: float = POLL_S) -> str:
    """The generation of this start (a short hex id), the same on every rank of it; see the module's
    docstring. `store` is the job's store, unprefixed. Raises JoinTimeout after `timeout_s` seconds."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout_s

    def left() -> timedelta:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise JoinTimeout(f"the job's {world} process(es) did not all arrive within {timeout_s:.0f} s")
        return timedelta(seconds=remaining)

    if rank == 0:
        generation = uuid.uuid4().hex[:12]
        store.set(START_KEY, f"{generation} {world}")
        if world > 1:
            try:
                store.wait([f"{KEY_ROOT}{generation}/all"], left())
            except dist.DistStoreError as err:
                raise JoinTimeout(f"{_arrived(store, generation)} of the other {world - 1} process(es) arrived "
                                  f"within {timeout_s:.0f} s") from err
        store.set(f"{KEY_ROOT}{generation}/go", "1")
        return generation
    while True:
        try:
            store.wait([START_KEY], left())  # a new store: rank 0 may not have opened the start yet
        except dist.DistStoreError as err:
            raise JoinTimeout(f"rank 0 did not open the start within {timeout_s:.0f} s") from err
        opened = store.get(START_KEY)
        generation, _, opened_world = opened.decode().partition(" ")
        counted = store.add(f"{KEY_ROOT}{generation}/arrived", 1)
        if counted == world - 1:
            store.set(f"{KEY_ROOT}{generation}/all", "1")
        # an earlier start's: complete (this count is one too many) or of another size
        current = counted <= world - 1 and opened_world == str(world)
        while True:
            if current:
                try:
                    store.wait([f"{KEY_ROOT}{generation}/go"], min(left(), timedelta(seconds=poll_s)))
                    return generation
                except dist.DistStoreError:
                    pass
            else:
                threading.Event().wait(min(left().total_seconds(), poll_s))
            left()
            if store.get(START_KEY) != opened:
                break  # this start's rank 0 opened it: count in there


def _arrived(store: Any, generation: str) -> int:
    return int(store.add(f"{KEY_ROOT}{generation}/arrived", 0))


@contextmanager
def stop_now_on(names: tuple[str, ...] = ("SIGTERM", "SIGINT")) -> Iterator[None]:
    """Inside the block, `names` end the process at once (their default action). A worker waiting to join
    blocks inside torch's store and gloo's connects, where a Python handler never runs: the handler of
    --stop_signals (which saves at the next step) would leave the launcher's SIGTERM unanswered until its
    SIGKILL, 30 s later under torchrun, and a worker whose agent gave up would wait out its timeout.
    Outside the main thread (no handlers can be set there) the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {name: signal.signal(getattr(signal, name), signal.SIG_DFL) for name in names}
    try:
        yield
    finally:
        for name, handler in previous.items():
            signal.signal(getattr(signal, name), handler)


def die_with_agent(env: Mapping[str, str], started_by: int) -> bool:
    """Under torch's elastic agent (torchrun, `accelerate launch`: TORCHELASTIC_RUN_ID set), ask Linux to
    SIGKILL this worker when the agent dies. An agent that is SIGKILLed, or dies with its node, otherwise
    leaves its workers orphaned, holding their GPU and waiting in a join or a collective until a timeout.
    An agent that is only asked to stop (SIGTERM) outlives its workers: it signals them and waits for them,
    so the graceful stop of --stop_signals is untouched. `started_by`: the parent this process had when it
    started; another parent now means the agent died already, and this process ends here. Returns whether
    it asked."""
    if "TORCHELASTIC_RUN_ID" not in env or os.uname().sysname != "Linux":
        return False
    import ctypes

    pr_set_pdeathsig = 1  # <linux/prctl.h>
    libc = ctypes.CDLL(None, use_errno=True)
    asked = libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) == 0
    if os.getppid() != started_by:
        os.kill(os.getpid(), signal.SIGKILL)
    return asked
