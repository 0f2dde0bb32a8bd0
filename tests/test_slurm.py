"""`sbatch slurm/multinode.sh` on a real two-node Slurm cluster (tests/slurm_cluster.sh): one process
group across the nodes, the loss curve of a local run, a preemption that checkpoints, requeues and
resumes without losing or repeating a step, a cancel that saves and stays cancelled, the launch
paths that must end at once or recover (--overwrite_output_dir, an earlier attempt that saved no
checkpoint, a taken port), and the CPUs each node's launcher gets from srun and shares among its
processes as threads."""

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


def step_processes(job: str) -> list[dict[str, str]]:
    """The environments of the job's step-0 processes now running (the fixture's nodes are this machine):
    each node's launcher task (accelerate launch) and the training processes it started."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            raw = (proc / "environ").read_bytes()
        except OSError:  # not a process, gone, or not ours to read
            continue
        env = dict(entry.split("=", 1) for entry in raw.decode(errors="replace").split("\0") if "=" in entry)
        if env.get("SLURM_JOB_ID") == job and env.get("SLURM_STEP_ID") == "0":
            found.append(env)
    return found


def watch_until(job: str, done, timeout: float, what: str) -> dict[str, dict]:
    """Wait for `done()`, and return what the step's processes saw meanwhile, per node: the launcher task's
    environment (what srun gave it) and the OMP_NUM_THREADS of each training process (what accelerate
    launch gave them), e.g. {"n1": {"launcher": {...}, "omp": {"0": "2"}}}."""
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in step_processes(job):
            node = seen.setdefault(proc.get("SLURMD_NODENAME", "?"), {"launcher": None, "omp": {}})
            if "LOCAL_RANK" in proc:  # a training process: torchrun numbers them on each node
                node["omp"][proc["LOCAL_RANK"]] = proc.get("OMP_NUM_THREADS")
            else:
                node["launcher"] = proc
        if done():
            return seen
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def wait_done_watching(env: dict, job: str, timeout: float) -> tuple[str, dict[str, dict]]:
    """wait_done, and what the step's processes saw while the job ran (watch_until)."""
    seen = watch_until(job, lambda: job_state(env, job) in ENDED, timeout, f"job {job} to end")
    return job_state(env, job), seen


def assert_cpus(log: str, seen: dict[str, dict], nodes: tuple[str, ...], cpus: int, threads: int) -> None:
    """The job chose `cpus` CPUs for each node's launcher task and `threads` threads for each of its (one)
    process, and said so; srun gave the launcher those CPUs, and accelerate launch the process those threads."""
    assert (f"mlm_ddp: {cpus} CPU(s) per task (one task per node: srun --cpus-per-task={cpus}), 1 process(es) "
            f"per node, {threads} thread(s) per process") in log, log[-3000:]
    assert sorted(seen) == sorted(nodes), seen.keys()
    for node in nodes:
        assert seen[node]["launcher"]["SLURM_CPUS_PER_TASK"] == str(cpus), (node, seen[node]["launcher"])
        assert seen[node]["omp"] == {"0": str(threads)}, (node, seen[node]["omp"])


