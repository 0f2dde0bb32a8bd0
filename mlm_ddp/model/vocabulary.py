"""A model's vocabulary grown by the domain's words (`python -m mlm_ddp.tokenizer --extend`).

The new tokens go into the tokenizer's own model (its vocabulary, its merges), never in front of it as
"added tokens": an added token is matched in the raw text before the pre-tokenizer, at word boundaries of
its own that are not the pre-tokenizer's, so a word can come out longer (a symbol glued to a new word
turned the whole word's one [UNK] into [UNK] + the word). Behind the pre-tokenizer each word is split on its
own, and each family is continued in its own way:

- BPE (RoBERTa's byte-level one among them): its training resumed. The most frequent adjacent pair of the
  training text's words, as the old merges leave them, becomes a merge ranked after every old one, and so
  on until N new tokens. A word first meets every old merge, exactly as before (a new merge only applies
  once no old one does), then the new ones, each one a piece fewer: never longer, by construction.
- WordPiece (BERT's) and Unigram (SentencePiece's): whole words the old tokenizer splits into several
  pieces, ranked by the tokens they save (count x (pieces - 1)). A Unigram piece is scored just above the
  segmentation it replaces, so Viterbi picks it where that segmentation was chosen, and elsewhere keeps
  what it chose. WordPiece's greedy longest match is not monotone: a longer word that begins with a new
  token is split as that token + the rest, which is rarely, but can be, more pieces than before. So for
  both, every word of the text read (training and held-out share) is split again, and a new token that
  lengthens one is dropped for the next candidate; a word never seen may still, rarely, be split so.
  With any_input (--never_longer any_input) WordPiece takes only words no input can be lengthened by
  (`crosses`): never longer, by construction, for fewer tokens saved.

A new token's embedding row (and, for a masked-LM head, its decoder row where untied and its bias) is the
mean of the rows of the old pieces it replaces (Fast Vocabulary Transfer, Gee et al., 2022); old rows are
unchanged, old ids kept.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tokenizers import Tokenizer

from mlm_ddp.errors import BadInput

FAMILIES = ("WordPiece", "BPE", "Unigram")
UNIGRAM_MARGIN = 1e-6  # a whole-word piece's score above the summed scores of the pieces it replaces
MOST_ROUNDS = 20  # WordPiece/Unigram: rounds of dropping a token that lengthens a word of the text


@dataclass
class NewToken:
    """One token the extension adds, and what it stands for."""

    token: str  # as the vocabulary spells it: 'kubectl' (WordPiece), 'Ġkubectl' (byte-level BPE), '▁kubectl'
    id: int
    pieces: list[str]  # the old tokens it replaces, in order
    piece_ids: list[int]
    count: int  # occurrences in the training text: of its word, or (BPE) of the pair it merges
    score: float | None = None  # Unigram: its log-probability


@dataclass
class Extension:
    """The new tokens of one extension and the tokenizer backend that holds them."""

    family: str
    old_size: int
    tokens: list[NewToken]
    backend: Tokenizer
    found: int  # candidates the text offered (>= len(tokens))
    dropped: list[str] = field(default_factory=list)  # WordPiece/Unigram: tokens that lengthened a word
    passed_over: int = 0  # WordPiece with any_input: candidates some unseen word could be lengthened by


def family_of(backend: Tokenizer) -> str:
    kind = json.loads(backend.to_str())["model"]["type"]
    if kind not in FAMILIES:
        raise BadInput(f"--extend: the tokenizer's model is {kind}; extending knows {', '.join(FAMILIES)}")
    return kind


def word_counts(backend: Tokenizer, texts: Iterable[str]) -> Counter[str]:
    """How often each word of `texts` occurs, as the tokenizer's normalizer and pre-tokenizer make them (the
    units its model splits, each on its own)."""
    counts: Counter[str] = Counter()
    normalizer, pre = backend.normalizer, backend.pre_tokenizer
    for text in texts:
        normalized = normalizer.normalize_str(text) if normalizer is not None else text
        counts.update(word for word, _ in (pre.pre_tokenize_str(normalized) if pre is not None else [(normalized, 0)]))
    return counts


def split(backend: Tokenizer, word: str) -> list[Any]:
    """The model's tokens for one pre-tokenized word (tokenizers.Token: .id, .value)."""
    return backend.model.tokenize(word)


