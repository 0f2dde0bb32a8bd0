"""The downstream probe: `python -m mlm_ddp.probe` and `probe()` for training to call.

The task: texts of 8 words drawn from one of two disjoint sets of 20 words of the tiny vocabulary; the
label says which set. Even the tiny model's random weights keep which words a text holds, so a linear
probe separates it; with labels drawn independently of the texts nothing can be learned.

Bounds. A probe that learned nothing predicts test labels it has no information about: on a balanced
test set of N = 400 its accuracy is Binomial(N, 1/2) / N, mean 1/2, standard deviation 1/(2 sqrt(N)) =
0.025. The separable task must reach 0.9: 16 standard deviations above chance (p < 1e-50). With
shuffled labels the mean over seeds must lie within 4 standard deviations of 1/2 (0.4..0.6): the test
labels are a random permutation independent of the texts and of the training set, so for any
prediction the number right is hypergeometric (variance at most the binomial's), and a mean of
equally spread, correlated seeds spreads no more than one seed does.
"""

from __future__ import annotations

import csv
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from mlm_ddp.errors import BadInput
from mlm_ddp.probe.compare import change, describe_change, text_shares
from mlm_ddp.probe.config import ProbeConfig
from mlm_ddp.probe.features import Pooling, encode, finetune_source, load_encoder, pool
from mlm_ddp.probe.standalone import (
    check_probe_data,
    load_probe_data,
    main,
    pooling_for,
    probe,
    settings,
    subsample,
)

REPO = Path(__file__).resolve().parents[1]
N_TEST, CHANCE_SD = 400, 0.5 / 400**0.5
FIELDS = {"accuracy", "accuracy_std", "macro_f1", "macro_f1_std", "majority_accuracy", "n_train", "n_test", "seeds",
          "mode", "protocol", "n_train_available", "settings"}
CPU = torch.device("cpu")


def word_sets() -> tuple[list[str], list[str]]:
    """Two disjoint sets of 20 whole words of the tiny WordPiece vocabulary (each one token)."""
    vocab = (REPO / "tests" / "data" / "wordpiece-600.txt").read_text().split()
    words = sorted(w for w in set(vocab) if w.isalpha() and len(w) >= 4)
    random.Random(0).shuffle(words)
    return words[:20], words[20:40]


def rows(n: int, seed: int, shuffled: bool = False) -> list[dict]:
    """n texts, half from each word set; with `shuffled` the labels are a random permutation, unrelated to them."""
    sets, pick = word_sets(), random.Random(seed)
    out = [{"text": " ".join(pick.choices(sets[i % 2], k=8)), "label": ("alpha", "beta")[i % 2]} for i in range(n)]
    if shuffled:
        labels = [r["label"] for r in out]
        pick.shuffle(labels)
        out = [{**r, "label": label} for r, label in zip(out, labels, strict=True)]
    return out


