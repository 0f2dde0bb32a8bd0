"""A run_mlm_no_trainer.py user's command line works: every flag of that script is accepted with its
meaning or refused with one line; --line_by_line and --pad_to_max_length train, resume and shard
like packed blocks; --gradient_checkpointing computes the same loss; final/ carries a model card."""

from __future__ import annotations

import functools
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from mlm_ddp.config import parse_args
from mlm_ddp.data.masking import TRAIN_SPLIT
from mlm_ddp.train import main, train
from tests.conftest import NO_DROPOUT, SAME_STEPS, read_metrics, recorded_batches, tiny_args, train_losses
from tests.test_topology import launch_with, max_rel_diff

# every flag of transformers' examples/pytorch/language-modeling/run_mlm_no_trainer.py, with a typical
# value as a user would paste it (None: a store_true flag), and where mlm_ddp keeps it
SCRIPT_FLAGS = {
    "--dataset_name": ("wikitext", "data.dataset_name", "wikitext"),
    "--dataset_config_name": ("wikitext-2-raw-v1", "data.dataset_config_name", "wikitext-2-raw-v1"),
    "--train_file": ("train.txt", "data.train_file", ["train.txt"]),  # a list: several sources are mixed
    "--validation_file": ("valid.txt", "data.validation_file", ["valid.txt"]),  # several allowed: a list
    "--validation_split_percentage": ("10", "data.validation_split_percentage", 10.0),
    "--pad_to_max_length": (None, "data.pad_to_max_length", True),
    "--model_name_or_path": ("bert-base-uncased", "model.model_name_or_path", "bert-base-uncased"),
    "--config_name": ("bert-base-uncased", "model.config_name", "bert-base-uncased"),
    "--tokenizer_name": ("bert-base-uncased", "model.tokenizer_name", "bert-base-uncased"),
    "--use_slow_tokenizer": (None, "model.use_slow_tokenizer", True),
    "--per_device_train_batch_size": ("8", "training.per_device_train_batch_size", 8),
    "--per_device_eval_batch_size": ("8", "training.per_device_eval_batch_size", 8),
    "--learning_rate": ("5e-5", "training.learning_rate", 5e-5),
    "--weight_decay": ("0.0", "training.weight_decay", 0.0),
    "--num_train_epochs": ("3", "training.num_train_epochs", 3.0),
    "--max_train_steps": ("1000", "training.max_train_steps", 1000),
    "--gradient_accumulation_steps": ("4", "training.gradient_accumulation_steps", 4),
    "--lr_scheduler_type": ("cosine_with_restarts", "training.lr_scheduler_type", "cosine_with_restarts"),
    "--num_warmup_steps": ("100", "training.num_warmup_steps", 100),
    "--output_dir": ("out", "run.output_dir", "out"),
    "--seed": ("1234", "training.seed", 1234),
    "--model_type": ("bert", "model.model_type", "bert"),
    "--max_seq_length": ("128", "data.max_seq_length", 128),
    "--line_by_line": ("True", "data.line_by_line", True),  # the script's type=bool takes a word
    "--preprocessing_num_workers": ("4", "data.preprocessing_num_workers", 4),
    "--overwrite_cache": (None, "data.overwrite_cache", True),
    "--mlm_probability": ("0.2", "data.mlm_probability", 0.2),
    "--push_to_hub": (None, "run.push_to_hub", True),
    "--hub_model_id": ("me/my-bert", "run.hub_model_id", "me/my-bert"),
    "--hub_token": ("hf_xyz", "run.hub_token", "hf_xyz"),
    "--trust_remote_code": (None, "model.trust_remote_code", True),
    "--checkpointing_steps": ("500", "run.checkpointing_steps", "500"),
    "--resume_from_checkpoint": ("out/checkpoints/step-0000500", "run.resume_from_checkpoint",
                                 "out/checkpoints/step-0000500"),
    "--with_tracking": (None, "run.with_tracking", True),
    "--report_to": ("tensorboard", "run.report_to", "tensorboard"),
    "--low_cpu_mem_usage": (None, "model.low_cpu_mem_usage", True),
}
SCHEDULES = ["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"]


@pytest.mark.parametrize("flag", sorted(SCRIPT_FLAGS))
def test_every_flag_of_the_script_is_accepted_with_its_meaning(flag: str) -> None:
    value, where, expected = SCRIPT_FLAGS[flag]
    cfg = parse_args([flag] if value is None else [flag, value])
    section, name = where.split(".")
    assert getattr(getattr(cfg, section), name) == expected