def job_args(tiny_model: Path, corpus: dict, out: Path) -> list[str]:
    return tiny_args(tiny_model, corpus, out, "--max_train_steps", str(STEPS), "--checkpointing_steps",
                     str(STEPS // 2), *NO_DROPOUT)


@pytest.fixture(scope="module")
def cancelled_then_preempted(slurm: dict, tiny_model: Path, corpus: dict,
                             tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One run through both stops, in two jobs: the first cancelled (scancel: SIGTERM), then the same
    command again (each attempt resumes --output_dir), warned of a preemption midway, requeued and run to
    the end. What the cancel left is read before the second job can change it. The file's one 2-node run of
    the job as shipped (#SBATCH lines unchanged): its whole curve is the local one, what its first job's
    processes saw is the CPUs srun gave them, and its 2-node checkpoints resume on one node."""
    out = tmp_path_factory.mktemp("stops") / "run"
    cancelled = sbatch(slurm, out, *job_args(tiny_model, corpus, out))
    seen = watch_until(cancelled, lambda: last_step(out) >= 3, 180, "step 3 of the job")
    subprocess.run(["scancel", cancelled], env=slurm, check=True)
    # a requeue shows as a restart count (and a job pending or running again)
    wait_for(lambda: job_state(slurm, cancelled) in ENDED or job_fields(slurm, cancelled).get("Restarts", "0") != "0",
             120, f"job {cancelled} to end")
    time.sleep(3)  # a requeue from the batch script would come after the step ended
    run = {"out": out, "cancelled": cancelled, "seen": seen, "cancelled_fields": job_fields(slurm, cancelled),
           "cancelled_log": (out.parent / f"job-{cancelled}.out").read_text(),
           "stopped_json": json.loads((out / "stopped.json").read_text())}
    run["checkpoint_complete"] = (Path(run["stopped_json"]["checkpoint"]) / "COMPLETE").is_file()
    job = run["preempted"] = sbatch(slurm, out, *job_args(tiny_model, corpus, out))
    resumed_at = run["stopped_json"]["step"]
    wait_for(lambda: last_step(out) >= resumed_at + 3, 180, f"step {resumed_at + 3} of job {job}")
    # what Slurm sends ahead of a preemption or the time limit (--signal=B:USR1@120)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm, check=True)
    run["preempted_state"] = wait_done(slurm, job, 400)
    run["log"] = (out.parent / f"job-{job}.out").read_text()
    return run


def test_two_nodes_form_one_group_and_train_the_local_curve(cancelled_then_preempted: dict, tiny_model: Path,
                                                            corpus: dict, tmp_path: Path) -> None:
    """Cancelled, resumed, preempted, requeued and resumed again, every step of the 2-node run is the step of one
    local process with the same global batch (2 nodes x 8): the group forms across the nodes, and each resume
    continues exactly."""
    log = cancelled_then_preempted["cancelled_log"]
    assert "2 node(s) x 1 process(es), master n1:" in log
    assert "topology: 2 process(es) on 2 node(s), DistributedType.MULTI_CPU, started by torchrun (master n1:" in log
    assert_matches_one_process(cancelled_then_preempted["out"], tiny_model, corpus, tmp_path, STEPS)


def test_srun_gives_each_node_s_launcher_the_job_s_cpus_and_its_process_as_many_threads(
        cancelled_then_preempted: dict) -> None:
    # #SBATCH --cpus-per-task=2 on each node: srun must be given them again (Slurm >= 22.05)
    run = cancelled_then_preempted
    assert_cpus(run["cancelled_log"], run["seen"], ("n1", "n2"), cpus=2, threads=2)


def test_scancel_saves_a_checkpoint_and_does_not_requeue(cancelled_then_preempted: dict) -> None:
    run = cancelled_then_preempted
    fields, log = run["cancelled_fields"], run["cancelled_log"]
    assert fields["JobState"] == "CANCELLED" and fields["Restarts"] == "0", log[-3000:]
    assert "not requeueing" in log and "requeueing job" not in log
    stopped = run["stopped_json"]
    assert stopped["reason"] == "signal SIGTERM" and 3 <= stopped["step"] < STEPS, stopped
    assert run["checkpoint_complete"]


def test_preemption_checkpoints_requeues_and_resumes(cancelled_then_preempted: dict) -> None:
    """The second job of `cancelled_then_preempted`: it resumed from the cancel's checkpoint, and the
    preemption warning stops, saves, requeues and resumes it."""
    run = cancelled_then_preempted
    job, out, log = run["preempted"], run["out"], run["log"]
    assert run["preempted_state"] == "COMPLETED", log[-3000:]
    assert "preemption warning" in log and f"requeueing job {job}" in log
    assert f"job {job} (restart 1)" in log
    cancelled_at = run["stopped_json"]["step"]
    assert f"resumed from {out / 'checkpoints' / f'step-{cancelled_at:07d}'} at step {cancelled_at}" in log
    stopped_at = int(log.split("mlm_ddp.train: stopped at step ")[1].split()[0])
    assert cancelled_at < stopped_at < STEPS  # a step this job trained before the warning
    assert f"resumed from {out / 'checkpoints' / f'step-{stopped_at:07d}'} at step {stopped_at}" in log
    records = [r for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # none lost, none repeated
    assert json.loads((out / "summary.json").read_text())["steps"] == STEPS


def test_a_two_node_checkpoint_resumes_on_one_node_with_the_same_losses(slurm: dict, cancelled_then_preempted: dict,
                                                                          tiny_model: Path, corpus: dict,
                                                                          tmp_path: Path) -> None:
    # the requeued job came back on one node: the per-device batch doubles, the global batch stays 16.
    # It holds the whole node (--exclusive: 2 CPUs) while --cpus-per-task says 1: the launcher gets the
    # node's 2, which only an explicit srun --cpus-per-task gives it (srun alone would pass on the 1).
    two_nodes = cancelled_then_preempted["out"]  # its whole curve is the local one
    out = tmp_path / "run"
    half = f"step-{STEPS // 2:07d}"
    shutil.copytree(two_nodes / "checkpoints" / half, out / "checkpoints" / half)
    job = sbatch(slurm, out, *job_args(tiny_model, corpus, out), "--per_device_train_batch_size", "16",
                 options=("--nodes=1", "--exclusive", "--cpus-per-task=1"))
    state, seen = wait_done_watching(slurm, job, 300)
    log = (tmp_path / f"job-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert "topology: 1 process(es) on 1 node(s)" in log
    [node] = seen
    assert_cpus(log, seen, (node,), cpus=2, threads=2)
    assert f"resumed from {out / 'checkpoints' / half} at step {STEPS // 2}, written by 2 process(es)" in log
    a, b = train_losses(two_nodes), train_losses(out)
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


@pytest.fixture(scope="module")
def over_a_dead_attempt_on_a_taken_port(slurm: dict, tiny_model: Path, corpus: dict,
                                        tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One job for three launch paths: --output_dir holds an earlier attempt of the same run that died
    (SIGKILL: a node failure, an OOM kill) before its first checkpoint, which is what a requeued job
    finds then; another program listens on the job-id port of the master node; and the job holds one
    CPU per node, fewer than this machine's 2 cores: that one is each node's launcher's, and its
    process's one thread."""
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
    job = sbatch(slurm, out, *args, options=("--hold", "--cpus-per-task=1"))  # held: its port is known
    port = 15000 + int(job) % 15000
    with socket.socket() as taken:  # the test and both nodes share this machine's ports
        taken.bind(("", port))
        taken.listen()
        subprocess.run(["scontrol", "release", job], env=slurm, check=True)
        try:
            state, seen = wait_done_watching(slurm, job, 300)
        except AssertionError:
            subprocess.run(["scancel", job], env=slurm)  # a rendezvous on a taken port hangs
            raise
    return {"out": out, "job": job, "port": port, "state": state, "seen": seen,
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


def test_one_cpu_per_node_gives_each_process_one_thread(over_a_dead_attempt_on_a_taken_port: dict) -> None:
    run = over_a_dead_attempt_on_a_taken_port
    assert run["state"] == "COMPLETED", run["log"][-3000:]
    assert_cpus(run["log"], run["seen"], ("n1", "n2"), cpus=1, threads=1)


def fake_slurm_bin(folder: Path) -> Path:
    """srun, scontrol and accelerate that only say how they were called: srun runs its command once, as
    node 0, with the --cpus-per-task it was given (as real srun exports it); accelerate prints its flags."""
    folder.mkdir()
    scripts = {
        "scontrol": '[[ "$1 $2" == "show hostnames" ]] && echo n1',
        "srun": 'echo "srun $*"; cpus=; while [[ $1 == --* ]]; do\n'
                '    [[ $1 == --cpus-per-task=* ]] && cpus=${1#*=}; shift; done\n'
                'SLURM_NODEID=0 SLURM_CPUS_PER_TASK=$cpus exec "$@"',
        "accelerate": 'echo "accelerate $*"',
    }
    for name, body in scripts.items():
        (folder / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (folder / name).chmod(0o755)
    return folder


@pytest.mark.parametrize(("gpus", "job_cpus", "procs", "cpus", "threads"), [
    ("8", "96(x2)", None, 96, 12),     # 8-GPU nodes, whole (--exclusive)
    ("8", "96,64", None, 64, 8),       # nodes that differ: the fewest CPUs, which every node has
    ("8", "2(x2)", None, 2, 1),        # --cpus-per-task=2 left in: at least 1 thread, and a warning
    (None, "8(x2)", "3", 8, 2),        # CPU processes (PROCS_PER_NODE): 8 // 3
])
def test_gpu_nodes_give_the_launcher_their_cpus_and_each_process_a_share(
        tmp_path: Path, gpus: str | None, job_cpus: str, procs: str | None, cpus: int, threads: int) -> None:
    # What the two-CPU fixture cluster cannot show (it has no GPUs): the arithmetic for GPU nodes, with
    # srun and accelerate replaced by fakes that print how they were called.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PROCS_PER_NODE"))}
    env.update(SLURM_JOB_ID="123", SLURM_JOB_NODELIST="n[1-2]", SLURM_NNODES="2", SLURM_SUBMIT_DIR=str(REPO),
               SLURM_JOB_CPUS_PER_NODE=job_cpus, SLURM_CPUS_PER_TASK="2",
               PATH=f"{fake_slurm_bin(tmp_path / 'bin')}:{Path(sys.executable).parent}:{os.environ['PATH']}")
    if gpus:
        env["SLURM_GPUS_ON_NODE"] = gpus
    if procs:
        env["PROCS_PER_NODE"] = procs
    proc = subprocess.run(["bash", str(REPO / "slurm" / "multinode.sh"), "--output_dir", str(tmp_path / "run")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    per_node = int(gpus or procs)
    assert (f"mlm_ddp: {cpus} CPU(s) per task (one task per node: srun --cpus-per-task={cpus}), {per_node} "
            f"process(es) per node, {threads} thread(s) per process") in proc.stdout
    assert f"srun --kill-on-bad-exit=0 --ntasks=2 --ntasks-per-node=1 --cpus-per-task={cpus} bash -c" in proc.stdout
    assert (f"--num_processes {2 * per_node} --num_cpu_threads_per_process {threads} "
            "--main_process_ip n1") in proc.stdout
    assert ("warning: 2 CPU(s) for the 8 process(es) of each node" in proc.stdout) == (cpus < per_node)


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
