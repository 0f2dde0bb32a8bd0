"""datasets's names that are not its public API, which mlm_ddp reaches (see mlm_ddp/compat/__init__.py).

A stream (`datasets.IterableDataset`) keeps its pipeline as a chain of examples iterables in
`_ex_iterable`, each wrapping the next in `ex_iterable`; the chain ends in the iterable of the builder's
generator, whose `kwargs` are the builder's generator keywords. datasets has no public accessor for the
files behind a stream's shards (`shard_files`) nor for the skip/take counts applied to it (`skip_take`).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from mlm_ddp.compat import Reach

# the file builders mlm_ddp streams text from (--train_file's .txt, .json/.jsonl, .csv), each keeping its files
# as the generator keyword `base_files`: datasets.packaged_modules.<name>.<name>.<Builder>
FILE_BUILDERS = {"text": "Text", "json": "Json", "csv": "Csv"}


def examples_iterable(ds: Any) -> Any:
    """The head of a stream's chain of examples iterables."""
    return ds._ex_iterable


def chain_end(ds: Any) -> Any:
    """The last examples iterable of a stream's chain that keeps generator keywords (`kwargs`), below any
    skip/take wrappers; the last one of the chain where none does."""
    ex_iterable = examples_iterable(ds)
    while not hasattr(ex_iterable, "kwargs") and hasattr(ex_iterable, "ex_iterable"):
        ex_iterable = ex_iterable.ex_iterable
    return ex_iterable


def shard_files(ds: Any) -> list[str] | None:
    """The file behind each shard of a stream loaded from files (one file per shard), else None.

    datasets' file builders keep the shard files in their generator keywords, `base_files`, at the end of
    the chain under any skip/take wrappers. Anything else (an in-memory table, a parquet stream) gives None.
    """
    files = getattr(chain_end(ds), "kwargs", {}).get("base_files")
    if not isinstance(files, list) or len(files) != ds.num_shards:
        return None
    if not all(isinstance(f, str) for f in files):
        return None
    return files


def skip_take(ds: Any) -> tuple[int, int | None]:
    """(texts skipped, texts taken; None: no take) by the skips and takes of a stream (a single shard's:
    the counts datasets gave it of the whole stream's)."""
    from datasets import iterable_dataset

    skipped, taken = 0, None
    ex_iterable = examples_iterable(ds)
    while ex_iterable is not None:
        if isinstance(ex_iterable, iterable_dataset.SkipExamplesIterable):
            skipped += ex_iterable.n
        elif isinstance(ex_iterable, iterable_dataset.TakeExamplesIterable):
            taken = ex_iterable.n if taken is None else min(taken, ex_iterable.n)
        ex_iterable = getattr(ex_iterable, "ex_iterable", None)
    return skipped, taken


def with_features(ds: Any) -> Any:
    """The stream with its features known, read from its first row where it has none (datasets' own
    inference, the one it runs when it joins streams)."""
    return ds._resolve_features()


# datasets' warning, at the first read after `load_state_dict`, that a shuffle buffer's content is not in a state
# dict; it comes from the logger of its module `datasets.iterable_dataset` (under another name it is only shown)
SHUFFLE_STATE_WARNING = "Loading a state dict of a shuffle buffer"


def _not_the_shuffle_state_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(SHUFFLE_STATE_WARNING)


def load_stream_state(ds: Any, state: dict[str, Any]) -> None:
    """`ds.load_state_dict(state)`, without datasets' warning that the shuffle buffer's content is lost:
    mlm_ddp's one-text buffer is empty between reads (`resumes_exactly`), so there is nothing to lose."""
    quiet = logging.getLogger("datasets.iterable_dataset")
    if _not_the_shuffle_state_warning not in quiet.filters:
        quiet.addFilter(_not_the_shuffle_state_warning)
    ds.load_state_dict(state)


def arrow_writer(features: Any, path: str) -> Any:
    """datasets' writer of an Arrow stream file of `features` at `path`, the format `Dataset.from_file` maps
    (`write_table(table)`, then `finalize()` and `close()`)."""
    from datasets import arrow_writer as module

    return module.ArrowWriter(features=features, path=path)


# ---------------------------------------------------------------------------------------------
# the feature checks, each on a tiny stream of its own, in memory (nothing read from or written to the disk)


