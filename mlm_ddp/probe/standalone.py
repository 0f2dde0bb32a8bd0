"""`python -m mlm_ddp.probe MODEL [MODEL ...] --train_file F --test_file F`: models scored on a labeled task.

What it measures: how well a model's features serve a labeled task, before and after MLM training.

linear (the default): each text becomes the model's pooled last hidden states (its own
sentence-transformers pooling where the checkpoint has one, else the mean over its tokens), computed
once; a logistic regression on every labeled training text (or, with --max_train_per_label, a seeded
subsample of at most that many per label for each seed), standardised, is fit and scored on the whole
test set. --protocol mteb is MTEB's classification protocol exactly: 8 texts per label, 10 experiments,
a plain LogisticRegression(max_iter=100) on the raw features. finetune: a fresh sequence classifier
fine-tuned from the model on the same subsamples. Every model gets the same splits, seeds and
subsamples, so their figures compare, seed by seed; each figure records the settings that made it
(`settings`), and two figures compare only where those are equal. A table, then one JSON line: model ->
its figures.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from transformers import HfArgumentParser, PreTrainedModel

from mlm_ddp import compat
from mlm_ddp.config import parse_exactly
from mlm_ddp.data.text import UTF8_CHECKED, _builder_for, _load, check_columns, first_undecodable, utf8_refusal
from mlm_ddp.errors import BadInput, say
from mlm_ddp.model.loading import check_local
from mlm_ddp.probe.compare import change, describe_change, settings
from mlm_ddp.probe.config import ProbeConfig
from mlm_ddp.probe.features import (
    FinetuneRecipe,
    Pooling,
    encode,
    finetune,
    finetune_source,
    load_encoder,
    own_random_state,
    sequence_length,
)

PROG = "mlm_ddp.probe"
WRITTEN_AS_FLOAT = re.compile(r"-?\d+\.0+")  # a csv cell as pandas writes a whole number of a float column
OWN_LABEL = 0.9  # a column in which more rows than this carry a label of their own, in both files, is not classes
LOGREG_MAX_ITER = 1000  # MTEB's 100 can stop lbfgs short of the optimum on 384-768 features; 1000 converges
MTEB_MAX_ITER = 100  # MTEB's LogisticRegression(max_iter=100), no scaler
SHOWN = 5  # unseen labels named in the message


@dataclass
class ProbeData:
    """Both splits, labels as class numbers: classes[k] is the label (a string, as written) of number k.
    `notes`: the rows left out (no label, or no text), one warning line per split, for the caller to say."""

    train_texts: list[str]
    train_labels: np.ndarray  # (N_train,) int64
    test_texts: list[str]
    test_labels: np.ndarray  # (N_test,) int64
    classes: list[str]
    notes: list[str] = field(default_factory=list)


def as_written(label: Any) -> str | None:
    """A label as a string: a string as written ("01" stays "01", "1.0" stays "1.0"); a number as its value, a whole
    one as the integer (1 and 1.0 are both "1": parquet holds an integer column that one missing value made
    float as 0.0, 1.0, NaN, and JSON does not tell 1.0 from 1); None where there is none (a missing value, a NaN,
    an empty cell)."""
    if label is None or (isinstance(label, float) and math.isnan(label)):
        return None
    if isinstance(label, float) and label.is_integer():
        return str(int(label))
    text = label if isinstance(label, str) else str(label)
    return text if text.strip() else None


def whole_numbers(labels: list[str | None]) -> list[str | None]:
    """A csv's labels, read as written unless every one is a whole number with a decimal point ("0.0", "1.0"):
    that is how pandas writes an integer column that one missing value made float, so they are the integers.
    One "1.5" or "yes" among them and the column is read as written."""
    given = [label for label in labels if label is not None]
    if not given or not all(WRITTEN_AS_FLOAT.fullmatch(label) for label in given):
        return labels
    return [None if label is None else str(int(label.partition(".")[0])) for label in labels]


class Records:
    """A json or jsonl file's rows, read with Python's json, values as written: datasets' json reader makes a
    column of numbers and strings a column of JSON values and decodes the string "01" as the number 1."""

    def __init__(self, path: str, flag: str) -> None:
        text = Path(path).read_text(encoding="utf-8")
        try:
            rows = json.loads(text)  # a whole-file array of records, or JSON lines of one record
            rows = [rows] if isinstance(rows, dict) else rows
        except ValueError:
            rows = []
            for number, line in enumerate(text.splitlines(), 1):  # JSON lines
                try:
                    rows += [json.loads(line)] if line.strip() else []
                except ValueError as err:
                    raise BadInput(f"{flag}: line {number} is not JSON ({err})") from err
        if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
            raise BadInput(f"{flag}: neither JSON lines nor an array of records (one object per text)")
        self.rows = rows
        self.column_names = list(dict.fromkeys(key for row in rows for key in row))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, name: str) -> list[Any]:
        return [row.get(name) for row in self.rows]


def load_file(builder: str, path: str, cfg: ProbeConfig, flag: str) -> Any:
    """One file's rows, labels and texts as written. A csv: pandas' defaults would read "NA", "None", "null" and
    "N/A" as missing and "01" as the number 1."""
    if builder == "json":
        return Records(path, flag)
    csv = {"keep_default_na": False, "na_filter": False,
           "converters": {cfg.label_column: str, cfg.text_column: str}} if builder == "csv" else {}
    from datasets import load_dataset

    return read(lambda: dict(load_dataset(builder, data_files={"train": path}, **csv)), flag)["train"]


def read_split(cfg: ProbeConfig, split: Literal["train", "test"]) -> tuple[list[str], list[str], str, str | None]:
    """(texts, labels, where, note) of one split, every column and value checked; labels are strings as written.
    Rows without a label or without text are left out, and `note` says which (None: none were)."""
    if cfg.dataset_name is not None:
        if cfg.train_file or cfg.test_file:
            raise BadInput("give either --dataset_name or --train_file and --test_file, not both")
        name = cfg.train_split if split == "train" else cfg.test_split
        where, flag = f"dataset {cfg.dataset_name!r}, split {name!r}", f"--dataset_name {cfg.dataset_name}"
        splits = read(lambda: _load(cfg.dataset_name, cfg.dataset_config_name, None, False, flag), flag)
        if name not in splits:
            raise BadInput(f"dataset {cfg.dataset_name!r} has no split {name!r}; splits found: {', '.join(splits)}. "
                           f"Pass --{split}_split with one of them.")
        ds, cells_are_text = splits[name], False  # datasets reads each column with its type
    else:
        path = cfg.train_file if split == "train" else cfg.test_file
        if path is None:
            raise BadInput(f"no --{split}_file given: pass --train_file and --test_file (csv, json, jsonl or "
                           "parquet), or --dataset_name")
        flag = where = f"{cfg.flag(f'{split}_file')} {path}"
        builder = _builder_for(path, cfg.flag(f"{split}_file"))  # a missing or empty file is named here
        if builder != "parquet" and (found := first_undecodable(path, limit=UTF8_CHECKED)):  # else a traceback
            raise utf8_refusal(cfg.flag(f"{split}_file"), path, found)
        ds = load_file(builder, path, cfg, flag)
        cells_are_text = builder == "csv"
    check_columns(ds.column_names, cfg.text_column, where, cfg.flag("text_column"))
    if cfg.label_column not in ds.column_names:
        raise BadInput(f"{where}: no label column {cfg.label_column!r}; columns found: {', '.join(ds.column_names)}. "
                       f"Pass {cfg.flag('label_column')} with one of them.")
    if len(ds) == 0:
        raise BadInput(f"{where}: holds no rows")
    raw = ds[cfg.label_column]
    odd = [label for label in raw if label is not None and not isinstance(label, str | int | float)]
    if odd:
        raise BadInput(f"{where}: column {cfg.label_column!r} holds {type(odd[0]).__name__} values; the probe takes "
                       "one class label (a string or an integer) per text")
    labels = [as_written(label) for label in raw]
    labels = whole_numbers(labels) if cells_are_text else labels
    texts = ["" if text is None else str(text) for text in ds[cfg.text_column]]
    unlabeled = [row for row, label in enumerate(labels, 1) if label is None]
    empty = [row for row, text in enumerate(texts, 1) if not text.strip() and labels[row - 1] is not None]
    if len(unlabeled) + len(empty) == len(labels):
        raise BadInput(f"{where}: none of its {len(labels)} rows has both a {cfg.label_column!r} and a text")
    note = None
    if unlabeled or empty:
        def rows(numbers: list[int]) -> str:
            shown = ", ".join(map(str, numbers[:SHOWN]))
            return ("row " if len(numbers) == 1 else "rows ") + shown + (
                f" and {len(numbers) - SHOWN} more" if len(numbers) > SHOWN else "")
        note = (f"{where}: {len(unlabeled) + len(empty)} of {len(labels)} rows left out"
                + (f"; {len(unlabeled)} without a {cfg.label_column!r} ({rows(unlabeled)})" if unlabeled else "")
                + (f"; {len(empty)} with an empty text ({rows(empty)})" if empty else "")
                + " (rows numbered from 1, a csv's header not counted)")
        kept = [row for row, (label, text) in enumerate(zip(labels, texts, strict=True)) if label and text.strip()]
        labels, texts = [labels[row] for row in kept], [texts[row] for row in kept]
    return texts, labels, where, note


def read(load: Any, flag: str) -> dict:
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    quiet = are_progress_bars_disabled()
    disable_progress_bars()  # a probe's files are small: a bar per split only hides the error line
    try:
        return load()
    except BadInput as err:
        # datasets' word for a file of headers only (a csv) or no records: it builds a split of no rows
        if "corresponds to no data" in str(err.__cause__):
            raise BadInput(f"{flag}: holds no rows") from err
        raise
    except Exception as err:  # noqa: BLE001 - the csv, json and parquet readers each raise their own types
        if "corresponds to no data" in str(err):
            raise BadInput(f"{flag}: holds no rows") from err
        raise BadInput(f"{flag}: cannot be read ({type(err).__name__}: {str(err)[:300]})") from err
    finally:
        if not quiet:
            enable_progress_bars()


def shown(label: str) -> str:
    """A label for a message: its repr, a long one cut (a column of texts given as the labels)."""
    return repr(label) if len(label) <= 40 else repr(label[:37]) + "..."


def same_number(one: str, other: str) -> bool:
    """Whether two labels that differ as written are one number ("1" and "1.0", "01" and "1")."""
    try:
        return float(one) == float(other)
    except ValueError:
        return False


def load_probe_data(cfg: ProbeConfig) -> ProbeData:
    """Both splits, read and checked; every problem a one-line BadInput. No model is loaded."""
    train_texts, train_labels, train_where, train_note = read_split(cfg, "train")
    test_texts, test_labels, test_where, test_note = read_split(cfg, "test")
    counts = Counter(train_labels)
    if len(counts) == 1:
        raise BadInput(f"{train_where}: every row has the label {next(iter(counts))!r}: a classifier needs at "
                       f"least two labels; check {cfg.flag('label_column')} {cfg.label_column!r}")
    test_counts = Counter(test_labels)
    own = [sum(n == 1 for n in c.values()) / sum(c.values()) for c in (counts, test_counts)]
    if min(own) > OWN_LABEL:  # a few-shot training file (many labels, few rows each) is fine: its test file repeats
        raise BadInput(f"column {cfg.label_column!r} gives nearly every row a label of its own ({len(counts)} distinct "
                       f"values in {len(train_labels)} rows of {train_where}, {len(test_counts)} in "
                       f"{len(test_labels)} rows of {test_where}): free text or an identifier, not classes. Pass "
                       f"{cfg.flag('label_column')} with the column of classes.")
    classes = sorted(counts)
    number = {label: k for k, label in enumerate(classes)}
    unseen = sorted({label for label in test_labels if label not in number}, key=repr)
    if unseen:
        more = f" (and {len(unseen) - SHOWN} more)" if len(unseen) > SHOWN else ""
        alike = [f"{shown(label)} and {shown(twin)}" for label in unseen[:SHOWN] for twin in classes
                 if same_number(label, twin)]
        raise BadInput(f"{test_where}: labels not in the training set: {', '.join(map(shown, unseen[:SHOWN]))}{more}; "
                       f"the training labels are {', '.join(map(shown, classes[:SHOWN]))}"
                       f"{' ...' if len(classes) > SHOWN else ''}. A classifier cannot predict a class it never saw: "
                       "add examples of them to the training set or drop them from the test set."
                       + (f" ({'; '.join(alike[:SHOWN])} are one number written two ways: a label written as text "
                          "is read as written, so write them alike)" if alike else ""))
    same = (cfg.dataset_name is None and Path(cfg.train_file).resolve() == Path(cfg.test_file).resolve()
            or cfg.dataset_name is not None and cfg.train_split == cfg.test_split)
    same_note = (f"{train_where} is also the test set ({test_where}): a classifier scored on the texts it was fit on "
                 "measures memorising, not the features; give another test set") if same else None
    return ProbeData(train_texts, np.array([number[v] for v in train_labels], dtype=np.int64),
                     test_texts, np.array([number[v] for v in test_labels], dtype=np.int64), classes,
                     [note for note in (train_note, test_note, same_note) if note])


def check_probe_data(cfg: ProbeConfig) -> None:
    """Preflight: raise BadInput for anything wrong with the probe's data, without loading a model."""
    load_probe_data(cfg)


