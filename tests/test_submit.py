"""`python -m mlm_ddp.submit`: in-process without Slurm, across two nodes of the real local cluster,
through a preemption, and refusing bad input before anything is submitted."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from mlm_ddp.submit import main
from tests.conftest import (
    NO_DROPOUT,
    REPO,
    assert_matches_one_process,
    last_step,
    read_metrics,
    tiny_args,
    train_losses,
    wait_for,
)
from tests.test_slurm import wait_done

STEPS = 30


def submit(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlm_ddp.submit", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def job_args(tiny_model: Path, corpus: dict, out: Path) -> list[str]:
    return tiny_args(tiny_model, corpus, out, "--max_train_steps", str(STEPS), *NO_DROPOUT)


def test_debug_cluster_runs_the_job_end_to_end(tiny_model: Path, corpus: dict, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert main(["--cluster", "debug", "--wait", *tiny_args(tiny_model, corpus, out, "--max_train_steps", "3")]) == 0
    assert "finished in" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    assert (out / "final" / "model.safetensors").exists()


@pytest.mark.parametrize(("case", "message"), [
    ("unknown_flag", "--no_such_flag"),
    ("nodes_0", "--nodes must be at least 1"),
    ("unwritable_job_dir", "--job_dir .*cannot be written"),
    ("missing_train_file", "--train_file .*no such file"),
    ("local_two_nodes", "--cluster local runs one process"),
])
def test_bad_input_is_refused_before_submission(case: str, message: str, tiny_model: Path, corpus: dict,
                                                tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = tiny_args(tiny_model, corpus, out, "--max_train_steps", "3")
    extra = {"unknown_flag": ["--no_such_flag", "1"], "nodes_0": ["--nodes", "0"],
             "unwritable_job_dir": ["--job_dir", str(corpus["train"] / "jobs")],
             "missing_train_file": ["--train_file", str(tmp_path / "absent.txt")],
             "local_two_nodes": ["--cluster", "local", "--nodes", "2"]}[case]
    proc = submit({}, *args, *extra)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(message, proc.stderr), proc.stderr
    assert "submitted job" not in proc.stdout and not out.exists()


@pytest.fixture(scope="module")
def submitted(slurm: dict, tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("submitit") / "run"
    proc = submit(slurm, "--nodes", "2", "--partition", "test", "--wait", *job_args(tiny_model, corpus, out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"submitted job \d+ \(2 node\(s\)\)", proc.stdout) and "finished in" in proc.stdout
    return out


def test_two_nodes_train_the_local_curve(submitted: Path, tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    log = "\n".join(p.read_text() for p in (submitted / "submitit").rglob("*_0_log.err"))
    assert "topology: 2 process(es) on 2 node(s), DistributedType.MULTI_CPU, started by submitit (master n1:" in log
    assert_matches_one_process(submitted, tiny_model, corpus, tmp_path, STEPS)


def test_preemption_saves_on_every_rank_requeues_and_resumes(slurm: dict, submitted: Path, tiny_model: Path,
                                                             corpus: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = submit(slurm, "--nodes", "2", "--partition", "test", *job_args(tiny_model, corpus, out))
    assert proc.returncode == 0, proc.stderr
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    wait_for(lambda: last_step(out) >= 5, 180, "step 5 of the job")
    signalled = datetime.now()
    subprocess.run(["scancel", "--signal=USR2", job], env=slurm, check=True)  # as Slurm warns Submitit jobs
    assert wait_done(slurm, job, 400) == "COMPLETED"
    logs = "\n".join(p.read_text() for p in sorted((out / "submitit").rglob("*_log.err")))
    stopped = re.findall(r"stopped at step (\d+) on signal SIGUSR2", logs)
    assert len(stopped) == 2 and len(set(stopped)) == 1  # both ranks, the same step
    assert f"requeued job {job}" in logs
    step = int(stopped[0])
    resumed = re.search(r"(\d\d:\d\d:\d\d) INFO mlm_ddp.train: \[RANK 0\] resumed from .*step-0*" + str(step), logs)
    assert resumed
    took = (datetime.combine(signalled.date(), datetime.strptime(resumed.group(1), "%H:%M:%S").time())
            - signalled).total_seconds()
    print(f"requeue: signal to resumed in {took:.0f} s")  # for the record: pytest -s
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == list(range(1, STEPS + 1))
    a, b = train_losses(submitted), train_losses(out)
    assert max(abs(a[s] - b[s]) / a[s] for s in a) <= 1e-5
