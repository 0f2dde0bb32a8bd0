"""Shared fixtures: a tiny real corpus, a tiny BERT and its WordPiece tokenizer, built offline."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tests.tiers import pytest_addoption, pytest_configure  # noqa: E402, F401 - hooks: the fast tier

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "tests" / "slurm_cluster.sh"
TINY_PEAK_TFLOPS = 0.1
NO_DROPOUT = ["--config_overrides", "hidden_dropout_prob=0,attention_probs_dropout_prob=0"]
# The bound of every loss-curve comparison in the suite: relative, per logged step. The runs compared
# compute the same steps on the same data in fp32 (tiny_args pins it); what may differ is the order of
# their sums: threads, DDP's bucketed all-reduce or FSDP's reduce-scatter, another number of processes
# or micro-batches, another padding width. fp32's unit roundoff is 2^-24 (6e-8): each reordering moves a
# loss by a few of those, and AdamW carries one step's difference into the next. Measured over the suite's
# 6-25 steps: 1e-7 (one process against two, two machines, FSDP against DDP). A real error moves a step's
# loss far more: a batch skipped, repeated or masked otherwise, or a parameter trained otherwise, by 1e-3
# or more; attending to padding, the subtlest error measured, by 1.8e-5. bf16 has its own bound
# (test_fsdp.BF16_UNIT_ROUNDOFF).
SAME_STEPS = 1e-5


def corpus_paragraphs() -> list[str]:
    """Real English text that every CPython ships: paragraphs of the reference documentation."""
    from pydoc_data.topics import topics

    paragraphs = []
    for key in sorted(topics):
        paragraphs += [" ".join(p.split()) for p in topics[key].split("\n\n") if len(p.split()) >= 8]
    return paragraphs


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """train.txt (600 paragraphs, one per line) and valid.txt (60 others)."""
    paragraphs = corpus_paragraphs()
    root = tmp_path_factory.mktemp("corpus")
    (root / "train.txt").write_text("\n".join(paragraphs[:600]) + "\n")
    (root / "valid.txt").write_text("\n".join(paragraphs[600:660]) + "\n")
    return {"train": root / "train.txt", "valid": root / "valid.txt", "root": root}


@pytest.fixture(scope="session")
def tiny_model(corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer BertForMaskedLM and a 600-token WordPiece tokenizer trained on the corpus.

    The vocabulary is the one shipped in tests/data (trained once with `tokenizers`' BertWordPieceTokenizer,
    vocab_size 600, min_frequency 2, on this corpus): training it anew in each session broke ties between
    equally frequent pieces differently, so every session had another vocabulary, other token ids, other
    masks and other losses, and a bound could hold in one session and not the next."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    root = tmp_path_factory.mktemp("tiny_bert")
    shutil.copyfile(REPO / "tests" / "data" / "wordpiece-600.txt", root / "vocab.txt")
    # a vocab.txt plus this config loads as a fast BERT tokenizer in transformers 4 and 5 alike
    (root / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": 64})
    )
    tokenizer = AutoTokenizer.from_pretrained(root)
    assert len(tokenizer) == 600 and tokenizer.is_fast
    tokenizer.save_pretrained(root)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    BertForMaskedLM(config).save_pretrained(root)
    return root


@pytest.fixture(scope="session")
def tiny_fresh_head(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny BERT's encoder saved as a BertModel, without an MLM head: the head is initialised fresh
    when it is loaded, as with the default all-MiniLM-L6-v2 and most sentence-transformers encoders."""
    from transformers import AutoTokenizer, BertForMaskedLM

    root = tmp_path_factory.mktemp("tiny_fresh_head")
    BertForMaskedLM.from_pretrained(tiny_model).bert.save_pretrained(root)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(root)
    return root


