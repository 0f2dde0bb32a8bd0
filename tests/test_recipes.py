"""The recipes shipped inside the package (`--config NAME`): each parses and trains a few steps on a
tiny model; a recipe run resumes exactly; the user's flags win over a recipe; the learning rate follows the
square-root rule when the global batch differs from the recipe's, and stays as given when the user names one."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import yaml

from mlm_ddp.config import parse_args
from mlm_ddp.config.tree import shipped_recipes
from mlm_ddp.errors import BadInput
from mlm_ddp.loop.optim import for_this_batch
from mlm_ddp.train import train
from tests.conftest import SAME_STEPS, TINY_PEAK_TFLOPS, read_metrics, train_losses

BATCH = 4  # sequences per step in these runs: one process, no accumulation


def recipe_args(name: str, model: Path, corpus: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """A recipe shrunk to a tiny run: only sizes and cadences change, never its optimizer or schedule."""
    return ["--config", name, "--model_name_or_path", str(model), "--train_file", str(corpus["train"]),
            "--validation_file", str(corpus["valid"]), "--output_dir", str(out), "--max_seq_length", "32",
            "--per_device_train_batch_size", str(BATCH), "--gradient_accumulation_steps", "1",
            "--per_device_eval_batch_size", "32", "--max_eval_samples", "64", "--logging_steps", "1",
            "--eval_steps", "2", "--peak_tflops", str(TINY_PEAK_TFLOPS), "--mixed_precision", "no",
            "--report", "false", *extra]


def test_the_package_ships_the_three_recipes() -> None:
    assert {"dapt", "tapt", "modernbert"} <= set(shipped_recipes())
    for path in shipped_recipes().values():
        text = path.read_text()
        assert "Source:" in text and "Global batch assumed:" in text, path  # each cites and states its batch
        assert "mlm_ddp's choice" in text, path  # the square-root rule is ours, not the source's
    recipes = {name: yaml.safe_load(path.read_text()) for name, path in shipped_recipes().items()}
    for name in ("dapt", "tapt", "modernbert"):  # the rule compares tokens: each states its batch's length
        assert recipes[name]["training"]["lr_reference_seq_length"] == recipes[name]["data"]["max_seq_length"]
    assert recipes["tapt"]["data"]["line_by_line"] is True  # one task text per sequence, as TAPT trained
    assert not recipes["dapt"]["data"].get("line_by_line")
    assert "What it leaves out" in shipped_recipes()["modernbert"].read_text()


@pytest.mark.parametrize("name", sorted(shipped_recipes()))
def test_every_recipe_trains_three_steps(name: str, tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    cfg = parse_args(recipe_args(name, tiny_model, corpus, tmp_path / "run", "--max_train_steps", "3"))
    reference = cfg.training.lr_reference_batch
    assert reference is not None and reference != BATCH
    result = train(cfg)
    assert result.steps == 3
    losses = train_losses(tmp_path / "run")
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(v) for v in losses.values())
    # the peak rate this run trains at: the recipe's, scaled by the square root of the ratio of tokens per
    # step, 4 x 32 against the reference's sequences x their length; warmup_stable_decay reaches it at step 1
    rates = [r["lr"] for r in read_metrics(tmp_path / "run") if "lr" in r]
    peak = cfg.training.learning_rate * math.sqrt(BATCH * 32 / (reference * cfg.training.lr_reference_seq_length))
    assert max(rates) <= peak * (1 + 1e-9)
    if cfg.training.lr_scheduler_type == "warmup_stable_decay":
        assert max(rates) == pytest.approx(peak, rel=1e-9)
    # the card states the rate trained at, not the recipe's unscaled one
    card_rate = re.search(r"^\| learning rate \| (\S+) \(--learning_rate", (tmp_path / "run" / "final" / "README.md")
                          .read_text(), re.MULTILINE)
    assert card_rate and float(card_rate.group(1)) == pytest.approx(peak, rel=1e-5), card_rate


def test_modernbert_trains_at_its_scaled_peak_and_evaluates_at_15_percent(tiny_model: Path, corpus: dict,
                                                                          tmp_path: Path) -> None:
    cfg = parse_args(recipe_args("modernbert", tiny_model, corpus, tmp_path / "run", "--max_train_steps", "3"))
    assert (cfg.data.mlm_probability, cfg.data.eval_mlm_probability) == (0.30, 0.15)
    assert (cfg.training.optimizer, cfg.training.lr_scheduler_type, cfg.training.decay_type) == (
        "stableadamw", "warmup_stable_decay", "1-sqrt")


def test_a_recipe_run_resumes_exactly(tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    """modernbert (WSD, StableAdamW, 30% masking) for 4 steps with a checkpoint at 2; the checkpoint resumed
    in another folder gives the same steps 3 and 4."""
    common = ("--max_train_steps", "4", "--checkpointing_steps", "2", "--config_overrides",
              "hidden_dropout_prob=0,attention_probs_dropout_prob=0")
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train(parse_args(recipe_args("modernbert", tiny_model, corpus, whole, *common)))
    train(parse_args(recipe_args("modernbert", tiny_model, corpus, resumed, *common, "--resume_from_checkpoint",
                                 str(sorted((whole / "checkpoints").glob("step-*"))[0]))))
    first, again = train_losses(whole), train_losses(resumed)
    assert sorted(again) == [3, 4]
    for step in (3, 4):
        assert abs(first[step] - again[step]) <= SAME_STEPS, (step, first[step], again[step])


def test_flags_win_over_a_recipe_and_a_given_rate_is_not_scaled(tiny_model: Path, corpus: dict,
                                                                  tmp_path: Path) -> None:
    args = recipe_args("dapt", tiny_model, corpus, tmp_path)
    assert parse_args(args).training.lr_reference_batch == 2048
    own = parse_args([*args, "--learning_rate", "3e-5", "--mlm_probability", "0.2"])
    assert own.training.learning_rate == 3e-5 and own.training.lr_reference_batch is None
    assert own.data.mlm_probability == 0.2
    assert parse_args([*args, "--learning_rate=3e-5", "--lr_reference_batch", "64"]).training.lr_reference_batch == 64
    assert parse_args([*args, "--learning-rate", "3e-5"]).training.lr_reference_batch is None
    with pytest.raises(BadInput, match="shipped recipe"):
        parse_args(["--config", "no_such_recipe"])


@pytest.mark.parametrize(("per_device", "world", "accumulation", "reference"),
                         [(32, 8, 8, 2048), (4, 1, 1, 2048), (16, 2, 3, 256), (8, 4, 1, 16)])
def test_the_square_root_rule(per_device: int, world: int, accumulation: int, reference: int) -> None:
    from accelerate import PartialState

    from mlm_ddp.config import TrainingConfig

    PartialState()  # the warning goes through accelerate's logger
    training = TrainingConfig(per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
                              learning_rate=5e-4, head_learning_rate=1e-3, lr_reference_batch=reference)
    scaled = for_this_batch(training, world)
    factor = math.sqrt(per_device * world * accumulation / reference)
    assert scaled.learning_rate == pytest.approx(5e-4 * factor, rel=1e-12)
    assert scaled.head_learning_rate == pytest.approx(1e-3 * factor, rel=1e-12)
    unset = TrainingConfig(lr_reference_batch=None)
    assert for_this_batch(unset, world) is unset


@pytest.mark.parametrize(("batch", "length", "far"), [(2048, 128, False), (256, 512, False), (64, 512, True),
                                                      (2048, 64, False), (8, 128, True), (32768, 512, True)])
def test_the_square_root_rule_counts_tokens_and_warns_far_from_the_reference(
        batch: int, length: int, far: bool, caplog: pytest.LogCaptureFixture) -> None:
    """The dapt recipe's reference is 2048 sequences of 512 tokens. The rule scales by the ratio of
    tokens per optimizer step, and warns only beyond 8x either way (within it: an info line)."""
    from accelerate import PartialState

    from mlm_ddp.config import TrainingConfig

    PartialState()
    training = TrainingConfig(per_device_train_batch_size=batch, learning_rate=5e-4, lr_reference_batch=2048,
                              lr_reference_seq_length=512)
    ratio = batch * length / (2048 * 512)
    with caplog.at_level("INFO"):
        scaled = for_this_batch(training, 1, length)
    assert scaled.learning_rate == pytest.approx(5e-4 * math.sqrt(ratio), rel=1e-12)
    assert ("the square-root rule is this project's choice" in caplog.text) == far
    assert "(the ratio of tokens)" in caplog.text
    assert for_this_batch(training, 1, None).learning_rate == pytest.approx(5e-4 * math.sqrt(batch / 2048))


@pytest.mark.parametrize(("value", "total", "steps"), [(10, 1000, 10), (0, 50, 0), (0.06, 1000, 60), (0.05, 3, 0)])
def test_warm_up_in_steps_or_a_fraction_of_the_run(value: float, total: int, steps: int) -> None:
    from mlm_ddp.config import TrainingConfig
    from mlm_ddp.loop.schedule import warmup_steps

    assert warmup_steps(TrainingConfig(num_warmup_steps=value), total) == steps
    with pytest.raises(BadInput, match="--num_warmup_steps"):
        TrainingConfig(num_warmup_steps=2.5)