def _tiny_stream(rows: int = 3) -> Any:
    """A stream of two shards of `rows` rows each, from a table in memory."""
    from datasets import Dataset

    return Dataset.from_dict({"i": list(range(2 * rows))}).to_iterable_dataset(num_shards=2)


def _same(row: dict[str, Any]) -> dict[str, Any]:
    return row


def _has_examples_iterable() -> bool:
    return examples_iterable(_tiny_stream()) is not None


def _keeps_base_files() -> bool:
    """The file builders name their files `base_files` among their generator keywords, and the end of a
    stream's chain keeps its generator keywords as `kwargs`, where `shard_files` looks."""
    import importlib

    for name, builder in FILE_BUILDERS.items():
        module = importlib.import_module(f"datasets.packaged_modules.{name}.{name}")
        if "base_files" not in inspect.signature(getattr(module, builder)._generate_shards).parameters:
            return False
    return isinstance(getattr(chain_end(_tiny_stream()), "kwargs", None), dict)


def _counts(name: str, cut: str) -> bool:
    """`ds.skip(2)` / `ds.take(2)` is an examples iterable of class `name` whose `n` is 2, over the stream's."""
    from datasets import iterable_dataset

    ds = _tiny_stream()
    cls = getattr(iterable_dataset, name)
    wrapped = examples_iterable(getattr(ds, cut)(2))
    return isinstance(wrapped, cls) and wrapped.n == 2 and wrapped.ex_iterable is examples_iterable(ds)


def _resolves_features() -> bool:
    """A stream whose features a `map` made unknown has them read from its first row."""
    ds = _tiny_stream().map(_same)
    return ds.features is None and list(with_features(ds).features or []) == ["i"]


def _writes_arrow() -> bool:
    from datasets import arrow_writer as module

    writer = module.ArrowWriter
    return {"features", "path"} <= set(inspect.signature(writer).parameters) and all(
        callable(getattr(writer, method, None)) for method in ("write_table", "finalize", "close"))


def resumes_exactly(rows: int = 5) -> bool:
    """A stream shuffled with a one-text buffer, stopped after any text, resumes from its `state_dict()` at
    the next text: the buffer holds nothing between reads (datasets 5.1 and later; earlier releases keep one
    more text there, which every resume skips). Tried at every position of two shards of `rows` texts (on
    datasets 5.0.1 a table in memory resumes right at its first two positions, and wrong from the third)."""
    def shuffled() -> Any:
        ds = _tiny_stream(rows).shuffle(seed=0, buffer_size=1)
        ds.set_epoch(1)
        return ds

    whole = shuffled()
    texts = iter(whole)
    next(texts)
    for _ in range(2 * rows - 1):
        state = whole.state_dict()
        expected = next(texts)
        resumed = shuffled()
        load_stream_state(resumed, state)
        if next(iter(resumed), None) != expected:
            return False
    return True


REACHES: list[Reach] = [
    Reach("datasets", "datasets.IterableDataset._ex_iterable", _has_examples_iterable,
          "the files behind a stream's shards and the skip/take counts given to each shard"),
    Reach("datasets", "base_files in a file stream's examples iterable (datasets.IterableDataset._ex_iterable)",
          _keeps_base_files, "the files behind a --streaming run's shards, split over the ranks by their bytes"),
    Reach("datasets", "datasets.iterable_dataset.SkipExamplesIterable", lambda: _counts("SkipExamplesIterable", "skip"),
          "the texts a stream's shard holds out, named when a shard gives no text to train on"),
    Reach("datasets", "datasets.iterable_dataset.TakeExamplesIterable", lambda: _counts("TakeExamplesIterable", "take"),
          "the --max_train_samples share of a stream's shard, named when it gives no text to train on"),
    Reach("datasets", "datasets.IterableDataset._resolve_features", _resolves_features,
          "a stream's features read once from its first text before it is split into single shards"),
    Reach("datasets", "datasets.arrow_writer.ArrowWriter", _writes_arrow,
          "mlm_ddp.prepare's shards, written as the Arrow files `Dataset.from_file` maps"),
    Reach("datasets", "empty one-text shuffle buffer between reads (datasets.IterableDataset.shuffle with "
          "buffer_size=1)", resumes_exactly, "a --streaming run resumed mid-epoch at the text it stopped before"),
]