def whole_word_candidates(backend: Tokenizer, counts: Counter[str], min_frequency: int,
                          unk_id: int | None) -> list[tuple[int, str, list[Any]]]:
    """(tokens saved, word, its old tokens) for each word split into several pieces, none unknown, seen at
    least `min_frequency` times; most saved first, then by the word (a fixed order)."""
    found = []
    for word, count in counts.items():
        if count < min_frequency:
            continue
        pieces = split(backend, word)
        if len(pieces) > 1 and all(p.id != unk_id for p in pieces):
            found.append((count * (len(pieces) - 1), word, pieces))
    return sorted(found, key=lambda c: (-c[0], c[1]))


def with_whole_words(state: dict, family: str, chosen: list[NewToken]) -> Tokenizer:
    """The backend `state` (its JSON) with the chosen words in its model's vocabulary."""
    state = json.loads(json.dumps(state))
    model = state["model"]
    for new in chosen:
        if family == "WordPiece":
            model["vocab"][new.token] = new.id
        elif new.id == len(model["vocab"]):  # Unigram: the vocabulary is a list, ids by position
            model["vocab"].append([new.token, new.score])
        else:
            raise BadInput(f"--extend: the tokenizer has ids past its Unigram vocabulary of {len(model['vocab'])} "
                           f"pieces (tokens added on top of it, up to id {new.id - 1}); extending it is not supported")
    return Tokenizer.from_str(json.dumps(state))


def proper_prefixes(vocab: Iterable[str]) -> set[str]:
    """Every string that some token of `vocab` extends: 'ab' for 'abc', '##c' for '##ces'."""
    return {token[:k] for token in vocab for k in range(1, len(token))}


def crosses(word: str, pieces: list[Any], prefix: str, extended: set[str]) -> bool:
    """Whether WordPiece's greedy match, reading `word` (old `pieces`) with more letters s after it, can
    take a continuation piece that runs past the word's end: at a piece boundary after the first, the rest
    of the word (as '##rest') is a proper prefix of a token. If none can, the old split of word + s is the
    word's pieces followed by the split of '##s', and the new token gives 1 + the same: shorter, for every
    s. At the first position a longer word-initial token is no risk: the new tokenizer takes it too, being
    the longest match. If one can, the old split may cross into s and come out shorter
    ('asyncestablished': as ##yn ##ces ##tablished is 4; async ##est ##ab ##lish ##ed is 5)."""
    start = len(pieces[0].value)
    for piece in pieces[1:]:
        if prefix + word[start:] in extended:
            return True
        start += len(piece.value) - len(prefix)
    return False


def lengthened(old: Tokenizer, new: Tokenizer, words: Iterable[str]) -> set[str]:
    """The words `new` splits into more tokens than `old` does."""
    return {w for w in words if len(split(new, w)) > len(split(old, w))}


def extend_whole_words(backend: Tokenizer, family: str, counts: Counter[str], check: Iterable[str], n: int,
                       first_id: int, min_frequency: int, unk_id: int | None, any_input: bool = False) -> Extension:
    """WordPiece or Unigram: the n whole words that save most tokens, none of which lengthens a word of
    `check` (the words of the text read); with `any_input`, WordPiece's none that `crosses` (no input)."""
    state = json.loads(backend.to_str())
    scores = [score for _, score in state["model"]["vocab"]] if family == "Unigram" else []
    candidates = whole_word_candidates(backend, counts, min_frequency, unk_id)
    passed_over = 0
    if any_input and family == "WordPiece":
        prefix, extended = state["model"]["continuing_subword_prefix"], proper_prefixes(state["model"]["vocab"])
        safe = [c for c in candidates if not crosses(c[1], c[2], prefix, extended)]
        candidates, passed_over = safe, len(candidates) - len(safe)
    if len(candidates) < n:
        return Extension(family, first_id, [], backend, len(candidates), passed_over=passed_over)
    check, banned, dropped = set(check), set(), []
    for _ in range(MOST_ROUNDS):
        picked = [c for c in candidates if c[1] not in banned][:n]
        if len(picked) < n:
            break
        chosen = [NewToken(word, first_id + i, [p.value for p in pieces], [p.id for p in pieces],
                           saved // (len(pieces) - 1),
                           sum(scores[p.id] for p in pieces) + UNIGRAM_MARGIN if scores else None)
                  for i, (saved, word, pieces) in enumerate(picked)]
        new = with_whole_words(state, family, chosen)
        longer = lengthened(backend, new, check)
        if not longer:
            return Extension(family, first_id, chosen, new, len(candidates), dropped, passed_over)
        # the new tokens the lengthened words now use: drop them, take the next candidates
        culprits = {t.value for w in longer for t in split(new, w) if t.id >= first_id}
        banned |= culprits
        dropped += sorted(culprits)
    return Extension(family, first_id, [], backend, len(candidates) - len(banned), dropped, passed_over)


