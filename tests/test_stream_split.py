"""Which texts a stream holds out and trains on, whatever the number of processes (docs/data.md, "Which
texts a stream holds out"): the rule is per file, so that an elastic resume on another number of
processes never trains on the old held-out set and evaluations of runs on other topologies compare."""

from pathlib import Path

import pytest

from mlm_ddp.config import DataConfig
from mlm_ddp.data.stream import shard_stream
from mlm_ddp.data.text import load_text


def text_files(folder: Path, lines_per_file: list[int]) -> Path:
    """A dataset folder of train-* text files; line j of file i reads "f{i}-{j} ..."."""
    folder.mkdir()
    for i, n in enumerate(lines_per_file):
        name = f"train-{i:05d}-of-{len(lines_per_file):05d}.txt"
        (folder / name).write_text("".join(f"f{i}-{j} some words of text\n" for j in range(n)))
    return folder


def per_file(counts: list[int], start: list[int] | None = None) -> set[str]:
    """The first `counts[i]` texts of file i after its first `start[i]`, by their tags."""
    start = start or [0] * len(counts)
    return {f"f{i}-{j}" for i, (s, n) in enumerate(zip(start, counts, strict=True)) for j in range(s, s + n)}


def ranks_read(ds, world: int) -> list[str]:
    return [row["text"].split()[0] for rank in range(world) for row in shard_stream(ds, rank, world)]


