"""Topologies: every shipped accelerate config, the launcher environment, per-rank sharding, and one
loss curve whatever the number of processes or machines (real processes, gloo on the CPU)."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType
from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env
from datasets import Dataset

from mlm_ddp.cluster import launcher as distributed
from mlm_ddp.config import DataConfig, parse_args
from mlm_ddp.data.epochs import EpochBatchSampler, train_loader
from mlm_ddp.data.feed import TrainFeed
from mlm_ddp.data.rank import rank_dataset
from mlm_ddp.data.stream import shard_stream, stream_sharding
from mlm_ddp.data.text import load_text
from tests.conftest import (
    CONFIGS,
    LAUNCH,
    NO_DROPOUT,
    REPO,
    SAME_STEPS,
    corpus_paragraphs,
    free_port,
    read_metrics,
    run_module,
    tiny_args,
    train_losses,
)

EXPECTED = {  # file -> (distributed type, runs on a CPU)
    "cpu.yaml": (DistributedType.NO, True),
    "cpu_ddp.yaml": (DistributedType.MULTI_GPU, True),  # + use_cpu: torchrun starts N CPU processes
    "single_gpu.yaml": (DistributedType.NO, False),
    "multi_gpu.yaml": (DistributedType.MULTI_GPU, False),
    "multi_node.yaml": (DistributedType.MULTI_GPU, False),
    "fsdp.yaml": (DistributedType.FSDP, False),
}
STEPS = 12


def launch_with(config: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_module([*LAUNCH, "--config_file", str(CONFIGS / config), "--main_process_port", str(free_port()),
                       "-m", "mlm_ddp.train", *args], env=env)


def max_rel_diff(a: dict[int, float], b: dict[int, float]) -> float:
    assert sorted(a) == sorted(b)
    return max(abs(a[s] - b[s]) / abs(a[s]) for s in a)


# --- accelerate_configs/ ---------------------------------------------------------------------------


def test_the_shipped_configs_are_exactly_the_expected_ones() -> None:
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_accelerate_config_loads_and_describes_topology_only(name: str) -> None:
    path = CONFIGS / name
    config = load_config_from_file(str(path))
    kind, on_cpu = EXPECTED[name]
    assert config.distributed_type == kind
    assert config.use_cpu is on_cpu
    # no precision: mlm_ddp's auto picks it per device, so Slurm, Submitit and accelerate launch train alike
    assert config.mixed_precision is None
    # accelerate overwrites the processes' CUDA_VISIBLE_DEVICES with any gpu_ids but "all": a job pinned to
    # GPU 3 by the user or by Slurm would land on physical GPU 0
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    with mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": "3"}):
        args, _, _ = _validate_launch_command(args)
        several = args.multi_gpu or args.use_fsdp
        env = prepare_multi_gpu_env(args) if several else prepare_simple_launcher_cmd_env(args)[1]
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    assert config.num_processes >= config.num_machines >= 1
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert any(f"accelerate launch --config_file accelerate_configs/{name}" in line for line in header)
    if kind == DistributedType.FSDP:
        # the wrap class is the model's (or --fsdp_wrap_classes), so any BERT family trains with it
        assert "fsdp_transformer_layer_cls_to_wrap" not in config.fsdp_config
        assert config.fsdp_config["fsdp_version"] == 2
        assert config.fsdp_config["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    if name == "multi_node.yaml":
        assert config.num_machines > 1 and not config.same_network


# --- the launcher environment --------------------------------------------------------------------


def test_detect_torchrun_wins_over_the_slurm_task_it_runs_in() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
           "MASTER_ADDR": "n1", "MASTER_PORT": "1234", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}
    topo = distributed.detect(env, cuda_devices=4)
    assert (topo.launcher, topo.rank, topo.world_size, topo.local_rank, topo.node_rank, topo.num_nodes) == (
        "torchrun", 5, 8, 1, 1, 2)
    assert (topo.master_addr, topo.master_port, topo.backend, topo.device) == ("n1", 1234, "nccl", "cuda:1")


def test_detect_srun_tasks_derive_the_port_from_the_job_id() -> None:
    env = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_STEP_NUM_NODES": "2", "SLURM_JOB_ID": "4242", "MASTER_ADDR": "n1"}
    topo = distributed.detect(env, cuda_devices=0)
    assert (topo.launcher, topo.rank, topo.world_size, topo.local_world_size, topo.num_nodes) == (
        "slurm", 3, 4, 2, 2)
    assert topo.master_port == distributed.slurm_master_port(4242) == 19242
    assert (topo.backend, topo.device) == ("gloo", "cpu")
    assert distributed.detect({**env, "SUBMITIT_EXECUTOR": "slurm"}, cuda_devices=0).launcher == "submitit"


def test_detect_a_batch_script_or_a_laptop_is_one_process() -> None:
    topo = distributed.detect({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0"}, cuda_devices=0)
    assert (topo.launcher, topo.world_size, topo.backend) == ("none", 1, None)
    assert any("not in an srun step" in reason for reason in topo.reasons)


def test_detect_reads_the_slurm_job_id_under_any_launcher_and_requeue_needs_one() -> None:
    assert distributed.detect({"SLURM_JOB_ID": "7"}, cuda_devices=0).job_id == "7"  # sbatch, no srun step
    srun = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_JOB_ID": "9"}
    assert distributed.detect(srun, cuda_devices=0).job_id == "9"
    torchrun = {"RANK": "0", "WORLD_SIZE": "1", "SLURM_JOB_ID": "8"}  # accelerate launch inside sbatch
    assert distributed.detect(torchrun, cuda_devices=0).job_id == "8"
    laptop = distributed.detect({}, cuda_devices=0)
    assert laptop.job_id is None
    with pytest.raises(RuntimeError, match="not in a Slurm job"):
        distributed.requeue(laptop)


def test_detect_refuses_inconsistent_variables() -> None:
    with pytest.raises(RuntimeError, match="inconsistent"):
        distributed.detect({"RANK": "2", "WORLD_SIZE": "2"}, cuda_devices=0)
    with pytest.raises(RuntimeError, match="RANK"):
        distributed.detect({"RANK": "x", "WORLD_SIZE": "2"}, cuda_devices=0)


def test_a_group_whose_processes_train_alone_is_refused() -> None:
    topo = distributed.detect({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, cuda_devices=0)
    with pytest.raises(RuntimeError, match="started 2 processes .* but Accelerate runs 1"):
        distributed.check_accelerator(topo, 1, "DistributedType.NO")


def test_the_fsdp_plugin_is_built_from_the_launcher_only_when_asked() -> None:
    assert distributed.fsdp_plugin_from_launcher({}) is None
    assert distributed.fsdp_plugin_from_launcher({"ACCELERATE_USE_FSDP": "false"}) is None


def test_doctor_under_plain_torchrun_forms_a_real_group() -> None:
    # a plain Accelerator() under torchrun on a CPU runs each process alone (state NO): show that,
    # then that the doctor really connects (train() under plain torchrun: the uneven-stream test)
    naive = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "--no-python", sys.executable, "-c",
         # one write() per process: two processes share the pipe, print() would interleave
         "import os; from accelerate import Accelerator; a = Accelerator(); "
         "os.write(1, f'naive {a.num_processes} {a.distributed_type}\\n'.encode())"],
        capture_output=True, text=True, timeout=120)
    assert naive.returncode == 0, naive.stderr[-2000:]
    assert naive.stdout.count("naive 1 DistributedType.NO") == 2
    proc = run_module(["torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                       "-m", "mlm_ddp.distributed", "--connect", "--timeout", "60"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for rank in (0, 1):
        assert f"[rank {rank}] rank          {rank} of 2" in proc.stdout
        assert f"[rank {rank}] connected: 2 process(es), DistributedType.MULTI_CPU" in proc.stdout
    assert "[rank 0] backend       gloo" in proc.stdout


# --- sharding, every rank looped over in one process ------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 13, 40])
def test_map_style_sharding_is_disjoint_and_complete(n: int, world: int) -> None:
    batch = 3
    samplers = [EpochBatchSampler(n, batch, rank, world, seed=1) for rank in range(world)]
    per_rank = [[i for b in itertools.islice(s, math.ceil(n / (batch * world))) for i in b] for s in samplers]
    seen = sum(per_rank, [])
    assert sorted(set(seen)) == list(range(n))
    assert len(seen) - n == samplers[0].padding < batch * world  # repeats: only the counted padding


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shards", [1, 2, 3, 8])
def test_stream_sharding_is_disjoint_and_complete(shards: int, world: int) -> None:
    n = 53  # not a multiple of anything here: shards and ranks get uneven parts
    raw = Dataset.from_dict({"id": list(range(n))}).to_iterable_dataset(num_shards=shards)
    parts = []
    for rank in range(world):
        part = shard_stream(raw, rank, world).shuffle(seed=3, buffer_size=5)
        part.set_epoch(2)  # every rank shuffles with the same seed and epoch, as in training
        parts.append([row["id"] for row in part])
    seen = sum(parts, [])
    assert sorted(seen) == list(range(n))  # disjoint (no id twice) and complete
    assert max(map(len, parts)) - min(map(len, parts)) <= max(n // shards + 1, 1)
    note = stream_sharding(shards, world)
    assert ("reads only its" in note) == (world > 1 and shards % world == 0)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_stream_train_and_held_out_eval_split_stays_disjoint_across_ranks(tmp_path: Path, world: int) -> None:
    path = tmp_path / "lines.jsonl"
    path.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(50)))
    cfg = DataConfig(train_file=str(path), streaming=True, max_eval_samples=7)
    train, held_out = load_text(cfg, seed=0)
    train_seen = [r["text"] for rank in range(world) for r in shard_stream(train, rank, world)]
    eval_seen = [r["text"] for rank in range(world) for r in shard_stream(held_out, rank, world)]
    assert sorted(eval_seen) == sorted(f"line {i}" for i in range(7))
    assert sorted(train_seen) == sorted(f"line {i}" for i in range(7, 50))


def test_map_style_windows_run_across_epoch_ends_like_one_process() -> None:
    table = Dataset.from_dict({"id": list(range(10))})
    loader = train_loader(table, lambda rows: [r["id"] for r in rows], 3, 0, 1, seed=0, num_workers=0)
    feed = TrainFeed(loader, None, accumulation=3, epoch=0, start=0, any_rank=lambda flag: flag)
    windows = [feed.next_window() for _ in range(3)]  # 4 batches per epoch: the 2nd window spans two
    assert [len(w) for w in windows] == [3, 3, 3] and (feed.epoch, feed.index) == (2, 1)
    epoch0 = sum(windows[0] + windows[1][:1], [])
    assert sorted(set(epoch0)) == list(range(10)) and len(epoch0) == 12
    assert epoch0[-2:] == epoch0[:2]  # the counted padding: the permutation's first blocks again


def test_two_processes_see_disjoint_samples(tmp_path: Path) -> None:
    n = 41
    proc = run_module([*LAUNCH, "--config_file", str(CONFIGS / "cpu_ddp.yaml"), "--main_process_port",
                       str(free_port()), str(REPO / "tests" / "shard_probe.py"), str(tmp_path), str(n)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    # map-style: same number of steps, union complete, repeats are only the counted padding
    maps = [r["map"]["steps"] for r in ranks]
    assert len(maps[0]) == len(maps[1]) == 6
    seen = [i for steps in maps for step in steps for i in step]
    assert sorted(set(seen)) == list(range(n)) and len(seen) - n == 6 * 8 - n
    # stream: both ranks ended the epoch at the same step; each trained on a prefix of its own part
    streams = [r["stream"] for r in ranks]
    assert len(streams[0]["steps"]) == len(streams[1]["steps"])
    raw = Dataset.from_dict({"id": list(range(n))}).to_iterable_dataset(num_shards=3)
    used = []
    for rank, record in enumerate(streams):
        mine = [i for step in record["steps"] for i in step]
        part = shard_stream(raw, rank, 2).shuffle(seed=7, buffer_size=8)
        full = [row["id"] for row in part]
        assert mine == full[: len(mine)]  # nothing skipped silently: only the tail after the end
        used += mine
        assert record["next_epoch_first"], "the next epoch starts on every rank"
    assert len(set(used)) == len(used)  # disjoint
    assert streams[0]["dropped"] + streams[1]["dropped"] > 0  # the uneven end was hit and counted


# --- one loss curve on every topology --------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process_curve(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process at the global batch, in this process (tests/test_train.py launches cpu.yaml)."""
    from mlm_ddp.train import train

    out = tmp_path_factory.mktemp("one") / "run"
    train(parse_args(tiny_args(tiny_model, corpus, out, "--max_train_steps", str(STEPS), *NO_DROPOUT,
                               "--per_device_train_batch_size", "16")))
    return train_losses(out)


