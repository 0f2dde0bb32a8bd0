"""Faults, for real: kill -9 during a save, stop signals on one rank, a dead rank, a full disk,
non-finite gradients, and every kind of bad checkpoint. Each ends with one clear message, the right
exit code, and nothing lost."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import pytest
import torch
from safetensors.torch import load_file, save_file

from mlm_ddp.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_NONFINITE, EXIT_REQUEUE
from mlm_ddp.train import main
from tests.conftest import (
    CONFIGS,
    LAUNCH,
    NO_DROPOUT,
    REPO,
    assert_matches_one_process,
    free_port,
    last_step,
    read_metrics,
    run_module,
    tiny_args,
    wait_for,
)


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root and a hash of its bytes: to prove that nothing was touched."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def popen(args: list[str], env: dict | None = None, stdout: int | IO[str] = subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1",
                            **(env or {})}, stdout=stdout, stderr=subprocess.STDOUT, text=True)


TRAINING_MODULES = ("mlm_ddp.train", "tests.fault_driver")  # what a worker process runs


def workers_of(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the training processes that `accelerate launch` (torchrun in-process) started."""
    found: dict[int, int] = {}
    pending = [launcher_pid]
    while pending:
        pid = pending.pop()
        for task in Path(f"/proc/{pid}/task").iterdir():
            children = (task / "children").read_text().split()
            pending += [int(c) for c in children]
            for child in map(int, children):
                try:
                    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{child}/environ").read_text().split("\0")
                               if "=" in kv)
                except OSError:
                    continue
                cmdline = Path(f"/proc/{child}/cmdline").read_text()
                if "RANK" in env and any(module in cmdline for module in TRAINING_MODULES):
                    found[int(env["RANK"])] = child
    return found


# --- crash during a save ---------------------------------------------------------------------------