def tiny_family_model(family: str, tiny_model: Path, root: Path) -> Path:
    """A 2-layer masked LM of another family ('roberta', 'deberta-v2', ...), the size of `tiny_model`,
    with its tokenizer, saved in `root`: the model family next door."""
    import torch
    from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.save_pretrained(root)
    # RoBERTa numbers positions from pad_token_id + 1: two more positions than the 64 tokens
    positions = 66 if family == "roberta" else 64
    config = AutoConfig.for_model(family, vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64, max_position_embeddings=positions,
                                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForMaskedLM.from_config(config).save_pretrained(root)
    return root


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> None:
    """train() may run several times in one test process; accelerate keeps singleton state."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def tiny_args(model: Path, corpus: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """Flags of a fast tiny run; later flags win over earlier ones. No warm-up: a run of a few steps
    trains at its full rate from the first. A given peak for the MFU: no second of matmuls at start-up.
    fp32: `auto` would pick bf16 on a CPU with native bf16 and fp32 on one without, so the suite's
    equality bounds would hold on some machines only; bf16 has tests of its own (test_precision.py). No
    report: drawing its plots takes a second of a tiny run's few tenths (measured 1.1-1.9 s against 0.3 s);
    the tests that read report.html ask for it with `--report true`."""
    return [
        "--model_name_or_path", str(model), "--train_file", str(corpus["train"]),
        "--validation_file", str(corpus["valid"]), "--output_dir", str(out),
        "--max_seq_length", "32", "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "32",
        "--learning_rate", "1e-3", "--num_warmup_steps", "0", "--logging_steps", "1",
        "--peak_tflops", str(TINY_PEAK_TFLOPS), "--mixed_precision", "no", "--report", "false", *extra,
    ]


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train_losses(out: Path) -> dict[int, float]:
    """step -> training loss, from a run's metrics.jsonl."""
    return {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def last_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


def assert_matches_one_process(run: Path, tiny_model: Path, corpus: dict[str, Path], scratch: Path,
                               steps: int, global_batch: int = 16) -> None:
    """`run` (several processes, dropout off) trained every step to the curve of one local process
    with the same global batch."""
    from mlm_ddp.config import parse_args
    from mlm_ddp.train import train

    train(parse_args(tiny_args(tiny_model, corpus, scratch, "--max_train_steps", str(steps), *NO_DROPOUT,
                               "--per_device_train_batch_size", str(global_batch))))
    local, distributed = train_losses(scratch), train_losses(run)
    assert sorted(distributed) == list(range(1, steps + 1))
    assert max(abs(local[s] - distributed[s]) / local[s] for s in local) <= SAME_STEPS


CONFIGS = REPO / "accelerate_configs"
LAUNCH = ["accelerate.commands.launch"]


HANDED_OUT: set[int] = set()  # free_port's picks in this process (a test run hands out a few dozen)


def free_port() -> int:
    """A free TCP port below the kernel's ephemeral range. A port from inside it (what binding port 0
    gives) can be taken as some connection's source port before the process it is meant for binds it:
    test_hang starts five 2-process runs at once, whose gloo connections did that on a loaded machine
    (EADDRINUSE). Below the range only explicit binds compete: 10000-14999, under the ports Slurm jobs
    derive (mlm_ddp.SLURM_PORT_BASE), never one this process handed out already."""
    from mlm_ddp.cluster.launcher import SLURM_PORT_BASE

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    picks = random.Random()  # seeded from the OS: another pick in each process and call
    for _ in range(100 if low > 11000 else 0):
        port = picks.randrange(10000, min(low, SLURM_PORT_BASE))
        if port in HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        HANDED_OUT.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_module(args: list[str], cwd: Path | None = None, env: dict | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd or REPO, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def launch_runs(cases: list[dict], results: Path, procs: int = 2, config: str = "cpu_ddp.yaml",
                env: dict | None = None, timeout: float = 600) -> dict[str, dict]:
    """Training runs one after the other under one start-up (tests/matrix_driver.py): in one process
    (`procs` 1) or in the 2 processes of one `accelerate launch` of accelerate_configs/`config`. A launch
    costs about 6 s before the first step, mostly imports; a tiny run after it a second or two. Each case
    is {"id", "argv", "out", "root"?}, in the order they must run (a resume after the run it resumes).
    id -> the main process's result (its exit, log, curve, checkpoints: matrix_driver); every rank ended
    every run the same way. `results` is a new folder for the ranks' result files."""
    results.mkdir(parents=True)
    spec = results / "cases.json"
    spec.write_text(json.dumps(cases))
    driver = ["tests.matrix_driver", str(spec), str(results)]
    if procs > 1:
        driver = [*LAUNCH, "--config_file", str(CONFIGS / config), "--num_processes", str(procs),
                  "--main_process_port", str(free_port()), "-m", *driver]
    proc = run_module(driver, env={"PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}", **(env or {})},
                      timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    by_rank = [json.loads((results / f"results_{r}.json").read_text()) for r in range(procs)]
    for rank_results in by_rank[1:]:
        assert [(r["id"], r["exit"]) for r in rank_results] == [(r["id"], r["exit"]) for r in by_rank[0]]
    return {r["id"]: r for r in by_rank[0]}


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A running cluster; yields the environment its clients and jobs need."""
    if shutil.which("slurmctld") is None and os.geteuid() != 0:
        pytest.skip("Slurm (slurm-wlm) is not installed and installing it needs root")
    state = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["bash", str(CLUSTER), "start", str(state)], capture_output=True, text=True,
                             timeout=600)
    if started.returncode == 3:
        pytest.skip(started.stderr.strip())
    assert started.returncode == 0, started.stdout + started.stderr
    # jobs run with the submitter's environment: this venv's accelerate, offline Hub, the config
    env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    yield env
    subprocess.run(["bash", str(CLUSTER), "stop", str(state)], capture_output=True, text=True, timeout=120)


# --- tokenizers that are not WordPiece; what a run in this process trained on ------------------------

import contextlib  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402


def save_tiny_masked_lm(family: str, tokenizer_dir: Path, **config: Any) -> Path:
    """A 2-layer masked LM of `family`, the size of `tiny_model`, for the tokenizer saved in
    `tokenizer_dir`, saved beside it; `config`: the family's own fields."""
    import torch
    from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    sizes = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForMaskedLM.from_config(AutoConfig.for_model(family, **{**sizes, **config})).save_pretrained(tokenizer_dir)
    return tokenizer_dir


@pytest.fixture(scope="session")
def tiny_bpe_model(corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer RobertaForMaskedLM and a 600-token byte-level BPE tokenizer (RoBERTa's kind: a word's
    first piece carries the space as 'Ġ', punctuation is a word of its own) trained on the corpus."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tiny_bpe")
    bpe = ByteLevelBPETokenizer()
    bpe.train([str(corpus["train"])], vocab_size=600, min_frequency=2, show_progress=False,
              special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    bpe.save_model(str(root))
    # vocab.json + merges.txt and this config load as a fast RoBERTa tokenizer in transformers 4 and 5
    (root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "RobertaTokenizer",
                                                            "model_max_length": 64}))
    tokenizer = AutoTokenizer.from_pretrained(root)
    assert type(tokenizer).__name__.startswith("RobertaTokenizer") and tokenizer.is_fast and len(tokenizer) == 600
    tokenizer.save_pretrained(root)
    # RoBERTa numbers positions from pad_token_id + 1: two more positions than the 64 tokens
    return save_tiny_masked_lm("roberta", root, max_position_embeddings=66)


@pytest.fixture(scope="session")
def tiny_unigram_model(corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer AlbertForMaskedLM and a 600-piece SentencePiece-style Unigram tokenizer (ALBERT's kind:
    '▁' starts a word, no lower-casing) trained on the corpus, saved as a fast AlbertTokenizer."""
    import transformers
    from tokenizers import SentencePieceUnigramTokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tiny_unigram")
    unigram = SentencePieceUnigramTokenizer()
    unigram.train([str(corpus["train"])], vocab_size=600, special_tokens=["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"],
                  unk_token="<unk>", show_progress=False)
    backend = unigram._tokenizer  # the `tokenizers.Tokenizer` that the wrapper class holds
    backend.post_processor = TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    # AlbertTokenizerFast: the fast class in transformers 4, an alias of AlbertTokenizer in 5
    transformers.AlbertTokenizerFast(
        tokenizer_object=backend, do_lower_case=False, model_max_length=64, unk_token="<unk>", pad_token="<pad>",
        cls_token="[CLS]", sep_token="[SEP]", bos_token="[CLS]", eos_token="[SEP]", mask_token="[MASK]",
    ).save_pretrained(root)
    tokenizer = AutoTokenizer.from_pretrained(root)
    assert type(tokenizer).__name__.startswith("AlbertTokenizer") and tokenizer.is_fast and len(tokenizer) == 600
    assert tokenizer("Return it.")["input_ids"][0] == tokenizer.cls_token_id
    return save_tiny_masked_lm("albert", root, embedding_size=32)


@contextlib.contextmanager
def recorded_batches() -> Iterator[list[tuple[int, list[dict], dict]]]:
    """(split, examples, batch) of every batch a MaskingCollator makes in this process inside the block,
    in order: what a run called here (DataLoader workers: 0) really trained and evaluated on."""
    from mlm_ddp.data.masking import MaskingCollator

    made: list[tuple[int, list[dict], dict]] = []
    collate = MaskingCollator.__call__

    def recording(self: MaskingCollator, examples: list[dict]) -> dict:
        batch = collate(self, examples)
        made.append((self.split, examples, batch))
        return batch

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MaskingCollator, "__call__", recording)
        yield made


def words_masked(batches: list[tuple[int, list[dict], dict]], special_ids: list[int]) -> tuple[int, int]:
    """(words of two or more pieces masked in part, those masked whole) in the training batches. A word:
    a run of non-special tokens, each after the first continuing its predecessor (word_continues)."""
    import numpy as np

    from mlm_ddp.data.masking import IGNORE_INDEX, TRAIN_SPLIT

    part = whole = 0
    for split, examples, batch in batches:
        if split != TRAIN_SPLIT:
            continue
        for row, example in enumerate(examples):
            ids = np.asarray(example["input_ids"])
            selected = batch["labels"][row, : len(ids)].numpy() != IGNORE_INDEX
            ordinary = ~np.isin(ids, special_ids)
            continues = np.asarray(example["word_continues"], dtype=bool) & np.r_[False, ordinary[:-1]]
            for word, kept in zip(np.split(selected, np.flatnonzero(~continues)[1:]),
                                  np.split(ordinary, np.flatnonzero(~continues)[1:]), strict=True):
                if kept.all() and len(word) > 1 and word.any():
                    whole, part = whole + int(word.all()), part + int(not word.all())
    return part, whole


def exact_lines(tokenizer: Any, paragraphs: list[str], count: int, length: int) -> list[str]:
    """`count` lines of the paragraphs' words, each exactly `length` tokens as a run tokenizes a text ([CLS]
    words [SEP]; WordPiece splits at spaces first, so a line's pieces are its words' pieces). Packed or
    streamed in any order, each such text is one block whole: `BySource` then names every block's source."""
    lines: list[str] = []
    words: list[str] = []
    used, budget, pieces = 0, length - 2, {}
    for word in " ".join(paragraphs).split():
        n = pieces.setdefault(word, len(tokenizer(word, add_special_tokens=False)["input_ids"]))
        if used + n > budget:
            continue  # a shorter word will fill the line exactly
        words.append(word)
        used += n
        if used == budget:
            lines.append(" ".join(words))
            words, used = [], 0
            if len(lines) == count:
                break
    assert len(lines) == count and all(len(tokenizer(line)["input_ids"]) == length for line in lines)
    return lines


class BySource:
    """Which source a trained block came from, told by its tokens alone. Each source's blocks are cut here as
    docs/data.md says packing cuts them: its texts tokenized as [CLS] text [SEP], each 1000 texts concatenated
    and cut every `length` tokens (the rest one shorter block). That holds for a map-style run with
    --validation_file (the texts packed in file order), and for any run whose every text is exactly one block
    (`exact_lines`: streamed too, in any order). A block of no source, or of two, fails the count."""

    def __init__(self, tokenizer: Any, files: dict[str, Path], length: int) -> None:
        self.source: dict[tuple[int, ...], str | None] = {}
        for name, path in files.items():
            texts = [line for line in path.read_text().splitlines() if line.strip()]
            for first in range(0, len(texts), 1000):
                ids = [i for row in tokenizer(texts[first:first + 1000])["input_ids"] for i in row]
                for start in range(0, len(ids), length):
                    block = tuple(ids[start:start + length])
                    self.source[block] = name if self.source.get(block, name) == name else None  # None: both
        self.names = list(files)

    def count(self, blocks: list[list[int]]) -> dict[str, dict[str, int]]:
        """Each source's blocks and tokens among `blocks` (each a block's token ids, unmasked)."""
        counted = {name: {"blocks": 0, "tokens": 0} for name in self.names}
        for block in blocks:
            name = self.source.get(tuple(block))
            assert name is not None, f"a trained block of no one source: {block}"
            counted[name]["blocks"] += 1
            counted[name]["tokens"] += len(block)
        return counted


def trained_blocks(made: list[tuple[int, list[dict], dict]]) -> list[list[list[int]]]:
    """The blocks of each training batch `recorded_batches` saw, batch after batch (each block's token ids)."""
    from mlm_ddp.data.masking import TRAIN_SPLIT

    return [[list(e["input_ids"]) for e in examples] for split, examples, _ in made if split == TRAIN_SPLIT]
