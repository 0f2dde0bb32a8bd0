"""`python -m mlm_ddp.tokenizer`: a BERT WordPiece tokenizer trained on the text training reads.

`--extend MODEL --train_file FILE... --num_new_tokens N --output_dir DIR` instead grows a model's vocabulary
by the domain's words (model/vocabulary.py): its tokenizer, its embeddings, report.json and report.md.

The texts come from `mlm_ddp.data.load_text`, so every source `mlm_ddp.train` reads works the same
way here: txt/json/jsonl/csv/parquet files, a `datasets` name or folder, `--streaming`, and the
embedded default corpus. Only the train split is read, and all of it: the tokenizer's config sets
validation_split_percentage to 0, so nothing is held out (training holds out 5% of the same texts for
evaluation unless it has a validation set; those texts are in the tokenizer's text, which is what a
tokenizer should cover). A dataset's own validation split is never read.

The result is BERT's recipe: [PAD] [UNK] [CLS] [SEP] [MASK], BERT's normalizer (lowercasing and accent
stripping with --lowercase, as bert-base-uncased) and pre-tokenizer, WordPiece pieces continued with
`##`, and `[CLS] A [SEP]` / `[CLS] A [SEP] B [SEP]`. It is saved as a fast tokenizer folder that
`AutoTokenizer.from_pretrained` loads and `mlm_ddp.train --tokenizer_name` takes; whole-word masking
finds its words through the pre-tokenizer (the fast tokenizer's word_ids).

The text is read twice. The `tokenizers` trainer numbers the `##` forms of the characters in hash-map
order, and the numbers break ties between equally frequent merges, so the same text gave a different
vocabulary from run to run (huggingface/tokenizers#1794). The first pass only counts, to learn the
alphabet; the second trains with the `##` forms numbered in sorted order, which makes the
vocabulary a function of the text alone. The first pass also finds a --vocab_size below the
alphabet's size before the long part starts.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from accelerate import PartialState
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, BertTokenizerFast, HfArgumentParser

from mlm_ddp import compat
from mlm_ddp.cluster.durable import unwritable
from mlm_ddp.config import DataConfig, ModelConfig, _doc, checks, parse_exactly
from mlm_ddp.config.tree import given
from mlm_ddp.data import AnyDataset, load_text
from mlm_ddp.errors import BadInput
from mlm_ddp.model import vocabulary
from mlm_ddp.model.tokenizer_files import check_tokenizer_files
from mlm_ddp.run import st_files

PROG = "mlm_ddp.tokenizer"
PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK)  # ids 0..4, in this order
CONTINUING_PREFIX = "##"
TEXTS_PER_BATCH = 1000
# what save_pretrained writes for a tokenizer, in either transformers 4 or 5: a folder holding one of
# these already has a tokenizer, and replacing it removes them all so no stale file is loaded instead
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json",
                   "added_tokens.json")
# a slow tokenizer's vocabulary files: an extended folder holds tokenizer.json alone, which they would contradict
SLOW_FILES = ("vocab.txt", "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model")

logger = logging.getLogger(PROG)  # not "__main__" under python -m


@dataclass
class TokenizerConfig:
    """What to train the tokenizer on, its size, and where it goes."""

    output_dir: str = _doc(
        "Folder for the tokenizer (tokenizer.json, tokenizer_config.json); may be a model's folder. "
        "Pass it to mlm_ddp.train as --tokenizer_name."
    )
    vocab_size: int = _doc("Tokens in the vocabulary, special tokens included (bert-base: 30522).",
                           default=30522)
    min_frequency: int = _doc(
        "A merged piece enters the vocabulary only if its pair occurs at least this often.", default=2
    )
    lowercase: bool = _doc(
        "Lowercase and strip accents, as bert-base-uncased ('--lowercase false' keeps case and accents).",
        default=True,
    )
    model_max_length: int = _doc("The tokenizer's model_max_length: the longest input it is for.",
                                 default=512)
    dataset_name: str | None = _doc(
        "A `datasets` name or local dataset folder (its train split). Neither this nor --train_file: "
        "mlm_ddp's embedded default corpus.",
        default=None,
    )
    dataset_config_name: str | None = _doc("Configuration name of --dataset_name.", default=None)
    train_file: str | None = _doc(
        "Text to train on: a .txt (one text per line), .json/.jsonl, .csv or .parquet file.", default=None
    )
    text_column: str = _doc("Column holding the text (a .txt file's lines are 'text').", default="text")
    streaming: bool = _doc("Read the data as a stream (nothing is cached or held in memory).", default=False)
    max_train_samples: int | None = _doc(
        "Train on the first this many texts only (texts: training's flag counts packed sequences).",
        default=None,
    )
    overwrite_output_dir: bool = _doc(
        "Replace the tokenizer files already in --output_dir (other files there are kept).", default=False
    )

    def __post_init__(self) -> None:
        if self.vocab_size <= len(SPECIAL_TOKENS):
            raise BadInput(f"--vocab_size must be larger than the {len(SPECIAL_TOKENS)} special tokens, "
                           f"got {self.vocab_size} (bert-base has 30522)")
        checks.not_negative("--min_frequency", self.min_frequency)
        checks.at_least("--model_max_length", self.model_max_length, 1)
        checks.at_least("--max_train_samples", self.max_train_samples, 1)
        if not self.output_dir:
            raise BadInput("--output_dir must not be empty")
        self.data_config()  # the data flags are checked as training checks them

    def data_config(self) -> DataConfig:
        """The data section training would build from the same flags, holding no text out.

        max_train_samples stays out: training counts it in packed sequences, this tool in texts.
        """
        return DataConfig(
            dataset_name=self.dataset_name, dataset_config_name=self.dataset_config_name,
            train_file=self.train_file, text_column=self.text_column, streaming=self.streaming,
            validation_split_percentage=0.0,
        )

    def source(self) -> str:
        if self.train_file is not None:
            return f"--train_file {self.train_file}"
        if self.dataset_name is not None:
            return f"--dataset_name {self.dataset_name}"
        return "the embedded default corpus"


@dataclass
class TextBatches:
    """The non-empty texts of one column, in lists of TEXTS_PER_BATCH, readable more than once.

    The trainer consumes an iterator, so a corpus larger than memory (or a stream) is never held whole.
    """

    dataset: AnyDataset
    column: str
    texts: int = 0  # texts yielded by the latest complete pass

    def __iter__(self) -> Iterator[list[str]]:
        yielded = 0
        for batch in self.dataset.select_columns([self.column]).iter(batch_size=TEXTS_PER_BATCH):
            kept = [text for text in batch[self.column] if isinstance(text, str) and text.strip()]
            yielded += len(kept)
            if kept:
                yield kept
        self.texts = yielded


@dataclass(frozen=True)
class TokenizerResult:
    vocab_size: int
    texts: int
    output_dir: Path

    def summary(self) -> str:
        return (f"{PROG}: a vocabulary of {self.vocab_size} tokens from {self.texts} texts, written to "
                f"{self.output_dir}; train with it: python -m mlm_ddp.train --tokenizer_name {self.output_dir}")


def bert_wordpiece(lowercase: bool, vocab: dict[str, int] | None = None) -> Tokenizer:
    """BERT's pipeline around a WordPiece model (untrained without `vocab`)."""
    model = models.WordPiece(vocab=vocab, unk_token=UNK, continuing_subword_prefix=CONTINUING_PREFIX)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                      strip_accents=None, lowercase=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix=CONTINUING_PREFIX)
    return tokenizer


