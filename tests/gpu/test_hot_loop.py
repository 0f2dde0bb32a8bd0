"""The training step on the device: how often it waits for the GPU, the masked-only last layer, and FSDP2
on one device with a fresh head."""

from __future__ import annotations

import traceback
import warnings
from pathlib import Path

import pytest
import torch

from tests.conftest import NO_DROPOUT, SAME_STEPS, train_losses
from tests.gpu.conftest import ON_GPU, device, gpu_precisions, on_cuda, pick, train_run, write_text

# waits for the device per optimizer step on the steps that neither log, evaluate nor save: the read of
# the step's all-reduce, once (tests/test_syncs.py counts the same on the CPU)
SYNC_BUDGET = 1
STEPS = pick(12, 6)  # the dry run: enough quiet steps to count, at a fraction of the time


def innermost_mlm_ddp_line() -> str:
    frames = [f for f in traceback.extract_stack() if "/mlm_ddp/" in f.filename]
    return f"{frames[-1].filename.rsplit('/mlm_ddp/', 1)[1]}:{frames[-1].lineno}" if frames else "outside mlm_ddp"


def padded_text(root: Path) -> list[str]:
    """A packed epoch of fewer blocks than one optimizer step reads (about half a step's tokens in words):
    every step reads the epoch's short block, padded, and blocks without padding."""
    return ["--train_file", str(write_text(root / "short.txt", pick(32 * 2 * 128, 8 * 2 * 32) // 2))]


# each run's quiet steps hold padded micro-batches: transformers' mask builder would read the padding mask
# back (`padding_mask.all()`) for each, unless the model passes the 4-D mask (model.padding_mask_4d)
PADDED_RUNS = {"packed": padded_text, "line_by_line": lambda root: ["--line_by_line"]}


@pytest.mark.parametrize("data", list(PADDED_RUNS))
def test_the_hot_loop_syncs_once_per_optimizer_step(request: pytest.FixtureRequest, encoders: dict[str, Path],
                                                   text: dict[str, Path], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch, data: str) -> None:
    """MiniLM's shape, accumulation 2, in the precision auto picks, with padded micro-batches in every
    counted step (asserted: a step without one would not test the padded path). On the GPU torch's sync
    debug mode reports every wait (a scalar read, a data-dependent shape, a copy from pageable host
    memory); in the dry run test_syncs' dispatch and function modes count the same operations."""
    from mlm_ddp.config import parse_args
    from mlm_ddp.train import Hooks, train
    from tests.test_syncs import count_syncs, describe, per_step, record_padded, waits

    args = ["--model_name_or_path", str(encoders["minilm"]), "--train_file", str(text["train"]),
            "--validation_file", str(text["valid"]), "--output_dir", str(tmp_path / "run"),
            "--max_train_steps", str(STEPS), "--gradient_accumulation_steps", "2", "--logging_steps", "1000",
            "--per_device_train_batch_size", str(pick(32, 8)), "--max_seq_length", str(pick(128, 32)),
            "--max_eval_samples", str(pick(64, 16)), "--mixed_precision", gpu_precisions()[-1], "--report", "false",
            *PADDED_RUNS[data](tmp_path)]
    if not on_cuda(request, "torch.cuda.set_sync_debug_mode counts the waits (the dry run: tests/test_syncs' modes)"):
        monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
        counted = count_syncs(args)
        steps, padded = waits(counted, STEPS), per_step(counted["padded"], STEPS)
    else:
        where: list[tuple[int, str]] = []  # (step, the mlm_ddp line that waited)
        padded_at: list[int] = []  # the step of each padded micro-batch
        step_now = [0]

        def record(message, category, filename, lineno, file=None, line=None) -> None:
            if "synchroniz" in str(message):
                where.append((step_now[0], innermost_mlm_ddp_line()))

        record_padded(monkeypatch, lambda: padded_at.append(step_now[0]))
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train(parse_args(args), Hooks(on_beat=lambda beat: step_now.__setitem__(0, beat.step)))
            finally:
                torch.cuda.set_sync_debug_mode(0)
        steps = {step: [line for at, line in where if at == step] for step in range(2, STEPS)}
        padded = {step: [at for at in padded_at if at == step] for step in range(2, STEPS)}
    print(f"{data}: padded micro-batches per step {[len(v) for v in padded.values()]}; waits for the device per "
          f"optimizer step on {device()}, accumulation 2, steps 2-{STEPS - 1}: {describe(steps)}")
    assert all(padded.values()), f"a counted step without a padded micro-batch proves nothing: {padded}"
    assert all(len(v) == SYNC_BUDGET for v in steps.values()), describe(steps)


def test_a_padded_batch_gets_the_2d_masks_loss(request: pytest.FixtureRequest) -> None:
    """model.padding_mask_4d on the device, in fp32 (TF32 off) and under each 16-bit autocast this device
    trains in: sdpa gets the tensor transformers' builder would have made, so the forward (the loss sums) is
    the same bits as with the 2-D mask: that is the sharp check (a mask that let padding be attended moves
    the loss). The gradients only to a loose bound, 4 unit roundoffs of the format times the largest gradient:
    CUDA's attention backward may sum in another order from one call to the next, by how much is not known
    until a GPU has run this; the largest difference seen is printed, to replace the bound with a measured one
    (tests/test_model.py asserts the same bits for the gradients on the CPU)."""
    from tests.test_model import padded_loss_with_both_masks

    torch.backends.cuda.matmul.allow_tf32 = False
    worst: dict[str, float] = {}
    for precision in ["no", *gpu_precisions()]:
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
        roundoff = {"fp16": 2.0**-11, "bf16": 2.0**-8}.get(precision, 2.0**-24)
        for kind in ("bert", "roberta", "modernbert"):  # ModernBERT: a mask per layer type
            for subset in (False, True):
                with torch.autocast(device(), dtype=dtype, enabled=dtype is not None):
                    (stats4, grads4), (stats2, grads2) = padded_loss_with_both_masks(kind, "sdpa", subset, device())
                assert torch.equal(stats4, stats2), (precision, kind, subset, stats4, stats2)
                # ModernBERT's window (8) holds only padding for the last padded queries: sdpa must give them 0
                assert all(bool(g.isfinite().all()) for g in (*grads4.values(), *grads2.values())), (
                    f"{precision} {kind}: non-finite gradients: sdpa made a query with nothing to attend NaN")
                scale = max(float(g.abs().max()) for g in grads2.values())
                for name in grads2:
                    gap = float((grads4[name] - grads2[name]).abs().max())
                    worst[precision] = max(worst.get(precision, 0.0), gap / scale)
                    assert gap <= 4 * roundoff * scale, (precision, kind, subset, name, gap, scale)
    print("4-D against 2-D mask, largest gradient difference / largest gradient: "
          + ", ".join(f"{p} {w:.1e}" for p, w in worst.items()))
    on_cuda(request, "the 4-D mask on CUDA's sdpa kernels (the dry run: the CPU's)")


def test_the_last_layer_subset_gives_the_full_loss_and_gradients(request: pytest.FixtureRequest) -> None:
    """fp32 with TF32 off: the same sums as the full layer in another order (cuBLAS picks kernels by
    shape), so 1e-5 as on the CPU."""
    from mlm_ddp.model.loading import MaskedLMLoss
    from tests.test_fast_paths import loss_and_grads
    from tests.test_model import batch, tiny

    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny("bert").eval().to(device())
    subset, full = MaskedLMLoss(model, last_layer_subset=True), MaskedLMLoss(model)
    for seed in range(3):
        b = {k: v.to(device()) for k, v in batch(seed, (8, 40)).items()}
        (stats_s, g_s), (stats_f, g_f) = loss_and_grads(subset, b), loss_and_grads(full, b)
        torch.testing.assert_close(stats_s, stats_f, rtol=1e-5, atol=0)
        scale = max(float(g.abs().max()) for g in g_f.values())
        for name in g_f:
            torch.testing.assert_close(g_s[name], g_f[name], rtol=1e-5, atol=1e-6 * scale, msg=name)
    assert next(model.parameters()).device.type == device()


def test_fsdp2_with_a_fresh_head_saves_resumes_and_writes_final(encoders: dict[str, Path], text: dict[str, Path],
                                                               tmp_path: Path) -> None:
    """accelerate_configs/fsdp.yaml on one device in the 16-bit format it trains in: a sharded checkpoint
    at step 3 and a resume from it give the straight run's losses; final/ fills masks."""
    from transformers import pipeline

    precision = gpu_precisions()[-1]
    flags = ["--lr_scheduler_type", "constant", *NO_DROPOUT, "--logging_steps", "1",
             "--per_device_train_batch_size", str(pick(16, 8)), "--max_seq_length", str(pick(128, 32)),
             "--max_eval_samples", str(pick(64, 16)), "--max_train_steps", "6"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    log = train_run(straight, encoders["minilm"], text, *flags, "--checkpointing_steps", "3", precision=precision,
                    fsdp=True)
    assert "DistributedType.FSDP" in log and "has no trained MLM head" in log
    assert (straight / "checkpoints" / "step-0000003" / "pytorch_model_fsdp_0").is_dir()
    train_run(resumed, encoders["minilm"], text, *flags, "--resume_from_checkpoint",
              str(straight / "checkpoints" / "step-0000003"), precision=precision, fsdp=True)
    a, b = train_losses(straight), train_losses(resumed)
    assert sorted(b) == [4, 5, 6] and max(abs(a[s] - b[s]) / a[s] for s in b) <= SAME_STEPS
    fill = pipeline("fill-mask", model=str(resumed / "final"), device=0 if ON_GPU else -1)
    assert len(fill("the [MASK] of the function", top_k=3)) == 3