def merged(a: str, b: str, prefix: str | None) -> str:
    """The token a BPE merge of a and b makes (b's continuation prefix, if the model has one, dropped)."""
    return a + (b[len(prefix):] if prefix and b.startswith(prefix) else b)


def extend_bpe(backend: Tokenizer, counts: Counter[str], n: int, first_id: int, min_frequency: int) -> Extension:
    """BPE: its training continued on the words of the text, as the old merges leave them, until n new tokens
    (a merge of two pieces into a token the vocabulary already has adds a merge and no token)."""
    state = json.loads(backend.to_str())
    model = state["model"]
    vocab, prefix = model["vocab"], model.get("continuing_subword_prefix")
    words = [[p.value for p in split(backend, w)] for w in counts]
    freq = list(counts.values())
    pairs: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = defaultdict(set)

    touched: set[tuple[str, str]] = set()  # pairs whose count fell in this round: dropped at 0

    def account(i: int, sign: int) -> None:
        for pair in zip(words[i], words[i][1:], strict=False):
            pairs[pair] += sign * freq[i]
            if sign > 0:
                where[pair].add(i)
            else:
                touched.add(pair)

    for i in range(len(words)):
        account(i, 1)
    pieces_of: dict[str, list[str]] = {}
    tokens: list[NewToken] = []
    merges: list[tuple[str, str]] = []
    while len(tokens) < n:
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]), default=None)
        if best is None or best[1] < min_frequency:
            break
        (a, b), count = best
        token = merged(a, b, prefix)
        merges.append((a, b))
        if token not in vocab and token not in pieces_of:
            pieces = pieces_of.get(a, [a]) + pieces_of.get(b, [b])
            pieces_of[token] = pieces
            tokens.append(NewToken(token, first_id + len(tokens), pieces, [vocab[p] for p in pieces], count))
        for i in sorted(where.pop((a, b), ())):
            account(i, -1)
            seg, out, j = words[i], [], 0
            while j < len(seg):
                if j + 1 < len(seg) and (seg[j], seg[j + 1]) == (a, b):
                    out.append(token)
                    j += 2
                else:
                    out.append(seg[j])
                    j += 1
            words[i] = out
            account(i, 1)
        for pair in touched:
            if pairs.get(pair, 1) <= 0:
                del pairs[pair]
        touched.clear()
    if len(tokens) < n:
        return Extension("BPE", first_id, [], backend, len(tokens))
    for new in tokens:
        vocab[new.token] = new.id
    strings = bool(model["merges"]) and isinstance(model["merges"][0], str)  # tokenizers < 0.20 wrote "a b"
    model["merges"] += [f"{a} {b}" if strings else [a, b] for a, b in merges]
    return Extension("BPE", first_id, tokens, Tokenizer.from_str(json.dumps(state)), len(tokens))


def extend(backend: Tokenizer, train_counts: Counter[str], check: Iterable[str], n: int, first_id: int,
           min_frequency: int, unk_id: int | None, any_input: bool = False) -> Extension:
    """The extension of `backend` by n tokens learned from `train_counts` (see the module's docstring)."""
    family = family_of(backend)
    if family == "BPE":
        return extend_bpe(backend, train_counts, n, first_id, min_frequency)
    return extend_whole_words(backend, family, train_counts, check, n, first_id, min_frequency, unk_id, any_input)


