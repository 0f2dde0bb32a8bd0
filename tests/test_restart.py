"""A torchrun restart is a resume (real torchrun, its elastic agents and the store they keep for every
start). Two agents with `--nnodes 2` on this host are two nodes, as most GPU clusters run torchrun: the
worker of rank 0 or of rank 1 is SIGKILLed in step 8; both agents restart their workers (the other one for
the membership change, without counting it: the two new workers see restart counts 1 and 0), which resume
from the checkpoint of step 5 and end with the uninterrupted run's losses, one restart round on each
agent, with the other node's worker back 12 s late (past --ddp_timeout), on the agents' shared store and
with torch's own TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a store per start, hosted by rank 0's worker); and
under `accelerate launch --max_restarts 1`.

And the start itself: what an earlier start leaves in the store (its generation, complete or not) is never
joined, whatever restart count each worker sees; a worker waiting in the join ends at once on SIGTERM; no
worker outlives its agent.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, LAUNCH, NO_DROPOUT, REPO, SAME_STEPS, free_port, tiny_args, train_losses, wait_for

STEPS, SAVED, KILLED = 10, 5, 8
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO"}  # LOGLEVEL: the agents'


def accelerate_launch(args: list[str], restarts: int, log: Path) -> int:
    """2 CPU processes of tests.fault_driver under `accelerate launch` (which drives torch's elastic agent)."""
    command = [*LAUNCH, "--config_file", str(CONFIGS / "cpu_ddp.yaml"), "--num_cpu_threads_per_process", "1",
               "--main_process_port", str(free_port())]
    with open(log, "w") as out:
        return subprocess.run([sys.executable, "-m", *command, "--max_restarts", str(restarts), "-m",
                               "tests.fault_driver", *args], cwd=REPO, env=ENV, stdout=out,
                              stderr=subprocess.STDOUT, timeout=600).returncode


def two_nodes(args: list[str], logs: Path, env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Two torchrun agents, one worker each (`--nnodes 2`, c10d rendezvous, one restart allowed), started.
    Their logs: logs/node-0.log and node-1.log."""
    port = free_port()
    agents = []
    for node in range(2):
        log = open(logs / f"node-{node}.log", "w")  # noqa: SIM115 - closed with the process
        agents.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
             "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "two-nodes",
             "--max_restarts", "1", "-m", "tests.fault_driver", *args],
            cwd=REPO, env={**ENV, **(env or {})}, stdout=log, stderr=subprocess.STDOUT))
    return agents


def exit_codes(agents: list[subprocess.Popen], timeout: float = 300) -> list[int]:
    """Each agent's exit code; -1 for one still running after `timeout` s (from now), which is killed."""
    deadline, codes = time.monotonic() + timeout, []
    for agent in agents:
        try:
            codes.append(agent.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            agent.kill()
            codes.append(-1)
    return codes


def run_args(tiny_model: Path, corpus: dict, out: Path) -> list[str]:
    return tiny_args(tiny_model, corpus, out, "--max_train_steps", str(STEPS), "--checkpointing_steps", str(SAVED),
                     "--resume_from_checkpoint", "auto", "--ddp_timeout", "8", "--save_timeout", "30",
                     "--rendezvous_timeout", "60", "--per_device_train_batch_size", "4", "--cpu_threads", "1",
                     "--report", "false", "--max_eval_samples", "16", *NO_DROPOUT)


@pytest.fixture(scope="module")
def straight(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run: one process in this one, with the jobs' global batch of 8 (4 per device x 2).
    Its curve is the one two processes train, to SAME_STEPS (the suite's one-against-two bound; measured here:
    7e-8), a second after the imports, where a two-node job of its own took 14 s, mostly its workers'
    start-up. Every job below ends on two processes (the shrunk one on one) and is held to it, so a resume that
    skips, repeats or forgets anything still fails the comparison; and that two agents finish a job without a
    fault, the jobs that restart show too."""
    from mlm_ddp.config import parse_args
    from mlm_ddp.train import train

    out = tmp_path_factory.mktemp("restart") / "straight"
    train(parse_args([*run_args(tiny_model, corpus, out), "--per_device_train_batch_size", "8"]))
    return out


def rounds(log: str) -> list[int]:
    """The restart count of each rendezvous round an agent's log reports (LOGLEVEL=INFO)."""
    return [int(n) for n in re.findall(r"\]\s+restart_count=(\d+)$", log, re.MULTILINE)]


# Two jobs cover both nodes and both store modes. Rank 1's worker is killed on the agents' shared store and rank
# 0 comes back 12 s late, so rank 1 reads the earlier start's generation first: the shared store's hazard, made
# certain. Rank 0's worker, the one that writes the run's files, is killed with a store per start, which that
# worker hosts: the store dies with it. A rank-0 kill on the shared store adds nothing: no assertion below
# depends on the killed rank or the store mode, and a shared store outlives every worker (an agent hosts it).
KILLED_JOBS = {"rank-1-killed-rank-0-late": (1, 0, True), "rank-0-killed-store-per-start": (0, 1, False)}


@pytest.fixture(scope="module")
def killed_jobs(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Both jobs at once (each mostly waits: for its late worker, for the agents to see the kill): id -> its
    output folder, its agents' exit codes and logs."""
    started = {}
    for job, (killed, late, shared) in KILLED_JOBS.items():
        logs = tmp_path_factory.mktemp(job)
        out = logs / "run"
        faults = ["--kill", f"{killed}:{KILLED}", "--late", f"{late}:12"]
        env = {} if shared else {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        started[job] = (out, logs, two_nodes([*faults, *run_args(tiny_model, corpus, out)], logs, env))
    return {job: {"out": out, "codes": exit_codes(agents), "late": KILLED_JOBS[job][1],
                  "logs": [(logs / f"node-{node}.log").read_text() for node in range(2)]}
            for job, (out, logs, agents) in started.items()}


@pytest.mark.parametrize("job", KILLED_JOBS)
def test_a_worker_killed_on_either_node_restarts_both_and_the_job_ends_with_the_uninterrupted_losses(
        job: str, killed_jobs: dict[str, dict], straight: Path) -> None:
    out, codes, logs, late = (killed_jobs[job][key] for key in ("out", "codes", "logs", "late"))
    assert codes == [0, 0], "\n=====\n".join(log[-3000:] for log in logs)
    said = "\n".join(logs)
    assert f"resumed from {out / 'checkpoints' / f'step-{SAVED:07d}'} at step {SAVED}" in said, said[-4000:]
    # the late worker was late: once, in the restart
    assert re.findall(r"fault_driver: rank (\d) starts 12 s late", said) == [str(late)]
    # one restart: two rounds on each agent; the agent of the killed worker counts it (the other may too, when
    # its own worker failed first, in the collective with the dead one, instead of being stopped for the round)
    assert [len(rounds(log)) for log in logs] == [2, 2], [rounds(log) for log in logs]
    assert max(max(rounds(log)) for log in logs) == 1
    expected, got = train_losses(straight), train_losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert max(abs(got[s] - expected[s]) / expected[s] for s in expected) <= SAME_STEPS


def test_accelerate_launch_restarts_a_killed_rank_which_resumes(straight: Path, tiny_model: Path, corpus: dict,
                                                                tmp_path: Path) -> None:
    out = tmp_path / "run"
    log = tmp_path / "launcher.log"
    code = accelerate_launch(["--kill", f"1:{KILLED}", *run_args(tiny_model, corpus, out)], 1, log)
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
    run's losses (that global batch)."""
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
import sys
from mlm_ddp.cluster import collectives
from mlm_ddp.cluster.launcher import detect
from mlm_ddp.loop.checkpoint import StopSignals
topo = detect(cuda_devices=0)
timeouts = collectives.Timeouts(ddp=5, save=30, rendezvous=int(sys.argv[1]))
with StopSignals(["SIGTERM"]):  # as train() holds them while it joins
    wait, scope = collectives.join_process_group(topo, timeouts)
print("joined", topo.world_size, scope, flush=True)
# torn down as a run tears down (collectives.tear_down_after): left to the interpreter's exit, a gloo group's
# threads can abort the process (SIGABRT, "terminate called without an active exception") after it joined
wait.close()
import torch
torch.distributed.destroy_process_group()
"""


def join(rank: int, world: int, port: int, restarts: int, rendezvous_s: int) -> subprocess.Popen:
    """One worker of a start, started as torchrun's agent starts it: on the agent's store (the test's), with
    the restart count its own agent keeps."""
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCHELASTIC_RESTART_COUNT": str(restarts), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", JOIN, str(rendezvous_s)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def start(port: int, world: int, restarts: list[int], delays: list[float], rendezvous_s: int = 60) -> list[str]:
    """One start of `world` workers on the agent's store, rank r started delays[r] s after rank 0 (negative:
    before); each worker's output, once all have ended."""
    order = sorted(range(world), key=lambda r: delays[r])
    procs: dict[int, subprocess.Popen] = {}
    began = time.monotonic()
    for rank in order:
        time.sleep(max(0.0, delays[rank] - delays[order[0]] - (time.monotonic() - began)))
        procs[rank] = join(rank, world, port, restarts[rank], rendezvous_s)
    return [procs[rank].communicate(timeout=120)[0] for rank in range(world)]


def joined(lines: list[str], world: int) -> str:
    """The scope every worker of one start joined (asserting they all joined the same)."""
    scopes = {re.search(rf"joined {world} (mlm_ddp/\w+/)run-\w+/", line).group(1) for line in lines if "joined" in line}
    assert sum("joined" in line for line in lines) == world and len(scopes) == 1, lines
    return scopes.pop()


def test_a_start_never_joins_what_an_earlier_start_left_in_the_store_whatever_the_restart_counts() -> None:
    from torch.distributed import TCPStore

    agent = TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    first = joined(start(agent.port, 2, [0, 0], [0, 0]), 2)
    # a restart: the agents' counts differ (1 where the worker died, 0 on the other node), and rank 1 reads
    # the complete first start's generation before rank 0 replaces it
    second = joined(start(agent.port, 2, [1, 0], [0, -3]), 2)
    # a start that never completes: rank 1 dies before it joins; rank 0 gives up after its rendezvous timeout
    alone = join(0, 2, agent.port, 2, 4).communicate(timeout=120)[0]
    assert "not every process joined within 5 s" in alone, alone[-2000:]
    # the next start: rank 1 first, counted into that incomplete generation, rank 0 4 s late
    third = joined(start(agent.port, 2, [3, 1], [0, -4]), 2)
    # an elastic shrink to one worker
    fourth = joined(start(agent.port, 1, [4], [0]), 1)
    assert len({first, second, third, fourth}) == 4


def test_a_worker_waiting_in_the_join_ends_at_once_on_sigterm() -> None:
    from torch.distributed import TCPStore

    agent = TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    worker = join(0, 2, agent.port, 0, 120)  # rank 1 never comes
    wait_for(lambda: agent.check(["mlm_ddp/start"]), 60, "rank 0 to open the start")
    sent = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    output = worker.communicate(timeout=30)[0]
    assert worker.returncode == -signal.SIGTERM and time.monotonic() - sent < 5, output[-2000:]


def test_no_worker_outlives_its_agent(tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    """A torchrun agent SIGKILLed (as a node's processes die) while rank 0 waits in the join and rank 1 is still
    in its preflight: both workers end with it."""
    import psutil
    from torch.distributed import TCPStore

    port = free_port()
    args = [*run_args(tiny_model, corpus, tmp_path / "run"), "--rendezvous_timeout", "300"]
    with open(tmp_path / "agent.log", "w") as log:
        agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                  "--master_port", str(port), "-m", "tests.fault_driver", "--slow_preflight", "1:300",
                                  *args], cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    try:
        store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
        wait_for(lambda: store.check(["mlm_ddp/start"]), 120, "rank 0 to wait in the join")
        wait_for(lambda: "rank 1 delays preflight" in (tmp_path / "agent.log").read_text(), 60, "rank 1's preflight")
        workers = psutil.Process(agent.pid).children()
        assert len(workers) == 2
        agent.kill()
        agent.wait(timeout=30)
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"{alive} outlived their agent: " + (tmp_path / "agent.log").read_text()[-3000:]
    finally:
        agent.kill()


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
