"""Evaluation at a fixed masking rate (--eval_mlm_probability), whatever the run trains at.

Two tiny runs of 2 steps from the same model: one trains at BERT's 15% with 80/10/10, the other at 30% with
[MASK] alone (NeoBERT's split). Both evaluate at 15% with 80/10/10, so before training they score the same
inputs and their losses are equal; a resume may change the evaluation rate, not the training masks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from mlm_ddp.config import parse_args
from mlm_ddp.data.masking import EVAL_SPLIT, IGNORE_INDEX, TRAIN_SPLIT
from mlm_ddp.errors import BadInput
from mlm_ddp.run.report import read_runs, summary_text
from mlm_ddp.train import TrainResult, summary_line, train
from tests.conftest import read_metrics, recorded_batches, tiny_args, train_losses

NEOBERT = ["--mlm_probability", "0.3", "--mask_replace_prob", "1", "--random_replace_prob", "0"]


@pytest.fixture(scope="module")
def runs(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("eval_masking")
    out = {}
    for name, flags in (("bert", []), ("neobert", NEOBERT)):
        fresh_accelerate_state()  # the conftest's reset runs between tests, not between these runs
        with recorded_batches() as made:
            result = train(parse_args(tiny_args(tiny_model, corpus, root / name, "--max_train_steps", "2",
                                                "--checkpointing_steps", "2", "--max_eval_samples", "64",
                                                "--report", "true", *flags)))
        out[name] = (root / name, result, list(made))
    return out


def fresh_accelerate_state() -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def evals(folder: Path) -> list[dict]:
    return [r for r in read_metrics(folder) if "eval_loss" in r]


def test_the_evaluation_before_training_does_not_depend_on_the_training_masks(runs: dict) -> None:
    (bert, _, bert_batches), (neo, _, neo_batches) = runs["bert"], runs["neobert"]
    first = [evals(folder)[0] for folder in (bert, neo)]
    assert first[0]["step"] == first[1]["step"] == 0
    for key in ("eval_loss", "perplexity", "eval_accuracy", "eval_mlm_probability"):
        assert first[0][key] == first[1][key], key  # the same inputs, the same model: equal, not close
    assert all(r["eval_mlm_probability"] == 0.15 for folder in (bert, neo) for r in evals(folder))
    # the held-out batches themselves: the same positions and inputs, at 15%, with 80/10/10's kept tokens
    held_out = [[b for split, _, b in batches if split == EVAL_SPLIT] for batches in (bert_batches, neo_batches)]
    assert len(held_out[0]) == len(held_out[1]) > 0
    for a, b in zip(*held_out, strict=True):
        assert (a["labels"] == b["labels"]).all() and (a["input_ids"] == b["input_ids"]).all()
    selected = np.concatenate([(b["labels"] != IGNORE_INDEX).numpy().ravel() for b in held_out[0]])
    assert 0.08 < selected.mean() < 0.2  # 15% of the maskable tokens (a few per block are special)
    # but the training losses differ: 30% of [MASK] is another task
    assert train_losses(bert)[1] != train_losses(neo)[1]


def test_the_training_masks_follow_the_flags(runs: dict, tiny_model: Path) -> None:
    mask_id = AutoTokenizer.from_pretrained(tiny_model).mask_token_id
    rates = {}
    for name in ("bert", "neobert"):
        trained = [b for split, _, b in runs[name][2] if split == TRAIN_SPLIT]
        labels = np.concatenate([b["labels"].numpy().ravel() for b in trained])
        inputs = np.concatenate([b["input_ids"].numpy().ravel() for b in trained])
        chosen = labels != IGNORE_INDEX
        rates[name] = chosen.mean()
        if name == "neobert":
            assert (inputs[chosen] == mask_id).all()  # [MASK] alone: no token random, none kept
        else:
            assert (inputs[chosen] != mask_id).any()
    assert rates["neobert"] > 1.5 * rates["bert"]


def test_the_closing_line_the_card_and_the_report_say_the_rate(runs: dict) -> None:
    folder, result, _ = runs["neobert"]
    assert "; eval (15% masked) loss " in summary_line(result)
    card = (folder / "final" / "README.md").read_text()
    assert "| held-out perplexity before training (15% masked) |" in card
    assert "| masking | 30% of the tokens; 100% [MASK], 0% random, 0% unchanged |" in card
    text = summary_text(read_runs([runs["bert"][0], folder]), ["bert", "neobert"])
    assert text.count("eval (15% masked) loss") == 2 and "not comparable" not in text
    assert "eval masked" in (folder / "report.html").read_text()


def test_a_resume_may_change_the_evaluation_rate_and_not_the_training_masks(
        runs: dict, tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    source = runs["neobert"][0]
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / "step-0000002", resumed / "checkpoints" / "step-0000002")
    shutil.copy(source / "metrics.jsonl", resumed / "metrics.jsonl")
    args = tiny_args(tiny_model, corpus, resumed, "--max_train_steps", "3", "--max_eval_samples", "64", *NEOBERT,
                     "--resume_from_checkpoint", "latest", "--allow_lr_jump")
    with pytest.raises(BadInput, match=r"data.mask_replace_prob: 1.0 -> 0.8"):
        train(parse_args([*args, "--mask_replace_prob", "0.8"]))
    fresh_accelerate_state()
    result: TrainResult = train(parse_args([*args, "--eval_mlm_probability", "0.3"]))
    assert result.steps == 3
    assert [r["eval_mlm_probability"] for r in evals(resumed)] == [0.15, 0.15, 0.3]
    assert "; eval (15% -> 30% masked) loss " in summary_line(result)
    text = summary_text(read_runs([source, resumed]), ["a", "b"])
    assert "15% -> 30%" in text and "not comparable" in text
