"""An elastic node range on torchrun's c10d rendezvous. Three real torchrun agents on this host are three
nodes (`--nnodes 2:3 --nproc_per_node 1 --max_restarts 1`): A (rank 0) and B start the job, B hosting the
rendezvous (`--rdzv_conf is_host=1`); A's node dies in step 8, its agent with it, and C joins the restart
and sorts before B (a lower pid: C's agent process exists from the start and execs torchrun once A is
gone), so C becomes rank 0 and B stays non-zero.

With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every agent the job resumes from step 5 on B and C and ends
with the first start's losses where both trained. Without it, torch 2.13 hands B's worker the lost agent's
store and C's a new one (a split store): B's worker ends at once in one line naming the split store and
the setting, C's worker (rank 0) said the setting at start, and no step after 8 is trained.

And the parts on their own: the node range read from the agent's command line, the start-up warning (rank
0 only, not with the setting, not for a fixed node count), a store that refuses connections named as a
split store, and one that answers passed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mlm_ddp.cluster import launcher
from mlm_ddp.errors import BadInput
from tests.conftest import NO_DROPOUT, REPO, SAME_STEPS, free_port, tiny_args, train_losses

STEPS, SAVED, KILLED = 10, 5, 8
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO"}  # LOGLEVEL: the agents'
SETTING = launcher.SPLIT_STORE_SETTING
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3", "--nproc_per_node", "1",
            "--rdzv_backend", "c10d", "--rdzv_id", "range", "--max_restarts", "1"]
# a rendezvous round closes 1 s after its second node joined; a lost agent is dropped after 2 missed 1 s beats
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2,is_host="


def run_args(tiny_model: Path, corpus: dict, out: Path) -> list[str]:
    return tiny_args(tiny_model, corpus, out, "--max_train_steps", str(STEPS), "--checkpointing_steps", str(SAVED),
                     "--resume_from_checkpoint", "auto", "--ddp_timeout", "8", "--save_timeout", "30",
                     "--rendezvous_timeout", "20", "--per_device_train_batch_size", "4", "--cpu_threads", "1",
                     "--report", "false", "--max_eval_samples", "16", *NO_DROPOUT)


def three_nodes(args: list[str], logs: Path, env: dict[str, str]) -> tuple[dict[str, int], float]:
    """A, B and C as the module's docstring says; their exit codes and the wall time from the first start
    to the last exit. Their logs: logs/A.log, B.log, C.log; the first start's metrics.jsonl as A left it:
    logs/first.jsonl (B waits for a second node before it starts again, so nothing writes it meanwhile)."""
    port, release = free_port(), logs / "release"

    def agent(name: str, host: bool, faults: list[str], after: Path | None = None) -> subprocess.Popen:
        command = [*TORCHRUN, "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_conf", RDZV_CONF + str(int(host)),
                   "-m", "tests.fault_driver", *faults, *args]
        if after is not None:  # the pid now, torchrun later: exec keeps the pid, by which c10d sorts the nodes
            command = ["bash", "-c", 'while [ ! -e "$0" ]; do sleep 0.1; done; exec "$@"', str(after), *command]
        log = open(logs / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        return subprocess.Popen(command, cwd=REPO, env={**ENV, **env}, stdout=log, stderr=subprocess.STDOUT)

    began = time.monotonic()
    agents = {"C": agent("C", False, [], after=release)}
    agents["A"] = agent("A", False, ["--kill_node", str(KILLED)])
    agents["B"] = agent("B", True, [])
    assert agents["C"].pid < agents["A"].pid < agents["B"].pid  # c10d ranks by (host, pid): A 0, B 1; then C 0
    codes = {}
    try:
        codes["A"] = agents["A"].wait(timeout=240)
        out = Path(args[args.index("--output_dir") + 1])
        (logs / "first.jsonl").write_text((out / "metrics.jsonl").read_text())
        release.touch()
        for name in ("B", "C"):
            codes[name] = agents[name].wait(timeout=240)
    finally:
        for process in agents.values():
            process.kill()
    return codes, time.monotonic() - began


def group_ranks(log: str) -> list[int]:
    """The node rank of each rendezvous round an agent's log reports (LOGLEVEL=INFO)."""
    return [int(n) for n in re.findall(r"\]\s+group_rank=(\d+)$", log, re.MULTILINE)]


def logs_of(folder: Path) -> dict[str, str]:
    return {name: (folder / f"{name}.log").read_text() for name in "ABC"}


