"""Raw texts in: local files by suffix, `datasets` names (map-style or streaming), or the embedded
corpus when neither is given; the text column checked before anything is tokenized.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict, load_dataset
from datasets.exceptions import DatasetGenerationError

from mlm_ddp.config import DataConfig
from mlm_ddp.config.mixture import unique_names
from mlm_ddp.errors import BadInput

SUFFIX_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
EMBEDDED_CORPUS = "python-docs"
STREAM_EVAL_TEXTS = 1000  # texts held out from a stream without a validation file
AnyDataset = Dataset | IterableDataset


def embedded_corpus() -> list[str]:
    """The offline default corpus: Python's own reference documentation, one text per topic.

    It ships inside every CPython (pydoc_data.topics, ~465k characters, ~128k BERT tokens in 3.11):
    real English prose about a subject every user knows, present without any download.
    """
    from pydoc_data.topics import topics

    return [topics[key].strip() for key in sorted(topics)]


def _builder_for(path_str: str, flag: str) -> str:
    path = Path(path_str)
    if path.is_dir():  # datasets would read its files as one corpus, split by its own patterns: a mixture's sources
        hint = (f", or prepare the folder (python -m mlm_ddp.prepare --train_file {path}) and train with "
                "--prepared_data" if flag == "--train_file" else "")
        raise BadInput(f"{flag} {path}: is a folder, not a file; give one of its files{hint}")
    suffix = path.suffix.lower()
    if suffix not in SUFFIX_BUILDERS:
        raise BadInput(
            f"{flag} {path}: unknown file extension {suffix or '(none)'!r}; use one of "
            f"{', '.join(sorted(SUFFIX_BUILDERS))}"
        )
    if not path.is_file():
        raise BadInput(f"{flag} {path}: no such file")
    if path.stat().st_size == 0:
        raise BadInput(f"{flag} {path}: the file is empty")
    if SUFFIX_BUILDERS[suffix] != "parquet" and only_blank(path):
        raise BadInput(f"{flag} {path}: the file holds only blank lines, no text")
    return SUFFIX_BUILDERS[suffix]


def only_blank(path: str | Path, chunk: int = 1 << 20) -> bool:
    """Whether a text, JSON or CSV file holds nothing but whitespace: no record to read. Reads up to its first
    byte that is not whitespace, so a file with text costs one small read."""
    with open(path, "rb") as f:
        while block := f.read(chunk):
            if not block.isspace():
                return False
    return True


def check_columns(columns: list[str] | None, text_column: str, source: str, flag: str = "--text_column") -> None:
    if columns is not None and text_column not in columns:
        raise BadInput(
            f"{source}: no text column {text_column!r}; columns found: {', '.join(columns)}. "
            f"Pass {flag} with one of them."
        )


def first_row(ds: IterableDataset, source: str) -> dict[str, Any]:
    """A stream's first example: its columns and their values (it also proves the stream is not empty)."""
    try:
        return next(iter(ds))
    except StopIteration:
        raise BadInput(f"{source}: holds no texts") from None


STRINGS = ("string", "large_string")


def check_text_column(ds: AnyDataset, column: str, source: str, first: dict[str, Any] | None = None) -> None:
    """The text column holds text: numbers or lists would tokenize to nothing and "pack into zero blocks".
    A stream without known features is judged by its `first` row."""
    features = ds.features if ds.features is not None else None
    if features is not None and column in features:
        feature = features[column]
        kind = getattr(feature, "dtype", type(feature).__name__)
        if kind in STRINGS or kind == "null":  # null: every value missing, which "holds no texts" names
            return
        texts = [name for name, f in features.items() if getattr(f, "dtype", None) in STRINGS]
    else:
        value = (first or {}).get(column)
        if value is None or isinstance(value, str):
            return
        kind = type(value).__name__
        texts = [name for name, v in (first or {}).items() if isinstance(v, str)]
    raise BadInput(f"{source}: column {column!r} holds {kind} values, not text; pass --text_column with a column "
                   f"of text ({', '.join(texts) if texts else 'it has none'})")