def grow_embeddings(model: torch.nn.Module, tokens: list[NewToken], size: int) -> None:
    """Grow `model` to `size` ids: each new row the mean of its old pieces' rows (input embeddings; an
    untied output layer's rows; the output bias), every old row as it was."""
    before_in = model.get_input_embeddings().weight
    before_out = model.get_output_embeddings()
    tied = before_out is not None and before_out.weight is before_in
    model.resize_token_embeddings(max(size, before_in.shape[0]), mean_resizing=False)
    with torch.no_grad():
        rows = [model.get_input_embeddings().weight]
        out = model.get_output_embeddings()
        if out is not None and not tied:
            rows.append(out.weight)
        vectors = [bias for bias in (getattr(out, "bias", None),) if bias is not None]
        for weight in [*rows, *vectors]:
            for new in tokens:
                # (pieces, H) or (pieces,) averaged in fp32, whatever the model's dtype
                weight[new.id] = weight[new.piece_ids].float().mean(0).to(weight.dtype)


def report_dict(extension: Extension, measured: dict[str, dict[str, float]], model: str,
                never_longer: str) -> dict[str, Any]:
    """What report.json holds: the extension, the text measured before and after, each new token."""
    return {"model": model, "family": extension.family, "never_longer": never_longer,
            "old_vocabulary": extension.old_size,
            "new_vocabulary": extension.old_size + len(extension.tokens), "candidates_found": extension.found,
            "dropped_for_lengthening_a_word": extension.dropped,
            # None: not looked for (--never_longer text)
            "passed_over_as_able_to_lengthen_an_unseen_word": extension.passed_over if never_longer == "any_input"
            else None, "text": measured,
            "tokens": [asdict(t) for t in extension.tokens]}


def measure(old: Any, new: Any, texts: list[str]) -> dict[str, float]:
    """Tokens per word and per character of `texts` under the old and the new tokenizer (transformers fast
    tokenizers, no special tokens), and how many texts the new one makes longer (0 unless a bug)."""
    words = sum(len(text.split()) for text in texts)
    characters = sum(sum(not c.isspace() for c in text) for text in texts)
    if not texts:
        return {"texts": 0}
    before = [len(ids) for ids in old(texts, add_special_tokens=False, verbose=False)["input_ids"]]
    after = [len(ids) for ids in new(texts, add_special_tokens=False, verbose=False)["input_ids"]]
    return {"texts": len(texts), "words": words, "characters": characters, "tokens_before": sum(before),
            "tokens_after": sum(after), "tokens_per_word_before": sum(before) / max(words, 1),
            "tokens_per_word_after": sum(after) / max(words, 1),
            "tokens_per_char_before": sum(before) / max(characters, 1),
            "tokens_per_char_after": sum(after) / max(characters, 1),
            "saving": 1 - sum(after) / max(sum(before), 1),
            "texts_longer": sum(a > b for a, b in zip(after, before, strict=True))}


def report_lines(report: dict[str, Any], shown: int = 20) -> list[str]:
    """The report as Markdown: the text before and after, then the new tokens (the first `shown` in the log)."""
    passed_over = report["passed_over_as_able_to_lengthen_an_unseen_word"]
    passed = "" if passed_over is None else f", {passed_over} passed over as able to lengthen an unseen word"
    lines = [f"# Vocabulary extension of {report['model']}", "",
             f"{report['family']} tokenizer, {report['old_vocabulary']} -> {report['new_vocabulary']} tokens "
             f"({report['candidates_found']} candidates in the training text; --never_longer "
             f"{report['never_longer']}{passed}, {len(report['dropped_for_lengthening_a_word'])} dropped for "
             "lengthening a word of the text).", "",
             "| text | texts | tokens before | tokens after | saving | tokens/word before -> after | "
             "tokens/char before -> after | texts made longer |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, m in report["text"].items():
        if m.get("texts"):
            lines.append(f"| {name} | {m['texts']} | {m['tokens_before']} | {m['tokens_after']} | {m['saving']:.2%} | "
                         f"{m['tokens_per_word_before']:.3f} -> {m['tokens_per_word_after']:.3f} | "
                         f"{m['tokens_per_char_before']:.4f} -> {m['tokens_per_char_after']:.4f} | "
                         f"{m['texts_longer']} |")
    lines += ["", "| id | token | count | old pieces |", "| --- | --- | --- | --- |"]
    lines += [f"| {t['id']} | `{t['token']}` | {t['count']} | {' '.join(f'`{p}`' for p in t['pieces'])} |"
              for t in report["tokens"]]
    return lines