def _train_pass(texts: TextBatches, lowercase: bool, trainer: trainers.WordPieceTrainer) -> dict[str, int]:
    # no progress bars: they print empty lines on stdout, which carries only the result line
    tokenizer = bert_wordpiece(lowercase)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer.get_vocab(with_added_tokens=False)


def train_wordpiece(texts: TextBatches, cfg: TokenizerConfig) -> Tokenizer:
    """A WordPiece vocabulary of at most cfg.vocab_size tokens that depends on the texts alone."""
    logger.info("reading %s, column %r: counting characters (pass 1 of 2)", cfg.source(), cfg.text_column)
    counted = _train_pass(texts, cfg.lowercase, trainers.WordPieceTrainer(
        vocab_size=0, special_tokens=list(SPECIAL_TOKENS), continuing_subword_prefix=CONTINUING_PREFIX,
        show_progress=False))
    if texts.texts == 0:
        raise BadInput(f"{cfg.source()}: no text found in column {cfg.text_column!r} (--text_column): "
                       "every text is empty")
    continuations = sorted(token for token in counted if token.startswith(CONTINUING_PREFIX))
    if cfg.vocab_size < len(counted):
        raise BadInput(
            f"--vocab_size {cfg.vocab_size} is too small: the {len(SPECIAL_TOKENS)} special tokens, the "
            f"{len(counted) - len(SPECIAL_TOKENS) - len(continuations)} characters of the text and their "
            f"{len(continuations)} '{CONTINUING_PREFIX}' forms already take {len(counted)}; give at least "
            f"{len(counted)}"
        )
    logger.info("%d texts, %d characters, %d '##' forms of them; learning up to %d tokens (pass 2 of 2)",
                texts.texts, len(counted) - len(SPECIAL_TOKENS) - len(continuations), len(continuations),
                cfg.vocab_size)
    # listed as special tokens, the '##' forms get their ids before the trainer meets them in hash order
    trained = _train_pass(texts, cfg.lowercase, trainers.WordPieceTrainer(
        vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
        special_tokens=[*SPECIAL_TOKENS, *continuations], continuing_subword_prefix=CONTINUING_PREFIX,
        show_progress=False))
    # BERT's order: special tokens, characters, their '##' forms, then the merges as they were learned;
    # ids do not change how WordPiece splits (longest match), and the trainer's special list is dropped
    placed = {*SPECIAL_TOKENS, *continuations}
    learned = [token for token in sorted(trained, key=trained.__getitem__) if token not in placed]
    characters = [token for token in learned if len(token) == 1]
    merges = [token for token in learned if len(token) > 1]
    order = [*SPECIAL_TOKENS, *characters, *continuations, *merges]
    tokenizer = bert_wordpiece(cfg.lowercase, {token: index for index, token in enumerate(order)})
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{CLS}:0 $A:0 {SEP}:0",
        pair=f"{CLS}:0 $A:0 {SEP}:0 $B:1 {SEP}:1",
        special_tokens=[(CLS, order.index(CLS)), (SEP, order.index(SEP))],
    )
    return tokenizer


