"""A real 2-process gloo DDP run on the CPU trains to the same curve as one process with the same global batch."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.conftest import NO_DROPOUT, run_module, tiny_args, train_losses


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_with_the_same_global_batch(tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["--max_train_steps", "10", *NO_DROPOUT]
    proc = run_module(["accelerate.commands.launch", "--num_processes", "1", "-m", "mlm_ddp.train",
                       *tiny_args(tiny_model, corpus, one, *common, "--per_device_train_batch_size", "16")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # on a CPU, `--cpu --num_processes 2` starts one process; this is the launch that starts two
    proc = run_module(
        ["accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_cpu_threads_per_process", "1",
         "--main_process_port", str(free_port()), "-m", "mlm_ddp.train",
         *tiny_args(tiny_model, corpus, two, *common, "--per_device_train_batch_size", "8")],
        env={"ACCELERATE_USE_CPU": "true"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "topology: 2 process(es), DistributedType.MULTI_CPU; global batch 16" in proc.stderr
    a, b = train_losses(one), train_losses(two)
    assert sorted(a) == sorted(b) == list(range(1, 11))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