def load_text(cfg: DataConfig, seed: int) -> tuple[AnyDataset, AnyDataset | dict[str, AnyDataset] | None]:
    """(train, eval) raw text datasets, each with the text in `cfg.text_column`.

    eval is None only when there is no validation set and validation_split_percentage is 0; with several
    --validation_file sources it is {name: dataset} (`source_names`), in the order given.
    """
    if cfg.prepared_data is not None:
        raise BadInput(f"--prepared_data {cfg.prepared_data} holds token ids, not text; give the text it was "
                       "prepared from (--train_file)")
    if cfg.train_file is None and cfg.dataset_name is None:
        if cfg.validation_file is not None:  # it was once ignored here, silently
            raise BadInput("--validation_file goes with --train_file: the embedded corpus holds its own texts out")
        texts = [t for t in embedded_corpus() if t]
        raw: Any = Dataset.from_dict({cfg.text_column: texts})
        if cfg.streaming:
            raw = raw.to_iterable_dataset(num_shards=8)
        splits = {"train": raw}
        source = f"embedded corpus {EMBEDDED_CORPUS!r}"
    elif cfg.train_file is not None:
        train_file = cfg.train_file[0]  # one source (several: data.mixture, which loads each this way)
        data_files = {"train": train_file}
        builder = _builder_for(train_file, "--train_file")
        source_names(cfg.validation_file or [])  # one file given twice is refused before anything is read
        for split, path in zip(eval_splits(cfg.validation_file), cfg.validation_file or [], strict=False):
            if _builder_for(path, "--validation_file") != builder:
                raise BadInput(f"--train_file {train_file} and --validation_file {path} must have the same format")
            data_files[split] = path
        splits = _load(builder, None, data_files, cfg.streaming, f"--train_file {train_file}")
        source = train_file
    else:
        splits = _load(cfg.dataset_name, cfg.dataset_config_name, None, cfg.streaming,
                       f"--dataset_name {cfg.dataset_name}")
        source = f"dataset {cfg.dataset_name!r}"
        if "train" not in splits:
            raise BadInput(f"{source} has no 'train' split; splits found: {', '.join(splits)}")
        if cfg.validation_file is not None:
            raise BadInput("--validation_file goes with --train_file, not with --dataset_name")

    train = splits["train"]
    files = cfg.validation_file or [f"{source} (validation)"]
    held_out = [(where, splits[split]) for split, where in zip(eval_splits(files), files, strict=True)
                if split in splits]
    for where, ds in ((source, train), *held_out):
        if isinstance(ds, IterableDataset):
            first = first_row(ds, where)
            check_columns(list(first), cfg.text_column, where)
            check_text_column(ds, cfg.text_column, where, first)
        else:
            check_columns(ds.column_names, cfg.text_column, where)
            if len(ds) == 0:
                raise BadInput(f"{where}: holds no texts")
            check_text_column(ds, cfg.text_column, where)
    evaluation = splits.get("validation")
    if len(held_out) > 1:  # several sources, each evaluated apart (evaluation.py), by name
        evaluation = dict(zip(source_names(files), (ds for _, ds in held_out), strict=True))

    if evaluation is None and cfg.validation_split_percentage > 0:
        if isinstance(train, IterableDataset):
            n_eval = cfg.max_eval_samples or STREAM_EVAL_TEXTS
            train, evaluation = train.skip(n_eval), train.take(n_eval)
        else:
            if len(train) < 2:
                raise BadInput(f"{source}: needs at least 2 texts to hold some out for evaluation")
            parts = train.train_test_split(
                test_size=cfg.validation_split_percentage / 100.0, shuffle=True, seed=seed
            )
            train, evaluation = parts["train"], parts["test"]
    if isinstance(train, IterableDataset):  # a stream's sequences are only known once read: count texts
        if cfg.max_train_samples is not None:
            train = train.take(cfg.max_train_samples)
        if isinstance(evaluation, dict) and cfg.max_eval_samples is not None:
            evaluation = {name: ds.take(cfg.max_eval_samples) for name, ds in evaluation.items()}
        elif evaluation is not None and cfg.max_eval_samples is not None:
            evaluation = evaluation.take(cfg.max_eval_samples)
    return train, evaluation


def load_held_out(cfg: DataConfig) -> AnyDataset | dict[str, AnyDataset]:
    """The --validation_file sources loaded on their own, each by its own suffix (a mixture's training sources
    may differ in format): one dataset, or {name: dataset} for several (`source_names`)."""
    loaded = {}
    for name, path in zip(source_names(cfg.validation_file), cfg.validation_file, strict=True):
        ds = _load(_builder_for(path, "--validation_file"), None, {"validation": path}, False,
                   f"--validation_file {path}")["validation"]
        check_columns(ds.column_names, cfg.text_column, path)
        if len(ds) == 0:
            raise BadInput(f"--validation_file {path}: holds no texts")
        check_text_column(ds, cfg.text_column, path)
        loaded[name] = ds
    return loaded if len(loaded) > 1 else next(iter(loaded.values()))


