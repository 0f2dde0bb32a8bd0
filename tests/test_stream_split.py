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
