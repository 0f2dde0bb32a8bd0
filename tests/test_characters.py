"""Bits per character: every evaluation divides the masked tokens' loss by the characters those
tokens cover, a figure that compares runs of different tokenizers. The characters come from a per-id table
(data.surface); the table counts a text's characters under every tokenizer family, the collator counts a
batch's by it, and adding the count changes no other figure."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, BertForMaskedLM

from mlm_ddp.data.masking import CHARACTERS_KEY, EVAL_SPLIT, IGNORE_INDEX, TRAIN_SPLIT, MaskingCollator
from mlm_ddp.data.pack import tokenize_and_pack
from mlm_ddp.data.surface import character_table
from mlm_ddp.loop.evaluation import evaluate_mlm, per_character
from mlm_ddp.model.loading import MaskedLMLoss
from tests.conftest import corpus_paragraphs
from tests.tiny_tokenizers import byte_bpe, unigram

# what a byte-level BPE must count too: accents, a character of three UTF-8 bytes, one of four, a ligature
UNICODE_WORDS = ["café", "naïve", "Straße", "東京", "😀", "ﬁne", "Ω", "–"]


def generated_texts(seed: int, count: int, unicode: bool) -> list[str]:
    """Texts of 1-30 words of the test corpus, joined by one or two spaces (and with `unicode`, by tabs and
    newlines too, which a Unigram over Metaspace does not know, and words outside ASCII mixed in, glued to
    the next word or not)."""
    words = " ".join(corpus_paragraphs()[:200]).split()
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        picked = [rng.choice(UNICODE_WORDS) if unicode and rng.random() < 0.2 else rng.choice(words)
                  for _ in range(rng.randint(1, 30))]
        texts.append("".join(w + rng.choice([" ", "  ", "\t", "\n", ""] if unicode else [" ", "  "])
                             for w in picked))
    return texts


def visible_characters(tokenizer, text: str) -> int:
    """The characters of `text` as the tokenizer normalizes it, whitespace not counted."""
    normalizer = tokenizer.backend_tokenizer.normalizer
    return sum(not c.isspace() for c in (normalizer.normalize_str(text) if normalizer else text))


@pytest.fixture(scope="module")
def tokenizers(tiny_model: Path) -> dict:
    texts = corpus_paragraphs()[:300]
    return {"wordpiece": AutoTokenizer.from_pretrained(tiny_model), "bpe": byte_bpe(texts), "unigram": unigram(texts)}


@pytest.mark.parametrize("family", ["wordpiece", "bpe", "unigram"])
def test_a_texts_tokens_cover_its_characters_whatever_the_tokenizer(family: str, tokenizers: dict) -> None:
    """Summed over a text's tokens, the table gives the text's characters: exactly, for every generated text
    the tokenizer spells without its unknown token (byte-level BPE has none, and cuts characters into bytes)."""
    tokenizer = tokenizers[family]
    table = character_table(tokenizer)
    assert table.shape == (len(tokenizer),) and all(table[i] == 0 for i in tokenizer.all_special_ids
                                                    if i != tokenizer.unk_token_id)
    checked = 0
    for text in generated_texts(58, 200, unicode=family == "bpe"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if tokenizer.unk_token_id in ids:
            continue
        assert int(table[ids].sum()) == visible_characters(tokenizer, text), (family, text)
        checked += 1
    assert checked >= 150, checked


def test_the_collator_counts_the_characters_of_the_masked_tokens_by_hand(tokenizers: dict) -> None:
    """The held-out collator's count is the masked tokens' spellings, '##' off, added by hand; the
    training collator counts nothing (its batches stay as they were: no new tensor in the training loop)."""
    tokenizer = tokenizers["wordpiece"]
    blocks = tokenize_and_pack(corpus_paragraphs()[:20], tokenizer, 32)["input_ids"][:6]
    common = dict(mlm_probability=0.3, seed=1)
    held_out = MaskingCollator.for_tokenizer(tokenizer, split=EVAL_SPLIT, characters=character_table(tokenizer),
                                             **common)
    batch = held_out([{"input_ids": ids} for ids in blocks])
    masked = batch["labels"][batch["labels"] != IGNORE_INDEX].tolist()
    by_hand = sum(len(token.removeprefix("##")) for token in tokenizer.convert_ids_to_tokens(masked))
    assert len(masked) > 10 and batch[CHARACTERS_KEY].item() == by_hand
    training = MaskingCollator.for_tokenizer(tokenizer, split=TRAIN_SPLIT, **common)
    assert CHARACTERS_KEY not in training([{"input_ids": ids} for ids in blocks])


def test_bits_per_character_is_the_loss_in_bits_over_the_characters() -> None:
    assert per_character(10 * math.log(2), 4) == {"bits_per_char": 2.5, "characters": 4}
    assert per_character(3.0, 0) == {}  # nothing counted (bench's collator): no figure, not a division by 0


def test_counting_characters_changes_no_other_figure(tiny_model: Path) -> None:
    """The same model and blocks evaluated with and without the character count: the same loss, accuracy and
    masked tokens to the bit, and bits per character = loss sum / ln 2 / characters."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    net = MaskedLMLoss(BertForMaskedLM.from_pretrained(tiny_model))
    blocks = [{"input_ids": ids} for ids in tokenize_and_pack(corpus_paragraphs()[600:640], tokenizer, 32)["input_ids"]]
    accelerator = Accelerator(cpu=True)
    results = []
    for table in (None, character_table(tokenizer)):
        collator = MaskingCollator.for_tokenizer(tokenizer, split=EVAL_SPLIT, characters=table)
        results.append(evaluate_mlm(net, DataLoader(blocks, batch_size=8, collate_fn=collator), accelerator))
    without, with_characters = results
    assert "bits_per_char" not in without
    assert {k: with_characters[k] for k in without} == without
    characters = sum(MaskingCollator.for_tokenizer(tokenizer, split=EVAL_SPLIT, characters=table)(
        blocks[i:i + 8])[CHARACTERS_KEY].item() for i in range(0, len(blocks), 8))
    assert with_characters["characters"] == characters
    loss_sum = without["loss"] * without["num_tokens"]
    assert with_characters["bits_per_char"] == pytest.approx(loss_sum / math.log(2) / characters, rel=1e-12)
    torch.testing.assert_close(torch.tensor(with_characters["bits_per_char"]),
                               torch.tensor(without["loss"] / math.log(2) * without["num_tokens"] / characters))
