"""`accelerate launch -m tests.agreement_driver ROOT` on 2 processes: each rank is given its own view
of an output folder (rank 1's lacks the newest checkpoint, as a node whose filesystem cache has not yet
seen a save), then asks the questions that lead to collectives. Writes ROOT/rank-N.json per rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from accelerate import Accelerator

from mlm_ddp.cluster.collectives import MainProcessWait
from mlm_ddp.config import RunConfig
from mlm_ddp.errors import BadInput
from mlm_ddp.loop import checkpoint as ckpt
from mlm_ddp.run.run_folder import agree_on_resume


def view(root: Path, rank: int) -> Path:
    """Rank `rank`'s view of one output folder: step 2 everywhere, step 4 only where rank 0 looks."""
    out = root / f"view-{rank}"
    steps = (2, 4) if rank == 0 else (2,)
    for step in steps:
        folder = ckpt.checkpoints_dir(out) / ckpt.step_dir_name(step)
        folder.mkdir(parents=True, exist_ok=True)
        state = ckpt.TrainerState(step=step, epoch=0, batch_in_epoch=step, tokens_seen=100 * step, world_size=2)
        (folder / ckpt.STATE_FILE).write_text(json.dumps(state.__dict__))
        (folder / ckpt.MARKER).write_text("ok\n")
    return out


def main() -> int:
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    out = view(Path(sys.argv[1]), rank)
    wait = MainProcessWait(accelerator.num_processes, 60)
    checkpointer = ckpt.Checkpointer(RunConfig(output_dir=str(out)), accelerator, wait, None, "", None)
    own = checkpointer.latest()
    agreed = checkpointer.agreed_latest()
    assert agreed is not None
    try:
        agree_on_resume(own, wait)
        refused = None
    except BadInput as err:
        refused = str(err)
    # a file per rank: two ranks printing into the launcher's one pipe can run into one line
    (Path(sys.argv[1]) / f"rank-{rank}.json").write_text(json.dumps(
        {"rank": rank, "own": own.name, "agreed": agreed[0].name, "agreed_step": agreed[1].step, "refused": refused}))
    wait.close()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
