"""numpy's names that are not its public API, which mlm_ddp reaches (see mlm_ddp/compat/__init__.py).

None: mlm_ddp calls numpy's public API only. mlm_ddp.data.row_rng reproduces the arithmetic of numpy's
PCG64 draws (SeedSequence, PCG64's seeding, Generator.random and .integers), which numpy does not promise,
through public calls; it is no Reach here because a release that computes them otherwise loses no number,
only speed: row_rng checks its emulation against numpy's own generator once per process and otherwise draws
every batch by numpy's generators, with one log line naming numpy's version (a Reach ends the run; and the
check needs data/, which this floor may not import).
"""

from __future__ import annotations

from mlm_ddp.compat import Reach

REACHES: list[Reach] = []
