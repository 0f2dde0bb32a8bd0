"""The GPU suite's frame: where it runs, what it builds, how it launches runs and how long it may take.

Two modes:
- on a CUDA GPU (`python -m pytest tests/gpu -v -s -rs`): every test at its GPU size;
- the dry run on the CPU (`MLM_DDP_GPU_SUITE_ON_CPU=1 python -m pytest tests/gpu`): every test at a tiny
  size, every fixture, launch, parse and comparison as on the GPU. Only the assertions that need CUDA
  are not checked; each is named (`on_cuda`) and listed at the end. CI runs it (tests/test_gpu_suite.py).

Elsewhere (no CUDA, no dry run) every test is skipped with one line. The suite needs torch, transformers,
accelerate and `datasets`: where one of them fails to import, the suite skips in the dry run on a CPU, and
fails on a machine with CUDA, naming the package (a broken GPU environment must not report green). Nothing
else of ours: the encoders are built from a config with the
vocabulary shipped in tests/data, and a test that needs the pretrained all-MiniLM-L6-v2 skips without it.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, corpus_paragraphs

DRY_RUN = os.environ.get("MLM_DDP_GPU_SUITE_ON_CPU") == "1"
ON_GPU = torch.cuda.is_available() and not DRY_RUN
# tests/test_gpu_suite.py's seam, read here only: the import check as on a machine with CUDA, on a CPU
ASSUME_CUDA = "MLM_DDP_GPU_SUITE_ASSUME_CUDA"
GPU_SUITE = Path(__file__).resolve().parent
VOCAB = REPO / "tests" / "data" / "wordpiece-30522.txt"  # bert-base-uncased's WordPiece (Apache-2.0)

# The suite's budget on one H100, checked at the end against what ran, measured: the setup, call and teardown
# of every test, fixtures included (`budget_verdict`). And each test's expected seconds there, printed beside
# its measured time, and summed over the tests not skipped at collection as a forecast, never checked against
# the budget. Where a test ran on the first GPU run (an H200, 2026-11-27; docs/gpu.md) its estimate is that
# time, rounded up: the H100 has the same 132 SMs and slower memory, and these tests are mostly start-up and
# launches. The others are still guesses (docs/gpu.md: how). The frame refuses a test without one.
BUDGET_S = 480
ESTIMATE_S = {
    "test_the_frame_kills_a_launch_and_its_workers_at_the_timeout": 10,  # measured 6.6 s
    "test_auto_picks_what_this_device_computes_natively": 2,  # measured 0.0 s
    "test_16_bit_logits_stay_within_the_rounding_bound": 5,  # measured 0.9 s, both formats
    "test_16_bit_trains_as_fp32_does": 90,  # measured 89.8 s: 3 launches
    "test_the_pretrained_default_job_in_16_bit": 45,  # not run yet (the model package was absent)
    "test_the_last_layer_subset_gives_the_full_loss_and_gradients": 2,  # measured 0.1 s
    "test_the_hot_loop_syncs_once_per_optimizer_step": 30,  # measured 28.1 s: packed and --line_by_line
    "test_a_padded_batch_gets_the_2d_masks_loss": 8,  # measured 6.6 s
    "test_fsdp2_with_a_fresh_head_saves_resumes_and_writes_final": 55,  # measured 51.7 s
    "test_bert_base_throughput_against_the_hf_recipe": 65,  # measured 63.7 s with 10 + 3 x 20 steps
    "test_minilm_bench_the_launch_bound_case": 30,  # measured 23.5-27.7 s
    "test_side_by_side_against_run_mlm_no_trainer": 75,  # measured 24.1-35.2 s for mlm_ddp's half alone
    "test_two_ranks_train_as_one": 100,  # not run yet (one GPU)
}
LAUNCH_TIMEOUT_S = 180  # the most one launched run may take; then its whole process tree is killed
TEST_TIMEOUT_S = 300  # the most one test may take (several launches); the dry run's CPU gets the same

# what one session of the suite left unchecked in the dry run: (test, assertion)
UNCHECKED: list[tuple[str, str]] = []
MEASURED_S: dict[str, float] = {}  # test id -> seconds of its setup, call and teardown (fixtures included)
SKIPPED: set[str] = set()
CASES: dict[str, int] = {}  # test function -> its parametrized cases, which share its one estimate


@dataclass(frozen=True)
class Shape:
    """A BERT encoder's sizes (transformers' BertConfig names)."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int