def subsample(labels: np.ndarray, per_label: int, seed: int) -> np.ndarray:
    """Sorted indices of at most `per_label` rows of each label, drawn at random (0: all rows). As MTEB's
    undersampling: a seeded permutation, then the first rows of each label in it."""
    if per_label == 0:
        return np.arange(len(labels))
    shuffled = np.random.default_rng(seed).permutation(len(labels))
    grouped = shuffled[np.argsort(labels[shuffled], kind="stable")]  # by label, each label's rows still shuffled
    group_start = np.searchsorted(labels[grouped], labels[grouped], side="left")
    return np.sort(grouped[np.arange(len(grouped)) - group_start < per_label])


def pooling_for(cfg: ProbeConfig, folder: str | Path | None) -> Pooling:
    """--pooling auto: the checkpoint's own; a named one: that, for every model alike."""
    own = Pooling.from_folder(folder)
    if cfg.pooling == "auto":
        return own
    return Pooling((cfg.pooling,), False, own.max_seq_length)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def spread(values: list[float]) -> float:
    """The sample standard deviation over seeds; 0 for one seed."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def probe(model: str | Path | PreTrainedModel, tokenizer: Any, cfg: ProbeConfig, device: torch.device | None = None,
          data: ProbeData | None = None, pooling: Pooling | None = None) -> dict[str, Any]:
    """The figures of one model: a folder or Hub name (tokenizer None: its own), or a transformers model in
    memory with its tokenizer (pass the base checkpoint's `pooling_for(cfg, base_folder)` to pool it alike).
    `data`: load_probe_data(cfg), to read the files once for several models. A model in memory keeps its
    weights and its train/eval mode, and ends on `device` (finetune trains copies); the random state of torch
    is as it was. Call it on one process, with the model unwrapped (not DDP, not sharded)."""
    data = data if data is not None else load_probe_data(cfg)
    device = device if device is not None else default_device()
    with own_random_state(device):  # a fresh pooler or head, finetune's seeds: none of it moves training's RNG
        return probe_in(model, tokenizer, cfg, device, data, pooling)


def probe_in(model: str | Path | PreTrainedModel, tokenizer: Any, cfg: ProbeConfig, device: torch.device,
             data: ProbeData, pooling: Pooling | None) -> dict[str, Any]:
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression  # scikit-learn is only needed by the probe
    from sklearn.metrics import accuracy_score, f1_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    folder = None if isinstance(model, PreTrainedModel) else str(model)
    pooling = pooling if pooling is not None else pooling_for(cfg, folder)
    seeds = list(range(cfg.seeds))
    samples = [subsample(data.train_labels, cfg.max_train_per_label, seed) for seed in seeds]
    if cfg.mode == "linear" and all(np.array_equal(samples[0], sample) for sample in samples):
        seeds, samples = seeds[:1], samples[:1]  # the same rows: lbfgs reaches the same optimum from every seed
    predictions, extra = [], {}
    if cfg.mode == "linear":
        if folder is not None:
            model, own = load_encoder(folder)
            tokenizer = tokenizer or own
        length = sequence_length(cfg.max_seq_length, pooling, model.config, tokenizer)
        needed = np.unique(np.concatenate(samples))  # the training rows any seed uses: each embedded once
        train_x = encode(model, tokenizer, [data.train_texts[i] for i in needed], pooling, cfg.batch_size, length,
                         device, "train features")
        test_x = encode(model, tokenizer, data.test_texts, pooling, cfg.batch_size, length, device, "test features")
        for seed, sample in zip(seeds, samples, strict=True):
            if cfg.protocol == "mteb":  # as MTEB: the raw features, lbfgs stopped at 100 iterations (not converged)
                classifier = LogisticRegression(max_iter=MTEB_MAX_ITER, random_state=seed)
            else:  # standardised as the scaler learns from this seed's training rows only; lbfgs, multinomial
                classifier = make_pipeline(StandardScaler(),
                                           LogisticRegression(max_iter=LOGREG_MAX_ITER, random_state=seed))
            with warnings.catch_warnings():
                if cfg.protocol == "mteb":  # MTEB's 100 iterations stop short by design: no warning per seed
                    warnings.filterwarnings("ignore", category=ConvergenceWarning)
                classifier.fit(train_x[np.searchsorted(needed, sample)], data.train_labels[sample])
            predictions.append(classifier.predict(test_x))
        extra["pooling"] = pooling.describe()
    else:
        losses = []
        with tempfile.TemporaryDirectory(prefix="mlm_ddp_probe_") as scratch:
            source, tokenizer, model_config = finetune_source(model if folder is None else folder, tokenizer,
                                                              Path(scratch))
            length = sequence_length(cfg.max_seq_length, pooling, model_config, tokenizer)
            recipe = FinetuneRecipe(cfg.learning_rate, cfg.epochs, cfg.batch_size, length)
            for seed, sample in zip(seeds, samples, strict=True):
                predicted, epoch_losses = finetune(source, tokenizer, [data.train_texts[i] for i in sample],
                                                   data.train_labels[sample], len(data.classes), data.test_texts,
                                                   recipe, seed, device)
                predictions.append(predicted)
                losses.append(epoch_losses)
        extra["epoch_loss"] = [float(np.mean(epoch)) for epoch in zip(*losses, strict=True)]  # mean over seeds
    accuracy = [float(accuracy_score(data.test_labels, p)) for p in predictions]
    macro_f1 = [float(f1_score(data.test_labels, p, average="macro", zero_division=0.0)) for p in predictions]
    majority = int(np.bincount(data.train_labels).argmax())  # of the whole training set, not a balanced subsample
    return {
        "accuracy": statistics.fmean(accuracy), "accuracy_std": spread(accuracy),
        "macro_f1": statistics.fmean(macro_f1), "macro_f1_std": spread(macro_f1),
        "majority_accuracy": float(np.mean(data.test_labels == majority)),
        "n_train": len(samples[0]), "n_train_available": len(data.train_texts), "n_test": len(data.test_texts),
        "seeds": len(seeds), "mode": cfg.mode, "protocol": cfg.protocol, "n_labels": len(data.classes),
        "accuracy_per_seed": accuracy, "macro_f1_per_seed": macro_f1, **extra, "settings": settings(cfg),
        "predictions_per_seed": [p.astype(int).tolist() for p in predictions],
    }


def format_table(results: dict[str, dict[str, Any]]) -> str:
    header = ("model", "mode", "features", "accuracy", "macro-F1", "majority", "train (of all)/test")
    rows = [header] + [(
        name, r["mode"], r.get("pooling", "classifier"), f"{r['accuracy']:.4f} ± {r['accuracy_std']:.4f}",
        f"{r['macro_f1']:.4f} ± {r['macro_f1_std']:.4f}", f"{r['majority_accuracy']:.4f}",
        f"{r['n_train']} (of {r['n_train_available']})/{r['n_test']}") for name, r in results.items()]
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = HfArgumentParser(ProbeConfig, prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("models", nargs="+", metavar="MODEL",
                        help="model folder, Hub name, a run's final/ or checkpoints/step-N folder")
    try:
        cfg, positional = parse_exactly(parser, argv)
        compat.check()
        data = load_probe_data(cfg)  # every data problem is found before any model is loaded
        for note in data.notes:
            say(f"{PROG}: warning: {note}")
        for name in positional.models:  # a missing folder, before transformers takes it for a Hub id
            check_local(name, "MODEL")
        device = default_device()
        results = {name: probe(name, None, cfg, device, data) for name in positional.models}
    except BadInput as err:
        sys.stderr.write(err.line(PROG) + "\n")  # one write: the line arrives whole
        return err.exit_code
    # each model after the first against the first: paired, with its 95% interval over test texts and seeds
    first, *others = positional.models
    changes = {name: change(results[first], results[name], data.test_labels) for name in others}
    print(format_table(results))
    for name, delta in changes.items():
        print(f"{name} - {first}: {describe_change(delta)}")
    print(json.dumps({name: {k: v for k, v in r.items() if not k.endswith("_per_seed")} | {
        "per_seed": {"accuracy": r["accuracy_per_seed"], "macro_f1": r["macro_f1_per_seed"]}}
        | ({"change": changes[name]} if name in changes else {}) for name, r in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
