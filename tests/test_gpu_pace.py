"""The GPU measurement (tests/gpu/pace.py) runs end to end on the CPU at tiny sizes, so that a
GPU slot spends its minutes measuring, not finding a broken script."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.conftest import run_module


def test_the_pace_script_writes_each_result_as_it_finishes(tmp_path: Path) -> None:
    env = {"MLM_DDP_GPU_SUITE_ON_CPU": "1", "HF_HUB_OFFLINE": "1"}
    env = {k: v for k, v in {**os.environ, **env}.items() if not k.startswith("ACCELERATE_")}
    proc = run_module(["tests.gpu.pace", str(tmp_path)], env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    bench = json.loads((tmp_path / "bench-bert-base-4x32.json").read_text())
    assert set(bench["variants"]) == {"workers"} and bench["workers"] == 0  # (b) in the thread, the variant not
    for figures in (bench["mlm_ddp"], bench["variants"]["workers"]):
        assert figures["tokens_per_s"] > 0 and figures["host_s_per_step"] > 0 and figures["device_s_per_step"] > 0
    assert {"matmul", "elementwise"} <= set(bench["seconds_by_kind"])
    trained = json.loads((tmp_path / "train.json").read_text())
    assert trained["steps_timed"] >= 2 and trained["tokens_per_s"] > 0
    assert "--dataloader_num_workers" in trained["flags"]
    assert "bench bert-base 4x32: (b)" in proc.stdout and "mlm_ddp.train bert-base 4x32 (" in proc.stdout
