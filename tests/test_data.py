import json
from pathlib import Path

import pandas as pd
import pytest
from transformers import AutoTokenizer

from mlm_ddp.config import ConfigError, DataConfig
from mlm_ddp.data import EpochBatchSampler, embedded_corpus, load_text, pack_stats, tokenize_and_pack, tokenize_dataset


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


def test_packing_keeps_every_token_in_order(tokenizer) -> None:
    texts = ["The quick brown fox.", "", "jumps over the lazy dog " * 7, None, "end"]
    packed = tokenize_and_pack(texts, tokenizer, block_size=16)
    expected = sum((tokenizer(t)["input_ids"] for t in texts if t), [])
    flat = sum(packed["input_ids"], [])
    assert flat == expected  # nothing dropped, nothing reordered; empty and non-string texts skipped
    lengths = [len(b) for b in packed["input_ids"]]
    assert all(n == 16 for n in lengths[:-1]) and 0 < lengths[-1] <= 16


def test_word_continuation_flags(tokenizer) -> None:
    text = "unbelievably interoperable identifiers"
    packed = tokenize_and_pack([text], tokenizer, block_size=64, with_word_continues=True)
    ids, cont = packed["input_ids"][0], packed["word_continues"][0]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert len(cont) == len(ids)
    for token, flag in zip(tokens, cont, strict=True):
        assert flag == int(token.startswith("##")), (token, flag)


@pytest.mark.parametrize("suffix", [".txt", ".json", ".jsonl", ".csv", ".parquet"])
def test_every_file_format_loads(tmp_path: Path, suffix: str) -> None:
    texts = [f"sentence number {i} of the corpus" for i in range(40)]
    path = tmp_path / f"data{suffix}"
    if suffix == ".txt":
        path.write_text("\n".join(texts))
    elif suffix == ".json":
        path.write_text(json.dumps([{"text": t, "id": i} for i, t in enumerate(texts)]))
    elif suffix == ".jsonl":
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    elif suffix == ".csv":
        pd.DataFrame({"text": texts}).to_csv(path, index=False)
    else:
        pd.DataFrame({"text": texts}).to_parquet(path)
    train, evaluation = load_text(DataConfig(train_file=str(path), validation_split_percentage=10), seed=0)
    assert len(train) + len(evaluation) == 40 and len(evaluation) == 4
    assert set(train["text"]) | set(evaluation["text"]) == set(texts)
    assert not set(train["text"]) & set(evaluation["text"])


def test_streaming_holds_out_the_first_texts(tmp_path: Path) -> None:
    path = tmp_path / "data.txt"
    path.write_text("\n".join(f"line {i}" for i in range(30)))
    train, evaluation = load_text(DataConfig(train_file=str(path), streaming=True, max_eval_samples=5), seed=0)
    assert [r["text"] for r in evaluation] == [f"line {i}" for i in range(5)]
    assert [r["text"] for r in train] == [f"line {i}" for i in range(5, 30)]


def test_bad_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_text(DataConfig(train_file=str(tmp_path / "missing.txt")), seed=0)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="empty.txt: the file is empty"):
        load_text(DataConfig(train_file=str(tmp_path / "empty.txt")), seed=0)
    (tmp_path / "data.xml").write_text("<a/>")
    with pytest.raises(ConfigError, match=r"unknown file extension '\.xml'; use one of .csv, .json"):
        load_text(DataConfig(train_file=str(tmp_path / "data.xml")), seed=0)
    (tmp_path / "data.jsonl").write_text('{"body": "a", "title": "b"}\n' * 3)
    with pytest.raises(ConfigError, match="no text column 'text'; columns found: body, title"):
        load_text(DataConfig(train_file=str(tmp_path / "data.jsonl")), seed=0)


def test_embedded_corpus_is_real_text() -> None:
    texts = embedded_corpus()
    assert len(texts) > 50 and sum(map(len, texts)) > 200_000


def test_map_style_pack_stats(tokenizer, corpus: dict[str, Path]) -> None:
    cfg = DataConfig(train_file=str(corpus["train"]), validation_split_percentage=0, max_seq_length=32)
    train, _ = load_text(cfg, seed=0)
    packed = tokenize_dataset(train, tokenizer, cfg)
    stats = pack_stats(packed, 32)
    expected_tokens = sum(len(tokenizer(t)["input_ids"]) for t in train["text"] if t.strip())
    assert stats.tokens == expected_tokens
    assert stats.short_blocks <= 1  # one tokenization batch of 1000 texts covers the 600 lines
    assert stats.pad_fraction < 0.01


@pytest.mark.parametrize(("n", "batch", "world"), [(10, 2, 1), (10, 2, 2), (11, 3, 2), (7, 1, 4), (5, 4, 3)])
def test_sampler_shards_are_disjoint_and_complete(n: int, batch: int, world: int) -> None:
    samplers = [EpochBatchSampler(n, batch, rank, world, seed=3) for rank in range(world)]
    per_rank = [list(s) for s in samplers]
    assert len({len(b) for b in per_rank}) == 1  # every rank runs the same number of steps
    seen = [i for batches in per_rank for b in batches for i in b]
    assert sorted(set(seen)) == list(range(n))  # the union is the whole data
    assert len(seen) - n == samplers[0].padding < batch * world  # repeats are only the stated padding
    # global batch k of W ranks x B holds the same samples as batch k of 1 rank x W*B
    single = list(EpochBatchSampler(n, batch * world, 0, 1, seed=3))
    for k, big in enumerate(single):
        assert sorted(big) == sorted(i for r in range(world) for i in per_rank[r][k])


def test_sampler_epochs_and_resume() -> None:
    sampler = EpochBatchSampler(20, 3, 0, 1, seed=5)
    epoch0 = list(sampler)
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert epoch0 != epoch1
    sampler.set_epoch(1, start_batch=4)
    assert list(sampler) == epoch1[4:] and len(sampler) == len(epoch1) - 4
    assert list(EpochBatchSampler(20, 3, 0, 1, seed=5)) == epoch0
    assert set(sum(epoch1, [])) == set(range(20))