@pytest.mark.parametrize("lines", [[6, 10, 16, 30], [9, 21]])
def test_a_stream_holds_out_and_trains_on_the_same_texts_on_every_topology(tmp_path: Path,
                                                                           lines: list[int]) -> None:
    # files of unequal sizes, counts that do not divide by the files; 2 and 4 processes split 4 files
    # by files, 3 processes (and 2 files on 4) every n-th text: every way shard_stream has
    folder = text_files(tmp_path / "files", lines)
    cfg = DataConfig(dataset_name=str(folder), streaming=True, max_eval_samples=7, max_train_samples=9)
    train, held_out = load_text(cfg, seed=0)
    files = len(lines)
    # datasets' division of a count over shards: n // files each, one more for the first n % files
    share = [7 // files + (i < 7 % files) for i in range(files)]
    trained = [9 // files + (i < 9 % files) for i in range(files)]
    for world in (1, 2, 3, 4):
        evaluated, seen = ranks_read(held_out, world), ranks_read(train, world)
        assert len(evaluated) == len(set(evaluated)) and len(seen) == len(set(seen)), world  # no text twice
        assert set(evaluated) == per_file(share), world
        assert set(seen) == per_file(trained, start=share), world


def test_an_epoch_end_counts_the_texts_of_the_blocks_yielded_not_of_the_chunk_loaded(tmp_path: Path,
                                                                                     tiny_model: Path) -> None:
    # one file over 2 processes: one text in 2 each, one chunk of all of them; rank 1 stops at a fifth of
    # its blocks, as when rank 0's part ran out there. Counting the chunk on loading said "0% unread".
    from transformers import AutoTokenizer

    from mlm_ddp.data.feed import RankRead, StreamEpochEnd, unread_fractions
    from mlm_ddp.data.rank import rank_dataset
    from tests.conftest import corpus_paragraphs

    path = tmp_path / "train.txt"
    path.write_text("\n".join(corpus_paragraphs()[:100]) + "\n")
    cfg = DataConfig(train_file=str(path), streaming=True, validation_split_percentage=0, max_seq_length=32,
                     shuffle_buffer_size=100)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    train, _ = load_text(cfg, seed=0)
    parts = [rank_dataset(train, tokenizer, cfg, rank, 2, shuffle_seed=1) for rank in (0, 1)]
    assert [p.split for p in parts] == ["texts", "texts"]
    for part in parts:  # whole parts: 50 texts each, every text's bytes counted
        part.set_epoch(0)
        assert sum(1 for _ in part) and part.texts_read == 50
    assert parts[0].text_bytes + parts[1].text_bytes == len(path.read_text().replace("\n", "").encode())
    straight = []
    parts[1].set_epoch(0)
    for _ in parts[1]:
        straight.append((parts[1].texts_read, parts[1].text_bytes))
    read = len(straight) // 5
    texts, text_bytes = straight[read - 1]
    assert texts == 50 * read // len(straight), (texts, read, len(straight))  # a fifth of the chunk's texts
    reads = [RankRead(read, True, parts[0].texts_read, parts[0].blocks_read, parts[0].text_bytes),
             RankRead(read, False, texts, read, text_bytes)]
    unread = unread_fractions(reads, "texts")[1]
    assert unread == 1 - texts / 50 and abs(unread - 0.8) < 0.03, unread
    assert (f"rank 1 read {read} micro-batches, {texts} texts, {read} blocks, about {unread:.0%} of its part "
            "unread") in StreamEpochEnd(0, read, reads, "texts").describe(dropped_so_far=0)
    # the counts are no part of where a resume starts: resumed half-way, it counts as the straight read did
    stopped = rank_dataset(train, tokenizer, cfg, 1, 2, shuffle_seed=1)
    stopped.set_epoch(0)
    for _ in zip(range(read // 2), stopped, strict=False):
        pass
    resumed = rank_dataset(train, tokenizer, cfg, 1, 2, shuffle_seed=1)
    resumed.load_state_dict(stopped.state_dict())
    again = [(resumed.texts_read, resumed.text_bytes) for _ in resumed]
    assert again == straight[read // 2:]


@pytest.mark.parametrize("world", [1, 2])
def test_a_file_left_no_text_to_train_on_is_one_line_naming_it_and_the_flag(tmp_path: Path, tiny_model: Path,
                                                                           world: int) -> None:
    # the audit's case: files of 10 and 50 lines, 20 texts held out, the first 10 of each: the first file is
    # all held out. On 2 processes it was rank 0's whole part, and joining it raised a bare StopIteration.
    from transformers import AutoTokenizer

    from mlm_ddp.data.rank import rank_dataset
    from mlm_ddp.errors import BadInput

    folder = text_files(tmp_path / "files", [10, 50])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    for flags, says in (({"max_eval_samples": 20}, "it holds 10 texts or fewer, and the first 10 texts of each file "
                                                   "are held out (--max_eval_samples 20, divided over 2 files)"),
                        ({"validation_split_percentage": 0, "max_train_samples": 1},
                         "--max_train_samples 1 is divided over the stream's 2 files and leaves it none")):
        cfg = DataConfig(dataset_name=str(folder), streaming=True, **flags)
        train, _ = load_text(cfg, seed=0)
        empty = folder / ("train-00000-of-00002.txt" if "max_eval_samples" in flags else "train-00001-of-00002.txt")
        refused = 0
        for rank in range(world):
            try:
                rank_dataset(train, tokenizer, cfg, rank, world, shuffle_seed=1)
            except BadInput as err:
                assert str(err).startswith(f"--streaming: file {empty} gives no text to train on: {says}"), err
                assert "\n" not in str(err)
                refused += 1
        assert refused == 1  # the rank that reads that file (every rank, where all read every file)


def test_a_stream_checkpoint_of_the_earlier_layout_goes_on_at_the_next_epoch(tmp_path: Path, tiny_model: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    # before the rule above, one process read a stream as one: its saved datasets state does not load into
    # the files read one by one (a KeyError deep in datasets, measured on a real checkpoint of that version).
    # Such a position has no `layout`: the run goes on at the next epoch, as an elastic resume does, and says so
    import json
    import shutil

    from mlm_ddp.config import parse_args
    from mlm_ddp.train import train
    from tests.conftest import read_metrics

    folder = text_files(tmp_path / "files", [40, 60])
    common = ["--model_name_or_path", str(tiny_model), "--dataset_name", str(folder), "--streaming",
              "--shuffle_buffer_size", "8", "--max_seq_length", "32", "--per_device_train_batch_size", "4",
              "--max_eval_samples", "8", "--max_train_steps", "6", "--checkpointing_steps", "3", "--mixed_precision",
              "no", "--peak_tflops", "0.1", "--num_warmup_steps", "0"]
    train(parse_args([*common, "--output_dir", str(tmp_path / "first")]))
    older = tmp_path / "older" / "checkpoints" / "step-0000003"
    shutil.copytree(tmp_path / "first" / "checkpoints" / "step-0000003", older)
    state = json.loads((older / "data_state_0.json").read_text())
    assert state["layout"] == 2 and state["source"] is not None
    (older / "data_state_0.json").write_text(json.dumps({k: v for k, v in state.items() if k != "layout"}))
    with caplog.at_level("INFO"):
        train(parse_args([*common, "--output_dir", str(tmp_path / "older"), "--resume_from_checkpoint", "latest"]))
    assert "step-0000003 was written by an earlier mlm_ddp, which read a stream as one" in caplog.text
    assert "training goes on at the start of epoch 1; the rest of epoch 0 is skipped" in caplog.text
    assert all(r["epoch"] >= 1 for r in read_metrics(tmp_path / "older") if r.get("step", 0) > 3 and "loss" in r)