SHAPES = {
    "minilm": Shape(6, 384, 12, 1536),  # all-MiniLM-L6-v2's shape
    "bert-base": Shape(12, 768, 12, 3072),
}
DRY_SHAPE = Shape(2, 32, 2, 64)  # every shape in the dry run


def pick(gpu, dry):
    """The GPU's figure, or the dry run's."""
    return dry if DRY_RUN else gpu


def device() -> str:
    return "cuda" if ON_GPU else "cpu"


def on_cuda(request: pytest.FixtureRequest, what: str) -> bool:
    """True on the GPU: check `what`. In the dry run: False, and `what` is listed as unchecked."""
    if not ON_GPU:
        UNCHECKED.append((request.node.name, what))
    return ON_GPU


def gpu_precisions() -> list[str]:
    """The 16-bit formats this device trains in: fp16 and bf16 on a GPU of compute capability 8 or more,
    fp16 alone before; bf16 in the dry run (a CPU's autocast)."""
    if not ON_GPU:
        return ["bf16"]
    return ["fp16", "bf16"] if torch.cuda.get_device_capability(0)[0] >= 8 else ["fp16"]


def gpu_count() -> int:
    """GPUs for the two-rank tests; the dry run has two CPU processes."""
    return torch.cuda.device_count() if ON_GPU else 2


# --- encoders built from a config, with the shipped vocabulary ------------------------------------------