def write(path: Path, data: list[dict]) -> Path:
    if path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(data[0]) if data else ["text", "label"])
            writer.writeheader()
            writer.writerows(data)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return path


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("probe_task")
    return {"train": write(root / "train.csv", rows(200, 1)), "test": write(root / "test.jsonl", rows(N_TEST, 2)),
            "train_shuffled": write(root / "train_shuffled.csv", rows(200, 3, shuffled=True)),
            "test_shuffled": write(root / "test_shuffled.jsonl", rows(N_TEST, 4, shuffled=True)), "root": root}


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_separable_task_far_above_majority_and_every_model_on_the_same_subsamples(
        tiny_model: Path, tiny_fresh_head: Path, task: dict, capsys: pytest.CaptureFixture) -> None:
    # tiny_fresh_head is tiny_model's encoder saved without its MLM head: the same features, so the same
    # subsamples must give the same figures seed by seed
    args = [str(tiny_model), str(tiny_fresh_head), "--train_file", str(task["train"]), "--test_file",
            str(task["test"]), "--seeds", "3", "--max_seq_length", "32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    results = last_json(out)
    assert list(results) == [str(tiny_model), str(tiny_fresh_head)]
    first, second = results.values()
    assert FIELDS <= set(first)
    # every labeled text by default: one fit, as every seed would fit the same rows
    assert first["mode"] == "linear" and first["seeds"] == 1 and first["n_test"] == N_TEST
    assert first["n_train"] == first["n_train_available"] == 200 and first["protocol"] == "default"
    assert first["majority_accuracy"] == 0.5
    assert first["accuracy"] >= 0.9 and first["macro_f1"] >= 0.9, first  # chance + 16 sd
    assert first["per_seed"] == second["per_seed"] and first["accuracy"] == second["accuracy"]
    assert "200 (of 200)/400" in out
    # the same features: the change is exactly 0, and so is its interval
    assert f"{tiny_fresh_head} - {tiny_model}: accuracy +0.0000 (95% CI +0.0000..+0.0000)" in out
    assert second["change"]["accuracy"] == 0 and second["change"]["accuracy_ci95"] == [0, 0]
    assert out.count("no measurable change") == 1 and "change" not in first
    table = out.splitlines()[:3]
    assert table[0].split()[:3] == ["model", "mode", "features"] and str(tiny_model) in table[1]


def test_shuffled_labels_come_out_near_chance(tiny_model: Path, task: dict) -> None:
    cfg = ProbeConfig(train_file=str(task["train_shuffled"]), test_file=str(task["test_shuffled"]), seeds=3,
                      max_train_per_label=32, max_seq_length=32)
    result = probe(str(tiny_model), None, cfg, CPU)
    assert abs(result["accuracy"] - 0.5) <= 4 * CHANCE_SD, result
    assert result["n_train"] == 64


def test_a_model_in_memory_scores_as_its_folder_and_is_left_as_it_came(tiny_model: Path, task: dict) -> None:
    """What train.py calls: probe(module, tokenizer, cfg, device) on the model it trains."""
    from transformers import AutoTokenizer, BertForMaskedLM

    cfg = ProbeConfig(train_file=str(task["train"]), test_file=str(task["test"]), seeds=2, max_seq_length=32)
    data = load_probe_data(cfg)
    model = BertForMaskedLM.from_pretrained(tiny_model).train()
    in_memory = probe(model, AutoTokenizer.from_pretrained(tiny_model), cfg, CPU, data)
    assert model.training
    assert in_memory == probe(str(tiny_model), None, cfg, CPU, data)


def test_finetune_starts_from_the_weights_in_memory(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertForMaskedLM

    model = BertForMaskedLM.from_pretrained(tiny_model)
    with torch.no_grad():
        model.bert.embeddings.word_embeddings.weight.add_(1.0)  # trained in memory: no folder holds these weights
    source, _, config = finetune_source(model, AutoTokenizer.from_pretrained(tiny_model), tmp_path)
    classifier = AutoModelForSequenceClassification.from_pretrained(source, num_labels=2)
    assert torch.equal(classifier.bert.embeddings.word_embeddings.weight, model.bert.embeddings.word_embeddings.weight)
    assert config.vocab_size == 600


def test_finetune_trains_and_reports(tiny_model: Path, task: dict) -> None:
    # measured: 64 per label, batch 16, lr 3e-3: the loss goes 0.69 -> 0.01 in 10 epochs, 1.0 accuracy
    cfg = ProbeConfig(train_file=str(task["train"]), test_file=str(task["test"]), mode="finetune", seeds=1,
                      max_train_per_label=64, batch_size=16, learning_rate=3e-3, epochs=6, max_seq_length=32)
    before = torch.get_rng_state()
    result = probe(str(tiny_model), None, cfg, CPU)
    assert torch.equal(torch.get_rng_state(), before)  # training's random state goes on as if no probe had run
    losses = result["epoch_loss"]
    assert len(losses) == 6 and losses[-1] < losses[0] / 2, losses
    assert result["mode"] == "finetune" and result["n_train"] == 128
    assert result["accuracy"] >= 0.9, result  # chance + 16 sd


def write_sentence_transformer(encoder: Path, root: Path, pooling: dict) -> Path:
    """A sentence-transformers checkpoint folder: the encoder, modules.json, a Pooling config, Normalize."""
    shutil.copytree(encoder, root)
    modules = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    (root / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(modules)]))
    (root / "1_Pooling").mkdir()
    (root / "2_Normalize").mkdir()
    (root / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (root / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 24, "do_lower_case": False}))
    return root


