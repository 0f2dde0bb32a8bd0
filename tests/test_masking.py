import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mlm_ddp.data.masking import IGNORE_INDEX, MaskingCollator
from mlm_ddp.errors import BadInput

MASK, PAD, CLS, SEP = 3, 0, 1, 2
SPECIAL = [PAD, CLS, SEP, MASK]
VOCAB = 1000


def blocks(n_blocks: int, length: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_blocks):
        ids = rng.integers(10, VOCAB, length)
        ids[0], ids[length // 2], ids[-1] = CLS, SEP, SEP
        cont = (rng.random(length) < 0.4).astype(int)
        out.append({"input_ids": ids.tolist(), "word_continues": cont.tolist()})
    return out


def collator(**kw) -> MaskingCollator:
    return MaskingCollator(mask_token_id=MASK, pad_token_id=PAD, special_ids=SPECIAL, vocab_size=VOCAB, **kw)


def test_ratios_80_10_10_and_special_tokens_never_masked() -> None:
    examples = blocks(100, 128)  # 12,800 tokens
    batch = collator(mlm_probability=0.15)(examples)
    original = np.array([e["input_ids"] for e in examples])
    inputs, labels = batch["input_ids"].numpy(), batch["labels"].numpy()
    special = np.isin(original, SPECIAL)
    selected = labels != IGNORE_INDEX
    assert not (selected & special).any()
    assert (inputs[special] == original[special]).all()
    assert abs(selected.sum() / (~special).sum() - 0.15) < 0.01
    assert (labels[selected] == original[selected]).all()
    to_mask = (inputs == MASK) & selected
    unchanged = (inputs == original) & selected
    random = selected & ~to_mask & ~unchanged
    n = selected.sum()
    assert abs(to_mask.sum() / n - 0.8) < 0.03
    assert abs(unchanged.sum() / n - 0.1) < 0.025
    assert abs(random.sum() / n - 0.1) < 0.025
    assert not np.isin(inputs[random], SPECIAL).any()  # random replacements are never special tokens
    assert (inputs[~selected] == original[~selected]).all()


def test_the_collator_gives_the_loss_positions_the_model_would_find_itself() -> None:
    from mlm_ddp.model.positions import loss_layout

    examples = blocks(8, 64)
    examples[3]["input_ids"] = examples[3]["input_ids"][:40]  # one shorter row: the batch is padded
    batch = collator(seed=3)(examples)
    selected = batch["labels"] != IGNORE_INDEX
    for key, value in loss_layout(selected).items():
        assert torch.equal(batch[key], value), key
    assert torch.equal(batch["labels"].reshape(-1)[batch["loss_positions"]], batch["labels"][selected])
    order, slots = batch["loss_order"], batch["loss_slots"]
    assert order.shape == (8, 16)  # the most masked in a row (9 to 16 at this seed), rounded up to 8's
    assert 8 < int(selected.sum(1).max()) <= 16
    assert torch.equal(order.reshape(-1)[slots] + torch.arange(8).repeat_interleave(selected.sum(1)) * 64,
                       batch["loss_positions"])
    assert batch["padded"] is True and collator(seed=3)(blocks(8, 64))["padded"] is False


def test_the_loss_layout_gathers_exactly_the_selected_positions_at_few_widths() -> None:
    """Any selection (B, T), T under and over WIDTH_MULTIPLE, rows with none selected: the gathered slots
    are x[selected] in order; the width is the most selected in a row rounded up to the multiple, never
    past T, never 0, so that a run's attention meets few query lengths."""
    from mlm_ddp.model.positions import WIDTH_MULTIPLE, loss_layout

    generator = torch.Generator().manual_seed(0)
    for case in range(200):
        b, t = int(torch.randint(1, 6, (1,), generator=generator)), int(torch.randint(1, 40, (1,), generator=generator))
        selected = torch.rand(b, t, generator=generator) < float(torch.rand(1, generator=generator))
        x = torch.arange(b * t).reshape(b, t)
        layout = loss_layout(selected)
        order, slots, positions = layout["loss_order"], layout["loss_slots"], layout["loss_positions"]
        most = int(selected.sum(1).max())
        width = order.shape[1]
        assert order.shape[0] == b and width >= max(1, most) and width <= max(1, t), (case, b, t, most, width)
        assert width % WIDTH_MULTIPLE == 0 or width == t or width == 1, (case, t, most, width)
        assert width < most + WIDTH_MULTIPLE or most == 0, (case, most, width)
        assert torch.equal(x.gather(1, order).reshape(-1)[slots], x[selected]), case
        assert torch.equal(x.reshape(-1)[positions], x[selected]), case
        assert len(set(order[0].tolist())) == width  # distinct positions: no row reads one twice


def test_masks_are_deterministic_per_seed_epoch_and_content() -> None:
    examples = blocks(8, 64)
    a = collator(seed=1)(examples)
    b = collator(seed=1)(examples)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)
    assert not (collator(seed=2)(examples)["labels"] == a["labels"]).all()
    later = collator(seed=1)
    later.set_epoch(1)
    assert not (later(examples)["labels"] == a["labels"]).all()
    # a sample's mask does not depend on its batch neighbours (so not on ranks or batch size)
    alone = collator(seed=1)(examples[3:4])
    assert (alone["labels"][0] == a["labels"][3]).all()