def save_encoder(shape: Shape, root: Path, seed: int = 0) -> Path:
    """A seeded BertModel of `shape` without an MLM head (as all-MiniLM-L6-v2 comes: the head starts
    fresh when mlm_ddp loads it), and the 30,522-word uncased WordPiece tokenizer, saved in `root`."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    root.mkdir(parents=True, exist_ok=True)
    (root / "vocab.txt").write_bytes(VOCAB.read_bytes())
    (root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer",
                                                            "do_lower_case": True, "model_max_length": 512}))
    tokenizer = AutoTokenizer.from_pretrained(root)
    assert tokenizer.is_fast and len(tokenizer) == 30522
    tokenizer.save_pretrained(root)
    config = BertConfig(vocab_size=len(tokenizer), max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                        **vars(pick(shape, DRY_SHAPE)))
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(root)
    return root


@pytest.fixture(scope="session")
def encoders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """'minilm' and 'bert-base': config-built encoders (tiny in the dry run)."""
    root = tmp_path_factory.mktemp("encoders")
    return {name: save_encoder(shape, root / name) for name, shape in SHAPES.items()}


def write_text(path: Path, tokens: int) -> Path:
    """Real English (CPython's reference paragraphs), one per line, repeated until it holds at least
    `tokens` words (about as many WordPiece tokens): a run that must not end an epoch gets enough."""
    paragraphs = corpus_paragraphs()
    lines, words = [], 0
    while words < tokens:
        for p in paragraphs:
            lines.append(p)
            words += len(p.split())
            if words >= tokens:
                break
    path.write_text("\n".join(lines) + "\n")
    return path


# the dry run's training text: 400 paragraphs (~27k tokens), about 100 of its largest steps (8 x 32 tokens) and
# 4 x the lines its --line_by_line run reads, where every paragraph (~118k tokens) was tokenized again by each of
# its runs, in a fresh datasets cache
DRY_TRAIN_PARAGRAPHS = 400


@pytest.fixture(scope="session")
def text(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """train.txt (every reference paragraph after the first 60; the dry run: 400 of them) and valid.txt (the
    first 60)."""
    root = tmp_path_factory.mktemp("text")
    paragraphs = corpus_paragraphs()
    (root / "valid.txt").write_text("\n".join(paragraphs[:60]) + "\n")
    (root / "train.txt").write_text("\n".join(paragraphs[60:pick(None, 60 + DRY_TRAIN_PARAGRAPHS)]) + "\n")
    return {"train": root / "train.txt", "valid": root / "valid.txt", "root": root}


# --- launching runs -------------------------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc. torchrun starts each worker in a session of its own, so
    killing the launcher's process group leaves the workers holding the GPU."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL to `proc`'s process group and to every process below it, wherever their sessions."""
    below = descendants(proc.pid)
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), *(lambda p=p: os.kill(p, signal.SIGKILL) for p in below)):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def run_env(extra: dict | None = None) -> dict[str, str]:
    """A run's environment: offline, unbuffered, and in the dry run on the CPU (no leaked device). Without
    the host's ACCELERATE_* variables (an exported ACCELERATE_MIXED_PRECISION would make the runs refuse
    their own --mixed_precision): what accelerate sets, it sets from the suite's config (`accelerate_config`)."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env = {**inherited, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if DRY_RUN:
        env.update(ACCELERATE_USE_CPU="true", CUDA_VISIBLE_DEVICES="")
    else:
        env.pop("ACCELERATE_USE_CPU", None)
    return {**env, **(extra or {})}


def launch(command: list[str], *, timeout: float = LAUNCH_TIMEOUT_S, env: dict | None = None,
           cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run `command` (`python -m` is put in front of a module name's list: command[0] without '/') in its
    own session; at `timeout`, or when the test itself is stopped, its whole tree is killed."""
    argv = command if "/" in command[0] else [sys.executable, "-m", *command]
    proc = subprocess.Popen(argv, cwd=cwd, env=run_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        # a process that escaped the kill would hold the pipes open: read what came, at most 10 s more
        out, err = proc.communicate(timeout=10)
        raise AssertionError(f"{' '.join(command[:6])} ... ran past {timeout:.0f} s; its processes were killed\n"
                             f"{err[-3000:]}") from None
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


START_LINE = re.compile(r"precision (\w+) \(.*\); device (\S+) \(")


def assert_ran_on_device(log: str, precision: str) -> None:
    """The run's start-up line says it trained on this suite's device in `precision`."""
    found = START_LINE.findall(log)
    assert found, f"no start-up line in the log:\n{log[-2000:]}"
    for chosen, where in found:
        assert where.startswith(device()), f"the run trained on {where}, not {device()}"
        assert chosen == precision, f"the run trained in {chosen}, not {precision}"


def accelerate_config(processes: int, fsdp: bool = False) -> Path:
    """The suite's own accelerate config for a launch: always one (`accelerate launch` without --config_file
    reads the host's default config, whose mixed_precision would make the 16-bit runs refuse their flags),
    and without mixed_precision (mlm_ddp's flag decides). In the dry run the CPU's."""
    from tests.conftest import CONFIGS

    if fsdp:
        return CONFIGS / "fsdp.yaml"  # the dry run: ACCELERATE_USE_CPU (run_env) keeps it on the CPU
    if processes > 1:
        return CONFIGS / ("multi_gpu.yaml" if ON_GPU else "cpu_ddp.yaml")
    return CONFIGS / ("single_gpu.yaml" if ON_GPU else "cpu.yaml")


def train_run(out: Path, model: Path, text: dict[str, Path], *flags: str, precision: str = "no",
              processes: int = 1, fsdp: bool = False, timeout: float = LAUNCH_TIMEOUT_S) -> str:
    """One `mlm_ddp.train` run through `accelerate launch` on `processes` devices; its log (stderr)."""
    from tests.conftest import LAUNCH, free_port

    topology = ["--config_file", str(accelerate_config(processes, fsdp)), "--num_processes", str(processes)]
    threads = [] if ON_GPU else ["--num_cpu_threads_per_process", "1"]
    proc = launch([*LAUNCH, *topology, *threads, "--main_process_port", str(free_port()), "-m", "mlm_ddp.train",
                   "--model_name_or_path", str(model), "--train_file", str(text["train"]),
                   "--validation_file", str(text["valid"]), "--output_dir", str(out), "--mixed_precision", precision,
                   "--report", "false", *flags], timeout=timeout,
                  env={"HF_DATASETS_CACHE": str(out.parent / f".cache-{out.name}")})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_ran_on_device(proc.stderr, precision)
    return proc.stderr


# --- pytest hooks: skip where it cannot run, refuse what has no estimate, time out a test --------------


SUITE_PACKAGES = ("transformers", "accelerate", "datasets")  # beyond torch: what the suite imports
MISSING_WHEELS = "docs/gpu.md lists the wheels to bring to an offline GPU machine"


def version_conflicts(packages: tuple[str, ...] = SUITE_PACKAGES) -> list[str]:
    """What `pip check` would say about `packages`' own requirements, read from the installed metadata
    without importing anything: "datasets 5.2.0 needs fsspec<=2026.9.0,>=2023.1.0 (installed: 2026.10.0)".
    A `--no-deps` install of the wheels next to an older image's packages passes pip and fails at import."""
    from importlib import metadata

    from packaging.requirements import Requirement

    found = []
    for package in packages:
        try:
            requires = metadata.requires(package) or []
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            need = Requirement(line)
            if need.marker is not None and not need.marker.evaluate({"extra": ""}):
                continue  # an extra's, or another platform's
            try:
                have = metadata.version(need.name)
            except metadata.PackageNotFoundError:
                found.append(f"{package} {version} needs {need.name}{need.specifier} (not installed)")
                continue
            if need.specifier and not need.specifier.contains(have, prereleases=True):
                found.append(f"{package} {version} needs {need.name}{need.specifier} (installed: {have})")
    return found


def import_problem(packages: tuple[str, ...] = SUITE_PACKAGES) -> str | None:
    """Why the suite cannot run here, or None: a package that is not installed, or whose import fails,
    with the import's own error and the version conflicts that likely caused it."""
    from importlib import metadata

    for package in packages:
        try:
            metadata.version(package)
        except metadata.PackageNotFoundError:
            return f"`{package}` is not installed: {MISSING_WHEELS}"
    conflicts = version_conflicts(packages)
    for package in packages:
        try:
            importlib.import_module(package)
        except Exception as err:  # noqa: BLE001 - an old pyarrow fails datasets' import with AttributeError
            cause = f"; version conflicts: {'; '.join(conflicts)}" if conflicts else ""
            return f"`{package}` cannot be imported ({type(err).__name__}: {err}){cause}. {MISSING_WHEELS}"
    return None


def skipped_at_collection(item: pytest.Item) -> bool:
    """Whether a skip or skipif marker skips `item` here (a test can still skip as it runs)."""
    return any(mark.name == "skip" or (mark.name == "skipif" and any(mark.args)) for mark in item.iter_markers())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if GPU_SUITE in Path(str(item.path)).parents]
    if not ours:
        return
    cuda = torch.cuda.is_available() or os.environ.get(ASSUME_CUDA) == "1"
    reason = None
    if not cuda and not DRY_RUN:
        reason = ("no CUDA GPU here: the GPU suite runs where one is (python -m pytest tests/gpu -v -s -rs), "
                  "or dry on the CPU with MLM_DDP_GPU_SUITE_ON_CPU=1")
    else:
        reason = import_problem()
        if reason and cuda:  # the dry run too: on a CUDA machine it precedes the real run
            raise pytest.UsageError(f"CUDA is here, but the GPU suite cannot run: {reason}")
    if reason:
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=reason))
        return
    missing = sorted({item.originalname for item in ours} - set(ESTIMATE_S))
    if missing:
        raise pytest.UsageError(f"tests/gpu/conftest.py ESTIMATE_S has no estimate for {', '.join(missing)}")
    runs = [item for item in ours if not skipped_at_collection(item)]
    for item in ours:
        CASES[item.originalname] = CASES.get(item.originalname, 0) + 1
    forecast = sum(ESTIMATE_S[name] for name in {item.originalname for item in runs})
    where = torch.cuda.get_device_name(0) if ON_GPU else "the CPU (dry run, tiny sizes)"
    print(f"\nGPU suite on {where}: {len(ours)} tests, {len(ours) - len(runs)} skipped here at collection; the "
          f"others estimated at {forecast} s on one H100 (a forecast; the budget, {BUDGET_S} s, is checked against "
          "the measured times at the end)")
    for conflict in version_conflicts():  # the imports work: the suite runs, and a failure may come from these
        print(f"version conflict: {conflict}")


