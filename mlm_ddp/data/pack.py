"""Texts -> tokens -> packed blocks.

Packing follows run_mlm's `group_texts`: every text is tokenized as `[CLS] text [SEP]`, the texts of
one tokenization batch are concatenated and cut into blocks of exactly `max_seq_length` tokens. The
remainder of each tokenization batch is kept as one shorter block (padded when batched), never
dropped; `PackStats` counts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow.compute as pc
from datasets import Dataset, IterableDataset

from mlm_ddp.config import DataConfig
from mlm_ddp.data.text import AnyDataset, first_row

TOKENIZE_BATCH = 1000  # texts packed together: the remainder of each such batch is one shorter block


def tokenize_and_pack(
    texts: list[Any], tokenizer: Any, block_size: int, with_word_continues: bool = False, line_by_line: bool = False
) -> dict[str, list[list[int]]]:
    """Pure: a batch of texts -> sequences `input_ids` (and `word_continues` for whole-word masking).

    Texts that are empty, blank or not strings are skipped. Packed (default): the texts are
    concatenated and cut into blocks of block_size tokens, the last one holding the remainder.
    `line_by_line`: each text is one sequence, truncated to block_size tokens.
    """
    kept = [t for t in texts if isinstance(t, str) and t.strip()]
    if not kept:
        return {"input_ids": [], **({"word_continues": []} if with_word_continues else {})}
    if line_by_line:
        encoded = tokenizer(kept, add_special_tokens=True, truncation=True, max_length=block_size, verbose=False)
        out = {"input_ids": [list(row) for row in encoded["input_ids"]]}
        if with_word_continues:
            out["word_continues"] = [_continues(encoded.word_ids(i)) for i in range(len(kept))]
        return out
    encoded = tokenizer(kept, add_special_tokens=True, verbose=False)
    ids: list[int] = []
    continues: list[int] = []
    for i, row in enumerate(encoded["input_ids"]):
        ids.extend(row)
        if with_word_continues:
            continues.extend(_continues(encoded.word_ids(i)))
    starts = range(0, len(ids), block_size)
    out = {"input_ids": [ids[s : s + block_size] for s in starts]}
    if with_word_continues:
        out["word_continues"] = [continues[s : s + block_size] for s in starts]
    return out


def _continues(words: list[int | None]) -> list[int]:
    """1 where a token continues the word of the token before it (whole-word masking), else 0."""
    return [int(w is not None and j > 0 and words[j - 1] == w) for j, w in enumerate(words)]


@dataclass(frozen=True)
class PackStats:
    """What packing made of a map-style split."""

    blocks: int
    tokens: int
    short_blocks: int  # remainders of tokenization batches, padded at batching time
    block_size: int

    @property
    def pad_fraction(self) -> float:
        """Share of the block slots that are padding."""
        return 1.0 - self.tokens / (self.blocks * self.block_size) if self.blocks else 0.0


def tokenize_dataset(raw: AnyDataset, tokenizer: Any, cfg: DataConfig) -> AnyDataset:
    """Tokenize and pack lazily (streams) or once, cached by `datasets` (map-style)."""
    columns = raw.column_names if raw.column_names is not None else list(first_row(raw, "stream"))
    kwargs: dict[str, Any] = dict(
        batched=True,
        batch_size=TOKENIZE_BATCH,
        remove_columns=columns,
        input_columns=[cfg.text_column],
        fn_kwargs={
            "tokenizer": tokenizer,
            "block_size": cfg.max_seq_length,
            "with_word_continues": cfg.whole_word_mask,
            "line_by_line": cfg.line_by_line,
        },
    )
    if isinstance(raw, IterableDataset):
        return raw.map(tokenize_and_pack, **kwargs)
    return raw.map(tokenize_and_pack, num_proc=cfg.preprocessing_num_workers, desc="Tokenizing and packing",
                   load_from_cache_file=not cfg.overwrite_cache, **kwargs)


def pack_stats(ds: Dataset, block_size: int) -> PackStats:
    lengths = pc.list_value_length(ds.data.column("input_ids"))
    tokens = int(pc.sum(lengths).as_py() or 0)
    short = int(pc.sum(pc.less(lengths, block_size)).as_py() or 0)
    return PackStats(blocks=len(ds), tokens=tokens, short_blocks=short, block_size=block_size)


def describe_sequences(stats: PackStats, data: DataConfig) -> str:
    """The start-up log's words for the training sequences, with their share of padding."""
    seq = data.max_seq_length
    if not data.line_by_line:
        return (f"{stats.blocks} blocks of {seq} tokens ({stats.tokens} tokens, {stats.short_blocks} shorter tail "
                f"blocks, {stats.pad_fraction:.2%} padding)")
    lines = f"{stats.blocks} lines of at most {seq} tokens, {stats.tokens / max(stats.blocks, 1):.1f} on average"
    if data.pad_to_max_length:
        return f"{lines} ({stats.pad_fraction:.2%} padding: every batch padded to {seq})"
    return f"{lines} (each batch padded to its longest line: at most {stats.pad_fraction:.2%} padding)"
