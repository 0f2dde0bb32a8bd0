"""BERT masking (80/10/10 by default, optional whole-word), seeded per sample.

A sample's mask depends only on (seed, split, epoch, the sample's tokens): not on the batch it lands
in, the rank that reads it or the number of processes. So 1 process x batch 2B and 2 processes x B
see identical masks, and a resumed run sees the masks the uninterrupted one would have. The positions
are drawn first, from their own uniform draws: the replacement split never moves them, and at a rate
p they are a subset of those at any rate q > p (a draw below p is below q). So an evaluation at 15%
scores the same positions of a block whatever rate or split the run trains with.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mlm_ddp.data import row_rng
from mlm_ddp.errors import BadInput
from mlm_ddp.model.positions import loss_layout

IGNORE_INDEX = -100  # label of positions that carry no loss (torch cross_entropy's ignore_index)
TRAIN_SPLIT, EVAL_SPLIT = 0, 1
EPOCH_KEY = "_epoch"  # a row's own epoch, when its batch may hold two (data.EpochKeyed); else `epoch`
# a mixture's row: the index of its source (data.mixture, data.mixed_stream); its EPOCH_KEY is that source's pass.
# The collator hands the rows' tags on as batch[SOURCE_KEY], a host array the feed takes off (data.counts)
SOURCE_KEY = "_source"
# an evaluation batch's characters covered by its masked tokens: a () int64 tensor, the denominator of bits
# per character (data.surface); only a collator given a character table adds it (the held-out one)
CHARACTERS_KEY = "masked_characters"


def content_digest(token_ids: np.ndarray) -> int:
    """A sample's 64-bit key: the hash of its token ids, so its mask is the same wherever it is read."""
    digest = hashlib.blake2b(np.ascontiguousarray(token_ids, dtype=np.int64).tobytes(), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def sample_rng(seed: int, split: int, epoch: int, token_ids: np.ndarray) -> np.random.Generator:
    """The generator a sample's mask is drawn from: numpy's PCG64 seeded by SeedSequence([seed, split, epoch,
    digest]) (row_rng.generator; mask_rows draws the same numbers for a whole batch)."""
    return row_rng.generator([seed, split, epoch, content_digest(token_ids)])


def percent(rate: float) -> str:
    """0.15 -> '15%', 0.125 -> '12.5%'."""
    return f"{round(rate * 100, 4):g}%"


def describe_masking(mlm_probability: float, mask_replace_prob: float, random_replace_prob: float,
                     whole_word_mask: bool) -> str:
    """'30% of the tokens; 80% [MASK], 10% random, 10% unchanged', as the model card says it."""
    kept = max(0.0, 1.0 - mask_replace_prob - random_replace_prob)
    return (f"{percent(mlm_probability)} of the {'words' if whole_word_mask else 'tokens'}; "
            f"{percent(mask_replace_prob)} [MASK], {percent(random_replace_prob)} random, {percent(kept)} unchanged")


def mask_rows(
    token_ids: np.ndarray,
    lengths: np.ndarray,
    maskable: np.ndarray,
    entropies: list[list[int]],
    mask_token_id: int,
    replacement_ids: np.ndarray,
    mlm_probability: float,
    word_continues: np.ndarray | None = None,
    mask_replace_prob: float = 0.8,
    random_replace_prob: float = 0.1,
) -> tuple[np.ndarray, np.ndarray]:
    """Mask a batch of samples: returns (inputs, labels), both shaped like token_ids (B, W).

    Row b holds lengths[b] tokens (the rest is padding, left as it is) and draws from its own generator,
    numpy's PCG64 seeded by SeedSequence(entropies[b]) (sample_rng, row_rng.draws): first one uniform per
    token, or with word_continues one per word (at least one), selecting it below mlm_probability; then
    one uniform per token, the action: a selected token becomes [MASK] below mask_replace_prob, a random
    ordinary token (the third draw, one integer per token, indexes replacement_ids) below
    mask_replace_prob + random_replace_prob, and stays itself otherwise (transformers'
    DataCollatorForLanguageModeling: both are fractions of all selected tokens). Only maskable tokens are
    selected; a word starts at every maskable token that does not continue (word_continues[b, t]) a
    maskable predecessor. Labels hold the original id at selected positions and IGNORE_INDEX elsewhere.
    """
    rows, width = token_ids.shape
    columns = np.arange(width)
    maskable = maskable & (columns < lengths[:, None])
    if word_continues is None:
        firsts = lengths  # (B,) selection draws: one per token
    else:
        prev_maskable = np.zeros_like(maskable)
        prev_maskable[:, 1:] = maskable[:, :-1]
        starts = maskable & ~(word_continues & prev_maskable)
        word_index = np.cumsum(starts, axis=1) - 1  # (B, W) index of the word each token belongs to
        firsts = np.maximum(starts.sum(axis=1), 1)
    # each row's draws in order: selection and action doubles, then one integer per token for the replacement
    uniforms, integers = row_rng.draws(entropies, firsts + lengths, lengths, replacement_ids.shape[0])  # (B, D), (B, N)

    def at(table: np.ndarray, offsets: np.ndarray) -> np.ndarray:  # (B, W): table[b, offsets[b] + t]
        return np.take_along_axis(table, np.minimum(offsets[:, None] + columns, table.shape[1] - 1), axis=1)

    if word_continues is None:
        selected = maskable & (at(uniforms, np.zeros_like(lengths)) < mlm_probability)
    else:
        chosen_words = uniforms[:, : int(firsts.max())] < mlm_probability  # (B, words)
        selected = maskable & np.take_along_axis(chosen_words, np.clip(word_index, 0, chosen_words.shape[1] - 1), 1)
    action = at(uniforms, firsts)
    draws = at(integers, np.zeros_like(lengths))
    inputs = token_ids.copy()
    to_mask = selected & (action < mask_replace_prob)
    to_random = selected & (action >= mask_replace_prob) & (action < mask_replace_prob + random_replace_prob)
    inputs[to_mask] = mask_token_id
    inputs[to_random] = replacement_ids[draws[to_random]]
    labels = np.where(selected, token_ids, IGNORE_INDEX)
    return inputs, labels


@dataclass
class MaskingCollator:
    """Pads packed blocks into a batch and masks them; `set_epoch` before iterating each epoch.

    Produces input_ids, attention_mask, labels (B, T) with T the longest sequence of the batch (a
    packed block is max_seq_length long except the last of a tokenization batch), or `pad_to` when it
    is longer (--pad_to_max_length: the same shape every batch); the loss positions of
    `positions.loss_layout`; and `padded`, a bool: whether any position of the batch is padding.
    Rows of a mixture (they carry `SOURCE_KEY`) add `SOURCE_KEY`: (B, 3) int64 numpy, each row's source,
    its pass and its tokens, for `data.counts`; numpy, not a tensor: it stays on the host.
    With `characters` (data.surface.character_table), `CHARACTERS_KEY`: the characters the batch's masked
    tokens cover, counted here on the host, so that evaluation sums them on the device with no read back.
    """

    mask_token_id: int
    pad_token_id: int
    special_ids: Sequence[int]
    vocab_size: int
    mlm_probability: float = 0.15
    whole_word_mask: bool = False
    mask_replace_prob: float = 0.8  # of the selected tokens: [MASK]
    random_replace_prob: float = 0.1  # of the selected tokens: a random ordinary token; the rest kept
    seed: int = 42
    split: int = TRAIN_SPLIT
    epoch: int = 0
    pad_to: int = 0
    characters: np.ndarray | None = field(default=None, repr=False)  # (vocab_size,) int64, per token id
    _replacement_ids: np.ndarray = field(init=False, repr=False)
    _special: np.ndarray = field(init=False, repr=False)
    _is_special: np.ndarray = field(init=False, repr=False)  # (vocab_size,) bool, looked up per token

    def __post_init__(self) -> None:
        # the rate and the split are the config's (config/sections.py checks them where the flags are declared)
        row_rng.emulation_holds()  # checked (and said, where it does not hold) as the collator is built, not mid-run
        self._special = np.asarray(sorted(set(self.special_ids)), dtype=np.int64)
        self._replacement_ids = np.setdiff1d(np.arange(self.vocab_size, dtype=np.int64), self._special)
        # a table, not np.isin: isin sorts on every call, ~25 us of a row's ~85 us (a 256 x 128 batch took ~33 ms)
        self._is_special = np.zeros(max(self.vocab_size, int(self._special.max(initial=-1)) + 1), dtype=bool)
        self._is_special[self._special] = True
        if self._replacement_ids.size == 0:
            # else every batch fails deep in the random-token draw (numpy: "high <= 0"), after the run began
            raise BadInput(f"the vocabulary of {self.vocab_size} ids holds special tokens only "
                           f"({', '.join(map(str, self._special))}): there is no ordinary token to mask, nor "
                           "to put in place of one; use a tokenizer trained on text (--tokenizer_name)")

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, **kwargs: Any) -> MaskingCollator:
        """The collator of a (fast) tokenizer's special tokens and vocabulary; kwargs: the other fields."""
        try:
            return cls(mask_token_id=tokenizer.mask_token_id, pad_token_id=tokenizer.pad_token_id,
                       special_ids=tokenizer.all_special_ids, vocab_size=len(tokenizer), **kwargs)
        except BadInput as err:
            raise BadInput(f"tokenizer {tokenizer.name_or_path!r}: {err}") from None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        rows = len(examples)
        lengths = np.fromiter((len(e["input_ids"]) for e in examples), dtype=np.int64, count=rows)
        width = max(self.pad_to, int(lengths.max()))
        ids = np.full((rows, width), self.pad_token_id, dtype=np.int64)
        for row, example in enumerate(examples):
            ids[row, : lengths[row]] = example["input_ids"]
        attention = (np.arange(width) < lengths[:, None]).astype(np.int64)  # (B, W)
        tokens = ids[attention == 1]
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self._is_special.shape[0]):
            bad = int(tokens.min()) if tokens.min() < 0 else int(tokens.max())
            raise BadInput(f"token id {bad} is outside the "
                           f"tokenizer's {self.vocab_size} ids: the data was tokenized with another tokenizer; "
                           "prepare or tokenize it again with this one (--tokenizer_name)")
        continues = None
        if self.whole_word_mask:
            if any("word_continues" not in e for e in examples):
                raise ValueError("whole-word masking needs the 'word_continues' column of data.tokenize_and_pack")
            continues = np.zeros((rows, width), dtype=bool)
            for row, example in enumerate(examples):
                continues[row, : lengths[row]] = example["word_continues"]
        # each row's generator: sample_rng's entropy, keyed by the row's own tokens and epoch
        entropies = [[self.seed, self.split, int(e.get(EPOCH_KEY, self.epoch)),
                      content_digest(ids[row, : lengths[row]])] for row, e in enumerate(examples)]
        input_ids, labels = mask_rows(
            ids, lengths, ~self._is_special[ids], entropies, self.mask_token_id, self._replacement_ids,
            self.mlm_probability, continues, self.mask_replace_prob, self.random_replace_prob)
        labels_t = torch.from_numpy(labels)
        batch = {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention),
            "labels": labels_t,
            # where the loss is, as indices (positions.py), and whether any position is padding: read here
            # on the host, where it is free, not on the GPU, where each read drains the queue
            **loss_layout(labels_t != IGNORE_INDEX),
            "padded": bool((attention == 0).any()),
        }
        if self.characters is not None:
            batch[CHARACTERS_KEY] = torch.tensor(int(self.characters[labels[labels != IGNORE_INDEX]].sum()))
        if SOURCE_KEY in examples[0]:
            batch[SOURCE_KEY] = np.array([[e[SOURCE_KEY], e[EPOCH_KEY], len(e["input_ids"])] for e in examples],
                                         dtype=np.int64)
        return batch
