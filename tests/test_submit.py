"""`python -m mlm_ddp.submit`: in-process without Slurm, across two nodes of the real local cluster,
through a preemption, refusing bad input before anything is submitted, and ending clearly when a
run already finished or bad input shows only on the cluster."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from mlm_ddp.submit import main
from tests.conftest import (
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
from tests.test_slurm import job_fields, wait_done

STEPS = 30


def submit(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlm_ddp.submit", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def job_args(tiny_model: Path, corpus: dict, out: Path) -> list[str]:
    return tiny_args(tiny_model, corpus, out, "--max_train_steps", str(STEPS), "--checkpointing_steps",
                     str(STEPS // 2), *NO_DROPOUT)


def test_debug_cluster_runs_the_job_end_to_end(tiny_model: Path, corpus: dict, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    args = ["--cluster", "debug", "--wait", *tiny_args(tiny_model, corpus, out, "--max_train_steps", "3")]
    assert main(args) == 0
    assert "finished in" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    assert (out / "final" / "model.safetensors").exists()
    # submitted again: the run is finished, which is a success with one line, not a failure
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "finished in" in captured.out and ": 3 steps" in captured.out
    assert [line for line in captured.err.splitlines() if line.startswith("mlm_ddp.submit:")] == [
        f"mlm_ddp.submit: --output_dir {out} holds a finished run (3 steps): nothing to do"]


@pytest.mark.parametrize(("case", "message"), [
    ("unknown_flag", "--no_such_flag"),
    ("nodes_0", "--nodes must be at least 1"),
    ("unwritable_job_dir", "--job_dir .*cannot be written"),
    ("missing_train_file", "--train_file .*no such file"),
    ("local_two_nodes", "--cluster local runs one process"),
    ("timeout_0", "--timeout_min must be at least 1 minute, got 0"),
    ("cpus_0", "--cpus_per_task must be at least 1, got 0"),
    ("mem_negative", "--mem_gb must be positive, got -4"),
    ("signal_negative", r"--signal_delay_s must be in \[0, 86400\), got -5 "
                        r"\(seconds, within --timeout_min's 86400 s\)"),
    ("no_slurm_here", "--cluster slurm: sbatch and srun not found on PATH"),
    ("overwrite", "^mlm_ddp.submit: error: --overwrite_output_dir: every attempt of this job.*resumes --output_dir "
                  ".*choose another --output_dir, and submit without --overwrite_output_dir$"),
    # sbatch itself refuses (a partition, an account, a limit): its reason, and the files submitit wrote removed
    ("sbatch_refuses", "^mlm_ddp.submit: error: Slurm refused the job: invalid partition specified: gpu-typo; Batch "
                       "job submission failed: Invalid partition name specified$"),
    ("sbatch_refuses_in_job_dir", "^mlm_ddp.submit: error: Slurm refused the job: invalid partition"),
])
def test_bad_input_is_refused_before_submission(case: str, message: str, tiny_model: Path, corpus: dict,
                                                tmp_path: Path, capsys: pytest.CaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process (main(argv), as `python -m mlm_ddp.submit` calls it): a refusal is parsed and checked
    before anything is submitted, so no interpreter start is needed to see it."""
    out = tmp_path / "run"
    args = tiny_args(tiny_model, corpus, out, "--max_train_steps", "3")
    extra = {"unknown_flag": ["--no_such_flag", "1"], "nodes_0": ["--nodes", "0"],
             # --cluster local: reaches the job folder with or without Slurm on this machine
             "unwritable_job_dir": ["--job_dir", str(corpus["train"] / "jobs"), "--cluster", "local"],
             "missing_train_file": ["--train_file", str(tmp_path / "absent.txt")],
             "local_two_nodes": ["--cluster", "local", "--nodes", "2"],
             "timeout_0": ["--timeout_min", "0"], "cpus_0": ["--cpus_per_task", "0"],
             "mem_negative": ["--mem_gb", "-4"], "signal_negative": ["--signal_delay_s", "-5"], "no_slurm_here": [],
             "overwrite": ["--overwrite_output_dir"], "sbatch_refuses": ["--partition", "gpu-typo"],
             "sbatch_refuses_in_job_dir": ["--job_dir", str(tmp_path / "jobs")]}[case]
    if case == "no_slurm_here":  # a PATH without Slurm's commands, as on a laptop
        monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    if case.startswith("sbatch_refuses"):
        fake = tmp_path / "bin"
        fake.mkdir()
        (fake / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: gpu-typo' >&2\n"
                                     "echo 'sbatch: error: Batch job submission failed: Invalid partition name "
                                     "specified' >&2\nexit 1\n")
        (fake / "srun").write_text("#!/bin/sh\nexit 0\n")
        for command in fake.iterdir():
            command.chmod(0o755)
        monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
        (tmp_path / "jobs").mkdir()
        (tmp_path / "jobs" / "notes.txt").write_text("the user's own")
    try:
        code = main([*args, *extra])
    except SystemExit as exited:  # argparse's refusal of a flag
        code = exited.code
    said = capsys.readouterr()
    assert code == 2, said.out + said.err
    assert re.search(message, said.err, re.MULTILINE), said.err
    if case != "unknown_flag":  # argparse adds its usage
        assert len(said.err.strip().splitlines()) == 1, said.err
    assert "submitted job" not in said.out and not out.exists()
    if case.startswith("sbatch_refuses"):  # a job folder that was there keeps what it held, and only that
        assert [p.name for p in (tmp_path / "jobs").iterdir()] == ["notes.txt"]