def check_output_dir(cfg: TokenizerConfig) -> Path:
    output = Path(cfg.output_dir)
    if (problem := unwritable(output)) is not None:  # a read-only place, a file: a traceback after the training
        raise BadInput(f"--output_dir {output}: {problem}; choose another --output_dir")
    held = [name for name in TOKENIZER_FILES if (output / name).exists()]
    if held and not cfg.overwrite_output_dir:
        raise BadInput(f"--output_dir {output} already holds a tokenizer ({', '.join(held)}); pass "
                       "--overwrite_output_dir to replace it, or choose another folder")
    return output


def save(tokenizer: Tokenizer, cfg: TokenizerConfig, output: Path) -> None:
    """Write the transformers folder next to the final files first, then move it into place."""
    wrapped = BertTokenizerFast(
        tokenizer_object=tokenizer, do_lower_case=cfg.lowercase, strip_accents=None,
        tokenize_chinese_chars=True, unk_token=UNK, sep_token=SEP, pad_token=PAD, cls_token=CLS,
        mask_token=MASK, model_max_length=cfg.model_max_length,
    )
    output.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output, prefix=".tokenizer-") as staging:
        wrapped.save_pretrained(staging)
        for name in TOKENIZER_FILES:
            (output / name).unlink(missing_ok=True)
        for written in sorted(Path(staging).iterdir()):
            os.replace(written, output / written.name)


def train_tokenizer(cfg: TokenizerConfig) -> TokenizerResult:
    output = check_output_dir(cfg)
    data = cfg.data_config()
    # the seed only shuffles a held-out split, and this config holds none out
    train_texts, _ = load_text(data, seed=0)
    if cfg.max_train_samples is not None:
        if isinstance(train_texts, Dataset):
            train_texts = train_texts.select(range(min(cfg.max_train_samples, len(train_texts))))
        else:
            train_texts = train_texts.take(cfg.max_train_samples)
    texts = TextBatches(train_texts, data.text_column)
    tokenizer = train_wordpiece(texts, cfg)
    if tokenizer.get_vocab_size() < cfg.vocab_size:
        logger.info("the vocabulary stopped at %d tokens: no further pair of pieces occurs "
                    "--min_frequency %d times", tokenizer.get_vocab_size(), cfg.min_frequency)
    save(tokenizer, cfg, output)
    return TokenizerResult(vocab_size=tokenizer.get_vocab_size(), texts=texts.texts, output_dir=output)


