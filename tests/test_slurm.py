"""`sbatch slurm/multinode.sh` on a real two-node Slurm cluster (tests/slurm_cluster.sh): one process
group across the nodes, the loss curve of a local run, a preemption that checkpoints, requeues and
resumes without losing or repeating a step, a cancel that saves and stays cancelled, and the launch
paths that must end at once or recover (--overwrite_output_dir, an earlier attempt that saved no
checkpoint, a taken port)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import (
    CLUSTER,
    NO_DROPOUT,
    REPO,
    SAME_STEPS,
    assert_matches_one_process,
    last_step,
    read_metrics,
    tiny_args,
    train_losses,
    wait_for,
)

STEPS = 40


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "GONE")


def sbatch(env: dict, out: Path, *args: str, options: tuple[str, ...] = ()) -> str:
    log = str(out.parent / "job-%j.out")
    proc = subprocess.run(["sbatch", "--parsable", "-o", log, "-e", log, *options,
                           str(REPO / "slurm" / "multinode.sh"), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job_fields(env: dict, job: str) -> dict[str, str]:
    """`scontrol show job` as key -> value (JobState, Restarts, ExitCode, ...); {} once it is gone."""
    proc = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True)
    return dict(f.split("=", 1) for f in proc.stdout.split() if "=" in f)


def job_state(env: dict, job: str) -> str:
    return job_fields(env, job).get("JobState", "GONE")


def wait_done(env: dict, job: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_state(env, job)
        if state in ENDED:
            return state
        time.sleep(0.5)
    raise AssertionError(f"job {job} still {job_state(env, job)} after {timeout} s")


def job_args(tiny_model: Path, corpus: dict, out: Path) -> list[str]:
    return tiny_args(tiny_model, corpus, out, "--max_train_steps", str(STEPS), "--checkpointing_steps",
                     str(STEPS // 2), *NO_DROPOUT)


@pytest.fixture(scope="module")
def uninterrupted(slurm: dict, tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sbatch") / "run"
    job = sbatch(slurm, out, *job_args(tiny_model, corpus, out))
    assert wait_done(slurm, job, 300) == "COMPLETED", (out.parent / f"job-{job}.out").read_text()[-3000:]
    return out


def test_two_nodes_form_one_group_and_train_the_local_curve(uninterrupted: Path, tiny_model: Path, corpus: dict,
                                                            tmp_path: Path) -> None:
    log = next(uninterrupted.parent.glob("job-*.out")).read_text()
    assert "2 node(s) x 1 process(es), master n1:" in log
    assert "topology: 2 process(es) on 2 node(s), DistributedType.MULTI_CPU, started by torchrun (master n1:" in log
    # the same global batch (2 nodes x 8) in one local process
    assert_matches_one_process(uninterrupted, tiny_model, corpus, tmp_path, STEPS)


def test_preemption_checkpoints_requeues_and_resumes(slurm: dict, uninterrupted: Path, tiny_model: Path,
                                                     corpus: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    job = sbatch(slurm, out, *job_args(tiny_model, corpus, out))
    wait_for(lambda: last_step(out) >= 5, 180, "step 5 of the job")
    # what Slurm sends ahead of a preemption or the time limit (--signal=B:USR1@120)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm, check=True)
    assert wait_done(slurm, job, 400) == "COMPLETED"
    log = (tmp_path / f"job-{job}.out").read_text()
    assert "preemption warning" in log and f"requeueing job {job}" in log
    assert f"job {job} (restart 1)" in log
    stopped_at = int(log.split("mlm_ddp.train: stopped at step ")[1].split()[0])
    assert 5 <= stopped_at < STEPS
    assert f"resumed from {out / 'checkpoints' / f'step-{stopped_at:07d}'} at step {stopped_at}" in log
    records = [r for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # none lost, none repeated
    assert json.loads((out / "summary.json").read_text())["steps"] == STEPS
    a, b = train_losses(uninterrupted), train_losses(out)
    assert max(abs(a[s] - b[s]) / a[s] for s in a) <= SAME_STEPS


def test_a_two_node_checkpoint_resumes_on_one_node_with_the_same_losses(slurm: dict, uninterrupted: Path,
                                                                          tiny_model: Path, corpus: dict,
                                                                          tmp_path: Path) -> None:
    # the requeued job came back on one node: the per-device batch doubles, the global batch stays 16
    out = tmp_path / "run"
    half = f"step-{STEPS // 2:07d}"
    shutil.copytree(uninterrupted / "checkpoints" / half, out / "checkpoints" / half)
    job = sbatch(slurm, out, *job_args(tiny_model, corpus, out), "--per_device_train_batch_size", "16",
                 options=("--nodes=1",))
    assert wait_done(slurm, job, 300) == "COMPLETED", (tmp_path / f"job-{job}.out").read_text()[-3000:]
    log = (tmp_path / f"job-{job}.out").read_text()
    assert "topology: 1 process(es) on 1 node(s)" in log
    assert f"resumed from {out / 'checkpoints' / half} at step {STEPS // 2}, written by 2 process(es)" in log
    a, b = train_losses(uninterrupted), train_losses(out)
    assert sorted(b) == list(range(STEPS // 2 + 1, STEPS + 1))
    assert max(abs(a[s] - b[s]) / a[s] for s in b) <= SAME_STEPS


def test_overwrite_output_dir_is_refused_before_anything_runs(slurm: dict, tiny_model: Path, corpus: dict,
                                                               tmp_path: Path) -> None:
    # every attempt resumes --output_dir: erasing it would lose a requeued job's checkpoints
    out = tmp_path / "run"
    job = sbatch(slurm, out, *job_args(tiny_model, corpus, out), "--overwrite_output_dir")
    assert wait_done(slurm, job, 120) == "FAILED"
    fields = job_fields(slurm, job)
    log = (tmp_path / f"job-{job}.out").read_text()
    assert fields["ExitCode"] == "2:0" and fields["Restarts"] == "0", log
    [line] = log.splitlines()  # one line, before any srun step or output
    assert line.startswith("slurm/multinode.sh: error: --overwrite_output_dir") and str(out) in line
    assert "choose another --output_dir" in line
    assert not out.exists()


def test_scancel_saves_a_checkpoint_and_does_not_requeue(slurm: dict, tiny_model: Path, corpus: dict,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "run"
    # enough steps to be running when cancelled, few enough that a job which requeued itself ends soon
    job = sbatch(slurm, out, *tiny_args(tiny_model, corpus, out, "--max_train_steps", "400"))
    wait_for(lambda: last_step(out) >= 3, 180, "step 3 of the job")
    subprocess.run(["scancel", job], env=slurm, check=True)
    # a requeue shows as a restart count (and a job pending or running again)
    wait_for(lambda: job_state(slurm, job) in ENDED or job_fields(slurm, job).get("Restarts", "0") != "0",
             120, f"job {job} to end")
    time.sleep(3)  # a requeue from the batch script would come after the step ended
    fields, log = job_fields(slurm, job), (tmp_path / f"job-{job}.out").read_text()
    assert fields["JobState"] == "CANCELLED" and fields["Restarts"] == "0", log[-3000:]
    assert "not requeueing" in log and "requeueing job" not in log
    stopped = json.loads((out / "stopped.json").read_text())
    assert stopped["reason"] == "signal SIGTERM" and 3 <= stopped["step"], stopped
    assert (Path(stopped["checkpoint"]) / "COMPLETE").is_file()


@pytest.fixture(scope="module")
def over_a_dead_attempt_on_a_taken_port(slurm: dict, tiny_model: Path, corpus: dict,
                                        tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One job for two launch paths: --output_dir holds an earlier attempt of the same run that died
    (SIGKILL: a node failure, an OOM kill) before its first checkpoint, which is what a requeued job
    finds then; and another program listens on the job-id port of the master node."""
    out = tmp_path_factory.mktemp("dead_attempt") / "run"
    args = job_args(tiny_model, corpus, out)
    first = subprocess.Popen([sys.executable, "-m", "mlm_ddp.train", "--resume_from_checkpoint", "auto", *args],
                             cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: last_step(out) >= 2, 180, "step 2 of the first attempt")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert not (out / "checkpoints").exists() and not (out / "summary.json").exists()
    job = sbatch(slurm, out, *args, options=("--hold",))  # held: its port is known before it runs
    port = 15000 + int(job) % 15000
    with socket.socket() as taken:  # the test and both nodes share this machine's ports
        taken.bind(("", port))
        taken.listen()
        subprocess.run(["scontrol", "release", job], env=slurm, check=True)
        try:
            state = wait_done(slurm, job, 300)
        except AssertionError:
            subprocess.run(["scancel", job], env=slurm)  # a rendezvous on a taken port hangs
            raise
    return {"out": out, "job": job, "port": port, "state": state,
            "log": (out.parent / f"job-{job}.out").read_text()}


