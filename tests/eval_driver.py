"""`python -m tests.eval_driver PEAK_FILE [training flags]`: `mlm_ddp.train.main`, counting on this rank the
evaluation batches that exist at once (made by the eval collator and not yet freed), written as JSON
({"peak": ..., "made": ...}) to PEAK_FILE.rank<RANK> when the run ends: what evaluation holds in memory,
measured. The count rides on the collator through a test seam; the production code is as it runs.

Runs under `accelerate launch -m tests.eval_driver` (cwd: the repo).
"""

from __future__ import annotations

import json
import os
import sys
import weakref
from pathlib import Path

from mlm_ddp.data.masking import TRAIN_SPLIT, MaskingCollator
from mlm_ddp.train import main as train_main


class AliveBatches:
    """Batches made and not yet freed: each is counted until its input_ids tensor is garbage."""

    def __init__(self) -> None:
        self.alive = self.peak = self.made = 0

    def add(self, batch: dict) -> None:
        self.alive, self.made = self.alive + 1, self.made + 1
        self.peak = max(self.peak, self.alive)
        weakref.finalize(batch["input_ids"], self.freed)

    def freed(self) -> None:
        self.alive -= 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    peak_file, train_argv = argv[0], argv[1:]
    count, collate = AliveBatches(), MaskingCollator.__call__

    def counting(self: MaskingCollator, examples: list[dict]) -> dict:
        batch = collate(self, examples)
        if self.split != TRAIN_SPLIT:
            count.add(batch)
        return batch

    MaskingCollator.__call__ = counting
    code = train_main(train_argv)
    Path(f"{peak_file}.rank{os.environ.get('RANK', '0')}").write_text(json.dumps({"peak": count.peak,
                                                                                 "made": count.made}))
    return code


if __name__ == "__main__":
    sys.exit(main())
