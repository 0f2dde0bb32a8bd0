"""Mixed precision: what `auto` picks on which device and why, the launcher's precision
honoured or refused, and FSDP2's policy. Skipped updates, for every precision and AdamW
implementation: fp16 overflows counted, non-finite losses stopped at or counted, a run that no longer
trains never ending as done.
The real bf16 runs on two CPU processes (DDP and FSDP) are in test_fsdp.py, beside the fp32 runs they
are measured against."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mlm_ddp.cluster import launcher as distributed
from mlm_ddp.cluster import precision
from mlm_ddp.cluster.precision import Hardware, choose_precision
from mlm_ddp.config import RunConfig
from mlm_ddp.errors import EXIT_NONFINITE, BadInput, NonFiniteLoss
from mlm_ddp.loop.spikes import LossSpikes
from mlm_ddp.loop.step import NONFINITE_IN_A_ROW, SkippedSteps, settle_step, train_step
from tests.conftest import CONFIGS, LAUNCH, run_module, tiny_args

CPU, CPU_BF16 = Hardware("cpu"), Hardware("cpu", cpu_bf16=True)


def cuda(major: int, minor: int = 0) -> Hardware:
    return Hardware("cuda", (major, minor))


# (visible CUDA devices, their capability, native CPU bf16, ACCELERATE_USE_CPU) -> (precision, why)
AUTO = [
    (1, (9, 0), False, None, "bf16", "compute capability 9.0 computes bf16 natively"),  # H100
    (8, (8, 0), True, None, "bf16", "compute capability 8.0 computes bf16 natively"),  # A100
    (1, (7, 5), False, None, "fp16", "compute capability 7.5 (V100, T4) has fp16 tensor cores"),  # T4
    (4, (7, 0), True, None, "fp16", "compute capability 7.0 (V100, T4) has fp16 tensor cores"),  # V100
    (1, (6, 0), False, None, "no", "compute capability 6.0 has no tensor cores"),  # P100
    (0, None, True, None, "bf16", "this CPU computes bf16 natively (AVX512-BF16 or AMX)"),
    (0, None, False, None, "no", "this CPU has no native bf16"),
    # a CPU-forced launch on a GPU node: the CPU's choice, whatever the GPU could do
    (8, (9, 0), False, "true", "no", "this CPU has no native bf16"),
    (8, (9, 0), True, "True", "bf16", "this CPU computes bf16 natively"),
    (2, (7, 0), False, "1", "no", "this CPU has no native bf16"),
    (2, (7, 0), False, "false", "fp16", "compute capability 7.0"),
]


@pytest.mark.parametrize(("gpus", "capability", "cpu_bf16", "use_cpu", "expected", "why"), AUTO)
def test_auto_follows_the_device_the_run_uses(gpus: int, capability: tuple | None, cpu_bf16: bool,
                                              use_cpu: str | None, expected: str, why: str) -> None:
    env = {} if use_cpu is None else {"ACCELERATE_USE_CPU": use_cpu}
    topo = distributed.detect(env, cuda_devices=gpus)
    forced = use_cpu is not None and use_cpu.lower() in ("true", "1")
    assert topo.device == ("cpu" if forced or not gpus else "cuda:0")
    hw = Hardware("cuda", capability) if topo.cuda_devices else Hardware("cpu", cpu_bf16=cpu_bf16)
    precision, reason = choose_precision("auto", None, hw)
    assert (precision, reason.startswith("auto: ")) == (expected, True)
    assert why in reason


@pytest.mark.parametrize(("requested", "launcher", "hw", "expected"), [
    ("no", None, CPU_BF16, ("no", "--mixed_precision no")),
    ("bf16", None, CPU, ("bf16", "--mixed_precision bf16")),  # asked for: emulated, but honoured
    ("auto", ("no", "accelerate launch --mixed_precision no"), CPU_BF16,
     ("no", "from accelerate launch --mixed_precision no")),
    ("auto", ("bf16", "accelerate launch"), cuda(7, 0), ("bf16", "from accelerate launch")),
    ("bf16", ("bf16", "accelerate launch"), CPU, ("bf16", "--mixed_precision bf16")),  # agreeing: fine
    ("fp16", None, cuda(7, 0), ("fp16", "--mixed_precision fp16")),
])
def test_a_precision_given_is_honoured(requested: str, launcher: tuple | None, hw: Hardware,
                                       expected: tuple) -> None:
    assert choose_precision(requested, launcher, hw) == expected


@pytest.mark.parametrize(("requested", "launcher", "hw", "message"), [
    ("no", ("bf16", "accelerate launch"), CPU_BF16,
     r"--mixed_precision no and the launcher's bf16 \(from accelerate launch\) disagree"),
    ("bf16", ("no", "mixed_precision: no in my.yaml"), cuda(9), r"the launcher's no \(from mixed_precision: no in my"),
    ("fp16", None, CPU_BF16, "fp16 .* needs a CUDA GPU; on a CPU accelerate would train in fp32"),
    ("auto", ("fp16", "accelerate launch"), CPU, "fp16 .*from accelerate launch.* needs a CUDA GPU"),
    ("auto", ("fp8", "accelerate launch"), cuda(9), "asks for mixed precision 'fp8'; mlm_ddp trains in no, fp16, bf16"),
])
def test_a_precision_that_cannot_be_honoured_is_refused(requested: str, launcher: tuple | None, hw: Hardware,
                                                        message: str) -> None:
    with pytest.raises(BadInput, match=message):
        choose_precision(requested, launcher, hw)


def test_the_launcher_precision_counts_no_only_where_it_was_said(tmp_path: Path) -> None:
    said_no, said_bf16, silent = (tmp_path / f"{n}.yaml" for n in ("no", "bf16", "silent"))
    said_no.write_text('mixed_precision: "no"\nnum_processes: 1\n')
    said_bf16.write_text("mixed_precision: bf16\n")
    silent.write_text("num_processes: 1\n")
    launch = ["/venv/bin/python", "/venv/bin/accelerate", "launch"]
    ours = ["-m", "mlm_ddp.train", "--mixed_precision", "no"]  # mlm_ddp's own flag, after the module
    cases = [
        ({}, [*launch, *ours], None),
        ({"ACCELERATE_MIXED_PRECISION": "bf16"}, [], ("bf16", precision.LAUNCHER_SOURCE)),
        # "no" is what accelerate launch exports when it was told nothing
        ({"ACCELERATE_MIXED_PRECISION": "no"}, [*launch, "--config_file", str(silent), *ours], None),
        ({"ACCELERATE_MIXED_PRECISION": "no"}, [*launch, "--mixed_precision", "no", *ours],
         ("no", "accelerate launch --mixed_precision no")),
        ({"ACCELERATE_MIXED_PRECISION": "no"}, ["python", "-m", "accelerate.commands.launch", "--mixed_precision=no",
                                                "train.py"], ("no", "accelerate launch --mixed_precision no")),
        ({"ACCELERATE_MIXED_PRECISION": "no"}, [*launch, "--config_file", str(said_no), *ours],
         ("no", f"mixed_precision: no in {said_no}")),
        ({"ACCELERATE_MIXED_PRECISION": "no"}, ["torchrun", "--nproc_per_node", "2", "train.py"], None),
    ]
    for env, argv, expected in cases:
        assert precision.launcher_precision(env, argv) == expected, (env, argv)


def launch_one(config: str, launch_flags: list[str], args: list[str]):
    return run_module([*LAUNCH, "--config_file", str(CONFIGS / config), *launch_flags, "-m", "mlm_ddp.train", *args])


def test_accelerate_launch_precision_reaches_the_run_or_stops_it(tiny_model: Path, corpus: dict,
                                                                 tmp_path: Path) -> None:
    # honoured: the launcher says no, mlm_ddp's flag says auto (what tiny_args pinned is put back)
    args = tiny_args(tiny_model, corpus, tmp_path / "honoured", "--max_train_steps", "1", "--report", "false",
                     "--mixed_precision", "auto")
    proc = launch_one("cpu.yaml", ["--mixed_precision", "no"], args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "precision no (from accelerate launch --mixed_precision no)" in proc.stderr
    # refused before anything is written: the launcher and the flag disagree
    args = tiny_args(tiny_model, corpus, tmp_path / "refused", "--max_train_steps", "1", "--mixed_precision", "no")
    proc = launch_one("cpu.yaml", ["--mixed_precision", "bf16"], args)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("mlm_ddp.train: error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert "--mixed_precision no and the launcher's bf16" in errors[0]
    assert not (tmp_path / "refused").exists()


def test_fsdp2_policy_keeps_loss_sums_and_gradient_reductions_in_fp32() -> None:
    from mlm_ddp.model.loading import check_loss_sum

    assert precision.fsdp2_policy("no") is None
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        policy = precision.fsdp2_policy(name)
        assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (dtype, torch.float32, None)
    assert check_loss_sum(torch.tensor(2201.6)).dtype == torch.float32
    with pytest.raises(RuntimeError, match="loss sum in torch.bfloat16"):
        check_loss_sum(torch.tensor(2201.6).bfloat16())  # 2208.0: what accelerate's own policy returned


def test_the_mfu_peak_multiplies_operands_already_in_the_training_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate import Accelerator

    from mlm_ddp.loop import speed

    seen: list[tuple] = []
    real = torch.nn.functional.linear

    def spy(a: torch.Tensor, b: torch.Tensor, *rest: object) -> torch.Tensor:
        seen.append((a.dtype, b.dtype))
        return real(a, b, *rest)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    assert speed.measure_peak(Accelerator(cpu=True, mixed_precision="bf16"), min_seconds=0.0) > 0
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}


# --- skipped updates, decided from the step's own numbers ------------------------------------------------
# fp16 needs CUDA, which this suite does not have. step.train_step runs here with torch's real
# torch.amp.GradScaler and a real fp16 autocast on the CPU: the Accelerator is given what accelerate gives it
# on a CUDA device (its scaler and native_amp: the only thing faked), so accelerate unscales the gradients
# for clipping and steps through the scaler as on a GPU. With a fused AdamW, GradScaler.step calls
# optimizer.step whatever the gradients hold and the kernel skips on the device (found_inf), so accelerate's
# step_was_skipped stays False: judged by that flag, such a step would count as taken (fp16 NaNs would never
# stop a run).

IMPLS = ["fused", "foreach", "for-loop"]


def skipped_steps(mode: str, accelerator) -> SkippedSteps:
    return SkippedSteps(mode, accelerator, LossSpikes(RunConfig()), lambda: None)


def one_step(precision: str, impl: str, loss_factor: float, init_scale: float = 2.0**8):
    """One train_step of a tiny BERT with the real optimizer mlm_ddp builds (--optimizer_impl `impl`), its
    loss multiplied by `loss_factor`; (the step judged as the loop judges it: None if its update was taken,
    else the skipped StepResult; whether any weight changed; the accelerator)."""
    from accelerate import Accelerator
    from transformers import BertConfig, BertForMaskedLM

    from mlm_ddp.config import TrainingConfig
    from mlm_ddp.loop.optim import build_optimizer
    from mlm_ddp.model.loading import MaskedLMLoss

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16)
    accelerator = Accelerator(cpu=True, mixed_precision=precision)
    if precision == "fp16":  # what accelerate sets on a CUDA device (see above)
        accelerator.native_amp, accelerator.scaler = True, torch.amp.GradScaler("cpu", init_scale=init_scale)
    model = MaskedLMLoss(BertForMaskedLM(config))
    optimizer = build_optimizer(model, TrainingConfig(optimizer_impl=impl, learning_rate=1e-3))
    model, optimizer = accelerator.prepare(model, optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    labels = torch.full((2, 8), -100)
    labels[:, 2] = 7
    window = [{"input_ids": torch.randint(5, 50, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long),
               "labels": labels}]
    result = train_step(accelerator, model, optimizer, window, torch.tensor(2.0, dtype=torch.float64), 1.0,
                        loss_factors=[loss_factor])
    changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    if isinstance(result.stepped, torch.Tensor):  # read as train.fit reads it (the next step's all-reduce)
        judged = settle_step(accelerator, result)
    else:
        judged = None if result.stepped else result
    return judged, changed, accelerator


@pytest.mark.parametrize("mode", ["stop", "skip"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("precision", ["fp16", "bf16", "no"])
def test_a_nan_loss_skips_the_update_then_stops_or_is_counted(precision: str, impl: str, mode: str) -> None:
    judged, changed, accelerator = one_step(precision, impl, math.nan)
    assert judged is not None and not judged.overflow and not changed
    skips = skipped_steps(mode, accelerator)
    if mode == "stop":
        with pytest.raises(NonFiniteLoss, match="step 1: the gradient norm is nan.*before any update, so not the "
                                                "learning rate: check the model"):
            skips(0, judged)
        with pytest.raises(NonFiniteLoss, match="step 5: the gradient norm is nan.*Lower --learning_rate"):
            skips(4, judged)  # after updates
    else:
        skips(0, judged)
        assert skips.reported() == {"nonfinite": 1, "overflow": 0}
    if precision == "fp16":
        assert accelerator.scaler.get_scale() == 2.0**7  # the scaler skipped it too, and lowered its scale


@pytest.mark.parametrize("mode", ["stop", "skip"])
@pytest.mark.parametrize("impl", IMPLS)
def test_fp16_an_overflow_is_counted_and_never_stops_the_run(impl: str, mode: str,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    # x 1e36 keeps the loss finite in fp32 (about 8e36) but its fp16 gradients are inf at any scale
    judged, changed, accelerator = one_step("fp16", impl, 1e36)
    assert judged is not None and judged.overflow and math.isfinite(float(judged.loss_sum)) and not changed
    skips = skipped_steps(mode, accelerator)
    with caplog.at_level("INFO"):
        skips(0, judged)
        skips.summary(0, 2)  # the run's second step took its update
    assert skips.reported() == {"nonfinite": 0, "overflow": 1}
    assert "step 1: the fp16 gradients overflowed; the gradient scaler skipped the update and lowered its scale " \
           "to 128 (1 so far)" in caplog.text
    assert "1 fp16 overflow(s): the gradient scaler skipped those updates" in caplog.text


@pytest.mark.parametrize("impl", IMPLS)
def test_fp16_a_normal_step_updates(impl: str) -> None:
    judged, changed, accelerator = one_step("fp16", impl, 1.0)
    assert (judged, changed, accelerator.scaler.get_scale()) == (None, True, 2.0**8)


def test_fp16_overflows_that_take_the_scale_below_one_stop_the_run() -> None:
    """At scale 1 the gradients overflow fp16 at their true size: no scale can make the next step fit."""
    judged, _, accelerator = one_step("fp16", "fused", 1e36, init_scale=1.0)
    with pytest.raises(NonFiniteLoss, match="step 1: the fp16 gradients overflowed 1 step.s. in a row and the loss "
                                            "scale fell to 0.5"):
        skipped_steps("skip", accelerator)(0, judged)


def test_skip_stops_a_run_whose_loss_stays_nonfinite() -> None:
    judged, _, accelerator = one_step("no", "fused", math.nan)
    skips = skipped_steps("skip", accelerator)
    for step in [0, 1, 2, *range(4, 4 + NONFINITE_IN_A_ROW - 1)]:  # step 3 took its update
        skips(step, judged)
    with pytest.raises(NonFiniteLoss, match=f"NaN/inf {NONFINITE_IN_A_ROW} steps in a row"):
        skips(4 + NONFINITE_IN_A_ROW - 1, judged)
    # a run none of whose updates was taken ends as no success, however short
    short = skipped_steps("skip", accelerator)
    for step in (5, 6):  # resumed after step 5
        short(step, judged)
    with pytest.raises(NonFiniteLoss, match="step 7: not one of this run's 2 update"):
        short.summary(5, 7)
    short.summary(4, 7)  # step 5 took its update: counted, not fatal


def test_a_nan_step_under_the_default_fused_adamw_is_skipped_and_reported_or_stops(
        tiny_model: Path, corpus: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The whole loop: the skip stays on the device and comes back with the next step's all-reduce."""
    from mlm_ddp.config import parse_args
    from mlm_ddp.train import Hooks, train
    from tests.fault_driver import OneSpike

    args = ["--max_train_steps", "4", "--report", "false"]
    with caplog.at_level("INFO"):
        result = train(parse_args(tiny_args(tiny_model, corpus, tmp_path / "skip", *args,
                                            "--on_nonfinite_loss", "skip")), Hooks(loss_factor=OneSpike("3:nan")))
    assert result.steps == 4 and result.skipped_steps == {"nonfinite": 1, "overflow": 0}
    assert json.loads((tmp_path / "skip" / "summary.json").read_text())["skipped_steps"] == result.skipped_steps
    assert "step 3: gradient norm nan, optimizer step skipped (1 so far)" in caplog.text
    with pytest.raises(NonFiniteLoss, match="step 3: the gradient norm is nan"):
        train(parse_args(tiny_args(tiny_model, corpus, tmp_path / "stop", *args)), Hooks(loss_factor=OneSpike("3:nan")))
    assert not (tmp_path / "stop" / "final").exists()


