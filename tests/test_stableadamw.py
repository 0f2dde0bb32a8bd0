"""--optimizer stableadamw: optimi's StableAdamW with ModernBERT's settings. Its refusals, its
fully decoupled weight decay on the optimizer's groups, a run that trains and resumes exactly in one
process and under FSDP2 on 2 CPU processes, and what it costs in waits for the device per step."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from mlm_ddp.config import TrainingConfig, parse_args
from mlm_ddp.errors import BadInput
from mlm_ddp.train import main, train
from tests.conftest import NO_DROPOUT, SAME_STEPS, launch_runs, tiny_args, train_losses
from tests.test_fsdp import COMMON, FSDP_ENV
from tests.test_syncs import SYNC_BUDGET, count_syncs, describe, waits

pytest.importorskip("optimi", reason='the stableadamw extra: pip install "mlm_ddp[stableadamw]"')

# ModernBERT's optimizer settings; no global clipping (StableAdamW clips each tensor's update)
MODERNBERT = ["--optimizer", "stableadamw", "--adam_beta1", "0.9", "--adam_beta2", "0.98", "--adam_epsilon", "1e-6",
              "--weight_decay", "1e-5", "--max_grad_norm", "0"]
STEPS, SAVE_AT = 6, 3


def test_refused_before_anything_is_written(tiny_model: Path, corpus: dict, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    args = tiny_args(tiny_model, corpus, out, *MODERNBERT)
    with pytest.raises(BadInput, match=r"--weight_decay 0\.01 with --optimizer stableadamw.*ModernBERT: 1e-5"):
        parse_args([*args, "--weight_decay", "0.01"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "optimi" else real(name, *a))
    with pytest.raises(BadInput, match=r'pip install "mlm_ddp\[stableadamw\]"'):
        parse_args(args)
    assert main(args) == 2 and not out.exists()


@pytest.mark.parametrize("peak", [1e-4, 3e-3])
@pytest.mark.parametrize("impl", ["fused", "foreach", "for-loop"])
def test_weight_decay_is_fully_decoupled_from_the_learning_rate(peak: float, impl: str) -> None:
    """A zero gradient makes a zero Adam step, so a step is the decay alone: weights x (1 - wd x lr / peak),
    the same fraction whatever the peak and in each group (the head's own peak too); none on 1-dim tensors."""
    from optimi import StableAdamW

    from mlm_ddp.loop.optim import stable_adamw

    training = TrainingConfig(optimizer="stableadamw", optimizer_impl=impl, learning_rate=peak, weight_decay=1e-4,
                              adam_beta2=0.98, adam_epsilon=1e-6)
    weights = [torch.nn.Parameter(torch.ones(3, 4)) for _ in range(2)]
    bias = torch.nn.Parameter(torch.ones(4))
    optimizer = stable_adamw([{"params": [weights[0]], "weight_decay": 1e-4, "lr": peak},
                              {"params": [weights[1]], "weight_decay": 1e-4, "lr": 10 * peak},  # a head's
                              {"params": [bias], "weight_decay": 0.0, "lr": peak}], training)
    assert isinstance(optimizer, StableAdamW)
    assert [(g["beta1"], g["beta2"], g["eps"], g["decouple_lr"]) for g in optimizer.param_groups] == \
        [(0.9, 0.98, 1e-6, True)] * 3
    for factor in (1.0, 0.5):  # the schedule at its peak, then at half of it
        for group in optimizer.param_groups:
            group["lr"] = group["max_lr"] * factor
        for p in (*weights, bias):
            p.grad = torch.zeros_like(p)
        before = [p.detach().clone() for p in (*weights, bias)]
        optimizer.step()
        for p, was in zip(weights, before, strict=False):
            torch.testing.assert_close(p.detach(), was * (1 - 1e-4 * factor), rtol=1e-7, atol=0)
        assert torch.equal(bias.detach(), before[-1])


@pytest.fixture(scope="module")
def straight(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """STEPS steps in this process, dropout off, a checkpoint at SAVE_AT."""
    out = tmp_path_factory.mktemp("stableadamw") / "straight"
    train(parse_args(tiny_args(tiny_model, corpus, out, *MODERNBERT, *NO_DROPOUT, "--max_train_steps", str(STEPS),
                               "--checkpointing_steps", str(SAVE_AT), "--report", "false")))
    return out


def resume_copy(run: Path, out: Path) -> None:
    (out / "checkpoints").mkdir(parents=True)
    name = f"step-{SAVE_AT:07d}"
    shutil.copytree(run / "checkpoints" / name, out / "checkpoints" / name)


def test_trains_and_resumes_exactly(straight: Path, tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    a = train_losses(straight)
    assert sorted(a) == list(range(1, STEPS + 1)) and a[STEPS] < a[1], a
    state = torch.load(straight / "checkpoints" / f"step-{SAVE_AT:07d}" / "optimizer.bin", weights_only=True)
    # optimi keeps its step counter in each group, and each group's peak for the decoupled decay
    assert [int(g["step"]) for g in state["param_groups"]] == [SAVE_AT] * len(state["param_groups"])
    assert all(g["max_lr"] == 1e-3 and g["decouple_lr"] for g in state["param_groups"])
    resumed = tmp_path / "resumed"
    resume_copy(straight, resumed)
    train(parse_args(tiny_args(tiny_model, corpus, resumed, *MODERNBERT, *NO_DROPOUT, "--max_train_steps",
                               str(STEPS), "--checkpointing_steps", str(SAVE_AT), "--report", "false",
                               "--resume_from_checkpoint", "latest")))
    b = train_losses(resumed)
    assert sorted(b) == list(range(SAVE_AT + 1, STEPS + 1))
    assert max(abs(a[s] - b[s]) / a[s] for s in b) <= 1e-6, (a, b)


def test_fsdp2_trains_the_same_curve_and_resumes_exactly(straight: Path, tiny_model: Path, corpus: dict,
                                                          tmp_path: Path) -> None:
    """2 CPU processes x 4 blocks = the in-process run's 8: each tensor's RMS is taken over the whole
    tensor, not over a rank's shard, so the curve is the same; the sharded optimizer state resumes. The
    clip acts in these steps: measured in process (optimi's `max` recorded), 35 of the 6 x 42 tensor
    updates had an RMS above 1 (up to 1.11), in steps 2 to 5."""
    common = [*MODERNBERT, "--max_train_steps", str(STEPS), "--checkpointing_steps", str(SAVE_AT),
              "--per_device_train_batch_size", "4", "--lr_scheduler_type", "linear"]
    fsdp, resumed = tmp_path / "fsdp", tmp_path / "resumed"
    saved = fsdp / "checkpoints" / f"step-{SAVE_AT:07d}"
    # one launch: the straight run, then a run in another folder resumed from its checkpoint
    runs = launch_runs([{"id": "fsdp", "out": str(fsdp), "argv": tiny_args(tiny_model, corpus, fsdp, *COMMON, *common)},
                        {"id": "resumed", "out": str(resumed),
                         "argv": tiny_args(tiny_model, corpus, resumed, *COMMON, *common, "--resume_from_checkpoint",
                                           str(saved))}],
                       tmp_path / "results", config="fsdp.yaml", env=FSDP_ENV)
    assert [runs[name]["exit"] for name in ("fsdp", "resumed")] == [0, 0], runs["resumed"]["log"][-3000:]
    assert "topology: 2 process(es) on 1 node(s), DistributedType.FSDP" in runs["fsdp"]["log"]
    assert f"resumed from {saved} at step {SAVE_AT}" in runs["resumed"]["log"], runs["resumed"]["log"][-3000:]
    assert (saved / "optimizer_0").is_dir()  # sharded, optimi's state too
    local, a, b = train_losses(straight), train_losses(fsdp), train_losses(resumed)
    assert sorted(a) == list(range(1, STEPS + 1)) and sorted(b) == list(range(SAVE_AT + 1, STEPS + 1))
    assert max(abs(local[s] - a[s]) / local[s] for s in a) <= SAME_STEPS, (local, a)
    assert max(abs(a[s] - b[s]) / a[s] for s in b) <= SAME_STEPS, (a, b)


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_each_parameter_tensor_costs_one_wait_per_step(impl: str, tiny_model: Path, corpus: dict,
                                                       tmp_path: Path) -> None:
    """The documented cost on a device without optimi's Triton kernels, in every quiet step: the loop's one
    wait; the read of the gradient norm's finiteness that decides the update (only a fused torch AdamW
    skips on the device); optimi's step counter, once per parameter group (a CPU tensor: no wait on a GPU,
    counted here all the same); and one `.item()` per parameter tensor, its update's RMS."""
    from transformers import AutoModelForMaskedLM

    steps, groups = 4, 2  # decayed and not: the tiny model's head is trained, its rate is --learning_rate
    seen = count_syncs(tiny_args(tiny_model, corpus, tmp_path, *MODERNBERT, "--optimizer_impl", impl,
                                 "--max_train_steps", str(steps), "--logging_steps", "1000", "--report", "false"))
    tensors = sum(1 for p in AutoModelForMaskedLM.from_pretrained(tiny_model).parameters() if p.requires_grad)
    counted = waits(seen, steps)
    print(f"stableadamw ({impl}), {tensors} parameter tensors: {describe(counted)}")
    assert counted and all(len(v) == SYNC_BUDGET + 1 + groups + tensors for v in counted.values()), describe(counted)
