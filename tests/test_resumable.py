"""A run's resumable parts (mlm_ddp/loop/resumable.py): a part registered once is saved by every checkpoint and
put back, exactly, by a resume after a kill, by a rollback and by a resume on another number of processes.

The part is the test's own (`tests.fault_driver.Tally`: the steps it saw start), registered through train's test
seam as the run registers its log and its loss-spike guard."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest

from mlm_ddp.config import parse_args
from mlm_ddp.errors import BadInput
from mlm_ddp.loop.checkpoint import complete_checkpoints
from mlm_ddp.loop.resumable import SHARED_FILE, Parts, rank_file
from mlm_ddp.train import Hooks, train
from tests.conftest import CONFIGS, LAUNCH, free_port, run_module, tiny_args
from tests.fault_driver import OneSpike, Tally, loss_factors

STEPS, SAVED, KILLED = 8, 4, 6
# per device 8, global 16: one micro-batch per step on 2 processes, two on 1, the same steps either way
FLAGS = ["--max_train_steps", str(STEPS), "--checkpointing_steps", str(SAVED), "--global_batch_size", "16"]


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.n = start

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def test_every_part_comes_back_from_its_own_section(tmp_path: Path) -> None:
    """Saved by rank 1 (which writes its own sections only) and rank 0 (which also writes the shared ones);
    loaded by fresh objects, one registered before the load and one after it."""
    for rank in (1, 0):
        parts = Parts(rank)
        parts.register("shared", Counter(7))
        parts.register("own", Counter(10 + rank), per_rank=True)
        parts.write(tmp_path, parts.collect(), is_main=rank == 0)
    assert json.loads((tmp_path / SHARED_FILE).read_text()) == {"shared": {"n": 7}}
    own_sections = [json.loads((tmp_path / rank_file(r)).read_text()) for r in (0, 1)]
    assert own_sections == [{"own": {"n": 10}}, {"own": {"n": 11}}]
    back, shared, own = Parts(1), Counter(), Counter()
    back.register("shared", shared)
    back.load(tmp_path, same_world=True)
    back.register("own", own, per_rank=True)
    assert (shared.n, own.n) == (7, 11)


def test_a_part_the_checkpoint_lacks_keeps_its_built_state_and_a_name_is_registered_once(tmp_path: Path) -> None:
    parts = Parts(0)
    parts.register("log", Counter(3))
    parts.write(tmp_path, parts.collect(), is_main=True)
    guard = Counter(5)  # a guard that was off when the checkpoint was saved
    back = Parts(0)
    back.register("guard", guard)
    back.load(tmp_path, same_world=True)
    assert guard.n == 5
    with pytest.raises(ValueError, match="'guard' is registered already"):
        back.register("guard", Counter())


def test_a_damaged_section_file_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / SHARED_FILE).write_text('{"log": ')
    with pytest.raises(BadInput, match=f"{SHARED_FILE}: unreadable"):
        Parts(0).load(tmp_path, same_world=True)
    (tmp_path / SHARED_FILE).write_text("[1, 2]")
    with pytest.raises(BadInput, match="not a mapping of sections"):
        Parts(0).load(tmp_path, same_world=True)
    (tmp_path / SHARED_FILE).write_text('{"log": {"count": 3}}')  # a section without the part's keys
    parts = Parts(0)
    parts.load(tmp_path, same_world=True)
    with pytest.raises(BadInput, match=f"{SHARED_FILE}: section 'log' cannot be restored \\(KeyError: 'n'\\)"):
        parts.register("log", Counter())


def tallies_at(checkpoint: Path, world: int) -> tuple[dict, list[dict]]:
    """The shared tally and each rank's, as checkpoint `checkpoint` holds them."""
    shared = json.loads((checkpoint / SHARED_FILE).read_text())
    own = [json.loads((checkpoint / rank_file(r)).read_text())["tally_rank"] for r in range(world)]
    assert {"log", "tally"} <= set(shared)  # the run's own parts are there too
    return shared["tally"], own


def launch(args: list[str]) -> int:
    return run_module([*LAUNCH, "--config_file", str(CONFIGS / "cpu_ddp.yaml"), "--num_processes", "2",
                       "--num_cpu_threads_per_process", "1", "--main_process_port", str(free_port()),
                       "-m", "tests.fault_driver", "--tally", *args]).returncode


def in_process(args: list[str], spike: str | None = None) -> tuple[Tally, Tally]:
    tallies = (Tally(), Tally(0))
    hooks = Hooks(loss_factor=functools.partial(loss_factors, list(tallies), spike and OneSpike(spike)),
                  parts=[("tally", tallies[0], False), ("tally_rank", tallies[1], True)])
    train(parse_args(args), hooks)
    return tallies


@pytest.fixture(scope="module")
def killed(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 processes, rank 0 killed (SIGKILL) as step KILLED starts: the job ends with step SAVED's checkpoint."""
    out = tmp_path_factory.mktemp("resumable") / "killed"
    assert launch(["--kill", f"0:{KILLED}", *tiny_args(tiny_model, corpus, out, *FLAGS)]) != 0
    assert [p.name for p in complete_checkpoints(out)] == [f"step-{SAVED:07d}"]
    return out


def test_a_registered_part_is_restored_exactly_after_a_kill(killed: Path, tiny_model: Path, corpus: dict,
                                                            tmp_path: Path) -> None:
    out = tmp_path / "requeued"
    shutil.copytree(killed, out)
    assert tallies_at(out / "checkpoints" / f"step-{SAVED:07d}", 2) == (
        {"steps": [1, 2, 3, 4]}, [{"rank": r, "steps": [1, 2, 3, 4]} for r in (0, 1)])
    assert launch([*tiny_args(tiny_model, corpus, out, *FLAGS, "--resume_from_checkpoint", "latest")]) == 0
    everything = list(range(1, STEPS + 1))
    assert tallies_at(out / "checkpoints" / f"step-{STEPS:07d}", 2) == (
        {"steps": everything}, [{"rank": r, "steps": everything} for r in (0, 1)])


def test_a_registered_part_is_restored_on_another_number_of_processes(
        killed: Path, tiny_model: Path, corpus: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """1 process resumes 2's checkpoint: the shared part goes on; a rank's own part, which was another
    process's, starts afresh, as the log says."""
    out = tmp_path / "one"
    with caplog.at_level("WARNING"):
        shared, own = in_process(tiny_args(tiny_model, corpus, out, *FLAGS, "--resume_from_checkpoint",
                                           str(killed / "checkpoints" / f"step-{SAVED:07d}")))
    assert shared.steps == list(range(1, STEPS + 1))
    assert own.steps == list(range(SAVED + 1, STEPS + 1))
    assert "tally_rank starts afresh" in caplog.text


def test_a_registered_part_is_restored_exactly_by_a_rollback(tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    """A spike at step 14 rolls back to step 12's checkpoint (the guard judges from its 11th step on): the part
    holds each step once, where a rollback that forgot it would hold steps 13 and 14 twice."""
    out = tmp_path / "rollback"
    shared, own = in_process(tiny_args(tiny_model, corpus, out, "--max_train_steps", "16", "--checkpointing_steps",
                                       "4", "--on_loss_spike", "rollback"), spike="14:1000")
    assert json.loads((out / "summary.json").read_text())["loss_spikes"] == {"skipped": 0, "rolled_back": 1}
    everything = list(range(1, 17))
    assert shared.steps == everything and own.steps == everything
    assert tallies_at(out / "checkpoints" / "step-0000016", 1) == ({"steps": everything},
                                                                  [{"rank": 0, "steps": everything}])
