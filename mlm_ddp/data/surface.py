"""How many characters of text each token id stands for: the denominator of bits per character.

Per-token perplexity changes meaning with the tokenizer (a tokenizer that cuts words into more pieces
predicts more, easier tokens), so evaluation also divides the masked tokens' loss by the characters those
tokens cover. A token's characters are its surface: the text it spells without the tokenizer's markers
(WordPiece's '##' continuation prefix; byte-level BPE's byte alphabet, 'Ġ' a space; Metaspace's '▁', the
space of SentencePiece / Unigram), whitespace not counted, so that a word costs the same characters
under every tokenizer that keeps its spelling. A character is counted once, in the token that holds its
first UTF-8 byte: byte-level BPE may cut one character into two tokens. Special tokens cover none;
the unknown token one (it stands for a character the vocabulary lacks).

A per-vocabulary table, not the offsets of the text: it works alike for packed blocks, prepared shards
and streams, which keep the ids and not the text. It counts the text as the tokenizer normalized it (an
uncased tokenizer's lower case, accents stripped): the characters are those of the text the model saw.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

WHITESPACE_BYTES = frozenset(b" \t\n\r\x0b\x0c")
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


def utf8_characters(raw: bytes) -> int:
    """Characters whose first byte is in `raw`, whitespace not counted: continuation bytes (0b10xxxxxx)
    belong to a character begun elsewhere, maybe in the token before."""
    return sum(1 for b in raw if b & 0xC0 != 0x80 and b not in WHITESPACE_BYTES)


def byte_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet back to bytes: the inverse of GPT-2's bytes_to_unicode."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _types(node: Any) -> set[str]:
    """Every "type" named in a pre-tokenizer or decoder's JSON (a Sequence holds several)."""
    if isinstance(node, dict):
        return {str(node.get("type")), *(t for value in node.values() for t in _types(value))}
    if isinstance(node, list):
        return {t for value in node for t in _types(value)}
    return set()


def surface_bytes(token: str, prefix: str | None, byte_level: bool, metaspace: str | None,
                  decoder: dict[str, int]) -> bytes:
    """The UTF-8 bytes a vocabulary token spells, its tokenizer's markers taken off."""
    if prefix and token.startswith(prefix) and token != prefix:
        token = token[len(prefix):]
    if byte_level and all(c in decoder for c in token):
        return bytes(decoder[c] for c in token)
    if metaspace:
        token = token.replace(metaspace, " ")
    fallback = BYTE_FALLBACK.fullmatch(token)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    return token.encode()


def character_table(tokenizer: Any) -> np.ndarray:
    """(len(tokenizer),) int64: the characters each id covers, as the module's docstring defines them. A fast
    tokenizer's backend says which markers its vocabulary uses; a slow one's class (--use_slow_tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        model, kinds = state.get("model") or {}, _types(state.get("pre_tokenizer")) | _types(state.get("decoder"))
        prefix = model.get("continuing_subword_prefix") if model.get("type") in ("WordPiece", "BPE") else None
    else:  # slow: GPT-2's and RoBERTa's keep a byte decoder, SentencePiece's a model; else WordPiece's '##'
        kinds = {"ByteLevel"} if hasattr(tokenizer, "byte_decoder") else set()
        kinds |= {"Metaspace"} if hasattr(tokenizer, "sp_model") else set()
        prefix = None if kinds else "##"
    metaspace = "▁" if "Metaspace" in kinds else None
    byte_level, decoder = "ByteLevel" in kinds, byte_decoder()
    size = len(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
    table = np.array([utf8_characters(surface_bytes(t or "", prefix, byte_level, metaspace, decoder))
                      for t in tokens], dtype=np.int64)
    table[[i for i in tokenizer.all_special_ids if 0 <= i < size]] = 0
    if tokenizer.unk_token_id is not None and 0 <= tokenizer.unk_token_id < size:
        table[tokenizer.unk_token_id] = 1
    return table