def eval_splits(files: list[str] | None) -> list[str]:
    """The split each held-out file is loaded as: 'validation' (as before several were taken), then
    'validation_2', 'validation_3'..."""
    return ["validation", *(f"validation_{i}" for i in range(2, len(files or []) + 1))]


def source_names(paths: list[str]) -> list[str]:
    """Each held-out file's name in the records (`unique_names`: stems made unique; a file given twice is
    refused)."""
    return unique_names(paths, "--validation_file")


def first_undecodable(path: str | Path, chunk: int = 1 << 20, limit: int | None = None) -> tuple[int, int] | None:
    """(offset, byte) of the first byte of `path` that is not UTF-8 (None: all of it is, or its first `limit`
    bytes are)."""
    import codecs

    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as err:
                return offset + err.start, block[err.start]
            offset += len(block)
            if limit is not None and offset >= limit:
                return None
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return offset, 0
    return None


def not_utf8(err: BaseException, data_files: dict | None, flag: str) -> BadInput | None:
    """The line that names the file which is not UTF-8 text, when `err` (datasets wraps its readers' errors) came
    from decoding one; None otherwise. A training and a held-out file load together: the one at fault is named."""
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, UnicodeDecodeError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    for split, path in (data_files or {}).items():
        found = first_undecodable(path) if Path(path).is_file() else None
        if found is not None:
            return utf8_refusal("--train_file" if split == "train" else "--validation_file", path, found)
    return BadInput(f"{flag}: not UTF-8 text ({cause}); save it as UTF-8")


def utf8_refusal(flag: str, path: str, found: tuple[int, int]) -> BadInput:
    return BadInput(f"{flag} {path}: not UTF-8 text (byte 0x{found[1]:02x} at offset {found[0]}); save it as "
                    f"UTF-8, e.g. iconv -f latin1 -t utf-8 {path} > {Path(path).stem}.utf8{Path(path).suffix}")


UTF8_CHECKED = 64 << 20  # bytes of each file `check_files` reads: a latin-1 file is found in its first lines


def check_files(cfg: DataConfig) -> None:
    """Each --train_file and --validation_file as loading would refuse it: a folder, a missing or empty file, an
    unknown suffix, text that is not UTF-8 (its first UTF8_CHECKED bytes). Reads no dataset: submit runs it on the
    login node before a job exists, training before its processes start."""
    given = [*(("--train_file", f) for f in cfg.train_file or []),
             *(("--validation_file", f) for f in cfg.validation_file or [])]
    for flag, path in given:
        if cfg.mixed and flag == "--train_file" and Path(path).is_dir():
            continue  # a mixture's source may be a folder: prepared, or a dataset's (mixture.source_config)
        if _builder_for(path, flag) != "parquet" and (found := first_undecodable(path, limit=UTF8_CHECKED)):
            raise utf8_refusal(flag, path, found)


def _load(path: str, name: str | None, data_files: dict | None, streaming: bool, flag: str) -> dict:
    try:
        loaded = load_dataset(path, name, data_files=data_files, streaming=streaming)
    except DatasetGenerationError as err:
        if (line := not_utf8(err, data_files, flag)) is not None:
            raise line from err
        raise
    except (FileNotFoundError, ConnectionError, ValueError, OSError) as err:
        raise BadInput(
            f"{flag}: could not be loaded ({type(err).__name__}: {err}). A Hub name needs network "
            "access (unset HF_HUB_OFFLINE); a local file needs a readable path."
        ) from err
    if not isinstance(loaded, (DatasetDict, IterableDatasetDict)):
        raise BadInput(f"{flag}: expected named splits, got {type(loaded).__name__}")
    return dict(loaded)


def data_notes(cfg: DataConfig) -> list[str]:
    """Data flags a run accepts that are likely a mistake: one warning line each (the run goes on)."""
    notes = []
    if cfg.train_weights is not None and len(cfg.train_file or []) == 1:
        notes.append(f"--train_weights {cfg.train_weights[0]:g} with one --train_file: a weight is a share among "
                     "several sources, so this one source gets every token whatever its weight; drop --train_weights "
                     "or give more --train_file sources")
    trained = {Path(f).resolve() for f in cfg.train_file or []}
    for path in cfg.validation_file or []:
        if Path(path).resolve() in trained:
            notes.append(f"--validation_file {path} is also a --train_file: the held-out loss is then measured on "
                         "text the model trains on (memorised, not generalised); give another file, or leave "
                         "--validation_file out to hold out --validation_split_percentage of the text")
    return notes