@pytest.mark.parametrize("mode", ["skip", "stop"])
def test_fsdp_a_nan_step_is_skipped_and_counted_or_stops_on_every_rank(mode: str, tiny_model: Path, corpus: dict,
                                                                      tmp_path: Path) -> None:
    """FSDP2 on two CPU processes: the gradients are DTensor shards, the norm clipping computes is the whole
    one, so every rank takes the same decision (a rank that stepped alone would leave its shard behind, and
    the ranks' collectives would part: 'skip' would not finish)."""
    from tests.conftest import run_module
    from tests.test_fsdp import FSDP_ENV, launch

    out = tmp_path / mode
    proc = run_module(launch("fsdp.yaml", tiny_model, corpus, out, "--max_train_steps", "4", "--on_nonfinite_loss",
                             mode, module=("tests.fault_driver", "--spike", "3:nan")), env=FSDP_ENV)
    if mode == "skip":
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "step 3: gradient norm nan, optimizer step skipped (1 so far)" in proc.stderr
        summary = json.loads((out / "summary.json").read_text())
        assert summary["steps"] == 4 and summary["skipped_steps"] == {"nonfinite": 1, "overflow": 0}
    else:
        # the launcher exits 1 when a process fails; the processes' own code is in its report
        assert proc.returncode != 0 and f"exitcode  : {EXIT_NONFINITE}" in proc.stderr, proc.stderr[-3000:]
        lines = [line for line in proc.stderr.splitlines() if line.startswith("mlm_ddp.train: error: step 3: ")]
        # the first rank to exit 3 has the launcher end the other: one line or two, naming the same step
        assert lines and all("the gradient norm is nan" in line for line in lines), proc.stderr[-3000:]
        assert not (out / "final").exists()
