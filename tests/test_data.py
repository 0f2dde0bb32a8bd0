import itertools
import json
import random
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from mlm_ddp.config import DataConfig
from mlm_ddp.data.epochs import EpochBatchSampler, train_loader
from mlm_ddp.data.feed import RankRead, StreamEpochEnd, TrainFeed, unread_fractions
from mlm_ddp.data.pack import pack_stats, tokenize_and_pack, tokenize_dataset
from mlm_ddp.data.rank import rank_dataset
from mlm_ddp.data.stream import PackedStream, balance_shards, naive_shards, plan_stream_split, shard_sizes, shard_stream
from mlm_ddp.data.text import embedded_corpus, load_text
from mlm_ddp.errors import BadInput
from tests.conftest import REPO, corpus_paragraphs


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
    with pytest.raises(BadInput, match="no such file"):
        load_text(DataConfig(train_file=str(tmp_path / "missing.txt")), seed=0)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(BadInput, match="empty.txt: the file is empty"):
        load_text(DataConfig(train_file=str(tmp_path / "empty.txt")), seed=0)
    (tmp_path / "blank.jsonl").write_text("\n\n  \r\n")
    with pytest.raises(BadInput, match="--train_file .*blank.jsonl: the file holds only blank lines, no text"):
        load_text(DataConfig(train_file=str(tmp_path / "blank.jsonl")), seed=0)
    (tmp_path / "data.xml").write_text("<a/>")
    with pytest.raises(BadInput, match=r"unknown file extension '\.xml'; use one of .csv, .json"):
        load_text(DataConfig(train_file=str(tmp_path / "data.xml")), seed=0)
    (tmp_path / "data.jsonl").write_text('{"body": "a", "title": "b"}\n' * 3)
    with pytest.raises(BadInput, match="no text column 'text'; columns found: body, title"):
        load_text(DataConfig(train_file=str(tmp_path / "data.jsonl")), seed=0)


def test_only_blank_reads_to_the_first_text_byte(tmp_path: Path) -> None:
    """Generated files of whitespace, with and without one printable byte anywhere (chunk edges included)."""
    from mlm_ddp.data.text import only_blank

    rng = random.Random(0)
    for case in range(200):
        blank = "".join(rng.choice(" \t\n\r\x0b\x0c") for _ in range(rng.randint(1, 40)))
        path = tmp_path / f"{case}.txt"
        path.write_text(blank)
        assert only_blank(path, chunk=rng.randint(1, 8)), repr(blank)
        at = rng.randint(0, len(blank))
        path.write_text(blank[:at] + rng.choice("a.é0") + blank[at:])
        assert not only_blank(path, chunk=rng.randint(1, 8)), (blank, at)


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


def epoch_batches(sampler: EpochBatchSampler, epochs: int = 1) -> list[list[int]]:
    """The first `epochs` epochs of a sampler (it runs without end) when its micro-batches divide them."""
    return list(itertools.islice(sampler, int(sampler.batches_per_epoch * epochs)))


@pytest.mark.parametrize(("n", "batch", "world"), [(10, 2, 1), (10, 2, 2), (11, 3, 2), (7, 1, 4), (5, 4, 3)])
def test_sampler_shards_are_disjoint_and_complete(n: int, batch: int, world: int) -> None:
    samplers = [EpochBatchSampler(n, batch, rank, world, seed=3) for rank in range(world)]
    per_rank = [epoch_batches(s) for s in samplers]
    seen = [i for batches in per_rank for b in batches for i in b]
    assert sorted(set(seen)) == list(range(n))  # the union is the whole data (keys of epoch 0 are blocks)
    assert len(seen) - n == samplers[0].padding < batch * world  # repeats are only the stated padding
    # global batch k of W ranks x B holds the same samples as batch k of 1 rank x W*B
    single = epoch_batches(EpochBatchSampler(n, batch * world, 0, 1, seed=3))
    for k, big in enumerate(single):
        assert sorted(big) == sorted(i for r in range(world) for i in per_rank[r][k])


