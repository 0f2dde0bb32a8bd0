"""Evaluation's memory stays bounded by a few batches under DDP and FSDP: under FSDP every rank must run
the same number of forwards (each gathers parameters from every rank). Reading the whole per-rank eval set
into (pinned) host memory first (`list(loader)`: a stream has no length to compare) would ensure it at the
cost of memory that grows with the set; the evaluation reads `EVAL_LOOKAHEAD` batches at a time and
agrees on each round's forwards (`evaluation.lockstep`)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from mlm_ddp.loop.evaluation import EVAL_LOOKAHEAD, lockstep
from tests.conftest import SAME_STEPS, read_metrics, run_module
from tests.test_fsdp import FSDP_ENV, launch


def chunk_sizes(batches: int, ahead: int):
    """What a rank with `batches` batches reads in each round of `lockstep`, then 0 for ever."""
    return itertools.chain((min(ahead, batches - start) for start in range(0, batches, ahead)), itertools.repeat(0))


def recorded(batches: range, read: list):
    """`batches`, each appended to `read` as it is read."""
    for batch in batches:
        read.append(batch)
        yield batch


@pytest.mark.parametrize("ahead", [1, 2, 4])
def test_lockstep_runs_the_same_forwards_on_every_rank_and_holds_at_most_ahead(ahead: int) -> None:
    """Two ranks of 0..9 batches each: both run max(a, b) forwards, each its own batches in order then idle
    ones, and neither has read more than `ahead` batches past what its forwards used."""
    for mine, theirs in itertools.product(range(10), repeat=2):
        other, read, used = chunk_sizes(theirs, ahead), [], []
        for batch in lockstep(recorded(range(mine), read), lambda n, other=other: max(n, next(other)), ahead):
            assert len(read) - len(used) <= ahead
            used.append(batch)
        assert used == [*range(mine), *[None] * (max(mine, theirs) - mine)], (mine, theirs)


@pytest.fixture(scope="module")
def evaluated(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two-process runs, DDP and FSDP, of 2 steps with many small eval batches per rank (an odd number of
    blocks: one rank has a batch more), each rank counting the eval batches alive at once
    (tests/eval_driver.py): config -> (eval records of metrics.jsonl, [each rank's count])."""
    root = tmp_path_factory.mktemp("evaluation")
    runs = {}
    for config in ("cpu_ddp.yaml", "fsdp.yaml"):
        out, peak = root / config, root / f"{config}.peak"
        proc = run_module(launch(config, tiny_model, corpus, out, "--max_train_steps", "2", "--eval_steps", "1",
                                 "--per_device_eval_batch_size", "2", "--max_eval_samples", "61",
                                 module=("tests.eval_driver", str(peak))),
                          env=FSDP_ENV if config == "fsdp.yaml" else None)
        assert proc.returncode == 0, proc.stderr[-3000:]
        counts = [json.loads(Path(f"{peak}.rank{rank}").read_text()) for rank in (0, 1)]
        runs[config] = ([r for r in read_metrics(out) if "eval_loss" in r], counts)
    return runs


def test_fsdp_evaluation_holds_a_few_batches_whatever_the_eval_set(evaluated: dict) -> None:
    """Each rank reads EVAL_LOOKAHEAD batches a round while the last forward's batch is still referenced
    (the loops' variables): EVAL_LOOKAHEAD + 1 alive at most. Before: every batch of the rank's share
    (16 here), whatever its size."""
    for config, (_, counts) in evaluated.items():
        print(f"{config}: eval batches alive at once per rank {[c['peak'] for c in counts]}, "
              f"made {[c['made'] for c in counts]} (3 evaluations)")
    _, counts = evaluated["fsdp.yaml"]
    assert sorted(c["made"] for c in counts) == [3 * 15, 3 * 16]  # 31 and 30 blocks, 2 a batch, 3 evaluations
    assert max(c["peak"] for c in counts) <= EVAL_LOOKAHEAD + 1


def test_fsdp_evaluation_gives_the_ddp_figures(evaluated: dict) -> None:
    """The same weights evaluated on the same blocks: FSDP's forward sums in another order than the plain
    module's (SAME_STEPS), and the idle forwards of the rank with a batch fewer add nothing."""
    ddp, fsdp = evaluated["cpu_ddp.yaml"][0], evaluated["fsdp.yaml"][0]
    assert [r["step"] for r in fsdp] == [r["step"] for r in ddp] == [0, 1, 2]
    for a, b in zip(ddp, fsdp, strict=True):
        assert a["eval_characters"] == b["eval_characters"]  # the idle forwards of FSDP's lockstep count none
        for key in ("eval_loss", "perplexity", "eval_accuracy", "eval_bits_per_char"):
            assert b[key] == pytest.approx(a[key], rel=SAME_STEPS), (key, a, b)