def task_logs(job_dir: Path, job: str) -> list[str]:
    return [p.read_text() for p in sorted((job_dir / job).glob("*_log.err"))]


@pytest.fixture(scope="module")
def cancelled_then_preempted(slurm: dict, tiny_model: Path, corpus: dict,
                             tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One run through both stops, in two jobs: the first job cancelled (scancel: SIGTERM to every task),
    then the same command again, with --wait, warned of a preemption (SIGUSR2) midway, requeued, and run to
    the end. What each stop left is read before the next job can change it. The suite's one 2-node training run
    through Submitit: its whole curve is the local one (test_two_nodes_train_the_local_curve), and the other
    tests read its folder (a finished run, its 2-node checkpoints)."""
    out = tmp_path_factory.mktemp("stops") / "run"
    args = ["--nodes", "2", "--partition", "test", *job_args(tiny_model, corpus, out)]
    proc = submit(slurm, *args)
    assert proc.returncode == 0, proc.stderr
    cancelled = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    wait_for(lambda: last_step(out) >= 3, 180, "step 3 of the job")
    subprocess.run(["scancel", cancelled], env=slurm, check=True)  # as a user cancels: SIGTERM to every task
    # rank 0 ends with what it decided: not requeued (or, wrongly, requeued, or a traceback)
    wait_for(lambda: any(s in (task_logs(out / "submitit", cancelled) or [""])[0]
                         for s in ("not requeued", "requeued job", "Traceback")), 120,
             f"rank 0 of job {cancelled} to end")
    wait_done(slurm, cancelled, 120)
    run = {"out": out, "cancelled": cancelled, "cancelled_fields": job_fields(slurm, cancelled),
           "cancelled_logs": task_logs(out / "submitit", cancelled),
           "stopped_json": json.loads((out / "stopped.json").read_text())}
    run["checkpoint_complete"] = (Path(run["stopped_json"]["checkpoint"]) / "COMPLETE").is_file()
    # the same command again, waiting for the end as a user would; warned of a preemption once it trains
    again = subprocess.Popen([sys.executable, "-m", "mlm_ddp.submit", *args, "--wait"], cwd=REPO, text=True,
                             env={**slurm, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = again.stdout.readline()
        found = re.search(r"submitted job (\d+)", first)
        assert found, first + again.stderr.read()
        job = run["preempted"] = found.group(1)
        resumed_at = run["stopped_json"]["step"]
        wait_for(lambda: last_step(out) >= resumed_at + 3, 180, f"step {resumed_at + 3} of job {job}")
        run["signalled"] = datetime.now()
        subprocess.run(["scancel", "--signal=USR2", job], env=slurm, check=True)  # as Slurm warns Submitit jobs
        rest, err = again.communicate(timeout=400)
    finally:
        if again.poll() is None:
            again.kill()
            again.wait()
    run.update(wait=again.returncode, wait_out=first + rest, wait_err=err,
               preempted_state=wait_done(slurm, job, 60),  # Slurm records the end a moment after --wait returns
               cancelled_restarts=job_fields(slurm, cancelled)["Restarts"])
    return run


def test_two_nodes_train_the_local_curve(cancelled_then_preempted: dict, tiny_model: Path, corpus: dict,
                                        tmp_path: Path) -> None:
    """Cancelled, resumed, preempted, requeued and resumed again, every step of the 2-node run is the step of
    one local process with the same global batch: the group forms across the nodes, and each resume
    continues exactly."""
    run = cancelled_then_preempted
    log = run["cancelled_logs"][0]
    assert "topology: 2 process(es) on 2 node(s), DistributedType.MULTI_CPU, started by submitit (master n1:" in log
    assert_matches_one_process(run["out"], tiny_model, corpus, tmp_path, STEPS)


def test_scancel_saves_a_checkpoint_and_is_not_requeued(cancelled_then_preempted: dict) -> None:
    run = cancelled_then_preempted
    fields, logs = run["cancelled_fields"], run["cancelled_logs"]
    assert (fields["JobState"], fields["Restarts"]) == ("CANCELLED", "0"), fields
    assert len(logs) == 2 and not any("Traceback" in log for log in logs), "\n".join(logs)
    stopped = re.findall(r"stopped at step (\d+) on signal SIGTERM", "\n".join(logs))
    assert len(stopped) == 2 and len(set(stopped)) == 1  # both ranks, the same step
    assert logs[0].count("mlm_ddp.submit: not requeued: SIGTERM is not the preemption warning (SIGUSR2); "
                         "resubmit the same command to continue") == 1
    assert "requeued job" not in logs[0]
    record = run["stopped_json"]
    assert (record["reason"], record["step"]) == ("signal SIGTERM", int(stopped[0]))
    assert run["checkpoint_complete"]
    # the same command again continues from that checkpoint and finishes
    assert run["wait"] == 0, run["wait_out"] + run["wait_err"]
    assert f": {STEPS} steps" in run["wait_out"]
    assert re.search(r"submitted job \d+ \(2 node\(s\)\)", run["wait_out"]) and "finished in" in run["wait_out"]
    assert re.search(r"resumed from .*step-0*" + stopped[0] + r"\b",
                     task_logs(run["out"] / "submitit", run["preempted"])[0])
    assert [r["step"] for r in read_metrics(run["out"]) if "loss" in r] == list(range(1, STEPS + 1))
    assert run["cancelled_restarts"] == "0"  # and the cancelled job never came back meanwhile


def test_preemption_saves_on_every_rank_requeues_and_resumes(cancelled_then_preempted: dict) -> None:
    """The second job of `cancelled_then_preempted`: it resumed from the cancel's checkpoint, and the
    preemption warning stops, saves, requeues and resumes it."""
    run = cancelled_then_preempted
    job, out = run["preempted"], run["out"]
    assert run["preempted_state"] == "COMPLETED"
    logs = "\n".join(task_logs(out / "submitit", job))
    stopped = re.findall(r"stopped at step (\d+) on signal SIGUSR2", logs)
    assert len(stopped) == 2 and len(set(stopped)) == 1  # both ranks, the same step
    assert f"requeued job {job}" in logs
    step = int(stopped[0])
    assert run["stopped_json"]["step"] < step < STEPS  # a step this job trained before the warning
    resumed = re.search(r"(\d\d:\d\d:\d\d) INFO mlm_ddp.loop.checkpoint: \[RANK 0\] resumed from .*step-0*"
                        + str(step), logs)
    assert resumed
    signalled = run["signalled"]
    took = (datetime.combine(signalled.date(), datetime.strptime(resumed.group(1), "%H:%M:%S").time())
            - signalled).total_seconds()
    print(f"requeue: signal to resumed in {took:.0f} s")  # for the record: pytest -s
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == list(range(1, STEPS + 1))


def test_resubmitted_on_one_node_a_two_node_checkpoint_trains_the_same_losses(
        slurm: dict, cancelled_then_preempted: dict, tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    submitted = cancelled_then_preempted["out"]  # its whole curve is the local one (test_two_nodes_...)
    out, half = tmp_path / "run", f"step-{STEPS // 2:07d}"
    shutil.copytree(submitted / "checkpoints" / half, out / "checkpoints" / half)
    proc = submit(slurm, "--nodes", "1", "--partition", "test", "--wait", *job_args(tiny_model, corpus, out),
                  "--per_device_train_batch_size", "16")  # 2 nodes x 8 -> 1 node x 16: the global batch kept
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = "\n".join(p.read_text() for p in (out / "submitit").rglob("*_0_log.err"))
    assert f"at step {STEPS // 2}, written by 2 process(es)" in log and "topology: 1 process(es) on 1 node(s)" in log
    a, b = train_losses(submitted), train_losses(out)
    assert sorted(b) == list(range(STEPS // 2 + 1, STEPS + 1))
    assert max(abs(a[s] - b[s]) / a[s] for s in b) <= SAME_STEPS


def test_a_finished_run_submitted_again_is_a_success(slurm: dict, cancelled_then_preempted: dict, tiny_model: Path,
                                                     corpus: dict) -> None:
    submitted = cancelled_then_preempted["out"]
    before = (submitted / "metrics.jsonl").read_text()
    proc = submit(slurm, "--nodes", "2", "--partition", "test", "--wait", *job_args(tiny_model, corpus, submitted))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f": {STEPS} steps, model in {submitted / 'final'}" in proc.stdout
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    assert wait_done(slurm, job, 60) == "COMPLETED"  # Slurm records the end a moment after --wait returns
    logs = task_logs(submitted / "submitit", job)
    assert len(logs) == 2
    for log in logs:  # every task: one line, no traceback
        assert log.count(f"holds a finished run ({STEPS} steps): nothing to do") == 1 and "Traceback" not in log
    assert (submitted / "metrics.jsonl").read_text() == before


def test_bad_input_found_on_the_cluster_ends_every_task_with_one_line_and_exit_2(
        slurm: dict, tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    # only the job's processes (2, one per node) know that 24 sequences do not split into batches of 8 on each: the
    # flags pass the checks before submission (a --max_seq_length above the model's no longer does)
    out = tmp_path / "run"
    proc = submit(slurm, "--nodes", "2", "--partition", "test", "--wait",
                  *job_args(tiny_model, corpus, out), "--global_batch_size", "24")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("mlm_ddp.submit:")]
    assert line.startswith(f"mlm_ddp.submit: job {job} stopped on bad input, on every task, not requeued: "
                           "--global_batch_size 24 is not a multiple of"), proc.stderr
    # --wait answers from the tasks' result files; Slurm records the job's end a moment after they exit
    wait_done(slurm, job, 60)
    fields = job_fields(slurm, job)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("FAILED", "2:0", "0")
    logs = task_logs(out / "submitit", job)
    assert len(logs) == 2
    for log in logs:
        assert log.count("mlm_ddp.submit: error: --global_batch_size 24") == 1 and "Traceback" not in log
