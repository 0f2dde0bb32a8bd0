"""The probe's settings: `ProbeConfig`, read by `standalone` (the probe itself, `python -m mlm_ddp.probe`) and
by `compare` (what makes two figures comparable), and built from a run's flags by run/probing.py. Its own
module, so that those two read it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mlm_ddp.config import _doc, checks
from mlm_ddp.errors import BadInput

MTEB = {"max_train_per_label": 8, "seeds": 10}  # MTEB's samples_per_label and n_experiments
FINETUNE_SEEDS = 3  # finetune's default seeds: each is a whole fine-tune


@dataclass
class ProbeConfig:
    """The labeled task and how to probe with it. Defaults: every labeled training text, a logistic regression
    run to convergence on standardised features (linear; --protocol mteb: MTEB's protocol exactly) and
    BERT's GLUE recipe (finetune, Devlin et al. 2019, section 4.1 and appendix A.3). After __post_init__,
    max_train_per_label and seeds hold the values used."""

    train_file: str | None = _doc("Labeled training texts: a csv, json, jsonl or parquet file.", default=None)
    test_file: str | None = _doc("Labeled test texts, scored whole: a csv, json, jsonl or parquet file.",
                                 default=None)
    dataset_name: str | None = _doc("Instead of the files: a `datasets` name or local dataset folder (read "
                                    "offline where it is cached) with --train_split and --test_split.", default=None)
    dataset_config_name: str | None = _doc("The dataset's configuration, if it has several.", default=None)
    train_split: str = _doc("--dataset_name's split to train on.", default="train")
    test_split: str = _doc("--dataset_name's split to score.", default="test")
    text_column: str = _doc("Column holding the texts.", default="text")
    label_column: str = _doc("Column holding the class labels (strings or integers).", default="label")
    protocol: Literal["default", "mteb"] = _doc(
        "default: every labeled training text (or --max_train_per_label), standardised features, a logistic "
        "regression run to convergence (max_iter 1000). mteb: MTEB's classification protocol exactly (linear "
        "only): 8 texts per label, 10 experiments, a plain LogisticRegression(max_iter=100) on the raw features.",
        default="default")
    max_train_per_label: int | None = _doc(
        "A cap: at most this many training texts per label in each seed's subsample, drawn at random. Default: "
        "every labeled text (0 says the same); --protocol mteb: 8.", default=None)
    seeds: int | None = _doc(
        "Seeds 0..N-1: subsamples (and fine-tunes) whose scores are averaged. Default: 10 (MTEB's n_experiments), "
        "finetune 3. linear on every text fits once: each seed would fit the same rows to the same optimum.",
        default=None)
    mode: Literal["linear", "finetune"] = _doc(
        "linear: frozen features + logistic regression; finetune: train a sequence classifier.", default="linear")
    pooling: Literal["auto", "mean", "cls", "max"] = _doc(
        "linear's features: auto = the checkpoint's sentence-transformers pooling (modules.json) if it has one, "
        "else mean. Name one to pool every model alike (no normalisation).", default="auto")
    batch_size: int = _doc("Texts per forward pass, and finetune's batch (BERT's GLUE batch: 32).", default=32)
    max_seq_length: int | None = _doc("Tokens per text; longer texts are cut. Default: the checkpoint's "
                                      "sentence-transformers length, else the model's, at most 512.", default=None)
    learning_rate: float = _doc("finetune's peak AdamW learning rate (BERT's GLUE grid: 2e-5..5e-5; the top, as "
                                "the probe's training sets are small), linear decay after 10%% warm-up.", default=5e-5)
    epochs: int = _doc("finetune's epochs over each subsample (BERT's GLUE recipe: 3).", default=3)
    # not a flag: how errors spell the flags. Inside a training run they are --probe_train_file, ... ("probe_")
    flag_prefix: str = field(default="", init=False, repr=False)

    def flag(self, name: str) -> str:
        """The flag the user typed for the field `name` (--train_file here, --probe_train_file in training)."""
        return f"--{self.flag_prefix}{name}"

    def __post_init__(self) -> None:
        if self.protocol == "mteb":
            given = [f"--{k} {getattr(self, k)}" for k, v in MTEB.items() if getattr(self, k) not in (None, v)]
            if self.mode != "linear" or given:
                raise BadInput("--protocol mteb is MTEB's classification protocol exactly (linear, 8 texts per label, "
                               f"10 seeds): drop {', '.join(given) or '--mode ' + self.mode}, or use --protocol "
                               "default")
            self.max_train_per_label, self.seeds = MTEB["max_train_per_label"], MTEB["seeds"]
        if self.max_train_per_label is None:
            self.max_train_per_label = 0
        if self.seeds is None:
            self.seeds = FINETUNE_SEEDS if self.mode == "finetune" else MTEB["seeds"]
        for name in ("seeds", "batch_size", "epochs"):
            checks.at_least(f"--{name}", getattr(self, name), 1)
        checks.not_negative("--max_train_per_label", self.max_train_per_label, meaning=" (0: all)")
        checks.positive("--learning_rate", self.learning_rate)
        checks.at_least("--max_seq_length", self.max_seq_length, 2, " (the special tokens)")
