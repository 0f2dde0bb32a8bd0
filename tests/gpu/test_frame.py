"""The suite's own frame, and what it learns of the device before anything trains."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.gpu.conftest import ON_GPU, launch, on_cuda


def alive(pid: int) -> bool:
    """Running, or stopped: anything but gone or a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_the_frame_kills_a_launch_and_its_workers_at_the_timeout(tmp_path: Path) -> None:
    """torchrun starts each worker in a session of its own: a launch that hangs must not leave them
    behind holding the GPU. Two workers that sleep, a 6 s timeout: afterwards none of them is alive."""
    worker = tmp_path / "worker.py"
    worker.write_text("import os, pathlib, time\n"
                      f"pid = pathlib.Path({str(tmp_path)!r}, 'pid' + os.environ['LOCAL_RANK'])\n"
                      "pid.write_text(str(os.getpid()))\n"
                      "time.sleep(600)\n")
    started = time.monotonic()
    with pytest.raises(AssertionError, match="ran past 6 s; its processes were killed"):
        launch(["torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0", str(worker)], timeout=6)
    assert time.monotonic() - started < 60
    workers = [int((tmp_path / f"pid{rank}").read_text()) for rank in range(2)]
    time.sleep(0.5)  # SIGKILL is delivered at once; reaping by init may take a moment
    assert not [pid for pid in workers if alive(pid)], "workers outlived their launch"


def test_auto_picks_what_this_device_computes_natively(request: pytest.FixtureRequest) -> None:
    from mlm_ddp.cluster import launcher as distributed
    from mlm_ddp.cluster import precision

    hw = precision.hardware(distributed.detect({})) if ON_GPU else precision.Hardware(
        "cpu", cpu_bf16=precision.cpu_computes_bf16())
    chosen, why = precision.auto_precision(hw)
    print(f"{torch.cuda.get_device_name(0) if ON_GPU else 'CPU'}: {hw}, auto -> {chosen} ({why})")
    if on_cuda(request, "auto's choice against torch.cuda.is_bf16_supported(including_emulation=False)"):
        native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        assert chosen == ("bf16" if native_bf16 else "fp16" if hw.capability[0] >= 7 else "no")
    else:
        assert chosen == ("bf16" if hw.cpu_bf16 else "no")