def test_sentence_transformers_pooling_is_honoured(tiny_fresh_head: Path, tmp_path: Path) -> None:
    # the format all-MiniLM-L6-v2 ships: one boolean per mode
    legacy = {"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False,
              "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}
    folder = write_sentence_transformer(tiny_fresh_head, tmp_path / "st", legacy)
    pooling = Pooling.from_folder(folder)
    assert (pooling.modes, pooling.normalize, pooling.max_seq_length) == (("cls",), True, 24)
    assert pooling_for(ProbeConfig(pooling="max"), folder) == Pooling(("max",), False, 24)  # every model alike
    texts = ["the value of the list", "a", " ".join(["the object is called"] * 12)]  # the last one is cut at 24
    model, tokenizer = load_encoder(str(folder))
    mine = encode(model, tokenizer, texts, pooling, 2, 24, CPU)
    # the tensor maths, one text at a time (no padding): the first token's state, L2-normalised
    with torch.no_grad():
        for text, vector in zip(texts, mine, strict=True):
            hidden = model(**tokenizer(text, truncation=True, max_length=24, return_tensors="pt")).last_hidden_state
            expected = torch.nn.functional.normalize(hidden[:, 0], dim=1)[0].numpy()
            np.testing.assert_allclose(vector, expected, atol=1e-5)
    # the dev extra installs sentence-transformers: a missing package is a failure, not a pass
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(mine, reference, atol=1e-5)


def test_pooling_configs_of_every_format() -> None:
    hidden = torch.tensor([[[1.0, 2.0], [3.0, -4.0], [9.0, 9.0]]])  # (1, 3, 2); the last position is padding
    mask = torch.tensor([[1, 1, 0]])
    assert pool(hidden, mask, Pooling(("mean",))).tolist() == [[2.0, -1.0]]
    assert pool(hidden, mask, Pooling(("cls", "max"))).tolist() == [[1.0, 2.0, 3.0, 2.0]]
    assert pool(hidden, mask, Pooling(("cls",), normalize=True))[0].tolist() == pytest.approx([5**-0.5, 2 * 5**-0.5])


def test_newer_pooling_config_and_a_plain_folder(tmp_path: Path) -> None:
    assert Pooling.from_folder(tmp_path) == Pooling()  # no modules.json: the mean
    (tmp_path / "modules.json").write_text(json.dumps([{"path": "p", "type": "x.Pooling"}]))
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "config.json").write_text(json.dumps({"embedding_dimension": 8, "pooling_mode": ["cls", "max"]}))
    assert Pooling.from_folder(tmp_path).modes == ("cls", "max") and not Pooling.from_folder(tmp_path).normalize
    (tmp_path / "p" / "config.json").write_text(json.dumps({"pooling_mode": "lasttoken"}))
    with pytest.raises(BadInput, match="pooling mode lasttoken .* pass --pooling mean"):
        Pooling.from_folder(tmp_path)


def test_subsamples_are_seeded_at_most_k_per_label() -> None:
    labels = np.array([0] * 50 + [1] * 5 + [2] * 20)
    picks = [subsample(labels, 8, seed) for seed in (0, 0, 1)]
    assert np.array_equal(picks[0], picks[1]) and not np.array_equal(picks[0], picks[2])
    assert np.bincount(labels[picks[0]]).tolist() == [8, 5, 8]
    assert len(subsample(labels, 0, 0)) == len(labels)