@pytest.fixture(autouse=True)
def _time_limit(request: pytest.FixtureRequest):
    """A test past TEST_TIMEOUT_S fails there (its launches are killed on the way out, `launch`)."""

    def expire(signum, frame):
        raise TimeoutError(f"{request.node.name} ran past {TEST_TIMEOUT_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, TEST_TIMEOUT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each test's measured time, its fixtures' setup included (a module's first test pays for the
    module's shared runs), printed when it ends beside its estimate."""
    if GPU_SUITE not in (REPO / report.fspath).resolve().parents:
        return
    MEASURED_S[report.nodeid] = MEASURED_S.get(report.nodeid, 0.0) + report.duration
    if report.skipped:
        SKIPPED.add(report.nodeid)
    if report.when == "teardown":
        print(f"\n[{time_line(report.nodeid)}]", flush=True)


def time_line(nodeid: str) -> str:
    name = nodeid.rsplit("::", 1)[-1]
    function = name.split("[", 1)[0]
    cases = CASES.get(function, 1)
    return (f"{name}: {MEASURED_S[nodeid]:.1f} s measured on {device()}{' (skipped)' if nodeid in SKIPPED else ''}, "
            f"estimated {ESTIMATE_S.get(function, '?')} s on one H100{f' for its {cases} cases' if cases > 1 else ''}")


def budget_verdict(measured: dict[str, float], budget: float = BUDGET_S) -> tuple[float, str | None]:
    """(seconds the suite's tests took, fixtures included; why that is over `budget`, or None)."""
    total = sum(measured.values())
    if total <= budget:
        return total, None
    slowest = sorted(measured.items(), key=lambda kv: -kv[1])[:3]
    return total, (f"the GPU suite took {total:.0f} s, over its budget of {budget:.0f} s; the slowest: "
                   + ", ".join(f"{nodeid.rsplit('::', 1)[-1]} {s:.0f} s" for nodeid, s in slowest))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """On a GPU a suite over its budget fails; in the dry run the CPU's times say nothing of an H100's."""
    if ON_GPU and MEASURED_S and budget_verdict(MEASURED_S)[1] is not None:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    if MEASURED_S:
        total, over = budget_verdict(MEASURED_S)
        terminalreporter.section(f"GPU suite: measured times on {device()}")
        for nodeid in MEASURED_S:
            terminalreporter.write_line(time_line(nodeid))
        verdict = (over or "within the budget") if ON_GPU else "the budget applies on a GPU: not checked in the dry run"
        terminalreporter.write_line(f"total {total:.1f} s (budget {BUDGET_S} s on one H100): {verdict}")
    if UNCHECKED:
        terminalreporter.section("dry run: assertions that need CUDA, not checked on the CPU")
        for test, what in UNCHECKED:
            terminalreporter.write_line(f"UNCHECKED {test}: {what}")