def test_kill_9_during_a_save_resumes_from_the_previous_checkpoint(tiny_model: Path, corpus: dict, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "run"
    args = tiny_args(tiny_model, corpus, out, "--max_train_steps", "6", "--checkpointing_steps", "2")
    proc = popen(["tests.fault_driver", "--slow_save_s", "2", *args])
    # every file of step 4 is written; the marker is not: the save is 2 s from complete
    half = out / "checkpoints" / ".tmp-step-0000004" / "trainer_state.json"
    try:
        wait_for(half.exists, 120, "the save of step 4")
    finally:
        proc.kill()  # SIGKILL: no handler, no cleanup
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [".tmp-step-0000004", "step-0000002"]

    with caplog.at_level("INFO"):
        code = main([*args, "--resume_from_checkpoint", "latest"])  # the resume, in this process
    said = "\n".join(record.getMessage() for record in caplog.records)
    assert code == 0, said[-3000:]
    assert "ignoring" in said and ".tmp-step-0000004: an incomplete checkpoint" in said
    assert "resumed from" in said and "step-0000002 at step 2" in said
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert json.loads((out / "summary.json").read_text())["steps"] == 6
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000002", "step-0000004", "step-0000006"]


# --- stop signals ----------------------------------------------------------------------------------


def test_sigusr1_to_one_rank_saves_one_checkpoint_on_both_and_resume_continues_the_curve(
        tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    """Dropout off, so that the stopped and resumed run is held to one process's curve at the same global
    batch (tests/test_resume.py restores two processes' dropout draws)."""
    steps, stopped = 60, tmp_path / "stopped"

    def launch(out: Path, *extra: str) -> list[str]:
        return [*LAUNCH, "--config_file", str(CONFIGS / "cpu_ddp.yaml"), "--main_process_port", str(free_port()),
                "-m", "mlm_ddp.train", *tiny_args(tiny_model, corpus, out, "--max_train_steps", str(steps),
                                                  "--per_device_train_batch_size", "4", *NO_DROPOUT,
                                                  *extra)]

    proc = popen(launch(stopped))
    try:
        wait_for(lambda: last_step(stopped) >= 5, 120, "step 5")
        ranks = workers_of(proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGUSR1)  # one rank only
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert output.count("exitcode  : 75") == 2 or ("exitcode  : 75" in output and "rank      : 1" in output)
    record = json.loads((stopped / "stopped.json").read_text())
    assert record["exit_code"] == EXIT_REQUEUE and 5 <= record["step"] < steps
    # written by rank 0, which got no signal itself: the step's vote told it which signal rank 1 got
    assert record["reason"] == "signal SIGUSR1"
    assert output.count("stopped at step") == 2 and output.count("on signal SIGUSR1;") == 2, output[-3000:]
    saved = Path(record["checkpoint"])
    assert saved.name == f"step-{record['step']:07d}" and (saved / "COMPLETE").exists()
    assert (saved / "random_states_0.pkl").exists() and (saved / "random_states_1.pkl").exists()

    resumed = run_module(launch(stopped, "--resume_from_checkpoint", "latest"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not (stopped / "stopped.json").exists()  # the resumed run finished what stopped
    assert_matches_one_process(stopped, tiny_model, corpus, tmp_path / "straight", steps, global_batch=8)


def test_a_second_signal_during_the_save_changes_nothing(tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = popen(["tests.fault_driver", "--slow_save_s", "2", *tiny_args(tiny_model, corpus, out, "--max_train_steps",
                                                                       "400", "--per_device_train_batch_size", "4")])
    try:
        wait_for(lambda: last_step(out) >= 3, 120, "step 3")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: any((out / "checkpoints").glob(".tmp-step-*/trainer_state.json")), 60, "the save")
        proc.send_signal(signal.SIGTERM)  # during the slow save
        proc.send_signal(signal.SIGUSR2)
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_REQUEUE, output[-3000:]
    record = json.loads((out / "stopped.json").read_text())
    assert record["reason"] == "signal SIGTERM"
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step-{record['step']:07d}"]
    assert (Path(record["checkpoint"]) / "COMPLETE").exists()


# --- a dead rank -----------------------------------------------------------------------------------


def two_machines(tiny_model: Path, corpus: dict, out: Path) -> list[subprocess.Popen]:
    """Two "machines", i.e. two separate launchers of one process each: no agent stops the survivor, only
    the broken connection (SIGKILL) or --ddp_timeout (SIGSTOP: the peer hangs, its sockets stay open).
    Their output: out.parent / machine<R>.log."""
    out.parent.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    args = tiny_args(tiny_model, corpus, out, "--max_train_steps", "100000", "--ddp_timeout", "20",
                     "--per_device_train_batch_size", "4")
    machines: list[subprocess.Popen] = []
    for rank in (0, 1):
        with open(out.parent / f"machine{rank}.log", "w") as log:  # a file: nobody reads a waiting run's pipe
            machines.append(popen([*LAUNCH, "--multi_gpu", "--num_machines", "2", "--machine_rank", str(rank),
                                   "--num_processes", "2", "--num_cpu_threads_per_process", "1", "--main_process_ip",
                                   "127.0.0.1", "--main_process_port", port, "--rdzv_backend", "static", "-m",
                                   "mlm_ddp.train", *args], env={"ACCELERATE_USE_CPU": "true"}, stdout=log))
    return machines


@pytest.fixture(scope="module")
def lost_ranks(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """fault -> what the survivor of a 2-machine run did once rank 1 got that signal at step 3 or later: its
    exit code, its output and the seconds from the signal to its exit (the signalled process is checked to be
    rank 1's one worker first). The hung rank's survivor waits out --ddp_timeout (20 s), mostly idle; the dead
    rank's run starts then and runs in that wait."""
    runs = {fault: tmp_path_factory.mktemp(fault) / "run" for fault in ("SIGSTOP", "SIGKILL")}
    machines: dict[str, list[subprocess.Popen]] = {}
    victims: dict[str, dict[int, int]] = {}
    signalled: dict[str, float] = {}
    lost: dict[str, dict] = {}
    try:
        for fault, out in runs.items():
            machines[fault] = two_machines(tiny_model, corpus, out)
            wait_for(lambda out=out: last_step(out) >= 3, 120, f"step 3 of the {fault} run")
            victims[fault] = workers_of(machines[fault][1].pid)
            assert list(victims[fault]) == [1], victims[fault]
            os.kill(victims[fault][1], getattr(signal, fault))
            signalled[fault] = time.monotonic()
        while len(lost) < len(runs):  # each survivor's exit, seen within 0.1 s of it
            assert time.monotonic() - min(signalled.values()) < 150, f"a survivor still runs: {lost}"
            for fault, out in runs.items():
                if fault not in lost and machines[fault][0].poll() is not None:
                    lost[fault] = {"exit": machines[fault][0].returncode, "took": time.monotonic() - signalled[fault],
                                   "output": (out.parent / "machine0.log").read_text()}
            time.sleep(0.1)
    finally:
        for fault in machines:
            if fault == "SIGSTOP" and 1 in victims.get(fault, {}):
                os.kill(victims[fault][1], signal.SIGKILL)
            for machine in machines[fault]:
                machine.kill()
                machine.wait()
    return lost


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_when_a_rank_dies_or_hangs_the_others_exit_promptly_and_the_lost_rank_is_named(
        fault: str, lost_ranks: dict[str, dict]) -> None:
    lost = lost_ranks[fault]
    survivor_output = lost["output"]
    print(f"{fault}: the survivor exited {lost['took']:.1f} s later")  # for the record: pytest -s
    assert lost["exit"] != 0 and lost["took"] < 120
    assert "rank 0 lost contact with the other process(es)" in survivor_output, survivor_output[-3000:]
    assert "rank 1" in survivor_output.split("lost contact", 1)[1][:400]


# --- non-finite gradients --------------------------------------------------------------------------


def test_nonfinite_gradients_stop_and_name_the_last_good_checkpoint(tiny_model: Path, corpus: dict,
                                                                    tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    code = main(tiny_args(tiny_model, corpus, out, "--max_train_steps", "6", "--checkpointing_steps", "1",
                          "--learning_rate", "1e12"))  # step 1 blows the weights up; step 2 is NaN
    assert code == EXIT_NONFINITE
    err = capsys.readouterr().err
    assert "step 2: the gradient norm is nan" in err and "last good checkpoint is" in err and "step-0000001" in err
    assert not (out / "final").exists()


def test_skipping_nonfinite_gradients_never_ends_a_run_that_took_no_update_as_done(tiny_model: Path, corpus: dict,
                                                                                    tmp_path: Path, capsys) -> None:
    """A NaN weight makes every step's loss NaN: 'skip' skips each update, and a run none of whose updates
    was taken ends with exit 3, not "done". A NaN step now and then is skipped and counted:
    test_precision.py."""
    broken = tmp_path / "nan_model"
    shutil.copytree(tiny_model, broken)
    weights = load_file(broken / "model.safetensors")
    name = next(k for k in weights if "encoder.layer.0.output.dense.weight" in k)
    weights[name][0, 0] = float("nan")
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "run"
    code = main(tiny_args(broken, corpus, out, "--max_train_steps", "3", "--on_nonfinite_loss", "skip",
                          "--checkpointing_steps", "2"))
    assert code == EXIT_NONFINITE
    assert "step 3: not one of this run's 3 update(s) was taken" in capsys.readouterr().err
    assert not (out / "final").exists()
    # no optimizer step was taken: the weights saved at step 2 are those loaded
    saved = load_file(out / "checkpoints" / "step-0000002" / "model.safetensors")
    assert torch.equal(torch.nan_to_num(saved["model." + name]), torch.nan_to_num(weights[name]))


# --- a full disk -----------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 900 KiB tmpfs: room for the run and one checkpoint of the tiny model (548 KiB), not two."""
    mount = tmp_path / "small"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=900k", "tmpfs", str(mount)], capture_output=True,
                            text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_disk_full_while_saving_keeps_the_previous_checkpoint(tiny_model: Path, corpus: dict, small_disk: Path,
                                                              capsys) -> None:
    out = small_disk / "run"
    code = main(tiny_args(tiny_model, corpus, out, "--max_train_steps", "6", "--checkpointing_steps", "2"))
    err = capsys.readouterr().err
    assert code == EXIT_FAILED, err[-2000:]
    assert "could not be written" in err and "step-0000002 is complete and intact" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000002"]  # no half-written folder
    # and it is usable: resume on a disk with room
    roomy = small_disk.parent / "roomy"
    shutil.copytree(out, roomy)
    assert main(tiny_args(tiny_model, corpus, roomy, "--max_train_steps", "6", "--checkpointing_steps", "2",
                          "--resume_from_checkpoint", "latest")) == 0


# --- bad checkpoints and changed settings ----------------------------------------------------------


@pytest.fixture(scope="module")
def finished_checkpoint(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "run"
    assert main(tiny_args(tiny_model, corpus, out, "--max_train_steps", "2", "--checkpointing_steps", "2")) == 0
    return out / "checkpoints" / "step-0000002"


class Payload:
    """Unpickling this runs a command: what a malicious 'checkpoint' would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def damage(case: str, folder: Path, tmp_path: Path) -> None:
    if case == "truncated_model":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif case == "foreign_folder":
        for path in folder.iterdir():
            if path.name not in ("COMPLETE", "trainer_state.json"):
                path.unlink()
    elif case == "pickle_payload":
        with open(folder / "optimizer.bin", "wb") as handle:
            pickle.dump(Payload(tmp_path / "pwned"), handle)
    elif case == "other_world_size":
        state = json.loads((folder / "trainer_state.json").read_text())
        (folder / "trainer_state.json").write_text(json.dumps({**state, "world_size": 2}))
        shutil.copy(folder / "random_states_0.pkl", folder / "random_states_1.pkl")  # as 2 processes write
    elif case == "garbage_state":
        (folder / "trainer_state.json").write_text("{not json")


@pytest.mark.parametrize(("case", "message"), [
    ("truncated_model", "cannot be resumed from .*damaged, from another model, or not written by mlm_ddp"),
    ("foreign_folder", "missing .*model.safetensors.*optimizer.bin"),
    ("pickle_payload", "cannot be resumed from .*UnpicklingError"),
    ("other_world_size", "global batch of 16 sequences per optimizer step \\(8 per device x 2 process\\(es\\) x 1 "
                         "accumulation\\) and this run's is 8.*--gradient_accumulation_steps 2"),
    ("garbage_state", "unreadable trainer state"),
    ("other_model", "other settings \\(model.config_overrides: None -> 'hidden_size=64'"),
    ("other_recipe", "training.learning_rate: 0.001 -> 0.002"),
])
def test_bad_checkpoints_are_refused_with_the_reason(case: str, message: str, finished_checkpoint: Path,
                                                     tiny_model: Path, corpus: dict, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    shutil.copytree(finished_checkpoint.parent.parent, out)
    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()
    damage(case, out / "checkpoints" / "step-0000002", tmp_path)
    extra = {"other_model": ["--config_overrides", "hidden_size=64"],
             "other_recipe": ["--learning_rate", "0.002"]}.get(case, [])
    before = snapshot(out)
    code = main(tiny_args(tiny_model, corpus, out, "--max_train_steps", "4", "--resume_from_checkpoint", "latest",
                          "--allow_lr_jump", *extra))
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT, err[-2000:]
    assert len([line for line in err.splitlines() if line.startswith("mlm_ddp.train: error:")]) == 1
    assert re.search(message, err, re.DOTALL), err[-2000:]
    assert snapshot(out) == before  # nothing written, nothing overwritten
    assert not (tmp_path / "pwned").exists()  # the payload never ran


def test_harmless_setting_changes_are_accepted_and_logged(finished_checkpoint: Path, tiny_model: Path,
                                                          corpus: dict, tmp_path: Path, caplog) -> None:
    out = tmp_path / "run"
    shutil.copytree(finished_checkpoint.parent.parent, out)
    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()
    with caplog.at_level("INFO"):
        code = main(tiny_args(tiny_model, corpus, out, "--max_train_steps", "4", "--resume_from_checkpoint",
                              "latest", "--logging_steps", "2", "--allow_lr_jump"))
    assert code == 0
    assert "resuming with a changed setting: run.logging_steps 1 -> 2" in caplog.text
    assert "resuming with a changed setting: training.max_train_steps 2 -> 4" in caplog.text
    # the linear decay ended at step 2; a run of 4 steps is at half the peak there: allowed, and said
    assert "at step 2 this run's schedule sets the learning rate to 0.0005 where the checkpoint's run was at 0" \
        in caplog.text
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
