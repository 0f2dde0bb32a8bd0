"""`python -m tests.sync_driver OUT [training flags]`: one `mlm_ddp.train` run with every wait for the
device counted (tests/test_syncs.count_syncs), this rank's waits per quiet step written to
OUT/waits-RANK.json: the count of tests/test_syncs.py under a launcher (FSDP2 on two processes)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from mlm_ddp.config import parse_args
    from tests.test_syncs import count_syncs, waits

    argv = sys.argv[1:] if argv is None else argv
    out, train_argv = Path(argv[0]), argv[1:]
    counted = waits(count_syncs(train_argv), parse_args(train_argv).training.max_train_steps)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"waits-{os.environ.get('RANK', '0')}.json").write_text(json.dumps(counted))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
