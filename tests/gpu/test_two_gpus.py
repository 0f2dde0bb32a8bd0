"""Two ranks train as one: DDP and FSDP2 on two GPUs (two CPU processes over gloo in the dry run)
give one rank's loss curve at the same global batch, save a checkpoint midway that a third run resumes into
another folder with the same losses, and write a final/ that a fill-mask pipeline loads.

The bound, on the GPU. The runs are fp32 and mlm_ddp leaves TF32 off: it sets neither
`torch.backends.cuda.matmul.allow_tf32` nor `torch.set_float32_matmul_precision` (torch's defaults: off,
'highest'), transformers switches it only from TrainingArguments (mlm_ddp has none), and accelerate turns it
on only with its own dynamo backend, which mlm_ddp never configures (--torch_compile compiles in place); the
test checks that neither the environment nor accelerate's default config sets one. fp32 attention runs the
memory-efficient kernel per sample, whose fp32 products are 3xTF32 (fp32 accuracy). So the unit roundoff is
fp32's, u = 2^-24, and the runs differ only in the order of their sums: cuBLAS picks kernels (tiles,
split-K) by the matrices' shapes, and two ranks sum a step's gradients in two halves plus NCCL's all-reduce
(FSDP: its reduce-scatter) where one rank sums them in one; the clip norm is reduced in another order too.
1. A sum of n terms reordered moves by at most about lambda * sqrt(n) * u of the sum of its magnitudes
   (Higham and Mary's probabilistic rounding analysis, 2019; lambda = 3 holds with high probability). The
   longest sum the runs reorder is a weight gradient's over the step's B*T tokens (n = 4096 here); the
   forward's dot products (n <= 1536) and the loss's sum over ~600 masked tokens are shorter.
2. AdamW divides each gradient by its own running magnitude: the update's relative error is the
   gradient's. An update off by a relative delta moves the next losses by delta times what the update
   moved them (to first order), and no step here moves the loss by more than the loss itself.
3. Each of the s steps adds at most its delta (linear, the coherent worst case): after s steps the loss is
   within s * lambda * sqrt(B*T) * u, relative: 8 * 3 * 64 * 2^-24 = 9.2e-5 at the GPU's sizes.
What the bound must catch: in the dry run, other batches (another --seed) moved the steps' losses by
1.7e-4 at step 1 and 8e-4 to 2.5e-3 after; a learning rate 10% off, by 3.6e-4 from step 3 on
(tests/conftest.py SAME_STEPS lists more, 1e-3 and up). With TF32 on, u would be 2^-11 and the bound
0.75, useless: the test refuses what would turn it on. The dry run keeps the CPU suite's SAME_STEPS (1e-5);
it measured 8e-8. A resumed run is compared with the straight one at the same bound: the same kernels, but
GPU backward kernels that add with atomics (index_add) do not sum in a fixed order.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from tests.conftest import NO_DROPOUT, SAME_STEPS, train_losses
from tests.gpu.conftest import DRY_RUN, ON_GPU, accelerate_config, gpu_count, on_cuda, pick, run_env, train_run

# SAVE_AT: the one checkpoint (no multiple of it is a later step: each sharded save costs seconds on the CPU)
SEQ, BATCH, STEPS, SAVE_AT = pick((128, 32, 8, 5), (32, 8, 7, 4))
FP32_UNIT_ROUNDOFF = 2.0**-24
LAMBDA = 3.0  # the probabilistic bound's multiple of sqrt(n) * u (module docstring, 1.)
GPU_BOUND = STEPS * LAMBDA * math.sqrt(BATCH * SEQ) * FP32_UNIT_ROUNDOFF
BOUND = pick(GPU_BOUND, SAME_STEPS)
FLAGS = [
    *NO_DROPOUT, "--lr_scheduler_type", "constant", "--num_warmup_steps", "0", "--max_seq_length", str(SEQ),
    "--max_train_steps", str(STEPS), "--logging_steps", "1", "--max_eval_samples", str(pick(64, 8)),
    # a given peak (an H100's fp32 datasheet figure): no second of matmuls at start-up to measure one
    "--peak_tflops", "67",
]


def max_rel_diff(reference: dict[int, float], other: dict[int, float]) -> float:
    """The largest relative difference of `other`'s losses from `reference`'s, over `other`'s steps."""
    return max(abs(other[s] - reference[s]) / abs(reference[s]) for s in other)


def tf32_switches() -> list[str]:
    """What would turn TF32 on in the launched runs: torch's override variable in their environment
    (`run_env`), or a dynamo backend in the suite's accelerate configs (its Accelerator then sets allow_tf32
    for fp32 on CUDA). The host's default accelerate config and ACCELERATE_* variables do not reach them."""
    from accelerate.commands.config.config_args import load_config_from_file

    found = []
    if run_env().get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1":
        found.append("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1")
    for config in sorted({accelerate_config(1), accelerate_config(2), accelerate_config(2, fsdp=True)}):
        backend = (load_config_from_file(str(config)).dynamo_config or {}).get("dynamo_backend", "NO")
        if str(backend).lower() != "no":
            found.append(f"dynamo_backend {backend} in {config}")
    return found