def test_the_scripts_whole_command_line_parses_at_once() -> None:
    argv = [word for flag, (value, _, _) in SCRIPT_FLAGS.items()
            if flag not in ("--dataset_name", "--dataset_config_name", "--model_type")  # exclusive with others
            for word in ([flag] if value is None else [flag, value])]
    cfg = parse_args(argv)
    assert cfg.data.line_by_line and cfg.data.pad_to_max_length and cfg.run.hub_model_id == "me/my-bert"
    assert cfg.to_dict()["run"]["hub_token"] is None  # never written anywhere


@pytest.mark.parametrize("schedule", SCHEDULES + ["inverse_sqrt"])
def test_every_schedule_of_the_script_is_accepted(schedule: str) -> None:
    assert parse_args(["--lr_scheduler_type", schedule]).training.lr_scheduler_type == schedule


@pytest.mark.parametrize(("extra", "line"), [
    (["--push_to_hub"], "--push_to_hub: the Hub is switched off here (HF_HUB_OFFLINE is set)"),
    (["--with_tracking", "--report_to", "comet_ml"], "--report_to 'comet_ml': unknown tracker"),
    (["--lr_scheduler_type", "reduce_lr_on_plateau"], "it steps on an evaluation metric"),
    (["--model_type", "bert_generation_x"], "--model_type 'bert_generation_x': not a model type"),
    (["--model_type", "gpt2"], "has no masked-LM head"),
])
def test_what_cannot_work_here_stops_before_anything_is_written(tiny_model: Path, corpus: dict, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture, extra: list[str],
                                                                line: str) -> None:
    args = tiny_args(tiny_model, corpus, tmp_path / "run", "--max_train_steps", "1", *extra)
    if "--model_type" in extra:  # from scratch: no trained model, the tiny model's tokenizer
        position = args.index("--model_name_or_path")
        args[position:position + 2] = ["--tokenizer_name", str(tiny_model)]
    assert main(args) == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("mlm_ddp.train: error:")]
    assert len(errors) == 1 and line in errors[0], errors
    assert not (tmp_path / "run").exists()


def test_a_slow_tokenizer_is_refused_only_where_whole_word_masking_needs_word_ids(tiny_model: Path,
                                                                                 tmp_path: Path) -> None:
    import transformers
    from transformers import AutoTokenizer

    from mlm_ddp.config import ModelConfig
    from mlm_ddp.errors import BadInput
    from mlm_ddp.model.loading import load_tokenizer

    # --use_slow_tokenizer on a BERT folder: transformers 4 loads its slow BertTokenizer, 5 has none
    # left and loads the fast one, which gives word ids
    slow_bert_left = int(transformers.__version__.split(".")[0]) < 5
    assert AutoTokenizer.from_pretrained(tiny_model, use_fast=False).is_fast != slow_bert_left
    asked = ModelConfig(model_name_or_path=str(tiny_model), use_slow_tokenizer=True)
    assert load_tokenizer(asked).mask_token == "[MASK]"  # without whole-word masking, any tokenizer
    if slow_bert_left:
        with pytest.raises(BadInput, match="drop --use_slow_tokenizer, or --whole_word_mask"):
            load_tokenizer(asked, needs_word_ids=True)
    else:
        assert load_tokenizer(asked, needs_word_ids=True).is_fast

    # a tokenizer that is slow in both: BertJapaneseTokenizer (Python only) on the same WordPiece vocabulary
    slow = tmp_path / "slow"
    slow.mkdir()
    shutil.copy(tiny_model / "vocab.txt", slow / "vocab.txt")
    (slow / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertJapaneseTokenizer", "word_tokenizer_type": "basic", "do_lower_case": True,
        "subword_tokenizer_type": "wordpiece", "model_max_length": 64}))
    only_slow = ModelConfig(model_name_or_path=str(tiny_model), tokenizer_name=str(slow))
    tokenizer = load_tokenizer(only_slow)
    assert not tokenizer.is_fast and tokenizer.mask_token == "[MASK]"
    with pytest.raises(BadInput, match="is a slow .* pass --tokenizer_name with a fast one"):
        load_tokenizer(only_slow, needs_word_ids=True)
    with pytest.raises(BadInput, match="drop --use_slow_tokenizer, or --whole_word_mask"):
        load_tokenizer(ModelConfig(tokenizer_name=str(slow), use_slow_tokenizer=True,
                                   model_name_or_path=str(tiny_model)), needs_word_ids=True)


