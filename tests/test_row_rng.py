"""The batched masking draws are numpy's per-row PCG64 generators, bit for bit (data.row_rng, data.masking).

Each row's mask is drawn from its own generator, numpy's PCG64 seeded by SeedSequence([seed, split, epoch,
digest]); the collator draws a batch at once, by an emulation of numpy's arithmetic that checks itself
against numpy once per process, else by numpy's own generators. The masks must not move: a resumed run, or
a checkpoint's masks compared with another run's, depend on it. So the reference here is the per-row
algorithm, frozen (reference_collate), and the batched one must equal it on generated batches; the golden
masks hold fixed batches' masks on either path, on every numpy the project admits.
"""

import functools
import hashlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from mlm_ddp.data import row_rng
from mlm_ddp.data.masking import EPOCH_KEY, IGNORE_INDEX, MaskingCollator, mask_rows, sample_rng

EDGES = [0, 1, 2**32 - 1, 2**32, 2**63 + 5, 2**64 - 1, 2**70 + 3]


def entropies(rng: np.random.Generator, count: int) -> list[list[int]]:
    """SeedSequence's entropy lists: 1 to 9 ints, each of 1 to 3 32-bit words, edges among them."""
    out = []
    for _ in range(count):
        out.append([int(rng.choice(EDGES)) if rng.random() < 0.3 else int(rng.integers(0, 2**63) >> rng.integers(0, 63))
                    for _ in range(int(rng.integers(1, 10)))])
    return out


def test_raw_draws_are_each_rows_own_generator() -> None:
    rng = np.random.default_rng(0)
    cases = entropies(rng, 200)
    counts = rng.integers(0, 40, len(cases))
    raw = row_rng.raw_draws(cases, counts)
    for entropy, count, row in zip(cases, counts, raw, strict=True):
        expected = row_rng.generator(entropy).bit_generator.random_raw(int(count))
        np.testing.assert_array_equal(row[:count], expected, err_msg=str(entropy))


