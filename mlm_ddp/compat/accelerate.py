"""accelerate's names that are not its public API, which mlm_ddp reaches (see mlm_ddp/compat/__init__.py)."""

from __future__ import annotations

from mlm_ddp.compat import Reach

REACHES: list[Reach] = []