def test_two_processes_train_to_the_one_process_curve(one_process_curve: dict, tiny_model: Path,
                                                       corpus: dict, tmp_path: Path) -> None:
    proc = launch_with("cpu_ddp.yaml", *tiny_args(tiny_model, corpus, tmp_path, "--max_train_steps", str(STEPS),
                                                  *NO_DROPOUT, "--per_device_train_batch_size", "8"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("topology: 2 process(es) on 1 node(s), DistributedType.MULTI_CPU, started by torchrun "
            "(master 127.0.0.1:") in proc.stderr
    assert "global batch 16 = 8 per device x 2 processes x 1 accumulation" in proc.stderr
    assert "rank r takes slice r of every global batch" in proc.stderr
    two = train_losses(tmp_path)
    assert len(two) == STEPS
    assert max_rel_diff(one_process_curve, two) <= SAME_STEPS


def test_two_machines_on_one_host_form_one_group(one_process_curve: dict, tiny_model: Path, corpus: dict,
                                                 tmp_path: Path) -> None:
    port, env = str(free_port()), {"ACCELERATE_USE_CPU": "true"}
    out = tmp_path / "run"
    args = tiny_args(tiny_model, corpus, out, "--max_train_steps", str(STEPS), *NO_DROPOUT,
                     "--per_device_train_batch_size", "8")
    machines = [
        subprocess.Popen(
            [sys.executable, "-m", *LAUNCH, "--multi_gpu", "--num_machines", "2", "--machine_rank", str(rank),
             "--num_processes", "2", "--num_cpu_threads_per_process", "1", "--main_process_ip", "127.0.0.1",
             "--main_process_port", port, "--rdzv_backend", "static", "-m", "mlm_ddp.train", *args],
            cwd=REPO, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        for rank in (0, 1)
    ]
    logs = [m.communicate(timeout=300) for m in machines]
    assert [m.returncode for m in machines] == [0, 0], logs[0][1][-2000:] + logs[1][1][-2000:]
    assert "topology: 2 process(es) on 2 node(s), DistributedType.MULTI_CPU" in logs[0][1]
    assert max_rel_diff(one_process_curve, train_losses(out)) <= SAME_STEPS


def test_uneven_stream_parts_end_every_epoch_together(tiny_model: Path, tmp_path: Path) -> None:
    # one file = one shard: rank 0 gets the even lines (long), rank 1 the odd ones (short), so rank 1
    # runs out of blocks long before rank 0 in every epoch
    paragraphs = corpus_paragraphs()
    lines = [" ".join(paragraphs[i : i + 4]) if i % 2 == 0 else paragraphs[i] for i in range(160)]
    train_file = tmp_path / "uneven.txt"
    train_file.write_text("\n".join(lines) + "\n")
    corpus = {"train": train_file, "valid": train_file}
    out = tmp_path / "run"
    steps = 60
    # started by a plain torchrun, which train() must also turn into one real group of 2
    proc = run_module(["torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                       "-m", "mlm_ddp.train",
                       *tiny_args(tiny_model, corpus, out, "--streaming", "--max_train_steps", str(steps),
                                  "--shuffle_buffer_size", "16", "--max_eval_samples", "8")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "topology: 2 process(es) on 1 node(s), DistributedType.MULTI_CPU, started by torchrun" in proc.stderr
    assert "1 shard(s) over 2 ranks: each rank reads every raw text and keeps one in 2" in proc.stderr
    pattern = r"step (\d+): epoch (\d) of the stream ended on every rank after (\d+) micro-batches"
    ends = re.findall(pattern, proc.stderr)
    # the shorter part is rank 1's: every epoch ends when its batches run out, on both ranks
    from transformers import AutoTokenizer

    cfg = parse_args(tiny_args(tiny_model, corpus, out, "--streaming", "--max_train_steps", "1",
                               "--shuffle_buffer_size", "16", "--max_eval_samples", "8"))
    raw, _ = load_text(cfg.data, cfg.training.seed)
    part = rank_dataset(raw, AutoTokenizer.from_pretrained(tiny_model), cfg.data, 1, 2, shuffle_seed=42)
    blocks = sum(1 for _ in part)
    short = math.ceil(blocks / 8)  # micro-batches of 8 blocks in rank 1's part
    assert [(int(s), int(e), int(n)) for s, e, n in ends] == [(short + 1, 0, short), (2 * short + 1, 1, short)]
    # what each part gave in epoch 0: rank 1 all of its 80 texts; rank 0 one micro-batch more (its window of
    # that step was full), the texts those blocks took, and the rest of its 80 texts left unread
    assert "the parts hold the same number of texts (one apart at most)" in proc.stderr
    longer = rank_dataset(raw, AutoTokenizer.from_pretrained(tiny_model), cfg.data, 0, 2, shuffle_seed=42)
    longer.set_epoch(0)
    for _ in zip(range((short + 1) * 8), longer, strict=False):
        pass
    unread = 1 - longer.texts_read / 80
    assert unread > 0.3
    assert (f"step {short + 1}: epoch 0 of the stream ended on every rank after {short} micro-batches, when rank 1's "
            f"part ran out (micro-batches of partial steps dropped so far, rank 0: 1); rank 0 read {short + 1} "
            f"micro-batches, {longer.texts_read} texts, {(short + 1) * 8} blocks, about {unread:.0%} of its part "
            f"unread; rank 1 read {short} micro-batches, 80 texts, {blocks} blocks, all of its part") in proc.stderr
    records = read_metrics(out)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, steps + 1))
    assert records[-1]["epoch"] == 2


def test_a_stream_part_smaller_than_one_step_stops_every_rank_at_once(tiny_model: Path, corpus: dict,
                                                                     tmp_path: Path) -> None:
    # two files, one per rank: rank 1's gives 1 micro-batch of 8 blocks, a step needs 4 on every rank.
    # Every rank used to drop its window and start the next epoch, forever (a livelock: the collectives
    # all succeed, so no timeout fires)
    paragraphs = corpus_paragraphs()
    folder = tmp_path / "two_files"
    folder.mkdir()
    (folder / "a_big.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs[:40]))
    (folder / "b_small.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs[40:43]))
    sizes = [(folder / name).stat().st_size for name in ("a_big.jsonl", "b_small.jsonl")]
    args = tiny_args(tiny_model, corpus, tmp_path / "run", "--streaming", "--max_train_steps", "3",
                     "--gradient_accumulation_steps", "4", "--max_eval_samples", "2")
    args = [a for i, a in enumerate(args) if a not in ("--train_file", "--validation_file")
            and args[i - 1] not in ("--train_file", "--validation_file")]
    # its own session: a livelocked run is killed whole (workers included) when the timeout fails the test
    launch = subprocess.Popen(
        [sys.executable, "-m", *LAUNCH, "--multi_gpu", "--num_processes", "2", "--num_cpu_threads_per_process", "1",
         "--main_process_port", str(free_port()), "-m", "mlm_ddp.train", "--dataset_name", str(folder), *args],
        cwd=REPO, env={**os.environ, "ACCELERATE_USE_CPU": "true", "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = launch.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)
        launch.communicate()
        raise AssertionError("the run did not end within 150 s: every rank kept starting new epochs") from None
    assert launch.returncode != 0
    assert f"files balanced by size, parts of {sizes[0]} B, {sizes[1]} B" in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("mlm_ddp.train: error: ")]
    # every rank raises it at the same step; the launcher stops the others once the first has exited
    assert errors and len(set(errors)) == 1, stderr[-3000:]
    assert errors[0] == (
        "mlm_ddp.train: error: the training stream is too small for one optimizer step: epoch 0 gave rank 0: 4 or "
        "more, rank 1: 1 micro-batch(es) of --per_device_train_batch_size 8 blocks, and every rank needs "
        "--gradient_accumulation_steps 4 of them for a step, with 2 process(es); every epoch would end before a "
        "step. Use --gradient_accumulation_steps 1 or less, a smaller --per_device_train_batch_size, fewer "
        "processes, or more text")
    assert "epoch 1" not in stderr  # it stopped in the first epoch
    assert not (tmp_path / "run" / "config.yaml").exists()  # before anything was written
