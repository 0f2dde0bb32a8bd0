"""A torchrun restart is a resume (real torchrun, its elastic agent and its one store for every attempt):
rank 1 is SIGKILLed in step 8; the agent restarts both workers, which resume from the checkpoint of step
5 and end with the uninterrupted run's losses, also when rank 1 comes back 12 s late (past --ddp_timeout),
and under `accelerate launch --max_restarts 1`.

And what a restart leaves in the store: attempt 0's keys are all there for attempt 1 (torchrun scopes
none), so a start-up of ours that read them passed early or never matched. Here, on one real TCPStore
played as the agent's: a partial attempt (rank 1 exits before it joins), then an elastic shrink to one
process, which must start.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, LAUNCH, NO_DROPOUT, REPO, SAME_STEPS, free_port, tiny_args, train_losses

STEPS, SAVED, KILLED = 10, 5, 8


def torchrun(args: list[str], restarts: int, log: Path, launcher: str = "torchrun") -> int:
    """2 CPU processes of tests.fault_driver under torchrun, or under `accelerate launch` (which drives the
    same elastic agent), with `restarts` restarts."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    port = str(free_port())
    if launcher == "torchrun":
        command = ["torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    else:
        command = [*LAUNCH, "--config_file", str(CONFIGS / "cpu_ddp.yaml"), "--num_cpu_threads_per_process", "1",
                   "--main_process_port", port]
    with open(log, "w") as out:
        return subprocess.run([sys.executable, "-m", *command, "--max_restarts", str(restarts), "-m",
                               "tests.fault_driver", *args], cwd=REPO, env=env, stdout=out,
                              stderr=subprocess.STDOUT, timeout=600).returncode


def run_args(tiny_model: Path, corpus: dict, out: Path) -> list[str]:
    return tiny_args(tiny_model, corpus, out, "--max_train_steps", str(STEPS), "--checkpointing_steps", str(SAVED),
                     "--resume_from_checkpoint", "auto", "--ddp_timeout", "8", "--save_timeout", "30",
                     "--per_device_train_batch_size", "4", "--cpu_threads", "1", "--report", "false",
                     "--max_eval_samples", "16", *NO_DROPOUT)


@pytest.fixture(scope="module")
def straight(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("restart") / "straight"
    assert torchrun(run_args(tiny_model, corpus, out), 0, out.parent / "straight.log") == 0, \
        (out.parent / "straight.log").read_text()[-3000:]
    return out


@pytest.mark.parametrize(("late_s", "launcher"), [(0, "torchrun"), (12, "torchrun"), (0, "accelerate")])
def test_a_rank_killed_mid_run_is_restarted_and_the_job_ends_with_the_uninterrupted_losses(
        late_s: int, launcher: str, straight: Path, tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    faults = ["--kill", f"1:{KILLED}"] + (["--late", f"1:{late_s}"] if late_s else [])
    log = tmp_path / "launcher.log"
    code = torchrun([*faults, *run_args(tiny_model, corpus, out)], 1, log, launcher)
    said = log.read_text()
    assert code == 0, said[-4000:]
    assert f"resumed from {out / 'checkpoints' / f'step-{SAVED:07d}'} at step {SAVED}" in said, said[-4000:]
    expected, got = train_losses(straight), train_losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert max(abs(got[s] - expected[s]) / expected[s] for s in expected) <= SAME_STEPS


def test_a_node_lost_mid_run_shrinks_the_elastic_job_which_resumes_with_its_global_batch(
        straight: Path, tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    """Two torchrun agents (one process each, `--nnodes 1:2`, c10d rendezvous); the second node dies in step
    8, its agent with it. The first agent restarts its worker alone: the job resumes from step 5 on one
    process with --global_batch_size 8 (accumulation 2 where it was 1) and ends with the uninterrupted
    2-process run's losses."""
    out, port = tmp_path / "run", free_port()
    args = [*run_args(tiny_model, corpus, out), "--global_batch_size", "8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def agent(name: str, faults: list[str]) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc_per_node",
                                 "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id",
                                 "shrink", "--max_restarts", "1", "--rdzv_conf",
                                 "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2",
                                 "-m", "tests.fault_driver", *faults, *args],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    first = agent("first", [])  # hosts the rendezvous store: the node that survives
    time.sleep(1)  # inside the rendezvous' last call: both nodes start the job
    second = agent("second", ["--kill_node", str(KILLED)])
    code = first.wait(timeout=600)
    second.wait(timeout=60)
    said = (tmp_path / "first.log").read_text()
    assert code == 0, said[-4000:]
    assert f"resumed from {out / 'checkpoints' / f'step-{SAVED:07d}'} at step {SAVED}, written by 2 process(es)" in said
    expected, got = train_losses(straight), train_losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert max(abs(got[s] - expected[s]) / expected[s] for s in expected) <= SAME_STEPS


JOIN = """
import os, sys
from mlm_ddp.cluster import collectives
from mlm_ddp.cluster.launcher import detect
topo = detect(cuda_devices=0)
wait, scope = collectives.join_process_group(topo, collectives.Timeouts(ddp=5, save=30, rendezvous=int(sys.argv[1])))
print("joined", topo.world_size, scope, flush=True)
# torn down as a run tears down (collectives.tear_down_after): left to the interpreter's exit, a gloo group's
# threads can abort the process (SIGABRT, "terminate called without an active exception") after it joined
wait.close()
import torch
torch.distributed.destroy_process_group()
"""


def join(rank: int, world: int, port: int, attempt: int, rendezvous_s: int) -> subprocess.Popen:
    """One worker of an attempt, started as torchrun's agent starts it: on the agent's store (the test's)."""
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": str(attempt),
           "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", JOIN, str(rendezvous_s)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_a_partial_attempt_then_an_elastic_shrink_starts_on_the_agents_store() -> None:
    from torch.distributed import TCPStore

    agent = TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    # attempt 0: two workers, rank 1 dies before it joins; rank 0 gives up after its rendezvous timeout
    alone = join(0, 2, agent.port, 0, 4)
    said = alone.communicate(timeout=120)[0]
    assert alone.returncode != 0 and "not every process joined within 5 s" in said, said[-2000:]
    # attempt 1: the agent shrinks the job to one worker, on the same store with attempt 0's keys in it
    shrunk = join(0, 1, agent.port, 1, 4)
    said = shrunk.communicate(timeout=120)[0]
    assert shrunk.returncode == 0 and "joined 1 mlm_ddp/attempt-1/run-" in said, said[-2000:]
    # attempt 2: both again, rank 1 8 s late: rank 0 waits for it, and neither reads an earlier attempt's
    # addresses (torch names the gloo groups the same in every attempt)
    late = [join(0, 2, agent.port, 2, 60)]
    time.sleep(8)
    late.append(join(1, 2, agent.port, 2, 60))
    lines = [proc.communicate(timeout=120)[0] for proc in late]
    assert [proc.returncode for proc in late] == [0, 0], lines
    assert all("joined 2 mlm_ddp/attempt-2/run-" in line for line in lines), lines
    assert len({line.split()[-1] for line in lines}) == 1, lines  # one run id, agreed by both


@pytest.mark.parametrize(("flags", "fix"), [
    (["--global_batch_size", "10"], "not a multiple of --per_device_train_batch_size 4 x 2 process(es) = 8"),
    (["--global_batch_size", "8", "--gradient_accumulation_steps", "2"], "give one of them"),
])
def test_a_global_batch_that_cannot_be_kept_is_refused_naming_the_flags(flags: list[str], fix: str) -> None:
    from mlm_ddp.config import parse_args
    from mlm_ddp.errors import BadInput

    with pytest.raises(BadInput, match=re.escape(fix)):
        parse_args(["--per_device_train_batch_size", "4", *flags]).training.accumulation_for(2)
    assert parse_args(["--per_device_train_batch_size", "4", "--global_batch_size", "16"]).training \
        .accumulation_for(2) == 2