@pytest.fixture(scope="module")
def ranges(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """SETTING's value ("1", "0") -> the three agents' run with it: its folder (the logs, and run/ the output),
    exit codes and wall time. Both at once: their agents mostly wait (for a beat, a round, a lost node)."""
    folders = {value: tmp_path_factory.mktemp(f"range-{value}") for value in ("1", "0")}
    with ThreadPoolExecutor(max_workers=len(folders)) as pool:
        runs = {value: pool.submit(three_nodes, run_args(tiny_model, corpus, folder / "run"), folder,
                                   {SETTING: value})  # "0": whatever the shell says
                for value, folder in folders.items()}
        return {value: {"folder": folders[value], **dict(zip(("codes", "took"), run.result(), strict=True))}
                for value, run in runs.items()}


def test_a_newcomer_that_becomes_rank_0_resumes_the_job_with_a_store_per_start(ranges: dict[str, dict]) -> None:
    tmp_path, codes, took = ranges["1"]["folder"], ranges["1"]["codes"], ranges["1"]["took"]
    out = tmp_path / "run"
    said = logs_of(tmp_path)
    print(f"three agents, {SETTING}=1: exit codes {codes} after {took:.0f} s")
    assert codes == {"A": -9, "B": 0, "C": 0}, "\n=====\n".join(log[-3000:] for log in said.values())
    assert group_ranks(said["C"]) == [0] and group_ranks(said["B"]) == [1, 1]  # C joined the restart as rank 0
    assert f"resumed from {out / 'checkpoints' / f'step-{SAVED:07d}'} at step {SAVED}" in said["C"], said["C"][-4000:]
    assert SETTING not in said["C"] + said["B"]  # no warning: a store per start
    first = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "first.jsonl").read_text().splitlines())
             if "loss" in r}
    got = train_losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    both = [s for s in first if SAVED < s < KILLED]  # trained by the first start and again by the resumed one
    assert both and max(abs(got[s] - first[s]) / first[s] for s in both) <= SAME_STEPS, (first, got)


def test_without_the_setting_the_split_store_is_said_as_such_naming_the_setting(ranges: dict[str, dict]) -> None:
    codes, took = ranges["0"]["codes"], ranges["0"]["took"]
    said = logs_of(ranges["0"]["folder"])
    print(f"three agents, shared store: exit codes {codes} after {took:.0f} s")
    everything = "\n=====\n".join(log[-3000:] for log in said.values())
    assert codes["A"] == -9 and codes["B"] != 0 and codes["C"] != 0, everything
    assert group_ranks(said["C"])[:1] == [0] and group_ranks(said["B"])[:2] == [1, 1], everything
    # rank 0 of each start says the setting at start, in one line
    warning = "WARNING mlm_ddp.cluster.launcher: torchrun --nnodes 2:3 on the rendezvous' shared store: "
    assert said["A"].count(warning) == 1 and said["C"].count(warning) >= 1 and warning not in said["B"], everything
    assert re.search(rf"^.*{warning}.*export {SETTING}=1 on every node.*$", said["C"], re.MULTILINE)
    # B's worker, handed the lost agent's store, ends at once with the split store named
    split = re.findall(rf"^mlm_ddp.train: error: split store: rank 1 \(node 1\) was handed the store \S+:\d+ "
                       rf"by its torchrun agent, and nothing listens there \(Connection refused\).*export {SETTING}=1 "
                       "on every node.*$", said["B"], re.MULTILINE)
    assert split, said["B"][-4000:]
    assert "resumed from" not in said["B"] + said["C"]


AGENT = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job",
         "TORCHELASTIC_USE_AGENT_STORE": "True"}


@pytest.mark.parametrize(("argv", "env", "expected"), [
    (["torchrun", "--nnodes", "2:3", "train.py"], {}, (2, 3)),
    (["torchrun", "--nnodes=1:4", "train.py"], {}, (1, 4)),
    (["torchrun", "train.py"], {"PET_NNODES": "2:8"}, (2, 8)),
    (["torchrun", "--nnodes", "2", "train.py"], {"PET_NNODES": "2:8"}, None),  # the flag wins
    (["torchrun", "--nnodes", "3:3", "train.py"], {}, None),
    (["torchrun", "--nproc_per_node", "2", "train.py"], {}, None),
    (["torchrun", "--nnodes", "2:3", "--nnodes=4", "train.py"], {}, None),  # the last one wins, as in argparse
])
def test_the_node_range_is_read_from_the_agents_command_line(argv: list[str], env: dict,
                                                             expected: tuple | None) -> None:
    assert launcher.node_range(env, argv) == expected