def test_padding_of_short_blocks() -> None:
    examples = blocks(3, 64)
    examples[1] = {k: v[:20] for k, v in examples[1].items()}
    batch = collator()(examples)
    assert batch["input_ids"].shape == (3, 64)
    assert batch["attention_mask"][1].sum() == 20
    assert (batch["input_ids"][1, 20:] == PAD).all()
    assert (batch["labels"][1, 20:] == IGNORE_INDEX).all()


def test_whole_word_masking_masks_every_piece_of_a_word() -> None:
    examples = blocks(50, 128, seed=3)
    batch = collator(whole_word_mask=True, mlm_probability=0.2)(examples)
    labels = batch["labels"].numpy()
    for row, example in enumerate(examples):
        ids = np.array(example["input_ids"])
        maskable = ~np.isin(ids, SPECIAL)
        cont = np.array(example["word_continues"], dtype=bool)
        selected = labels[row] != IGNORE_INDEX
        for t in range(1, len(ids)):
            if cont[t] and maskable[t] and maskable[t - 1]:
                assert selected[t] == selected[t - 1], (row, t)
    # words, not tokens, are drawn with p=0.2, so about 20% of the maskable tokens are selected
    maskable_share = 1 - 3 / 128
    assert abs((labels != IGNORE_INDEX).mean() - 0.2 * maskable_share) < 0.03


def test_whole_word_masking_needs_word_boundaries() -> None:
    with pytest.raises(ValueError, match="word_continues"):
        collator(whole_word_mask=True)([{"input_ids": [CLS, 10, 11, SEP]}])


def test_a_vocabulary_of_special_tokens_only_is_refused_where_the_collator_is_built() -> None:
    # else the first batch fails inside the random-token draw: numpy's "high <= 0"
    with pytest.raises(BadInput, match=r"vocabulary of 4 ids holds special tokens only \(0, 1, 2, 3\)"):
        MaskingCollator(mask_token_id=MASK, pad_token_id=PAD, special_ids=SPECIAL, vocab_size=4)
    assert collator_of_vocab(5)([{"input_ids": [CLS, 4, 4, SEP]}])["input_ids"].shape == (1, 4)  # one is enough


def collator_of_vocab(size: int) -> MaskingCollator:
    return MaskingCollator(mask_token_id=MASK, pad_token_id=PAD, special_ids=SPECIAL, vocab_size=size)


def special_only_tokenizer(folder: Path) -> Path:
    """A WordPiece vocabulary of BERT's five special tokens and nothing else: every word is [UNK]."""
    folder.mkdir()
    (folder / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer",
                                                              "model_max_length": 64}))
    return folder


def test_a_tokenizer_without_ordinary_tokens_stops_the_run_before_anything_is_written(
        tiny_model: Path, corpus: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from transformers import AutoTokenizer

    from mlm_ddp.train import main
    from tests.conftest import tiny_args

    folder = special_only_tokenizer(tmp_path / "specials")
    with pytest.raises(BadInput, match=f"tokenizer '{folder}': the vocabulary of 5 ids holds special tokens only"):
        MaskingCollator.for_tokenizer(AutoTokenizer.from_pretrained(folder))
    out = tmp_path / "run"
    assert main(tiny_args(tiny_model, corpus, out, "--max_train_steps", "1", "--tokenizer_name", str(folder))) == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("mlm_ddp.train: error:")]
    assert len(errors) == 1 and "holds special tokens only" in errors[0] and "--tokenizer_name" in errors[0], errors
    assert not out.exists()


# The replacement split, measured over many blocks. A random replacement draws from the ordinary ids, the
# original one among them: with probability 1/len(ordinary ids) it puts the token back, and is seen as kept.
ORDINARY = VOCAB - len(SPECIAL)


def within_binomial(count: int, n: int, p: float, sigmas: float = 5.0) -> bool:
    """Whether `count` successes of `n` draws at probability `p` lie within `sigmas` standard deviations of n*p
    (exact at p 0 or 1). 5 sigma: a correct collator fails one check in ~1.7 million, on any machine; the
    masks are seeded, so a given case passes or fails the same way everywhere."""
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


