"""`python -m mlm_ddp.tokenizer`: a WordPiece tokenizer trained on the text training reads, usable by
AutoTokenizer, whole-word masking and `mlm_ddp.train`, the same every time for the same text."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from mlm_ddp.tokenizer import main
from tests.conftest import tiny_args

VOCAB = 800


def train_into(out: Path, *flags: str) -> None:
    assert main(["--vocab_size", str(VOCAB), "--output_dir", str(out), *flags]) == 0


@pytest.fixture(scope="module")
def trained(corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A tokenizer made by the command's main (its `python -m` entry answers --help: tests/test_layout.py); its
    folder and the command's stdout."""
    out = tmp_path_factory.mktemp("tokenizer") / "tok"
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        code = main(["--train_file", str(corpus["train"]), "--vocab_size", str(VOCAB), "--output_dir", str(out)])
    assert code == 0, said.getvalue()[-3000:]
    return out, said.getvalue()


def word_groups(maskable: np.ndarray, continues: np.ndarray) -> list[list[int]]:
    """Positions of each maskable word of a block: a piece continuing a maskable piece joins its word."""
    groups: list[list[int]] = []
    for position in np.flatnonzero(maskable):
        if position > 0 and continues[position] and maskable[position - 1]:
            groups[-1].append(int(position))
        else:
            groups.append([int(position)])
    return groups


