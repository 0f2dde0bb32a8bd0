"""The downstream probe inside a training run: --probe_train_file / --probe_test_file score the
starting model before training and final/ after it; `before` is the standalone probe's figure of the
starting model (same seeds, same subsamples); summary.json, metrics.jsonl, the closing line, the model
card and the report carry both; bad probe files stop the run before anything is written; two processes
finish (the others wait in the patient group while rank 0 probes). --probe_every_eval probes at each
evaluation and keeps the model of the best one as best_probe/, which probes to the figure recorded."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from mlm_ddp.config import parse_args
from mlm_ddp.errors import BadInput
from mlm_ddp.probe.config import ProbeConfig
from mlm_ddp.probe.standalone import load_probe_data, probe
from mlm_ddp.run.probing import held_out
from mlm_ddp.train import main, train
from tests.conftest import CONFIGS, LAUNCH, free_port, read_metrics, run_module, tiny_args
from tests.test_eval_masking import fresh_accelerate_state
from tests.test_probe import rows, write

STEPS = 4


@pytest.fixture(scope="module")
def probe_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("probe_task")
    return {"train": write(root / "train.csv", rows(80, seed=1)), "test": write(root / "test.csv", rows(100, seed=2))}


def probed_args(tiny_model: Path, corpus: dict, out: Path, files: dict[str, Path], *extra: str) -> list[str]:
    return tiny_args(tiny_model, corpus, out, "--max_train_steps", str(STEPS), "--probe_train_file",
                     str(files["train"]), "--probe_test_file", str(files["test"]), "--probe_seeds", "3", *extra)


@pytest.fixture(scope="module")
def probed_run(tiny_model: Path, corpus: dict, probe_files: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("probed") / "run"
    train(parse_args(probed_args(tiny_model, corpus, out, probe_files, "--probe_every_eval", "--eval_steps",
                                 str(STEPS // 2), "--report", "true")))
    return out


def test_before_is_the_standalone_probe_of_the_starting_model(probed_run: Path, tiny_model: Path,
                                                               probe_files: dict) -> None:
    standalone = probe(tiny_model, None, ProbeConfig(train_file=str(probe_files["train"]),
                                                     test_file=str(probe_files["test"]), seeds=3))
    summary = json.loads((probed_run / "summary.json").read_text())["probe"]
    for key in ("accuracy", "macro_f1", "accuracy_std", "majority_accuracy"):
        assert summary["before"][key] == standalone[key], key
    after = probe(probed_run / "final", None, ProbeConfig(train_file=str(probe_files["train"]),
                                                          test_file=str(probe_files["test"]), seeds=3))
    assert summary["after"]["accuracy"] == after["accuracy"] and summary["after"]["macro_f1"] == after["macro_f1"]
    assert summary["before"]["accuracy"] > summary["before"]["majority_accuracy"]  # the task is learnable
    # the paired change with its interval, and the per-seed figures it pairs
    delta = summary["change"]
    assert delta["accuracy"] == summary["after"]["accuracy"] - summary["before"]["accuracy"]
    assert delta["accuracy_ci95"][0] <= delta["accuracy"] <= delta["accuracy_ci95"][1]
    assert delta["macro_f1_ci95"][0] <= delta["macro_f1"] <= delta["macro_f1_ci95"][1]
    assert delta["seeds"] == 1 and delta["n_test"] == 100 and len(summary["before"]["accuracy_per_seed"]) == 1
    after_line = [r for r in read_metrics(probed_run) if r.get("probe") == "after"][-1]
    assert after_line["probe_change_accuracy"] == delta["accuracy"]
    assert after_line["probe_change_macro_f1_ci95_low"] == delta["macro_f1_ci95"][0]


def test_metrics_card_and_report_carry_both(probed_run: Path) -> None:
    lines = [r for r in read_metrics(probed_run) if "probe" in r]
    assert [(r["probe"], r["step"]) for r in lines] == [("before", 0), ("eval", STEPS // 2), ("eval", STEPS),
                                                         ("after", STEPS)]
    # an evaluation's probe is scored on held-out training texts, never on the test set
    assert all("probe_accuracy" not in r and 0 <= r["probe_heldout_accuracy"] <= 1 for r in lines[1:3])
    assert all(0 <= r["probe_accuracy"] <= 1 and 0 <= r["probe_macro_f1"] <= 1 for r in (lines[0], lines[3]))
    card = (probed_run / "final" / "README.md").read_text()
    assert "## Downstream probe" in card and "| before |" in card and "| after |" in card and "| best (step " in card
    report = (probed_run / "report.html").read_text() if (probed_run / "report.html").exists() else ""
    assert "downstream probe" in report.lower() and "probe.png" in report  # the curve over evaluations
    assert "measurable change" in report and "measurable change" in card  # the paired change, with its interval


def test_the_closing_line_names_the_probe(tiny_model: Path, corpus: dict, probe_files: dict, tmp_path: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    assert main(probed_args(tiny_model, corpus, tmp_path / "run", probe_files, "--max_train_steps", "1",
                            "--report", "false")) == 0
    done = [line for line in caplog.text.splitlines() if "done: " in line]
    assert done and "; probe accuracy " in done[-1], caplog.text[-2000:]
    assert " (change: accuracy " in done[-1] and "(95% CI " in done[-1], done[-1]


def test_a_bad_probe_file_stops_the_run_before_anything_is_written(tiny_model: Path, corpus: dict, tmp_path: Path,
                                                                   probe_files: dict) -> None:
    one_label = write(tmp_path / "one.csv", [{"text": "a b c", "label": "x"}] * 20)
    out = tmp_path / "run"
    with pytest.raises(BadInput, match="check --probe_label_column 'label'"):
        train(parse_args(probed_args(tiny_model, corpus, out, {"train": one_label, "test": probe_files["test"]})))
    # the errors name the flags of the run, not the standalone probe's (--train_file is the MLM text's)
    with pytest.raises(BadInput, match=r"^--probe_train_file \S*missing.csv: no such file$"):
        train(parse_args(probed_args(tiny_model, corpus, out, {"train": str(tmp_path / "missing.csv"),
                                                               "test": probe_files["test"]})))
    no_text = write(tmp_path / "no_text.csv", [{"body": "a b c", "label": "x"}] * 20)
    with pytest.raises(BadInput, match="Pass --probe_text_column with one of them"):
        train(parse_args(probed_args(tiny_model, corpus, out, {"train": no_text, "test": probe_files["test"]})))
    assert not out.exists()
    with pytest.raises(BadInput, match="both --probe_train_file and --probe_test_file"):
        parse_args(tiny_args(tiny_model, corpus, out, "--probe_train_file", str(one_label)))


def test_two_processes_finish_with_the_probe(tiny_model: Path, corpus: dict, probe_files: dict,
                                             tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_module([*LAUNCH, "--config_file", str(CONFIGS / "cpu_ddp.yaml"), "--num_processes", "2",
                       "--main_process_port", str(free_port()), "-m", "mlm_ddp.train",
                       *probed_args(tiny_model, corpus, out, probe_files, "--report", "false",
                                    "--save_timeout", "120", "--probe_every_eval", "--eval_steps", "2")],
                      timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())["probe"]
    assert summary["before"]["accuracy"] > 0 and summary["after"]["accuracy"] > 0
    assert summary["best"]["step"] in (2, 4) and (out / "best_probe" / "config.json").exists()


def test_every_eval_keeps_the_best_probe(probed_run: Path, probe_files: dict) -> None:
    """best_probe/ is chosen on a seeded held-out split of the probe's training texts, and
    scored on the test set once, reported apart."""
    evals = [r for r in read_metrics(probed_run) if r.get("probe") == "eval"]
    best = max(evals, key=lambda r: r["probe_heldout_accuracy"])  # the first of equals: a tie keeps the earlier
    kept = json.loads((probed_run / "best_probe" / "probe.json").read_text())
    assert kept["step"] == best["step"] and kept["heldout_accuracy"] == best["probe_heldout_accuracy"]
    assert json.loads((probed_run / "summary.json").read_text())["probe"]["best"] == kept
    cfg = ProbeConfig(train_file=str(probe_files["train"]), test_file=str(probe_files["test"]), seeds=3)
    split = held_out(load_probe_data(cfg))
    assert len(split.test_texts) == 16 and len(split.train_texts) == 64  # 20% of 80, both labels alike
    assert np.bincount(split.test_labels).tolist() == [8, 8]
    assert set(split.test_texts) <= set(load_probe_data(cfg).train_texts)  # training texts, not test texts
    chosen = probe(probed_run / "best_probe", None, cfg, data=split)
    assert chosen["accuracy"] == kept["heldout_accuracy"] and chosen["n_test"] == kept["n_heldout"] == 16
    again = probe(probed_run / "best_probe", None, cfg)
    assert again["accuracy"] == kept["test"]["accuracy"] and again["macro_f1"] == kept["test"]["macro_f1"]
    assert not list(probed_run.glob(".tmp-*")) and not list(probed_run.glob(".old-*"))


def test_every_eval_needs_the_probe_and_evaluations(tiny_model: Path, corpus: dict, probe_files: dict,
                                                    tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="--probe_every_eval .* --probe_train_file"):
        parse_args(tiny_args(tiny_model, corpus, tmp_path, "--probe_every_eval", "--eval_steps", "2"))
    with pytest.raises(BadInput, match="--eval_steps"):
        parse_args(probed_args(tiny_model, corpus, tmp_path, probe_files, "--probe_every_eval"))


def test_a_resume_with_other_probe_settings_measures_before_again(tiny_model: Path, corpus: dict, probe_files: dict,
                                                                 tmp_path: Path) -> None:
    """A first attempt probed with 4 texts per label, resumed with the default (all 80):
    `before` is measured again with the resume's settings, on the starting model, and so compares with `after`."""
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    train(parse_args(probed_args(tiny_model, corpus, first, probe_files, "--probe_max_train_per_label", "4",
                                 "--max_train_steps", "2", "--checkpointing_steps", "2", "--report", "false")))
    assert json.loads((first / "probe_before.json").read_text())["n_train"] == 8
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(first / "checkpoints" / "step-0000002", resumed / "checkpoints" / "step-0000002")
    for name in ("metrics.jsonl", "probe_before.json"):
        shutil.copy(first / name, resumed / name)
    fresh_accelerate_state()
    train(parse_args(probed_args(tiny_model, corpus, resumed, probe_files, "--max_train_steps", "3",
                                 "--resume_from_checkpoint", "latest", "--report", "false", "--allow_lr_jump")))
    summary = json.loads((resumed / "summary.json").read_text())["probe"]
    standalone = probe(tiny_model, None, ProbeConfig(train_file=str(probe_files["train"]),
                                                     test_file=str(probe_files["test"]), seeds=3))
    assert summary["before"]["n_train"] == summary["after"]["n_train"] == 80
    assert summary["before"]["settings"] == summary["after"]["settings"] == standalone["settings"]
    assert summary["before"]["accuracy"] == standalone["accuracy"]
    # the first attempt's lines, then the resume's: before measured again
    assert [r["probe"] for r in read_metrics(resumed) if "probe" in r] == ["before", "after", "before", "after"]