@dataclass
class ExtendConfig:
    """`--extend MODEL`: which model's vocabulary grows, by how many tokens, from which text, and where to."""

    extend: str = _doc("The model (a folder, or a Hub name in the local cache) whose tokenizer and embeddings "
                       "grow: WordPiece (BERT), BPE (RoBERTa) or Unigram (SentencePiece) fast tokenizers.")
    output_dir: str = _doc("Folder for the extended model, its tokenizer and report.json / report.md; train "
                           "from it with mlm_ddp.train --model_name_or_path DIR.")
    num_new_tokens: int = _doc("Tokens to add, chosen from the text by the tokens they save.", default=1000)
    train_file: list[str] | None = _doc(
        "The domain's text: .txt (one text per line), .json/.jsonl, .csv or .parquet files.", default=None)
    text_column: str = _doc("Column holding the text (a .txt file's lines are 'text').", default="text")
    validation_split_percentage: float = _doc(
        "Share of the texts (every n-th one) held out: not used to choose tokens, measured in the report.",
        default=5.0)
    min_frequency: int = _doc("A word (BPE: a pair of pieces) becomes a token only if seen this often.",
                              default=2)
    never_longer: Literal["text", "any_input"] = _doc(
        "WordPiece: 'text' takes no token that lengthens a word of the text read (an unseen word glued to a "
        "new one rarely may be); 'any_input' only tokens that cannot lengthen any input, for fewer tokens "
        "saved (docs/vocabulary.md). BPE: never longer either way; Unigram: within its 1e-6 margin.",
        default="text")
    overwrite_output_dir: bool = _doc("Replace --output_dir if it is not empty.", default=False)

    def __post_init__(self) -> None:
        checks.at_least("--num_new_tokens", self.num_new_tokens, 1)
        if not self.train_file:
            raise BadInput("--extend needs the domain's text: give --train_file FILE [FILE ...]")
        checks.within("--validation_split_percentage", self.validation_split_percentage, 0, 100)
        checks.at_least("--min_frequency", self.min_frequency, 1)
        output = Path(self.output_dir)
        if output.is_file() or (output.is_dir() and any(output.iterdir()) and not self.overwrite_output_dir):
            raise BadInput(f"--output_dir {output} is in use (not an empty folder); pass --overwrite_output_dir "
                           "to replace it, or choose another folder")


def extension_texts(cfg: ExtendConfig) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts) of --train_file: every n-th non-empty text is held out."""
    texts: list[str] = []
    for file in cfg.train_file or []:
        data = DataConfig(train_file=[file], text_column=cfg.text_column, validation_split_percentage=0.0)
        batches = TextBatches(load_text(data, seed=0)[0], cfg.text_column)
        texts += [text for batch in batches for text in batch]
    stride = round(100 / cfg.validation_split_percentage) if cfg.validation_split_percentage else 0
    held = [i for i in range(len(texts)) if stride and i % stride == stride - 1]
    return [t for i, t in enumerate(texts) if not stride or i % stride != stride - 1], [texts[i] for i in held]


def extension_model(path: str) -> Any:
    """The checkpoint in its own class (a BertModel stays one: a sentence-transformers encoder is not given
    a fresh MLM head here, which training would take for a trained one)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    name = (config.architectures or ["AutoModelForMaskedLM"])[0]
    return getattr(transformers, name, transformers.AutoModelForMaskedLM).from_pretrained(path)