def test_the_agents_command_line_is_this_workers_parent_process() -> None:
    child = subprocess.run([sys.executable, "-c", "import json; from mlm_ddp.cluster.launcher import agent_argv; "
                            "print(json.dumps([agent_argv({'TORCHELASTIC_RUN_ID': 'job'}), agent_argv({})]))"],
                           cwd=REPO, capture_output=True, text=True, check=True)
    ours = [arg.decode() for arg in Path("/proc/self/cmdline").read_bytes().split(b"\0")[:-1]]
    assert json.loads(child.stdout) == [ours, []]  # outside torchrun's agent: none


@pytest.mark.parametrize(("env", "argv", "warned"), [
    (AGENT, ["torchrun", "--nnodes", "2:3"], True),
    ({**AGENT, SETTING: "1"}, ["torchrun", "--nnodes", "2:3"], False),
    ({**AGENT, "TORCHELASTIC_USE_AGENT_STORE": "False"}, ["torchrun", "--nnodes", "2:3"], False),  # as the setting
    (AGENT, ["torchrun", "--nnodes", "2"], False),
])
def test_a_node_range_on_the_shared_store_is_said_on_rank_0_naming_the_setting(
        env: dict, argv: list[str], warned: bool, caplog: pytest.LogCaptureFixture) -> None:
    for rank in (0, 1):
        topo = launcher.detect({**env, "RANK": str(rank), "GROUP_RANK": str(rank)}, cuda_devices=0, argv=argv)
        assert bool(topo.warnings) == warned
        assert (f"export {SETTING}=1 on every node" in topo.describe()) == warned
        with caplog.at_level(logging.WARNING, logger="mlm_ddp.cluster.launcher"):
            caplog.clear()
            launcher.export_for_accelerate(topo, {"TORCHELASTIC_USE_AGENT_STORE": "False"})
        said = [r.getMessage() for r in caplog.records]
        assert said == ([f"torchrun --nnodes 2:3 on the rendezvous' shared store: a node that joins a restart and "
                         f"becomes rank 0 gets a new store while the other nodes' workers keep the old rank 0's, and "
                         f"that start never joins; export {SETTING}=1 on every node (a store per start, hosted by rank "
                         "0's worker)"] if warned and rank == 0 else []), said


def test_an_agent_store_that_refuses_connections_is_a_split_store_and_one_that_answers_passes() -> None:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**AGENT, "RANK": "1", "GROUP_RANK": "1", "MASTER_PORT": str(store.port)}
    c10d = ["torchrun", "--nnodes", "2:3", "--rdzv-backend=c10d"]
    launcher.check_agent_store(launcher.detect(env, cuda_devices=0, argv=[]), env, c10d)
    TCPStore("127.0.0.1", store.port, is_master=False).set("after", "probe")  # the probe left it serving
    assert store.get("after") == b"probe"
    gone = free_port()
    env = {**env, "MASTER_PORT": str(gone)}
    with pytest.raises(BadInput, match=rf"^split store: rank 1 \(node 1\) was handed the store 127.0.0.1:{gone} by "
                                       rf"its torchrun agent, and nothing listens there \(Connection refused\): .*; "
                                       rf"export {SETTING}=1 on every node \(a store per start, hosted by rank 0's "
                                       r"worker\)$"):
        launcher.check_agent_store(launcher.detect(env, cuda_devices=0, argv=[]), env, c10d, attempts=1)
    # the workers of a store per start may come before rank 0's worker hosts it: not checked
    launcher.check_agent_store(launcher.detect(env, cuda_devices=0, argv=[]),
                               {**env, "TORCHELASTIC_USE_AGENT_STORE": "False"}, c10d, attempts=1)
    # nor under the static rendezvous (accelerate launch, slurm/multinode.sh), whose nodes keep their ranks
    for static in (["accelerate", "launch", "--rdzv_backend", "static"], ["torchrun", "--nnodes", "2"]):
        launcher.check_agent_store(launcher.detect(env, cuda_devices=0, argv=[]), env, static, attempts=1)
    with pytest.raises(BadInput, match="^split store: "):  # c10d given through torchrun's variable
        launcher.check_agent_store(launcher.detect(env, cuda_devices=0, argv=[]),
                                   {**env, "PET_RDZV_BACKEND": "c10d"}, ["torchrun"], attempts=1)