def test_trained_tokenizer_loads_encodes_and_masks_whole_words(trained: tuple[Path, str], corpus: dict) -> None:
    from transformers import AutoTokenizer

    from mlm_ddp.data.masking import IGNORE_INDEX, MaskingCollator
    from mlm_ddp.data.pack import tokenize_and_pack

    out, stdout = trained
    assert stdout.strip().splitlines() == [
        f"mlm_ddp.tokenizer: a vocabulary of {VOCAB} tokens from 600 texts, written to {out}; "
        f"train with it: python -m mlm_ddp.train --tokenizer_name {out}"
    ]
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.is_fast and tokenizer.model_max_length == 512
    assert (tokenizer.pad_token, tokenizer.unk_token, tokenizer.cls_token, tokenizer.sep_token,
            tokenizer.mask_token) == ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
    # 600 paragraphs hold more than 800 pieces that occur twice: the vocabulary is full
    assert len(tokenizer) == VOCAB == len(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"])

    lines = corpus["train"].read_text().splitlines()
    sentence = lines[0]
    encoded = tokenizer(sentence)
    pieces = tokenizer.convert_ids_to_tokens(encoded["input_ids"])
    assert pieces[0] == "[CLS]" and pieces[-1] == "[SEP]" and "[UNK]" not in pieces
    assert tokenizer.convert_ids_to_tokens(tokenizer("python", "the")["input_ids"]) == [
        "[CLS]", "python", "[SEP]", "the", "[SEP]"]
    # every word of the sentence is its pieces, the later ones marked '##', lowercased
    words = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(sentence.lower())
    word_ids = encoded.word_ids()
    for index, (word, _) in enumerate(words):
        own = [pieces[position] for position, owner in enumerate(word_ids) if owner == index]
        assert own[0] == word[: len(own[0])] and all(piece.startswith("##") for piece in own[1:])
        assert "".join(piece.removeprefix("##") for piece in own) == word
    assert any(len([owner for owner in word_ids if owner == index]) > 1 for index in range(len(words)))

    packed = tokenize_and_pack(lines[:40], tokenizer, 32, with_word_continues=True)
    blocks = [{"input_ids": ids, "word_continues": continues}
              for ids, continues in zip(packed["input_ids"], packed["word_continues"], strict=True)]
    for block in blocks:  # the masking's word boundaries are the '##' marks
        marked = [piece.startswith("##") for piece in tokenizer.convert_ids_to_tokens(block["input_ids"])]
        assert marked == [bool(flag) for flag in block["word_continues"]]
    collator = MaskingCollator.for_tokenizer(tokenizer, mlm_probability=0.3, whole_word_mask=True)
    batch = collator(blocks)
    selected_pieces = selected_long_words = 0
    for row, block in enumerate(blocks):
        ids = np.asarray(block["input_ids"])
        selected = batch["labels"][row, : len(ids)].numpy() != IGNORE_INDEX
        maskable = ~np.isin(ids, tokenizer.all_special_ids)
        for group in word_groups(maskable, np.asarray(block["word_continues"], dtype=bool)):
            assert selected[group].all() or not selected[group].any(), (row, group)
            selected_long_words += len(group) > 1 and bool(selected[group].all())
        selected_pieces += int(selected.sum())
        assert not selected[~maskable].any()
    assert selected_long_words > 0 and selected_pieces > 0


def test_same_text_from_txt_jsonl_and_a_stream_gives_the_same_vocabulary(
        trained: tuple[Path, str], corpus: dict, tmp_path: Path) -> None:
    reference = (trained[0] / "tokenizer.json").read_bytes()
    again = tmp_path / "again"
    train_into(again, "--train_file", str(corpus["train"]))
    assert (again / "tokenizer.json").read_bytes() == reference  # deterministic, to the byte

    lines = corpus["train"].read_text().splitlines()
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps({"id": index, "body": line}) + "\n" for index, line in enumerate(lines)))
    from_jsonl, streamed = tmp_path / "jsonl", tmp_path / "streamed"
    train_into(from_jsonl, "--train_file", str(jsonl), "--text_column", "body")
    train_into(streamed, "--train_file", str(corpus["train"]), "--streaming")
    vocab = json.loads(reference)["model"]["vocab"]
    for folder in (from_jsonl, streamed):
        assert json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"] == vocab, folder


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("vocab_too_small", r"--vocab_size 50 is too small: .* give at least \d+"),
        ("missing_file", r"--train_file .*nope\.txt: no such file"),
        ("holds_a_tokenizer", r"--output_dir .* already holds a tokenizer .*--overwrite_output_dir"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(case: str, message: str, trained: tuple[Path, str], corpus: dict,
                                               tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out, train_file, extra = tmp_path / "out", corpus["train"], []
    if case == "vocab_too_small":
        extra = ["--vocab_size", "50"]
    elif case == "missing_file":
        train_file = tmp_path / "nope.txt"
    else:
        shutil.copytree(trained[0], out)
    flags = ["--train_file", str(train_file), "--output_dir", str(out), *extra]
    before = sorted(path.name for path in tmp_path.rglob("*"))
    capsys.readouterr()
    assert main(flags) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("mlm_ddp.tokenizer: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert re.search(message, errors[0]), errors[0]
    assert sorted(path.name for path in tmp_path.rglob("*")) == before


def test_overwrite_output_dir_replaces_the_tokenizer(trained: tuple[Path, str], corpus: dict, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "tok"
    train_into(out, "--train_file", str(corpus["train"]), "--max_train_samples", "100")
    assert " from 100 texts, " in capsys.readouterr().out  # texts, not training's packed sequences
    small = (out / "tokenizer.json").read_bytes()
    train_into(out, "--train_file", str(corpus["train"]), "--overwrite_output_dir")
    assert small != (out / "tokenizer.json").read_bytes() == (trained[0] / "tokenizer.json").read_bytes()
    assert sorted(path.name for path in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]


def test_pretraining_from_scratch_with_the_new_tokenizer(trained: tuple[Path, str], corpus: dict,
                                                       tmp_path: Path) -> None:
    """README's recipe, tiny: a tokenizer trained on the text, a fresh BERT of --model_type bert whose
    vocabulary follows it, whole-word masking; the held-out perplexity falls and final/ fills masks."""
    from transformers import AutoTokenizer, pipeline

    from mlm_ddp.config import parse_args
    from mlm_ddp.train import train

    tokenizer_dir, _ = trained
    out = tmp_path / "run"
    args = tiny_args(tokenizer_dir, corpus, out, "--max_train_steps", "30", "--learning_rate", "2e-3",
                     "--num_warmup_steps", "3", "--whole_word_mask", "--model_type", "bert", "--config_overrides",
                     "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64,"
                     "max_position_embeddings=64")
    position = args.index("--model_name_or_path")
    args[position] = "--tokenizer_name"  # no trained model: from scratch
    result = train(parse_args(args))
    assert result.eval_after["perplexity"] < 0.75 * result.eval_before["perplexity"]  # 818 -> 537 measured
    final = AutoTokenizer.from_pretrained(out / "final")
    assert final.get_vocab() == AutoTokenizer.from_pretrained(tokenizer_dir).get_vocab()
    fill = pipeline("fill-mask", model=str(out / "final"), tokenizer=str(out / "final"))
    predictions = fill(f"the value of the {final.mask_token} is returned")
    assert len(predictions) == 5 and all(p["token_str"] for p in predictions)
    card = (out / "final" / "README.md").read_text()
    assert "a bert pretrained from scratch (config: bert)" in card