# --- --line_by_line, --pad_to_max_length --------------------------------------------------------------


LINES = ["--line_by_line", "--max_train_steps", "6", *NO_DROPOUT, "--per_device_train_batch_size", "16"]
LINE_WORDS = 8  # line i keeps its first 1 + i % LINE_WORDS words: 3 to ~20 tokens, a few cut at 32


@pytest.fixture(scope="module")
def line_corpus(corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The corpus with its training lines cut to 1..8 words. Whole, 76% of them reach --max_seq_length
    32, so nearly every batch of 16 held one, and padding per batch was padding to 32."""
    root = tmp_path_factory.mktemp("line_corpus")
    lines = corpus["train"].read_text().splitlines()
    (root / "train.txt").write_text("\n".join(" ".join(line.split()[: 1 + i % LINE_WORDS])
                                             for i, line in enumerate(lines)) + "\n")
    return {**corpus, "train": root / "train.txt", "root": root}


@pytest.fixture(scope="module")
def line_runs(tiny_model: Path, line_corpus: dict) -> dict[str, Path | list]:
    """One process, line by line: padded per batch, and padded to --max_seq_length; with the batches
    each trained and evaluated on ("<run> batches")."""
    root = line_corpus["root"]
    runs: dict[str, Path | list] = {"batch": root / "batch", "max": root / "max"}
    for name, extra in (("batch", ["--checkpointing_steps", "3"]), ("max", ["--pad_to_max_length"])):
        with recorded_batches() as made:
            train(parse_args(tiny_args(tiny_model, line_corpus, runs[name], *LINES, *extra)))
        runs[f"{name} batches"] = [batch for split, _, batch in made if split == TRAIN_SPLIT]
    return runs


def test_line_by_line_trains_one_line_per_sequence(line_runs: dict, tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    batches = line_runs["batch batches"]
    assert len(batches) == 6 and all(b["input_ids"].shape[0] == 16 for b in batches)
    for batch in batches:  # each row: [CLS] one line [SEP], never two lines packed into a sequence
        for ids, attention in zip(batch["input_ids"], batch["attention_mask"], strict=True):
            length = int(attention.sum())
            assert (attention[:length] == 1).all() and 3 <= length <= 32
            original = ids[:length].tolist()
            assert original[0] == tokenizer.cls_token_id and original[-1] == tokenizer.sep_token_id
            assert tokenizer.cls_token_id not in original[1:-1] and tokenizer.sep_token_id not in original[1:-1]
    first = read_metrics(line_runs["batch"])[1]
    assert first["step"] == 1 and first["tokens_seen"] == int(batches[0]["attention_mask"].sum())
    assert yaml.safe_load((line_runs["batch"] / "config.yaml").read_text())["data"]["line_by_line"] is True


def test_padding_to_max_length_changes_no_loss(line_runs: dict) -> None:
    per_batch, to_max = line_runs["batch batches"], line_runs["max batches"]
    assert [b["input_ids"].shape[1] for b in to_max] == [32] * 6
    widths = [b["input_ids"].shape[1] for b in per_batch]
    assert sum(width < 32 for width in widths) >= 3, widths  # measured: 28, 32, 28, 18, 23, 25
    # the share of padding the model ran on: measured 56% padded per batch, 65% padded to 32
    assert padding_share(per_batch) < padding_share(to_max) - 0.05
    for a, b in zip(per_batch, to_max, strict=True):  # the same tokens and masks, only padded otherwise
        width = a["input_ids"].shape[1]
        assert (b["attention_mask"][:, width:] == 0).all()
        for key in ("input_ids", "attention_mask", "labels"):
            assert (a[key] == b[key][:, :width]).all(), key
    # padded keys are masked out of attention, so only the order of fp32 sums differs (matmuls and
    # softmaxes of other widths): a few ulps (fp32 epsilon 1.2e-7) per operation. Measured: 0 at five
    # steps, 1.1e-7 at one. Letting the padding be attended to moved it by 1.8e-5 to 7.9e-5 (measured
    # with the attention mask set to ones), so the bound sits between the two
    batch, padded = train_losses(line_runs["batch"]), train_losses(line_runs["max"])
    assert sorted(batch) == list(range(1, 7)) and max_rel_diff(batch, padded) <= SAME_STEPS
    assert read_metrics(line_runs["batch"])[-1]["tokens_seen"] == read_metrics(line_runs["max"])[-1]["tokens_seen"]


def padding_share(batches: list[dict]) -> float:
    slots = sum(b["attention_mask"].numel() for b in batches)
    return 1 - sum(int(b["attention_mask"].sum()) for b in batches) / slots


def test_line_by_line_resumes_exactly(line_runs: dict, tiny_model: Path, line_corpus: dict, tmp_path: Path) -> None:
    resumed = tmp_path / "resumed"
    shutil.copytree(line_runs["batch"] / "checkpoints" / "step-0000003", tmp_path / "step-0000003")
    train(parse_args(tiny_args(tiny_model, line_corpus, resumed, *LINES, "--resume_from_checkpoint",
                               str(tmp_path / "step-0000003"))))
    straight, continued = train_losses(line_runs["batch"]), train_losses(resumed)
    assert sorted(continued) == [4, 5, 6]
    assert max(abs(straight[s] - continued[s]) / straight[s] for s in continued) <= SAME_STEPS


def test_line_by_line_on_two_processes_trains_the_one_process_curve(line_runs: dict, tiny_model: Path,
                                                                     line_corpus: dict, tmp_path: Path) -> None:
    proc = launch_with("cpu_ddp.yaml", *tiny_args(tiny_model, line_corpus, tmp_path, *LINES,
                                                  "--per_device_train_batch_size", "8", "--pad_to_max_length"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"lines of at most 32 tokens, [\d.]+ on average \([\d.]+% padding: every batch padded to 32\)",
                     proc.stderr)
    assert max_rel_diff(train_losses(line_runs["batch"]), train_losses(tmp_path)) <= SAME_STEPS


# --- --gradient_checkpointing, the model card -----------------------------------------------------------


def test_gradient_checkpointing_computes_the_same_loss(line_runs: dict, tiny_model: Path, line_corpus: dict,
                                                       tmp_path: Path) -> None:
    train(parse_args(tiny_args(tiny_model, line_corpus, tmp_path, *LINES, "--gradient_checkpointing")))
    assert max_rel_diff(train_losses(line_runs["batch"]), train_losses(tmp_path)) <= SAME_STEPS


def test_gradient_checkpointing_runs_each_layer_again_in_the_backward(tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForMaskedLM

    from mlm_ddp.config import ModelConfig
    from mlm_ddp.model.loading import MaskedLMLoss, with_gradient_checkpointing

    batch = {"input_ids": torch.tensor([[2, 40, 50, 60, 3]]), "attention_mask": torch.ones(1, 5, dtype=torch.long),
             "labels": torch.tensor([[-100, 40, -100, 60, -100]])}
    for enabled, forwards in ((False, 1), (True, 2)):
        model = with_gradient_checkpointing(AutoModelForMaskedLM.from_pretrained(tiny_model),
                                            ModelConfig(gradient_checkpointing=enabled)).train()
        calls: list[int] = []
        model.base_model.encoder.layer[0].attention.register_forward_hook(functools.partial(count, calls))
        MaskedLMLoss(model)(**batch)[0].backward()
        assert len(calls) == forwards


def count(calls: list[int], *_hook_args: object) -> None:
    calls.append(1)


def test_final_carries_a_model_card_and_no_token(tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = train(parse_args(tiny_args(tiny_model, corpus, out, "--max_train_steps", "2",
                                        "--hub_token", "hf_secret_never_written")))
    card = (out / "final" / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["pipeline_tag"] == "fill-mask" and meta["library_name"] == "transformers"
    assert "| training steps | 2 |" in card and f"| tokens trained on | {result.tokens_seen:,} |" in card
    for name in ("before", "after"):
        ppl = (result.eval_before if name == "before" else result.eval_after)["perplexity"]
        assert f"| held-out perplexity {name} training (15% masked) | {ppl:.2f} " in card
    assert "python -m mlm_ddp.train --model_name_or_path" in card and "--max_train_steps 2" in card
    written = [p for p in out.rglob("*") if p.is_file() and b"hf_secret_never_written" in p.read_bytes()]
    assert written == []
