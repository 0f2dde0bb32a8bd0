"""`python -m tests.fault_driver --slow_save_s S [training flags]`: `mlm_ddp.train.main` with a fault
injected through `train`'s test seam (`Hooks`), never through the production code's environment:
every checkpoint save sleeps S seconds once its files are durable and before its COMPLETE marker,
widening the window in which a kill leaves a half-written checkpoint, or in which the other ranks
wait for the main process. Runs under `accelerate launch -m tests.fault_driver` too (cwd: the repo).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

from mlm_ddp.train import Hooks
from mlm_ddp.train import main as train_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests.fault_driver", allow_abbrev=False)
    parser.add_argument("--slow_save_s", type=float, required=True)
    faults, train_argv = parser.parse_known_args(argv)
    return train_main(train_argv, Hooks(before_checkpoint_marker=functools.partial(time.sleep, faults.slow_save_s)))


if __name__ == "__main__":
    sys.exit(main())