@pytest.mark.parametrize("flags", [["--config_overrides", "hidden_dropout_prob=0"], ["--trust_remote_code"]])
def test_before_must_be_the_model_training_starts_from(tiny_model: Path, corpus: dict, probe_files: dict,
                                                       tmp_path: Path, flags: list[str]) -> None:
    """'before' reads the starting checkpoint's folder; where the flags make training start
    from another model, the combination is refused in one line before anything is written."""
    out = tmp_path / "run"
    with pytest.raises(BadInput, match=f"--probe_train_file with {flags[0]}: the probe's 'before' reads"):
        train(parse_args(probed_args(tiny_model, corpus, out, probe_files, *flags)))
    assert not out.exists()


def test_a_resume_from_before_the_best_probe_sets_it_aside_with_the_abandoned_future(
        tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    """best_probe/ chosen after the checkpoint that a resume goes back to is the abandoned future's model: it goes
    with that future's checkpoints, and the new future's evaluations choose anew. Left in place, it stayed the
    run's best unless beaten: here the first future's best is at its step 4, and a new future from step 1 that
    ends at step 3 reported it as its best, a model it never trained."""
    # labels unrelated to the texts, a high rate: the held-out accuracy moves from one evaluation to the next
    files = {"train": write(tmp_path / "train.csv", rows(80, seed=1, shuffled=True)),
             "test": write(tmp_path / "test.csv", rows(100, seed=2, shuffled=True))}
    out = tmp_path / "run"
    args = probed_args(tiny_model, corpus, out, files, "--probe_every_eval", "--eval_steps", "1", "--max_train_steps",
                       "4", "--checkpointing_steps", "1", "--learning_rate", "5e-2", "--report", "false")
    train(parse_args(args))
    chosen = json.loads((out / "best_probe" / "probe.json").read_text())["step"]
    assert chosen >= 3, "the setup must choose a best after step 2 (an evaluation beat the first two)"
    end = chosen - 1
    fresh_accelerate_state()
    train(parse_args([*args, "--max_train_steps", str(end), "--allow_lr_jump", "--resume_from_checkpoint",
                      str(out / "checkpoints" / "step-0000001")]))
    aside = out / "checkpoints" / "abandoned-after-step-0000001"
    assert json.loads((aside / "best_probe" / "probe.json").read_text())["step"] == chosen  # kept, out of the way
    best = json.loads((out / "summary.json").read_text())["probe"]["best"]
    heldout = {r["step"]: r["probe_heldout_accuracy"] for r in read_metrics(out) if r.get("probe") == "eval"}
    assert sorted(heldout) == list(range(1, end + 1))  # step 1's from the common past, then the new future's
    new = max(v for s, v in heldout.items() if s > 1)
    assert 1 < best["step"] <= end and best["heldout_accuracy"] == heldout[best["step"]] == new
    assert json.loads((out / "best_probe" / "probe.json").read_text())["step"] == best["step"]
