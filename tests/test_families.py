"""Model families and tokenizers beside the tiny BERT: each trains a few real steps in the loop (one
process), and a checkpoint without its MLM head trains that head at the head's learning rate.

"Trained" is checked the same way everywhere: the exact step count, finite losses, a lower held-out
loss after than before (its masks are seeded, so the same positions are scored both times and only the
weights differ; updates that did not follow the gradient would not lower it), and a final/ folder that
`AutoModelForMaskedLM` loads as the same class with weights other than the start's.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer

from mlm_ddp.config import parse_args
from mlm_ddp.train import TrainResult, train
from tests.conftest import recorded_batches, tiny_args, tiny_family_model, train_losses, words_masked

STEPS = 4
FAMILIES = ["bert", "roberta", "distilbert", "electra", "modernbert", "deberta-v2"]


@pytest.fixture(scope="module")
def family_models(tiny_model: Path, tiny_unigram_model: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> dict[str, Path]:
    """A 2-layer masked LM of each family with the tiny WordPiece tokenizer; ALBERT with its Unigram one."""
    models = {family: tiny_family_model(family, tiny_model, tmp_path_factory.mktemp(family))
              for family in FAMILIES if family != "bert"}
    return {**models, "bert": tiny_model, "albert": tiny_unigram_model}


def train_and_check(model: Path, corpus: dict, out: Path, *extra: str) -> tuple[TrainResult, list]:
    """A run of STEPS steps from `model`, checked as the module docstring says; returns its result and
    the (split, examples, batch) its collators made."""
    with recorded_batches() as made:
        result = train(parse_args(tiny_args(model, corpus, out, "--max_train_steps", str(STEPS), *extra)))
    assert result.steps == STEPS
    losses = train_losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(math.isfinite(v) for v in losses.values()), losses
    assert result.eval_after["loss"] < result.eval_before["loss"], (result.eval_before, result.eval_after)
    start, final = (AutoModelForMaskedLM.from_pretrained(path) for path in (model, out / "final"))
    assert type(final) is type(start)
    before = start.state_dict()
    assert any(not torch.equal(value, before[name]) for name, value in final.state_dict().items())
    return result, made


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains(family: str, family_models: dict[str, Path], corpus: dict, tmp_path: Path) -> None:
    train_and_check(family_models[family], corpus, tmp_path / "run")


def test_modernbert_with_attention_dropout_trains_line_by_line(tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    """Sliding-window layers (window 8 under the 64 tokens) with attention dropout, on the CPU's 16-bit draws,
    every batch padded: a padded query whose window holds only padding attends to nothing. Before: NaN at
    the first step (its softmax over nothing), and the run stopped."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = tmp_path / "modernbert"
    tokenizer.save_pretrained(model)
    special = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.cls_token_id,
                   eos_token_id=tokenizer.sep_token_id, cls_token_id=tokenizer.cls_token_id,
                   sep_token_id=tokenizer.sep_token_id)
    torch.manual_seed(0)
    ModernBertForMaskedLM(ModernBertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=3,
                                           num_attention_heads=2, intermediate_size=64, local_attention=8,
                                           attention_dropout=0.1, **special)).save_pretrained(model)
    train_and_check(model, corpus, tmp_path / "run", "--line_by_line", "--max_seq_length", "64",
                    "--dropout_draws", "16bit")


@pytest.mark.parametrize("whole_words", [False, True], ids=["tokens", "whole_words"])
def test_a_byte_level_bpe_tokenizer_trains(tiny_bpe_model: Path, corpus: dict, tmp_path: Path,
                                           whole_words: bool) -> None:
    _, made = train_and_check(tiny_bpe_model, corpus, tmp_path / "run", *(["--whole_word_mask"] * whole_words))
    if whole_words:  # a word is a 'Ġ' piece and the pieces after it, read from the fast tokenizer's word ids
        part, whole = words_masked(made, AutoTokenizer.from_pretrained(tiny_bpe_model).all_special_ids)
        assert part == 0 and whole >= 10, (part, whole)  # one session measured 44 such words


def test_a_sentencepiece_unigram_tokenizer_trains(tiny_unigram_model: Path, corpus: dict, tmp_path: Path) -> None:
    _, made = train_and_check(tiny_unigram_model, corpus, tmp_path / "run", "--whole_word_mask")
    part, whole = words_masked(made, AutoTokenizer.from_pretrained(tiny_unigram_model).all_special_ids)
    assert part == 0 and whole >= 10, (part, whole)  # one session measured 31 such words


@pytest.mark.parametrize("family", [*FAMILIES, "albert"])
def test_a_fresh_head_trains_at_the_head_rate_in_every_family(family: str, family_models: dict[str, Path],
                                                               tmp_path: Path) -> None:
    from accelerate.state import PartialState

    from mlm_ddp.config import ModelConfig, from_dict
    from mlm_ddp.loop.optim import build_optimizer
    from mlm_ddp.model.loading import FRESH_HEAD, HEAD_LR_FACTOR, MaskedLMLoss, load_model, load_model_config

    # the family's encoder (`base_model`) saved alone with its tokenizer, like the tiny_fresh_head fixture
    headless = tmp_path / "headless"
    AutoModelForMaskedLM.from_pretrained(family_models[family]).base_model.save_pretrained(headless)
    AutoTokenizer.from_pretrained(family_models[family]).save_pretrained(headless)
    PartialState()  # accelerate's logger, which load_model's warning goes through, needs one
    cfg = ModelConfig(model_name_or_path=str(headless))
    model = load_model(cfg, load_model_config(cfg, AutoTokenizer.from_pretrained(headless)))
    assert getattr(model, FRESH_HEAD)
    # the head, independently of mlm_ddp: what transformers initialised because the checkpoint lacked it
    _, info = AutoModelForMaskedLM.from_pretrained(headless, output_loading_info=True)
    fresh = {id(model.get_parameter(name)) for name in info["missing_keys"]}
    embeddings = {id(p) for p in model.get_input_embeddings().parameters()}
    assert fresh and not fresh & embeddings  # the decoder weight is the word embeddings: not fresh

    optimizer = build_optimizer(MaskedLMLoss(model), from_dict({"learning_rate": 1e-4}).training)
    lr_of = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    assert len(lr_of) == sum(len(group["params"]) for group in optimizer.param_groups) == len(list(model.parameters()))
    head_lr = 1e-4 * HEAD_LR_FACTOR
    names = {id(p): name for name, p in model.named_parameters()}
    assert {names[i] for i, lr in lr_of.items() if lr == head_lr} == {names[i] for i in fresh}
    assert all(lr_of[i] == 1e-4 for i in embeddings)