def bad_inputs(root: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (flags, what the one line must say)."""
    good_test = write(root / "good_test.jsonl", rows(20, 5))
    empty = root / "empty.csv"
    empty.write_text("")
    one_label = write(root / "one_label.csv", [r | {"label": "alpha"} for r in rows(20, 6)])
    unseen = write(root / "unseen.jsonl", rows(20, 7) + [{"text": "x", "label": "gamma"},
                                                          {"text": "y", "label": "delta"}])
    good_train = write(root / "good_train.csv", rows(40, 8))
    return {
        "missing file": (["--train_file", str(root / "nope.csv"), "--test_file", str(good_test)],
                         f"--train_file {root / 'nope.csv'}: no such file"),
        "missing column": (["--train_file", str(good_train), "--test_file", str(good_test), "--label_column", "topic"],
                           "no label column 'topic'; columns found: text, label"),
        "missing text column": (["--train_file", str(good_train), "--test_file", str(good_test), "--text_column",
                                 "body"], "no text column 'body'; columns found: text, label"),
        "empty file": (["--train_file", str(empty), "--test_file", str(good_test)], "the file is empty"),
        "no rows": (["--train_file", str(write(root / "header.csv", [])), "--test_file", str(good_test)],
                    "holds no rows"),
        "single label": (["--train_file", str(one_label), "--test_file", str(good_test)],
                         "every row has the label 'alpha': a classifier needs at least two labels"),
        "unseen labels": (["--train_file", str(good_train), "--test_file", str(unseen)],
                          "labels not in the training set: 'delta', 'gamma'"),
        "free text": (["--train_file", str(good_train), "--test_file", str(good_test), "--label_column", "text"],
                      "column 'text' gives nearly every row a label of its own (40 distinct values in 40 rows of "
                      f"--train_file {good_train}, 20 in 20 rows of --test_file {good_test}): free text or an "
                      "identifier, not classes"),
        "no test": (["--train_file", str(good_train)], "no --test_file given"),
        "bad flag": (["--train_file", str(good_train), "--test_file", str(good_test), "--seeds", "0"],
                     "--seeds must be at least 1, got 0"),
    }


BAD_INPUTS = ["missing file", "missing column", "missing text column", "empty file", "no rows", "single label",
              "unseen labels", "free text", "no test", "bad flag"]


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_2_before_any_model_loads(case: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    cases = bad_inputs(tmp_path)
    assert sorted(cases) == sorted(BAD_INPUTS)
    flags, says = cases[case]
    # the model does not exist: a message about the data proves it was never loaded
    assert main([str(tmp_path / "no-such-model"), *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlm_ddp.probe: error: ") and says in lines[0], captured.err


def test_help_lists_the_flags(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as ended:
        main(["--help"])
    assert ended.value.code == 0 and "--max_train_per_label" in capsys.readouterr().out


def test_check_probe_data_is_the_preflight(task: dict, tmp_path: Path) -> None:
    check_probe_data(ProbeConfig(train_file=str(task["train"]), test_file=str(task["test"])))
    with pytest.raises(BadInput, match="labels not in the training set"):
        check_probe_data(ProbeConfig(train_file=str(task["train"]),
                                     test_file=str(write(tmp_path / "t.jsonl", [{"text": "a", "label": 3}]))))


def test_a_dataset_folder_with_its_splits(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write(tmp_path / "train.csv", rows(40, 9))
    write(tmp_path / "test.csv", rows(40, 10))
    cfg = ProbeConfig(dataset_name=str(tmp_path), seeds=1)
    data = load_probe_data(cfg)
    assert len(data.train_texts) == 40 and len(data.test_texts) == 40 and data.classes == ["alpha", "beta"]
    assert main([str(tiny_model), "--dataset_name", str(tmp_path), "--test_split", "validation"]) == 2
    assert "has no split 'validation'; splits found: train, test" in capsys.readouterr().err


def test_every_labeled_text_by_default_and_a_cap_is_a_flag(tiny_model: Path, task: dict) -> None:
    """The default trains on all 200 labeled texts; --max_train_per_label caps it, and the
    figures say how many of how many were used."""
    every = probe(str(tiny_model), None, ProbeConfig(train_file=str(task["train"]), test_file=str(task["test"]),
                                                     max_seq_length=32), CPU)
    assert (every["n_train"], every["n_train_available"], every["seeds"]) == (200, 200, 1)
    capped = probe(str(tiny_model), None, ProbeConfig(train_file=str(task["train"]), test_file=str(task["test"]),
                                                      max_train_per_label=8, max_seq_length=32), CPU)
    assert (capped["n_train"], capped["n_train_available"], capped["seeds"]) == (16, 200, 10)
    assert capped["settings"]["max_train_per_label"] == 8 and every["settings"]["max_train_per_label"] == 0


def test_protocol_mteb_is_mteb_exactly(tiny_model: Path, task: dict) -> None:
    """8 per label, 10 experiments, a plain LogisticRegression(max_iter=100) on the raw
    features (no scaler): the figures equal scikit-learn's on the same features and subsamples."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import accuracy_score

    cfg = ProbeConfig(train_file=str(task["train"]), test_file=str(task["test"]), protocol="mteb", max_seq_length=32)
    assert (cfg.max_train_per_label, cfg.seeds) == (8, 10)
    result = probe(str(tiny_model), None, cfg, CPU)
    data = load_probe_data(cfg)
    model, tokenizer = load_encoder(str(tiny_model))
    train_x = encode(model, tokenizer, data.train_texts, Pooling(), 32, 32, CPU)
    test_x = encode(model, tokenizer, data.test_texts, Pooling(), 32, 32, CPU)
    expected = []
    for seed in range(10):
        rows_ = subsample(data.train_labels, 8, seed)
        fitted = LogisticRegression(max_iter=100, random_state=seed).fit(train_x[rows_], data.train_labels[rows_])
        expected.append(accuracy_score(data.test_labels, fitted.predict(test_x)))
    assert result["accuracy_per_seed"] == expected and result["n_train"] == 16 and result["protocol"] == "mteb"
    with pytest.raises(BadInput, match="--protocol mteb is MTEB's classification protocol exactly.*--seeds 3"):
        ProbeConfig(protocol="mteb", seeds=3)
    with pytest.raises(BadInput, match="drop --mode finetune"):
        ProbeConfig(protocol="mteb", mode="finetune")


def test_settings_name_the_files_by_their_contents(task: dict, tmp_path: Path) -> None:
    cfg = ProbeConfig(train_file=str(task["train"]), test_file=str(task["test"]))
    copy = tmp_path / "train.csv"
    shutil.copy(task["train"], copy)
    assert settings(cfg) == settings(ProbeConfig(train_file=str(copy), test_file=str(task["test"])))
    copy.write_text(copy.read_text() + "one more text,alpha\n")
    assert settings(cfg)["train"] != settings(ProbeConfig(train_file=str(copy), test_file=str(task["test"])))["train"]


def test_text_shares_average_to_scikit_learns_figures_and_are_each_texts_influence() -> None:
    """Each text's share of a seed's [accuracy, macro-F1] averages to scikit-learn's figure, a class absent from
    the predictions or from both included (f1_score averages over the labels in y_true or y_pred only). A
    macro-F1 share is the figure plus the text's influence: N - 1 times what leaving the text out takes away
    (the jackknife's pseudo-value), to within O(1/N)."""
    from sklearn.metrics import accuracy_score, f1_score

    rng = np.random.default_rng(1)
    labels, predicted = rng.integers(0, 4, 400), rng.integers(0, 3, (3, 400))
    labels[labels == 3] = 2  # class 3 is in neither; class 3 of 5 is what n_classes adds
    shares = text_shares(labels, predicted, 5)  # (2, 3, 400)
    for seed, said in enumerate(predicted):
        f1 = f1_score(labels, said, average="macro", zero_division=0.0)
        np.testing.assert_allclose(shares[:, seed].mean(axis=1), [accuracy_score(labels, said), f1], rtol=1e-12)
        left_out = np.array([f1_score(np.delete(labels, i), np.delete(said, i), average="macro", zero_division=0.0)
                             for i in range(0, 400, 7)])
        jackknife = f1 + (len(labels) - 1) * (f1 - left_out)
        np.testing.assert_allclose(shares[1, seed, ::7], jackknife, atol=0.01)


def figures(predictions: list[np.ndarray], labels: np.ndarray, **settings_: object) -> dict:
    from sklearn.metrics import accuracy_score, f1_score

    return {"accuracy": float(np.mean([accuracy_score(labels, p) for p in predictions])),
            "macro_f1": float(np.mean([f1_score(labels, p, average="macro") for p in predictions])),
            "predictions_per_seed": [p.tolist() for p in predictions], "settings": {"mode": "linear", **settings_}}


def test_the_change_is_paired_with_an_interval() -> None:
    """After - before, text by text and seed by seed, with a 95% interval that holds 0 where the two differ on a
    handful of texts, and not where one fixes 40 of 400; with one seed it is Student's t
    on the texts' differences (0.1 +- t(0.975, 399) sqrt(0.1 x 0.9 x 400 / 399 / 400)), and seeds that disagree
    widen it."""
    labels = np.arange(400) % 2
    before = labels.copy()
    before[:100] = 1 - before[:100]  # 100 errors: 0.75
    fixed = before.copy()
    fixed[:40] = labels[:40]  # 40 of them fixed, nothing broken: 0.85
    swapped = before.copy()
    swapped[:2] = labels[:2]  # 2 fixed, 2 broken: the same accuracy
    swapped[200:202] = 1 - labels[200:202]
    gain = change(figures([before], labels), figures([fixed], labels), labels)
    half = 1.9659273 * (0.1 * 0.9 / 399) ** 0.5  # t's 97.5% quantile on 399 degrees of freedom
    assert gain["accuracy"] == pytest.approx(0.1) and gain["accuracy_ci95"] == pytest.approx([0.1 - half, 0.1 + half])
    assert describe_change(gain).endswith(": a measurable change")
    level = change(figures([before], labels), figures([swapped], labels), labels)
    assert level["accuracy"] == 0 and level["accuracy_ci95"][0] < 0 < level["accuracy_ci95"][1]
    assert describe_change(level).endswith(": no measurable change")
    # several seeds: seeds that disagree (a change of 0.1 and one of 0) widen the interval past 0
    spread = change(figures([before, before], labels), figures([fixed, swapped], labels), labels)
    assert spread["accuracy"] == pytest.approx(0.05) and spread["accuracy_ci95"][0] <= 0 and spread["seeds"] == 2
    assert spread["accuracy_ci95"][1] - spread["accuracy_ci95"][0] > 2 * (gain["accuracy_ci95"][1] - 0.1)
    with pytest.raises(ValueError, match="other settings .*max_train_per_label 8 -> 0"):
        change(figures([before], labels, max_train_per_label=8), figures([fixed], labels, max_train_per_label=0),
               labels)


def test_finetune_gives_both_models_the_same_head(tiny_model: Path, tiny_fresh_head: Path, task: dict,
                                                  tmp_path: Path) -> None:
    """A source with a trained pooler and a final/ without one (a masked LM's), with the same
    encoder, fine-tune alike: the head (pooler and classifier) is drawn from the seed for both."""
    from transformers import AutoTokenizer, BertModel

    source = BertModel.from_pretrained(tiny_fresh_head)  # BertModel adds a pooler: set it as a trained one would be
    with torch.no_grad():
        source.pooler.dense.weight.fill_(0.05)
    source.save_pretrained(tmp_path / "source")
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(tmp_path / "source")
    cfg = ProbeConfig(train_file=str(task["train"]), test_file=str(task["test"]), mode="finetune", seeds=1,
                      max_train_per_label=16, batch_size=16, learning_rate=3e-3, epochs=2, max_seq_length=32)
    with_pooler, without = probe(str(tmp_path / "source"), None, cfg, CPU), probe(str(tiny_model), None, cfg, CPU)
    assert with_pooler["epoch_loss"] == without["epoch_loss"]
    assert with_pooler["predictions_per_seed"] == without["predictions_per_seed"]