def test_sampler_epochs_and_resume() -> None:
    sampler = EpochBatchSampler(20, 3, 0, 1, seed=5)
    epoch0, epoch1 = (batches := epoch_batches(sampler, 2))[:7], batches[7:]
    assert [k for b in epoch1 for k in b] != [k + 20 for b in epoch0 for k in b]
    assert {k // 20 for b in epoch1 for k in b} == {1} and {k % 20 for b in epoch1 for k in b} == set(range(20))
    sampler.seek(7 * 3 + 4 * 3)  # epoch 1, micro-batch 4
    assert list(itertools.islice(sampler, 3)) == epoch1[4:]
    assert epoch_batches(EpochBatchSampler(20, 3, 0, 1, seed=5)) == epoch0


def step_blocks(n: int, batch: int, world: int, accumulation: int, layout: int, start_step: int,
                steps: int) -> list[list[int]]:
    """The keys (epoch x n + block) each optimizer step reads, all ranks together, from `start_step` on."""
    samplers = [EpochBatchSampler(n, batch, rank, world, seed=11, layout_batch=layout) for rank in range(world)]
    for sampler in samplers:
        sampler.seek(start_step * batch * world * accumulation)
    streams = [iter(s) for s in samplers]
    return [sorted(k for _ in range(accumulation) for it in streams for k in next(it)) for _ in range(steps)]


@pytest.mark.parametrize("n", [1, 7, 24, 37])
def test_every_split_of_a_global_batch_reads_the_same_blocks_each_step(n: int) -> None:
    # the property behind resuming on another number of processes: laid out for the first run's
    # micro-batch, every (per-device batch, processes, accumulation) with the same product reads the
    # same blocks in every optimizer step, across epoch ends and from any step on
    global_batch = 12
    splits = [(b, w, global_batch // (b * w)) for b in (1, 2, 3, 4, 6, 12) for w in (1, 2, 3, 4)
              if global_batch % (b * w) == 0]
    assert len(splits) > 10
    for first in splits:
        layout = first[0] * first[1]
        straight = step_blocks(n, *first, layout, 0, 9)
        for resumed in splits:
            assert step_blocks(n, *resumed, layout, 4, 5) == straight[4:], (first, resumed)


# --- stream epochs: too small for a step, balanced shards, what is left unread -----------------------


def _livelock_guard(limit: int = 100):
    """any_rank for one process that fails the test instead of spinning forever in next_window."""
    calls = 0

    def any_rank(flag: bool) -> bool:
        nonlocal calls
        calls += 1
        assert calls <= limit, f"next_window made {calls} collectives without returning or raising: a livelock"
        return flag

    return any_rank


def test_a_stream_too_small_for_one_step_raises_instead_of_looping() -> None:
    # 3 micro-batches of 1 block per epoch, 4 per optimizer step: no epoch can ever train a step
    stream = Dataset.from_dict({"id": [0, 1, 2]}).to_iterable_dataset()
    loader = train_loader(stream, lambda rows: [r["id"] for r in rows], 1, 0, 1, seed=0, num_workers=0)
    feed = TrainFeed(loader, None, accumulation=4, epoch=0, start=0, any_rank=_livelock_guard())
    with pytest.raises(BadInput) as raised:
        feed.next_window()
    message = str(raised.value)
    for part in ("epoch 0 gave rank 0: 3 micro-batch(es)", "--per_device_train_batch_size 1",
                 "--gradient_accumulation_steps 4", "with 1 process(es)", "--gradient_accumulation_steps 3 or less",
                 "fewer processes", "more text"):
        assert part in message, message


def test_a_map_style_epoch_shorter_than_a_step_still_trains() -> None:
    # the map-style neighbour: windows run across epoch ends, as in one process; nothing to raise
    table = Dataset.from_dict({"id": [0, 1, 2]})
    loader = train_loader(table, lambda rows: [r["id"] for r in rows], 1, 0, 1, seed=0, num_workers=0)
    feed = TrainFeed(loader, None, accumulation=4, epoch=0, start=0, any_rank=_livelock_guard())
    windows = [feed.next_window() for _ in range(3)]
    assert [len(w) for w in windows] == [4, 4, 4] and (feed.epoch, feed.index) == (4, 0)
    assert sorted(i for w in windows for b in w for i in b) == sorted([0, 1, 2] * 4)


def test_balanced_shards_assign_every_file_once_and_never_worse_than_datasets() -> None:
    rng = np.random.default_rng(0)
    for _ in range(400):
        world = int(rng.integers(1, 6))
        n = world * int(rng.integers(1, 6))
        sizes = [int(s) for s in rng.choice([1, 10, 1000], size=n) * rng.integers(1, 100, size=n)]
        parts = balance_shards(sizes, world)
        assert sorted(i for part in parts for i in part) == list(range(n))  # each file exactly once
        assert {len(part) for part in parts} == {n // world}  # equal shard counts per rank
        totals = [sum(sizes[i] for i in p) for p in parts]
        naive = [sum(sizes[i] for i in p) for p in naive_shards(n, world)]
        assert max(totals) <= max(naive)
    # the case the rule is for: a 1 GB file beside a 100 MB one, dealt by position to one rank each
    sizes = [1000, 900, 100, 50]
    assert naive_shards(4, 2) == [[0, 2], [1, 3]] and balance_shards(sizes, 2) == [[0, 3], [1, 2]]
    with pytest.raises(ValueError, match="do not divide"):
        balance_shards([1, 2, 3], 2)


def write_files(folder: Path, paragraphs_per_file: list[int]) -> Path:
    """A dataset folder of JSON-lines files holding these numbers of (distinct) paragraphs."""
    paragraphs = corpus_paragraphs()
    folder.mkdir()
    start = 0
    for i, n in enumerate(paragraphs_per_file):
        lines = [json.dumps({"text": p}) + "\n" for p in paragraphs[start : start + n]]
        (folder / f"part{i}.jsonl").write_text("".join(lines))
        start += n
    return folder


@pytest.fixture
def unequal_files(tmp_path: Path) -> Path:
    return write_files(tmp_path / "unequal", [60, 6, 40, 20])


def test_stream_files_are_balanced_by_size_disjoint_and_complete(unequal_files: Path) -> None:
    cfg = DataConfig(dataset_name=str(unequal_files), streaming=True, max_eval_samples=8)
    train, held_out = load_text(cfg, seed=0)
    sizes = [(unequal_files / f"part{i}.jsonl").stat().st_size for i in range(4)]
    assert shard_sizes(train) == sizes
    split = plan_stream_split(train, 2)
    assert split.kind == "files" and split.shards == balance_shards(sizes, 2) == [[0, 1], [2, 3]]
    assert split.part_bytes == [sizes[0] + sizes[1], sizes[2] + sizes[3]]
    assert max(split.part_bytes) < max(split.naive_bytes)  # dealt by position: 60 + 40 paragraphs on rank 0
    note = split.note()
    assert "files balanced by size, parts of" in note and f"{sizes[0] + sizes[1]} B" in note
    assert f"the largest part would be {sizes[0] + sizes[2]} B" in note
    for epoch in (0, 1):  # the same files every epoch; train and held-out texts never overlap
        seen, held = [], []
        for rank in (0, 1):
            part = shard_stream(train, rank, 2).shuffle(seed=3, buffer_size=1)
            part.set_epoch(epoch)
            seen.append([r["text"] for r in part])
            held += [r["text"] for r in shard_stream(held_out, rank, 2)]
        assert len(held) == 8 and not set(held) & set(seen[0] + seen[1])
        assert sorted(seen[0] + seen[1] + held) == sorted(corpus_paragraphs()[:126])  # disjoint and complete
        texts_of = [{json.loads(line)["text"] for line in (unequal_files / f"part{i}.jsonl").open()}
                    for i in range(4)]
        assert set(seen[0]) <= texts_of[0] | texts_of[1] and set(seen[1]) <= texts_of[2] | texts_of[3]


def test_what_an_epoch_end_leaves_unread_is_estimated_from_file_sizes(tmp_path: Path, tokenizer) -> None:
    # files no balancing can even out: the part with the big file is read as far as the other part
    # goes (as TrainFeed reads them), and the estimate of what it left must be close to what remained
    folder = write_files(tmp_path / "lopsided", [60, 6, 10, 6])
    cfg = DataConfig(dataset_name=str(folder), streaming=True, validation_split_percentage=0,
                     max_seq_length=32, shuffle_buffer_size=4)
    train, _ = load_text(cfg, seed=0)
    parts = [rank_dataset(train, tokenizer, cfg, rank, 2, shuffle_seed=1) for rank in (0, 1)]
    assert [p.split for p in parts] == ["files", "files"]
    whole = [sum(1 for _ in p) for p in parts]
    whole_bytes = [p.text_bytes for p in parts]
    short = int(np.argmin(whole))
    reads = []
    for rank, part in enumerate(parts):
        part.set_epoch(0)
        for _ in itertools.islice(iter(part), whole[short]):
            pass
        reads.append(RankRead(-(-part.blocks_read // 8), rank == short, part.texts_read, part.blocks_read,
                              part.text_bytes, part.part_bytes))
    long = 1 - short
    estimate = unread_fractions(reads, "files")
    truth = 1 - reads[long].text_bytes / whole_bytes[long]
    assert estimate[short] == 0.0 and 0.05 < truth and abs(estimate[long] - truth) < 0.05, (estimate, truth)
    line = StreamEpochEnd(0, 3, reads, "files").describe(dropped_so_far=1)
    assert line.startswith(f"epoch 0 of the stream ended on every rank after 3 micro-batches, when rank {short}'s "
                           "part ran out (micro-batches of partial steps dropped so far, rank 0: 1); ")
    assert (f"rank {long} read {reads[long].micro_batches} micro-batches, {reads[long].texts} texts, "
            f"{reads[long].blocks} blocks, about {estimate[long]:.0%} of its part unread") in line
    assert (f"rank {short} read {reads[short].micro_batches} micro-batches, {reads[short].texts} texts, "
            f"{reads[short].blocks} blocks, all of its part") in line


def test_a_balanced_file_part_resumes_exactly_and_counts_on(unequal_files: Path, tokenizer) -> None:
    # the joined files of one rank resume from a saved position like one file does: the same blocks follow,
    # and the epoch's counts go on from where they were
    cfg = DataConfig(dataset_name=str(unequal_files), streaming=True, validation_split_percentage=0,
                     max_seq_length=32, shuffle_buffer_size=4)
    train, _ = load_text(cfg, seed=0)

    def part() -> PackedStream:
        return rank_dataset(train, tokenizer, cfg, 1, 2, shuffle_seed=5)

    straight = part()
    straight.set_epoch(1)
    blocks = [b["input_ids"] for b in straight]
    counts = (straight.texts_read, straight.text_bytes, straight.blocks_read)
    first = part()
    first.set_epoch(1)
    for _ in zip(range(23), first, strict=False):
        pass
    resumed = part()
    resumed.load_state_dict(first.state_dict())
    assert [b["input_ids"] for b in resumed] == blocks[23:]
    assert (resumed.texts_read, resumed.text_bytes, resumed.blocks_read) == counts == (60, counts[1], len(blocks))


def test_the_datasets_floor_is_where_a_one_text_shuffle_buffer_resumes_exactly(tmp_path: Path) -> None:
    """PackedStream's exact resume rests on this property of `datasets` (false before 5.1, where each
    resume skipped one text): checked on the installed version, for in-memory and file streams, at
    positions inside and across shards, and pinned in pyproject."""
    import re

    from datasets import load_dataset

    from mlm_ddp.data.stream import STREAM_RESUME_DATASETS, check_stream_resume

    files = []
    for i, lines in enumerate((20, 30, 25)):
        files.append(tmp_path / f"part{i}.txt")
        files[-1].write_text("".join(f"f{i}-{j}\n" for j in range(lines)))
    sources = {
        "memory": lambda: Dataset.from_dict({"text": [f"t{i}" for i in range(120)]}).to_iterable_dataset(num_shards=4),
        "files": lambda: load_dataset("text", data_files=[str(f) for f in files], split="train", streaming=True),
    }
    for name, make in sources.items():
        for epoch in (0, 2):
            def stream(make=make, epoch=epoch):
                ds = make().shuffle(seed=1, buffer_size=1)
                ds.set_epoch(epoch)
                return ds
            whole = [row["text"] for row in stream()]
            for k in (1, 19, 20, 21, 50, len(whole) - 1):
                first = stream()
                rows = iter(first)
                head = [next(rows)["text"] for _ in range(k)]
                resumed = stream()
                resumed.load_state_dict(first.state_dict())
                assert head + [row["text"] for row in resumed] == whole, (name, epoch, k)
    floor = re.search(r'^\s*"datasets>=([\d.]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert floor is not None and floor.group(1) == ".".join(map(str, STREAM_RESUME_DATASETS))
    with pytest.raises(BadInput, match=r"needs datasets >= 5.1 \(installed: 5.0.1\)"):
        check_stream_resume("5.0.1")
    check_stream_resume("5.1.0")