@pytest.fixture(scope="module")
def one_rank(encoders: dict[str, Path], text: dict[str, Path],
             tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The reference: one rank at global batch BATCH, shared by both strategies; step -> loss."""
    out = tmp_path_factory.mktemp("one_rank") / "run"
    started = time.monotonic()
    train_run(out, encoders["minilm"], text, *FLAGS, "--per_device_train_batch_size", str(BATCH))
    print(f"\none rank x batch {BATCH}, seq {SEQ}, {STEPS} steps: {time.monotonic() - started:.1f} s")
    losses = train_losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


# The dry run launches FSDP's case alone (it ran both: 64 s and 70 s of a 418 s dry run on this repository's 2-core
# CPU): DDP's runs the same lines but for its checkpoint's two files (model.safetensors, optimizer.bin), and two CPU
# processes under cpu_ddp.yaml train one process's curve (tests/test_topology.py) and resume it (tests/test_resume.py),
# and a 2-process DDP checkpoint's two files are opened in tests/test_fsdp.py (its bf16 test). On a GPU both run.
DRY_RUN_SKIPS_DDP = ("the dry run: [fsdp] runs this test's lines but DDP's checkpoint files, which the CPU suite "
                     "checks (tests/test_topology.py, tests/test_resume.py, tests/test_fsdp.py); both cases run on "
                     "two GPUs")


@pytest.mark.skipif(ON_GPU and gpu_count() < 2, reason=f"two ranks need 2 GPUs; this machine has {gpu_count()}")
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.skipif(DRY_RUN, reason=DRY_RUN_SKIPS_DDP)),
                                      "fsdp"])
def test_two_ranks_train_as_one(strategy: str, one_rank: dict[int, float], encoders: dict[str, Path],
                                text: dict[str, Path], tmp_path: Path, request: pytest.FixtureRequest) -> None:
    from transformers import pipeline

    fsdp = strategy == "fsdp"
    if on_cuda(request, "nothing turns TF32 on in the runs (the GPU bound assumes fp32's unit roundoff)"):
        assert not tf32_switches(), f"TF32 would be on, outside the bound's fp32 analysis: {tf32_switches()}"
    two = ["--per_device_train_batch_size", str(BATCH // 2)]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"

    started = time.monotonic()
    log = train_run(straight, encoders["minilm"], text, *FLAGS, *two, "--checkpointing_steps", str(SAVE_AT),
                    processes=2, fsdp=fsdp)
    straight_s = time.monotonic() - started
    kind = "FSDP" if fsdp else pick("MULTI_GPU", "MULTI_CPU")
    assert f"topology: 2 process(es) on 1 node(s), DistributedType.{kind}" in log, log[-3000:]
    assert "has no trained MLM head" in log  # the head starts fresh, as all-MiniLM-L6-v2's does
    losses = train_losses(straight)
    assert sorted(losses) == list(range(1, STEPS + 1))
    as_one = max_rel_diff(one_rank, losses)

    checkpoint = straight / "checkpoints" / f"step-{SAVE_AT:07d}"
    assert (checkpoint / "COMPLETE").is_file()
    if fsdp:  # one torch.distributed.checkpoint folder each for the model and the optimizer, a shard per rank
        for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
            assert sorted(p.name for p in (checkpoint / folder).iterdir()) == [".metadata", "__0_0.distcp",
                                                                               "__1_0.distcp"], folder
        assert not (checkpoint / "model.safetensors").exists()
    else:
        assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "optimizer.bin").is_file()

    started = time.monotonic()
    log = train_run(resumed, encoders["minilm"], text, *FLAGS, *two, "--resume_from_checkpoint", str(checkpoint),
                    processes=2, fsdp=fsdp)
    assert f"resumed from {checkpoint} at step {SAVE_AT}" in log, log[-3000:]
    resumed_s = time.monotonic() - started
    rest = train_losses(resumed)
    assert sorted(rest) == list(range(SAVE_AT + 1, STEPS + 1))
    reproduced = max_rel_diff(losses, rest)

    fill = pipeline("fill-mask", model=str(resumed / "final"), device=0 if ON_GPU else -1)
    top = fill("the [MASK] of the function", top_k=3)
    assert len(top) == 3 and all(0 <= t["score"] <= 1 for t in top)

    print(f"\n{strategy}: 2 ranks x batch {BATCH // 2} against 1 x {BATCH}, seq {SEQ}, {STEPS} steps: largest "
          f"relative loss difference {as_one:.2e}; resumed at step {SAVE_AT} against straight {reproduced:.2e} "
          f"(bound {BOUND:.1e}{', dry run' if DRY_RUN else ''}); straight run {straight_s:.1f} s, resumed run "
          f"{resumed_s:.1f} s; fill-mask top 3: {[t['token_str'] for t in top]}")
    assert as_one <= BOUND, (one_rank, losses)
    assert reproduced <= BOUND, (losses, rest)