def test_a_taken_job_id_port_moves_to_the_next_free_one(over_a_dead_attempt_on_a_taken_port: dict) -> None:
    run = over_a_dead_attempt_on_a_taken_port
    port, log = run["port"], run["log"]
    assert run["state"] == "COMPLETED", log[-3000:]
    assert f"port {port} (15000 + job id % 15000) is taken on n1; using {port + 1}, the next free one" in log
    assert f"master n1:{port + 1}" in log


def test_an_attempt_that_died_before_its_first_checkpoint_is_started_over(
        over_a_dead_attempt_on_a_taken_port: dict) -> None:
    run = over_a_dead_attempt_on_a_taken_port
    out = run["out"]
    assert run["state"] == "COMPLETED", run["log"][-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == STEPS
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == list(range(1, STEPS + 1))


def test_srun_one_task_per_process_is_recognised_and_connects(slurm: dict) -> None:
    # the way Submitit starts tasks: no torchrun, only Slurm variables (mlm_ddp.distributed reads them)
    proc = subprocess.run(["srun", "-N2", "--ntasks-per-node=1", sys.executable, "-m", "mlm_ddp.distributed",
                           "--connect", "--timeout", "60"], cwd=REPO, env=slurm, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] launcher      slurm" in proc.stdout
        assert f"[rank {rank}] connected: 2 process(es), DistributedType.MULTI_CPU" in proc.stdout
    assert "[rank 1] master        n1:" in proc.stdout
    assert "(local rank 0 of 1 on node 1 of 2)" in proc.stdout


@pytest.mark.parametrize("script", ["multinode.sh", "singlenode.sh"])
def test_outside_an_allocation_the_scripts_fail_at_once(script: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    # a hang would hit the subprocess timeout
    proc = subprocess.run(["bash", str(REPO / "slurm" / script), "--max_train_steps", "1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "not inside a Slurm allocation" in proc.stderr and "sbatch slurm/" in proc.stderr


def test_the_scripts_pass_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    proc = subprocess.run([shellcheck, *map(str, sorted((REPO / "slurm").glob("*.sh"))), str(CLUSTER)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