@pytest.mark.parametrize("high", [1, 2, 7, 30517, 2**31 + 1, 2**32 - 1])
def test_uniform_and_bounded_are_generator_random_and_integers(high: int) -> None:
    """2**31 + 1 rejects half its draws: there `rejected` must mark where numpy's values take the next draw."""
    rejections = 0
    for entropy in entropies(np.random.default_rng(high), 50):
        doubles, n = 7, 24
        raw = row_rng.raw_draws([entropy], np.array([doubles + (n + 1) // 2]))[0]
        generator = row_rng.generator(entropy)
        np.testing.assert_array_equal(row_rng.uniform(raw[:doubles]), generator.random(doubles))
        pairs = raw[doubles + np.arange(n) // 2]
        values, rejected = row_rng.bounded(row_rng.halves(pairs), high)
        expected = generator.integers(0, high, n)
        first = int(np.argmax(rejected)) if rejected.any() else n  # numpy's values agree up to the first rejection
        np.testing.assert_array_equal(values[:first], expected[:first])
        rejections += first < n
    if high == 2**31 + 1:
        assert rejections > 0  # else the marks were never tested


def reference_collate(collator: MaskingCollator, examples: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """The per-row masking, one row and its generator at a time, frozen."""
    width = max(collator.pad_to, *(len(e["input_ids"]) for e in examples))
    inputs = np.full((len(examples), width), collator.pad_token_id, dtype=np.int64)
    labels = np.full((len(examples), width), IGNORE_INDEX, dtype=np.int64)
    replacement = collator._replacement_ids
    for row, example in enumerate(examples):
        ids = np.asarray(example["input_ids"], dtype=np.int64)
        n = ids.shape[0]
        rng = sample_rng(collator.seed, collator.split, example.get(EPOCH_KEY, collator.epoch), ids)
        maskable = ~np.isin(ids, collator.special_ids)
        if collator.whole_word_mask:
            continues = np.asarray(example["word_continues"], dtype=bool)
            prev_maskable = np.concatenate([[False], maskable[:-1]])
            starts = maskable & ~(continues & prev_maskable)
            word_index = np.cumsum(starts) - 1
            chosen_words = rng.random(max(int(starts.sum()), 1)) < collator.mlm_probability
            selected = maskable & chosen_words[np.clip(word_index, 0, None)]
        else:
            selected = (rng.random(n) < collator.mlm_probability) & maskable
        action = rng.random(n)
        draws = rng.integers(0, replacement.shape[0], n)
        out = ids.copy()
        to_mask = selected & (action < collator.mask_replace_prob)
        edge = collator.mask_replace_prob + collator.random_replace_prob
        to_random = selected & (action >= collator.mask_replace_prob) & (action < edge)
        out[to_mask] = collator.mask_token_id
        out[to_random] = replacement[draws[to_random]]
        inputs[row, :n] = out
        labels[row, :n] = np.where(selected, ids, IGNORE_INDEX)
    return inputs, labels


def generated_batch(rng: np.random.Generator, vocab: int, whole_word: bool) -> list[dict]:
    examples = []
    empty = rng.random() < 0.1  # now and then a batch of empty rows only
    for _ in range(int(rng.integers(1, 9))):
        n = 0 if empty else int(rng.integers(0, 40))
        ids = rng.integers(0, vocab, n)
        ids[rng.random(n) < 0.1] = int(rng.integers(0, 4))  # special tokens among the ordinary ones
        example = {"input_ids": ids.tolist(), EPOCH_KEY: int(rng.integers(0, 3))}
        if whole_word:
            example["word_continues"] = (rng.random(n) < 0.5).tolist()
        examples.append(example)
    return examples


@pytest.mark.parametrize("whole_word", [False, True])
def test_the_batched_collator_masks_exactly_as_the_per_row_one(whole_word: bool) -> None:
    """Generated batches (empty rows, special tokens, per-row epochs, padding to a width, every split)."""
    rng = np.random.default_rng(1 + whole_word)
    for case in range(60):
        vocab = int(rng.choice([6, 50, 30522]))
        mask, random = [(0.8, 0.1), (1.0, 0.0), (0.0, 1.0), (0.5, 0.25)][case % 4]
        collator = MaskingCollator(mask_token_id=3, pad_token_id=0, special_ids=[0, 1, 2, 3], vocab_size=vocab,
                                   mlm_probability=float(rng.choice([0.15, 0.4, 0.99])), whole_word_mask=whole_word,
                                   mask_replace_prob=mask, random_replace_prob=random, seed=int(rng.integers(0, 2**40)),
                                   pad_to=int(rng.choice([0, 48])))
        examples = generated_batch(rng, vocab, whole_word)
        batch = collator(examples)
        inputs, labels = reference_collate(collator, examples)
        np.testing.assert_array_equal(batch["input_ids"].numpy(), inputs)
        np.testing.assert_array_equal(batch["labels"].numpy(), labels)


def test_a_row_whose_replacement_draw_is_rejected_asks_its_own_generator() -> None:
    """Over 69,921 replacement ids a draw is rejected 1.6e-5 of the time (2**32 mod 69,921 of 2**32): in
    256 x 512 draws ~2 are; these rows, fixed, hold some."""
    vocab, rows, width = 69_925, 256, 512
    rng = np.random.default_rng(3)
    ids = rng.integers(4, vocab, (rows, width))
    lengths = np.full(rows, width)
    cases = [[42, 0, 0, row] for row in range(rows)]
    replacement = np.arange(4, vocab)
    firsts = lengths
    raw = row_rng.raw_draws(cases, firsts + lengths + width // 2)
    pairs = np.take_along_axis(raw, (firsts + lengths)[:, None] + np.arange(width) // 2, axis=1)
    rejected_rows = np.flatnonzero(row_rng.bounded(row_rng.halves(pairs), replacement.shape[0])[1].any(axis=1))
    assert rejected_rows.size > 0  # else this test would not reach the path it is for
    inputs, labels = mask_rows(ids, lengths, np.ones_like(ids, dtype=bool), cases, 3, replacement, 0.5,
                               mask_replace_prob=0.0, random_replace_prob=1.0)
    for row in rejected_rows:
        generator = row_rng.generator(cases[row])
        selected = generator.random(width) < 0.5
        generator.random(width)
        draws = generator.integers(0, replacement.shape[0], width)
        np.testing.assert_array_equal(inputs[row], np.where(selected, replacement[draws], ids[row]))
        np.testing.assert_array_equal(labels[row], np.where(selected, ids[row], IGNORE_INDEX))


def test_batched_masks_are_independent_of_the_batch_a_row_lands_in() -> None:
    collator = MaskingCollator(mask_token_id=3, pad_token_id=0, special_ids=[0, 1, 2, 3], vocab_size=50)
    rng = np.random.default_rng(5)
    examples = [{"input_ids": rng.integers(4, 50, int(rng.integers(5, 30))).tolist()} for _ in range(8)]
    together = collator(examples)
    for row, example in enumerate(examples):
        alone = collator([example])
        n = len(example["input_ids"])
        assert torch.equal(alone["input_ids"][0], together["input_ids"][row, :n])
        assert torch.equal(alone["labels"][0], together["labels"][row, :n])


# Golden masks: the collator's inputs and labels for fixed batches, hashed. The batches come from splitmix64,
# not from numpy, so that only the masks' draws can move them: a numpy release whose generator draws other
# numbers (SeedSequence, PCG64, Generator.random or .integers) fails here, on the fast path and the fallback.
# name: (vocabulary, rows, longest row, seed, split, mlm_probability, mask_replace_prob, random_replace_prob,
# whole_word_mask, pad_to)
GOLDEN_CASES = {
    "bert": (30522, 16, 128, 42, 0, 0.15, 0.8, 0.1, False, 0),
    "eval": (30522, 8, 96, 2**63 + 5, 1, 0.15, 0.8, 0.1, False, 128),
    "words": (50, 12, 64, 7, 0, 0.4, 0.5, 0.25, True, 0),
    "random": (6, 8, 40, 2**32, 0, 0.99, 0.0, 1.0, False, 0),
    # 1,073,742 replacement ids: Lemire's method rejects 2.5e-4 of the draws, so a row of this batch takes one
    "rejections": (1_073_746, 64, 128, 3, 0, 0.5, 0.0, 1.0, False, 0),
}
# sha256 of the case's input_ids then labels, int64 little-endian (B, W), as numpy 2.4.6 draws them
GOLDEN_MASKS = {
    "bert": "0804e9e785238d286a224bbee56049cb3989a39bfcafb75efa5849a6a4b11ff1",
    "eval": "203c9c7cda25ffd52664892d253de161d96569258149e3c45eaacc25f878634d",
    "words": "7b920e4aa1d106305005edaf1dd37c96a4e0666fbb09538979f875a9b9c01ed1",
    "random": "797de4a7de9eac935a3ab89b5e161468da8ffd8c902e431dd9648e6df41223c4",
    "rejections": "497ed8aa3c9cd9ddba413af6958ecf5081a0e897c7f5353706bef32b2da9a6ea",
}
MASK64 = (1 << 64) - 1


def splitmix64(state: int) -> Iterator[int]:
    while True:
        state = (state + 0x9E3779B97F4A7C15) & MASK64
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        yield z ^ (z >> 31)


@functools.cache  # a collator of 1,073,746 ids takes ~1 s to build (its ordinary ids: setdiff1d)
def golden_batch(name: str) -> tuple[MaskingCollator, list[dict]]:
    """The case's collator and rows: every fourth row of a random length up to the longest (0 among them), the
    others the longest; a tenth of the tokens special; each row's epoch its index mod 3."""
    vocab, rows, longest, seed, split, mlm, mask, random, whole_word, pad_to = GOLDEN_CASES[name]
    stream = splitmix64(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little"))
    examples = []
    for row in range(rows):
        n = longest if row % 4 else next(stream) % (longest + 1)
        ids = [4 + next(stream) % (vocab - 4) for _ in range(n)]
        for t in range(n):
            if next(stream) % 10 == 0:
                ids[t] = next(stream) % 4
        example = {"input_ids": ids, EPOCH_KEY: row % 3}
        if whole_word:
            example["word_continues"] = [bool(next(stream) % 2) for _ in range(n)]
        examples.append(example)
    collator = MaskingCollator(mask_token_id=3, pad_token_id=0, special_ids=[0, 1, 2, 3], vocab_size=vocab,
                               mlm_probability=mlm, whole_word_mask=whole_word, mask_replace_prob=mask,
                               random_replace_prob=random, seed=seed, split=split, pad_to=pad_to)
    return collator, examples


def masks_hash(batch: dict) -> str:
    return hashlib.sha256(batch["input_ids"].numpy().astype("<i8").tobytes()
                          + batch["labels"].numpy().astype("<i8").tobytes()).hexdigest()


@pytest.fixture
def fresh_check() -> Iterator[None]:
    """emulation_holds is cached per process: a test that changes what it finds checks afresh, and leaves no
    finding behind."""
    row_rng.emulation_holds.cache_clear()
    yield
    row_rng.emulation_holds.cache_clear()


@pytest.mark.parametrize("path", ["emulation", "numpy's generators"])
@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_the_masks_of_fixed_batches_are_the_golden_ones(name: str, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "emulation":
        assert row_rng.emulation_holds(), row_rng.emulation_differs()
    else:
        monkeypatch.setattr(row_rng, "emulation_holds", lambda: False)
    asked = []
    generator = row_rng.generator
    monkeypatch.setattr(row_rng, "generator", lambda entropy: asked.append(entropy) or generator(entropy))
    collator, examples = golden_batch(name)
    assert masks_hash(collator(examples)) == GOLDEN_MASKS[name], f"numpy {np.__version__} draws other masks"
    if path == "emulation" and name == "rejections":
        assert len(asked) == 1  # the batch's one row with a rejected draw asked its own generator
    elif path == "emulation":
        assert asked == []
    else:
        assert len(asked) == len(examples)


def test_the_emulation_holds_on_the_installed_numpy_and_its_check_meets_a_rejection() -> None:
    assert row_rng.emulation_differs() is None
    assert row_rng.emulation_holds()
    # the check compares Lemire's threshold only where some draw of its rows is rejected
    count = len(row_rng.CHECK_ENTROPIES) * 2 * row_rng.CHECK_INTEGERS
    raw = row_rng.raw_draws(row_rng.CHECK_ENTROPIES, np.full(len(row_rng.CHECK_ENTROPIES), count))
    assert row_rng.bounded(row_rng.halves(raw[:, np.arange(count) // 2]), max(row_rng.CHECK_BOUNDS))[1].any()


@pytest.mark.parametrize("high", [1, 6, 30518, 1_073_742, 2**31 + 1])
def test_the_batched_draws_are_numpys_on_generated_rows(high: int) -> None:
    """Counts of 0 among them; 2**31 + 1 sends about every row with integers to its own generator."""
    rng = np.random.default_rng(high)
    cases = entropies(rng, 40)
    doubles, integers = rng.integers(0, 30, len(cases)), rng.integers(0, 30, len(cases))
    batched, numpys = row_rng.batched_draws(cases, doubles, integers, high), row_rng.numpy_draws(
        cases, doubles, integers, high)
    for ours, theirs in zip(batched, numpys, strict=True):
        np.testing.assert_array_equal(ours, theirs)


def off_by_one_ulp(raw: np.ndarray) -> np.ndarray:
    """An emulation of Generator.random that numpy's is not: each double one step up."""
    return np.nextafter(np.asarray(raw >> np.uint64(11), dtype=np.float64) * (1.0 / 9007199254740992.0), 1.0)


def test_an_emulation_that_differs_sends_every_batch_to_numpys_generators_with_one_line(
        fresh_check: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(row_rng, "uniform", off_by_one_ulp)
    collator, examples = golden_batch("words")
    wrong = row_rng.batched_draws([[1, 2]], np.array([3]), np.array([2]), 50)[0]
    assert not np.array_equal(wrong, row_rng.numpy_draws([[1, 2]], np.array([3]), np.array([2]), 50)[0])
    with caplog.at_level("WARNING", logger="mlm_ddp.data.row_rng"):
        assert not row_rng.emulation_holds()
        monkeypatch.setattr(row_rng, "batched_draws", None)  # never called again in this process
        for name in GOLDEN_CASES:
            collator, examples = golden_batch(name)
            assert masks_hash(collator(examples)) == GOLDEN_MASKS[name], name
    lines = [r.getMessage() for r in caplog.records if r.name == "mlm_ddp.data.row_rng"]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"mlm_ddp's emulation of numpy's PCG64 (mlm_ddp.data.row_rng) does not hold on numpy "
                               f"{np.__version__}: Generator.random of SeedSequence([42, 0, 0, "), lines[0]
    assert lines[0].endswith("differs; every row's masks are drawn by numpy's own PCG64, row by row (slower)")


def test_a_numpy_whose_pcg64_draws_differ_masks_by_its_own_generator_and_misses_the_golden_masks(
        fresh_check: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A release whose PCG64 (here: PCG64DXSM standing for it) draws other numbers: the emulation no longer
    holds, every row is masked by that generator (as reference_collate does it), and the golden masks fail."""
    monkeypatch.setattr(row_rng, "generator", lambda entropy: np.random.Generator(
        np.random.PCG64DXSM(np.random.SeedSequence(entropy))))
    assert not row_rng.emulation_holds()
    assert "PCG64's raw outputs of SeedSequence([42, 0, 0, 2134822173486100501]) differ;" in caplog.text
    for name in ("bert", "words"):
        collator, examples = golden_batch(name)
        batch = collator(examples)
        inputs, labels = reference_collate(collator, examples)
        np.testing.assert_array_equal(batch["input_ids"].numpy(), inputs)
        np.testing.assert_array_equal(batch["labels"].numpy(), labels)
        assert masks_hash(batch) != GOLDEN_MASKS[name]


def test_an_emulation_that_cannot_run_does_not_hold(fresh_check: None, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    def moved(*args: object) -> None:
        raise ValueError("state must be a dict")

    monkeypatch.setattr(row_rng, "pool_states", moved)
    assert not row_rng.emulation_holds()
    assert f"does not hold on numpy {np.__version__}: it raises ValueError: state must be a dict;" in caplog.text
    collator, examples = golden_batch("bert")
    assert masks_hash(collator(examples)) == GOLDEN_MASKS["bert"]
