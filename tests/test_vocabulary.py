"""`python -m mlm_ddp.tokenizer --extend`: a model's vocabulary grown by the domain's words, for
WordPiece (BERT), byte-level BPE (RoBERTa) and Unigram (SentencePiece) tokenizers. Every old id and row is
kept; no text tokenizes longer; training from the extended folder works on 1 and 2 processes alike;
bad input is one line and exit 2 before anything is written."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer

from mlm_ddp.tokenizer import main
from mlm_ddp.train import main as train_main
from tests.conftest import SAME_STEPS, corpus_paragraphs, read_metrics, run_module, tiny_args, train_losses
from tests.test_characters import UNICODE_WORDS
from tests.test_fsdp import COMMON, launch
from tests.test_st_files import FILES, make_st_model
from tests.tiny_tokenizers import byte_bpe, unigram

NEW = 30  # tokens added in each family's extension


def tiny_model_with(tokenizer, family: str, root: Path) -> Path:
    """A 2-layer masked LM of `family` ('bert', 'roberta') around `tokenizer`, saved in `root`."""
    tokenizer.save_pretrained(root)
    config = AutoConfig.for_model(family, vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=66 if family == "roberta" else 64,
                                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForMaskedLM.from_config(config).save_pretrained(root)
    return root


def extend(model: Path, corpus: dict, out: Path, *extra: str) -> int:
    return main(["--extend", str(model), "--train_file", str(corpus["train"]), "--output_dir", str(out), *extra])


@pytest.fixture(scope="module")
def extended(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """family -> (the model, its extension by NEW tokens from train.txt)."""
    root = tmp_path_factory.mktemp("vocabulary")
    texts = corpus_paragraphs()[:300]
    models = {"wordpiece": tiny_model, "wordpiece-any": tiny_model,
              "bpe": tiny_model_with(byte_bpe(texts), "roberta", root / "bpe"),
              "unigram": tiny_model_with(unigram(texts), "bert", root / "unigram")}
    for family, model in models.items():
        mode = "any_input" if family == "wordpiece-any" else "text"
        assert extend(model, corpus, root / f"{family}-extended", "--num_new_tokens", str(NEW),
                      "--never_longer", mode) == 0
    return {family: (model, root / f"{family}-extended") for family, model in models.items()}


def adversarial_texts(seed: int, new_words: list[str], count: int, glued: bool) -> list[str]:
    """Texts of corpus words and the new tokens' words, these glued to punctuation, and with `glued` to
    corpus words before and after, to each other, to symbols and to characters outside ASCII: where a new
    token could split a word otherwise."""
    words = " ".join(corpus_paragraphs()[:600]).split()  # train.txt's: the extension read them all
    rng = random.Random(seed)
    glue = ["", "_", "'s", "-", ".", "(", ")"]
    if glued:
        glue += ["s", "ing", "ed", "€", "©", "é", "1", *UNICODE_WORDS]

    def word() -> str:
        kind = rng.random()
        if kind < 0.4:
            return rng.choice(words)
        new = rng.choice(new_words)
        if kind < 0.6:
            return new
        more = [rng.choice(words), rng.choice(new_words)] if glued else []
        if kind < 0.75:
            return new + rng.choice([*glue, *more])
        return rng.choice([*glue, *more]) + new

    return [" ".join(word() for _ in range(rng.randint(1, 25))) for _ in range(count)]


@pytest.mark.parametrize("family", ["wordpiece", "wordpiece-any", "bpe", "unigram"])
def test_every_old_id_and_row_is_kept_and_no_text_gets_longer(family: str, extended: dict) -> None:
    source, out = extended[family]
    old, new = AutoTokenizer.from_pretrained(source), AutoTokenizer.from_pretrained(out)
    report = json.loads((out / "report.json").read_text())
    assert new.is_fast and len(new) == len(old) + NEW == report["new_vocabulary"]
    old_vocab, new_vocab = old.get_vocab(), new.get_vocab()
    assert {token: new_vocab[token] for token in old_vocab} == old_vocab  # same token, same id
    added = report["tokens"]
    assert sorted(t["id"] for t in added) == list(range(len(old), len(old) + NEW))
    assert all(new_vocab[t["token"]] == t["id"] and t["count"] >= 2 and len(t["pieces"]) >= 2 for t in added)
    # the rows: old ones bit-identical, each new one the mean of its old pieces' rows; the head still tied
    before, after = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    grown = {name for name, w in after.items() if w.shape != before[name].shape}
    assert grown and all(after[n].shape[0] == len(new) for n in grown), grown
    for name in grown:
        assert torch.equal(after[name][:len(old)], before[name]), name
        for t in added:
            torch.testing.assert_close(after[name][t["id"]], before[name][t["piece_ids"]].mean(0))
    model = AutoModelForMaskedLM.from_pretrained(out)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.get_output_embeddings().bias.shape == (len(new),)
    # never longer: the text read (report) and generated text where the new tokens meet other words. BPE,
    # Unigram and WordPiece with --never_longer any_input hold it for any word; WordPiece by default for the
    # words of the text read (the extension checks each), and not always for a word never seen that begins
    # with a new token ('asyncestablished': async ##est ##ab ##lish ##ed, one more than before): its greedy
    # longest match is not monotone (docs/vocabulary.md)
    assert report["never_longer"] == ("any_input" if family == "wordpiece-any" else "text")
    passed_over = report["passed_over_as_able_to_lengthen_an_unseen_word"]
    assert passed_over > 0 if family == "wordpiece-any" else passed_over is None
    assert all(m["texts_longer"] == 0 and m["tokens_after"] < m["tokens_before"] for m in report["text"].values())
    surfaces = [new.convert_tokens_to_string([t["token"]]).strip() for t in added]
    texts = adversarial_texts(58, surfaces, 300, glued=family != "wordpiece")
    lengths = [(len(a), len(b)) for a, b in zip(old(texts, add_special_tokens=False)["input_ids"],
                                                new(texts, add_special_tokens=False)["input_ids"], strict=True)]
    assert all(b <= a for a, b in lengths), [t for t, (a, b) in zip(texts, lengths, strict=True) if b > a][:3]
    assert sum(b < a for a, b in lengths) > 150  # and most of them shorter


@pytest.mark.parametrize("case", ["zero", "negative", "slow", "too_few", "too_few_any", "in_use", "no_text"])
def test_bad_input_is_one_line_and_exit_2_before_anything_is_written(case: str, extended: dict, corpus: dict,
                                                                     tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    source, _ = extended["wordpiece"]
    out, flags = tmp_path / "out", ["--num_new_tokens", "5"]
    if case == "slow":  # ByT5's tokenizer is Python code over bytes, with no fast form (and needs no file)
        source = tmp_path / "slow"
        source.mkdir()
        (source / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByT5Tokenizer"}))
    if case in ("zero", "negative"):
        flags = ["--num_new_tokens", "0" if case == "zero" else "-3"]
    if case == "too_few":
        flags = ["--num_new_tokens", "100000"]
    if case == "too_few_any":
        flags = ["--num_new_tokens", "500", "--never_longer", "any_input"]
    if case == "in_use":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    if case == "no_text":
        code = main(["--extend", str(source), "--output_dir", str(out), *flags])
    else:
        code = extend(source, corpus, out, *flags)
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 2 and len(err) == 1, err
    expected = {"zero": "--num_new_tokens must be at least 1, got 0", "negative": "got -3",
                "slow": "not a fast one", "too_few": "the text yields 893 useful tokens",
                "too_few_any": "yields 400 useful tokens (words of several pieces, or pairs of pieces, seen at least "
                               "--min_frequency 2 times) that cannot lengthen any input, and 493 more that could",
                "in_use": "is in use", "no_text": "give --train_file"}[case]
    assert expected in err[0], err[0]
    assert not out.exists() if case != "in_use" else [p.name for p in out.iterdir()] == ["notes.txt"]


def test_one_and_two_processes_train_an_extended_model_alike_with_whole_word_masking(extended: dict, corpus: dict,
                                                                                      tmp_path: Path) -> None:
    """`--model_name_or_path DIR` of an extension: global batch 8 as 1 x 8 and 2 x 4 (fp32, dropout off):
    the same losses and held-out figures (SAME_STEPS); a resume from step 2 takes the same step 3, to the
    bit; final/ keeps the grown vocabulary."""
    _, model = extended["wordpiece"]
    steps = ["--max_train_steps", "3", "--eval_steps", "3", "--whole_word_mask"]
    one, resumed = tmp_path / "one", tmp_path / "resumed"
    args = [*COMMON, *steps, "--per_device_train_batch_size", "8", "--checkpointing_steps", "2"]
    assert train_main(tiny_args(model, corpus, one, *args)) == 0
    shutil.copytree(one / "checkpoints" / "step-0000002", resumed / "checkpoints" / "step-0000002")
    # the records of steps 1-2 only, so that step 3's loss is the resumed run's own
    records = (one / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("".join(f"{r}\n" for r in records if json.loads(r).get("step", 0) <= 2))
    assert train_main(tiny_args(model, corpus, resumed, *args, "--resume_from_checkpoint", "latest")) == 0
    assert sorted(train_losses(resumed)) == [1, 2, 3] and train_losses(resumed)[3] == train_losses(one)[3]
    proc = run_module(launch("cpu_ddp.yaml", model, corpus, tmp_path / "two", *steps,
                             "--per_device_train_batch_size", "4"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    local, distributed = train_losses(one), train_losses(tmp_path / "two")
    assert sorted(distributed) == [1, 2, 3] and all(
        abs(local[s] - distributed[s]) <= SAME_STEPS * local[s] for s in local), (local, distributed)
    last = [[r for r in read_metrics(out) if "eval_loss" in r][-1] for out in (one, tmp_path / "two")]
    assert last[0]["eval_characters"] == last[1]["eval_characters"]
    assert last[1]["eval_bits_per_char"] == pytest.approx(last[0]["eval_bits_per_char"], rel=SAME_STEPS)
    assert len(AutoTokenizer.from_pretrained(one / "final")) == len(AutoTokenizer.from_pretrained(model))


def test_a_sentence_transformers_source_keeps_its_pipeline_and_gets_no_head(tiny_fresh_head: Path, corpus: dict,
                                                                           tmp_path: Path) -> None:
    source = make_st_model(tiny_fresh_head, tmp_path / "st")
    assert extend(source, corpus, tmp_path / "out", "--num_new_tokens", "10") == 0
    for name in FILES:
        assert json.loads((tmp_path / "out" / name).read_text()) == json.loads((source / name).read_text()), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["BertModel"] and config["vocab_size"] == 610  # an encoder, grown


def test_a_wordpiece_word_that_would_lengthen_a_word_of_the_text_is_passed_over() -> None:
    """Greedy longest match: with 'runn' added, 'running' (run ##ning) becomes runn ##i ##n ##g. The most
    saving word 'runn' is dropped for the next one, 'ab'."""
    from collections import Counter

    from tokenizers import Tokenizer, models, pre_tokenizers

    from mlm_ddp.model import vocabulary

    pieces = ["[UNK]", "run", "##n", "##ning", "##i", "##g", "a", "##b"]
    backend = Tokenizer(models.WordPiece({p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    counts = Counter(vocabulary.word_counts(backend, ["runn runn runn runn runn running ab ab ab"]))
    assert [p.value for p in vocabulary.split(backend, "running")] == ["run", "##ning"]
    ext = vocabulary.extend(backend, counts, counts, 1, len(pieces), 2, 0)
    assert [t.token for t in ext.tokens] == ["ab"] and ext.dropped == ["runn"]
    assert [p.value for p in vocabulary.split(ext.backend, "running")] == ["run", "##ning"]
    assert vocabulary.extend(backend, counts, counts, 2, len(pieces), 2, 0).tokens == []  # only one fits


def test_a_wordpiece_word_that_cannot_cross_never_lengthens_any_generated_word() -> None:
    """--never_longer any_input on generated WordPiece vocabularies over four letters: every multi-piece word
    `crosses` lets through, all added at once, leaves each of them followed by any of 150 generated tails,
    and 150 generated words, no longer than before; and among the words it passes over, some do lengthen a
    tail (the check is needed, and the generator finds what it guards against)."""
    from tokenizers import Tokenizer, models

    from mlm_ddp.model import vocabulary

    rng = random.Random(58)
    letters, caught, safe_words = "abcd", 0, 0

    def text(lo: int, hi: int) -> str:
        return "".join(rng.choice(letters) for _ in range(rng.randint(lo, hi)))

    def lengths(vocab: list[str], words: list[str]) -> list[int]:
        model = models.WordPiece({p: i for i, p in enumerate(vocab)}, unk_token="[UNK]")
        return [len(model.tokenize(w)) for w in words]

    for _ in range(30):
        pieces = ["[UNK]", *sorted(set(letters) | {text(2, 4) for _ in range(10)}),
                  *sorted({f"##{c}" for c in letters} | {"##" + text(2, 5) for _ in range(25)})]
        backend = Tokenizer(models.WordPiece({p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
        splits = {w: vocabulary.split(backend, w) for w in {text(3, 8) for _ in range(25)}}
        multi = {w: s for w, s in splits.items() if len(s) > 1}
        extended = vocabulary.proper_prefixes(pieces)
        safe = sorted(w for w, s in multi.items() if not vocabulary.crosses(w, s, "##", extended))
        safe_words += len(safe)
        tails = [text(1, 7) for _ in range(150)]
        probes = [w + t for w in safe for t in tails] + [text(1, 12) for _ in range(150)]
        before, after = lengths(pieces, probes), lengths([*pieces, *safe], probes)
        assert all(a <= b for a, b in zip(after, before, strict=True)), [
            p for p, a, b in zip(probes, after, before, strict=True) if a > b][:3]
        for word in sorted(multi.keys() - set(safe)):
            probes = [word + t for t in tails]
            caught += any(a > b for a, b in zip(lengths([*pieces, word], probes), lengths(pieces, probes),
                                                strict=True))
    assert safe_words > 50 and caught > 5, (safe_words, caught)