def extend_vocabulary(cfg: ExtendConfig) -> ExtensionResult:
    """Grow the model's tokenizer and embeddings by --num_new_tokens (model/vocabulary.py); write DIR whole."""
    try:
        old = AutoTokenizer.from_pretrained(cfg.extend)
    except (OSError, ValueError) as err:
        raise BadInput(f"--extend {cfg.extend}: no tokenizer loads from it ({str(err).splitlines()[0]})") from None
    check_tokenizer_files(cfg.extend, old, "extend a folder that holds the model and its tokenizer")
    if not getattr(old, "is_fast", False) or getattr(old, "backend_tokenizer", None) is None:
        raise BadInput(f"--extend {cfg.extend}: its tokenizer ({type(old).__name__}) is not a fast one; extending "
                       "needs a tokenizer.json (convert it: AutoTokenizer.from_pretrained(..., from_slow=True))")
    backend = old.backend_tokenizer
    vocabulary.family_of(backend)
    train, held_out = extension_texts(cfg)
    counts = vocabulary.word_counts(backend, train)
    check = set(counts) | set(vocabulary.word_counts(backend, held_out))
    logger.info("%d training texts (%d distinct words), %d held out; choosing %d tokens", len(train), len(counts),
                len(held_out), cfg.num_new_tokens)
    ext = vocabulary.extend(backend, counts, check, cfg.num_new_tokens, len(old), cfg.min_frequency,
                            old.unk_token_id, any_input=cfg.never_longer == "any_input")
    if len(ext.tokens) < cfg.num_new_tokens:
        safe, other = "", ""
        if ext.passed_over:
            safe = (f" that cannot lengthen any input, and {ext.passed_over} more that could (--never_longer "
                    "any_input passes them over)")
            other = ", pass --never_longer text"
        raise BadInput(f"--train_file: the text yields {ext.found} useful tokens (words of several pieces, or "
                       f"pairs of pieces, seen at least --min_frequency {cfg.min_frequency} times){safe}, fewer "
                       f"than --num_new_tokens {cfg.num_new_tokens}; ask for at most {ext.found}{other}, or give "
                       "more text")
    try:
        model = extension_model(cfg.extend)
    except (OSError, ValueError) as err:
        raise BadInput(f"--extend {cfg.extend}: no model loads from it ({str(err).splitlines()[0]})") from None
    vocabulary.grow_embeddings(model, ext.tokens, len(old) + len(ext.tokens))
    output = Path(cfg.output_dir)
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}-") as staging_dir:
        staging = Path(staging_dir)
        old.save_pretrained(staging)
        for stale in SLOW_FILES:  # the slow tokenizer's files would load the old vocabulary
            (staging / stale).unlink(missing_ok=True)
        (staging / "tokenizer.json").write_text(ext.backend.to_str(), encoding="utf8")
        new = AutoTokenizer.from_pretrained(staging)
        assert len(new) == len(old) + len(ext.tokens), (len(new), len(old), len(ext.tokens))
        new.save_pretrained(staging)
        model.save_pretrained(staging)
        PartialState(cpu=True)  # st_files logs through accelerate's logger, which needs a state
        st_files.copy_into(ModelConfig(model_name_or_path=cfg.extend), staging)
        measured = {"training": vocabulary.measure(old, new, train), "held-out": vocabulary.measure(old, new, held_out)}
        report = vocabulary.report_dict(ext, measured, cfg.extend, cfg.never_longer)
        (staging / "report.json").write_text(json.dumps(report, indent=1, ensure_ascii=False), encoding="utf8")
        lines = vocabulary.report_lines(report)
        (staging / "report.md").write_text("\n".join(lines) + "\n", encoding="utf8")
        if output.exists():
            shutil.rmtree(output)  # in use and --overwrite_output_dir (checked before anything was read)
        os.replace(staging, output)
        staging.mkdir()  # for the context manager to remove
    shown = 8 + len(measured) + 3 + 20  # the title, the text before and after, the first 20 new tokens
    logger.info("report (%s; the first 20 new tokens):\n%s", output / "report.md", "\n".join(lines[:shown]))
    return ExtensionResult(len(ext.tokens), len(new), output, measured)


@dataclass(frozen=True)
class ExtensionResult:
    added: int
    vocab_size: int
    output_dir: Path
    measured: dict[str, dict[str, float]]

    def summary(self) -> str:
        saved = ", ".join(f"{name} text {m['saving']:.1%}" for name, m in self.measured.items() if m.get("texts"))
        return (f"{PROG}: {self.added} tokens added ({self.vocab_size} in all), {saved} fewer tokens; written to "
                f"{self.output_dir}; train from it: accelerate launch -m mlm_ddp.train --model_name_or_path "
                f"{self.output_dir}")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        level=logging.INFO)
    argv = sys.argv[1:] if argv is None else argv
    extending = given(argv, "extend")  # --extend MODEL: grow a model's vocabulary (model/vocabulary.py)
    parser = HfArgumentParser(ExtendConfig if extending else TokenizerConfig, prog=PROG,
                              description=__doc__.split("\n")[0], allow_abbrev=False,
                              epilog=None if extending else "--extend MODEL grows a model's vocabulary by the "
                              "domain's words instead (its flags: --extend MODEL --help; docs/vocabulary.md)")
    try:
        (cfg,) = parse_exactly(parser, argv)
        compat.check()
        result = extend_vocabulary(cfg) if extending else train_tokenizer(cfg)
    except BadInput as err:
        # one write: the line arrives whole even on an unbuffered stderr
        sys.stderr.write(err.line(PROG) + "\n")
        return err.exit_code
    print(result.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