@pytest.mark.parametrize(("mask", "random", "whole_word"), [
    (0.8, 0.1, False), (1.0, 0.0, False), (0.5, 0.4, True), (0.0, 1.0, False), (0.6, 0.2, True), (0.0, 0.0, True),
])
def test_the_replacement_split_matches_the_flags(mask: float, random: float, whole_word: bool) -> None:
    examples = blocks(200, 128, seed=7)  # 25,600 tokens, ~7,700 selected at 0.3
    original = np.array([e["input_ids"] for e in examples])
    masked = collator(mlm_probability=0.3, whole_word_mask=whole_word, mask_replace_prob=mask,
                      random_replace_prob=random)(examples)
    inputs, labels = masked["input_ids"].numpy(), masked["labels"].numpy()
    selected = labels != IGNORE_INDEX
    n = int(selected.sum())
    seen_mask = int((selected & (inputs == MASK)).sum())
    seen_kept = int((selected & (inputs == original)).sum())
    seen_random = n - seen_mask - seen_kept
    assert within_binomial(seen_mask, n, mask), (seen_mask, n)
    assert within_binomial(seen_random, n, random * (1 - 1 / ORDINARY)), (seen_random, n)
    assert within_binomial(seen_kept, n, 1 - mask - random + random / ORDINARY), (seen_kept, n)
    assert not np.isin(inputs[selected & (inputs != original) & (inputs != MASK)], SPECIAL).any()
    assert (inputs[~selected] == original[~selected]).all()
    # the split moves no position: the same blocks under BERT's split select the same tokens
    bert = collator(mlm_probability=0.3, whole_word_mask=whole_word)(examples)["labels"].numpy()
    assert np.array_equal(bert != IGNORE_INDEX, selected)


@pytest.mark.parametrize("whole_word", [False, True])
def test_positions_at_a_lower_rate_are_a_subset_of_those_at_a_higher_one(whole_word: bool) -> None:
    """What evaluation at a fixed rate rests on: a block's positions at 15% follow from its seed alone."""
    examples = blocks(40, 128, seed=11)
    chosen = {rate: collator(mlm_probability=rate, whole_word_mask=whole_word, seed=5)(examples)["labels"].numpy()
              != IGNORE_INDEX for rate in (0.15, 0.3, 0.5)}
    assert (chosen[0.15] <= chosen[0.3]).all() and (chosen[0.3] <= chosen[0.5]).all()
    assert chosen[0.15].sum() < chosen[0.3].sum() < chosen[0.5].sum()


@pytest.mark.parametrize(("flags", "message"), [
    (["--mask_replace_prob", "1.2"], r"--mask_replace_prob is a fraction of the selected tokens, in \[0, 1\]; got 1.2"),
    (["--random_replace_prob", "-0.1"], r"--random_replace_prob is a fraction .* got -0.1"),
    (["--mask_replace_prob", "0.9", "--random_replace_prob", "0.2"],
     r"--mask_replace_prob 0.9 \+ --random_replace_prob 0.2 exceeds 1"),
    (["--eval_mlm_probability", "0"], r"--eval_mlm_probability must be strictly between 0 and 1, got 0.0"),
    (["--eval_mlm_probability", "1"], r"--eval_mlm_probability must be strictly between 0 and 1"),
])
def test_bad_masking_flags_are_refused_with_the_flag_named(flags: list[str], message: str) -> None:
    from mlm_ddp.config import parse_args

    with pytest.raises(BadInput, match=message):
        parse_args(flags)


def test_neobert_and_keep_all_splits_are_accepted() -> None:
    from mlm_ddp.config import parse_args

    data = parse_args(["--mlm_probability", "0.2", "--mask_replace_prob", "1", "--random_replace_prob", "0"]).data
    assert (data.mlm_probability, data.eval_mlm_probability, data.mask_replace_prob, data.random_replace_prob) == (
        0.2, 0.15, 1.0, 0.0)
    assert parse_args(["--mask_replace_prob", "0.7", "--random_replace_prob", "0.3"]).data.random_replace_prob == 0.3


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 7, -1])
def test_a_token_id_outside_the_vocabulary_is_refused_by_name(bad: int) -> None:
    """Data tokenized with another tokenizer: the collator names the id, before the model's embedding
    would index past its table (on a GPU a device-side assert that names nothing)."""
    examples = blocks(3, 16)
    examples[1]["input_ids"][5] = bad
    with pytest.raises(BadInput, match=rf"token id {bad} is outside the tokenizer's {VOCAB} ids: the data was "
                                       "tokenized with another tokenizer"):
        collator()(examples)
