"""An evaluation per held-out source: `--validation_file valid.txt other.txt` evaluates each file
apart and as their mix, at every evaluation, on 1 process, 2 (gloo DDP) and FSDP alike; one file keeps
the records it always had; bad input is one line and exit 2 before anything is written."""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from mlm_ddp import prepare as prep
from mlm_ddp.config import Config, parse_args
from mlm_ddp.data.text import source_names
from mlm_ddp.errors import BadInput
from mlm_ddp.run import run_folder
from mlm_ddp.run.run_log import tracked, tracker_config
from mlm_ddp.train import main
from tests.conftest import NO_DROPOUT, SAME_STEPS, corpus_paragraphs, read_metrics, run_module, tiny_args, train_losses
from tests.test_fsdp import FSDP_ENV, launch

# dropout off and a constant rate, as test_fsdp's COMMON (which `launch` adds): one process trains the same steps
STEPS = ["--max_train_steps", "4", "--eval_steps", "2", "--checkpointing_steps", "2", *NO_DROPOUT,
         "--lr_scheduler_type", "constant"]
FIGURES = {"loss", "perplexity", "accuracy", "masked_tokens", "bits_per_char", "characters"}
# The mix's sums are the sources' sums added in float64 (53-bit mantissa) after the all-reduce; recomputing
# them from the recorded per-source means and counts costs a few float64 roundings more (2^-53 each, 1.1e-16):
# 1e-12 is that with three orders of margin, and far below fp32's 6e-8, where a mix taken from other sums
# (another batch composition, a source dropped or counted twice) would differ.
FLOAT64_SUMS = 1e-12


@pytest.fixture(scope="module")
def other(corpus: dict) -> Path:
    """A second held-out source: 60 paragraphs of the documentation that neither train.txt nor valid.txt holds."""
    path = corpus["root"] / "other.txt"
    path.write_text("\n".join(corpus_paragraphs()[700:760]) + "\n")
    return path


def sources_args(tiny_model: Path, corpus: dict, out: Path, *files: Path, extra: tuple[str, ...] = ()) -> list[str]:
    return tiny_args(tiny_model, corpus, out, *STEPS, *extra, "--validation_file", *map(str, files))


@pytest.fixture(scope="module")
def runs(tiny_model: Path, corpus: dict, other: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One process, 4 steps, evaluating at 0, 2 and 4: 'two' with valid.txt and other.txt, 'one' with
    valid.txt alone (the records every earlier run wrote)."""
    root = tmp_path_factory.mktemp("eval_sources")
    # both write their report: 'two''s shows the sources, 'one''s has no sources plot
    report = ("--report", "true")
    assert main(sources_args(tiny_model, corpus, root / "two", corpus["valid"], other, extra=report)) == 0
    assert main(sources_args(tiny_model, corpus, root / "one", corpus["valid"], extra=report)) == 0
    return {"two": root / "two", "one": root / "one"}


def evals(out: Path) -> list[dict]:
    return [r for r in read_metrics(out) if "eval_loss" in r]


def test_source_names_are_the_stems_made_unique(tmp_path: Path) -> None:
    assert source_names(["d/general.txt", "d/domain.txt"]) == ["general", "domain"]
    assert source_names(["a/general.txt", "b/general.txt", "c/domain.txt"]) == ["a/general", "b/general", "domain"]
    assert source_names(["x/a/g.txt", "y/a/g.txt"]) == ["x/a/g", "y/a/g"]
    with pytest.raises(BadInput, match="given twice"):  # one file, spelled two ways
        source_names([str(tmp_path / "v.txt"), str(tmp_path / "sub" / ".." / "v.txt")])


def test_a_yaml_list_and_a_single_file_both_parse(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"data": {"validation_file": ["general.txt", "domain.txt"]}}))
    assert parse_args(["--config", str(recipe)]).data.validation_file == ["general.txt", "domain.txt"]
    recipe.write_text(yaml.safe_dump({"validation_file": "valid.txt"}))  # a config.yaml of before lists
    assert parse_args(["--config", str(recipe)]).data.validation_file == ["valid.txt"]
    assert parse_args(["--validation_file", "a.txt", "b.txt"]).data.validation_file == ["a.txt", "b.txt"]


def test_the_cards_command_line_gives_the_held_out_files_back() -> None:
    for files in (["valid.txt"], ["general.txt", "my domain.txt"]):
        cfg = parse_args(["--train_file", "t.txt", "--validation_file", *files])
        assert parse_args(shlex.split(cfg.command_line())[3:]).data.validation_file == files


def test_a_checkpoint_written_before_lists_names_its_file_as_one_source_and_trackers_get_flat_names() -> None:
    """A config.yaml of before --validation_file took several files holds a string: the same file, no change."""
    saved, current = Config().to_dict(), Config().to_dict()
    saved["data"]["validation_file"], current["data"]["validation_file"] = "valid.txt", ["valid.txt"]
    assert run_folder.config_changes(saved, current) == {}
    current["data"]["validation_file"] = ["valid.txt", "other.txt"]
    assert list(run_folder.config_changes(saved, current)) == ["data.validation_file"]
    record = {"step": 2, "eval_loss": 2.0, "tag": "x",
              "eval_sources": {"a": {"loss": 1.0, "perplexity": 2.7, "accuracy": 0.5, "masked_tokens": 9}}}
    cfg = parse_args(["--validation_file", "a.txt", "b.txt"])
    assert tracker_config(cfg)["validation_file"] == "a.txt, b.txt"
    assert tracker_config(parse_args(["--validation_file", "a.txt"]))["validation_file"] == "a.txt"  # as before
    assert tracked(record) == {"eval_loss": 2.0, "eval_loss/a": 1.0, "perplexity/a": 2.7, "eval_accuracy/a": 0.5}


def test_every_evaluation_reports_each_source_and_the_mix_is_their_token_weighted_mean(runs: dict) -> None:
    records = evals(runs["two"])
    assert [r["step"] for r in records] == [0, 2, 4]  # before training, every --eval_steps, the end
    for record in records:
        sources = record["eval_sources"]
        assert list(sources) == ["valid", "other"] and all(set(s) == FIGURES for s in sources.values())
        masked = sum(s["masked_tokens"] for s in sources.values())
        mix_loss = sum(s["loss"] * s["masked_tokens"] for s in sources.values()) / masked
        mix_accuracy = sum(s["accuracy"] * s["masked_tokens"] for s in sources.values()) / masked
        assert record["eval_loss"] == pytest.approx(mix_loss, rel=FLOAT64_SUMS)
        assert record["eval_accuracy"] == pytest.approx(mix_accuracy, rel=FLOAT64_SUMS, abs=FLOAT64_SUMS)
        assert all(s["perplexity"] == pytest.approx(math.exp(s["loss"]), rel=FLOAT64_SUMS) for s in sources.values())
        assert min(s["loss"] for s in sources.values()) < record["eval_loss"] < max(s["loss"] for s in sources.values())
        # bits per character: the sources' characters add up, their bits too
        characters = sum(s["characters"] for s in sources.values())
        mix_bits = sum(s["bits_per_char"] * s["characters"] for s in sources.values()) / characters
        assert record["eval_characters"] == characters > masked
        assert record["eval_bits_per_char"] == pytest.approx(mix_bits, rel=FLOAT64_SUMS)
        assert record["eval_bits_per_char"] == pytest.approx(
            record["eval_loss"] * masked / math.log(2) / characters, rel=FLOAT64_SUMS)


def test_a_source_scores_as_it_does_alone_and_evaluating_more_changes_no_step(runs: dict) -> None:
    """valid.txt within the pair: its own blocks, batches and masks, so exactly its figures as the only
    --validation_file (whose records have no eval_sources, as before); and the same training steps."""
    alone, pair = evals(runs["one"]), evals(runs["two"])
    assert all("eval_sources" not in r for r in alone)
    assert [r["step"] for r in alone] == [r["step"] for r in pair]
    for one, two in zip(alone, pair, strict=True):
        source = two["eval_sources"]["valid"]
        assert (one["eval_loss"], one["perplexity"], one["eval_accuracy"], one["eval_bits_per_char"]) == (
            source["loss"], source["perplexity"], source["accuracy"], source["bits_per_char"])
    assert train_losses(runs["one"]) == train_losses(runs["two"])


def test_summary_closing_line_card_and_report_show_each_source(runs: dict, tiny_model: Path, corpus: dict,
                                                               other: Path, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    out, records = runs["two"], evals(runs["two"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_before"]["sources"] == records[0]["eval_sources"]
    assert summary["eval_after"]["sources"] == records[-1]["eval_sources"]
    assert summary["eval_after"]["bits_per_char"] == records[-1]["eval_bits_per_char"]
    assert "<th>bits per char</th>" in (out / "report.html").read_text()
    card = (out / "final" / "README.md").read_text()
    before, after = records[0]["eval_sources"]["other"], records[-1]["eval_sources"]["other"]
    assert f"| held-out perplexity on other | {before['perplexity']:.2f} -> {after['perplexity']:.2f} |" in card
    assert (out / "report_plots" / "sources.png").is_file()
    assert not (runs["one"] / "report_plots" / "sources.png").exists()
    with caplog.at_level("INFO"):
        assert main(sources_args(tiny_model, corpus, tmp_path / "run", corpus["valid"], other,
                                 extra=("--max_train_steps", "1", "--report", "false"))) == 0
    closing = next(line for line in caplog.text.splitlines() if "done: 1 steps" in line)
    assert "; per source: valid loss " in closing and "; other loss " in closing and " -> " in closing.split("valid")[1]
    assert re.search(r"accuracy [0-9.]+ -> [0-9.]+, [0-9.]+ -> [0-9.]+ bits per character;", closing), closing


def test_two_processes_and_fsdp_give_each_source_the_one_process_figures(runs: dict, tiny_model: Path,
                                                                         corpus: dict, other: Path,
                                                                         tmp_path: Path) -> None:
    """Global batch 8 every way (2 x 4), dropout off, fp32: the same steps summed in another order (SAME_STEPS)."""
    reference = evals(runs["two"])
    for config in ("cpu_ddp.yaml", "fsdp.yaml"):
        out = tmp_path / config
        proc = run_module(launch(config, tiny_model, corpus, out, *STEPS, "--per_device_train_batch_size", "4",
                                 "--validation_file", str(corpus["valid"]), str(other)),
                          env=FSDP_ENV if config == "fsdp.yaml" else None)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = evals(out)
        assert [r["step"] for r in got] == [0, 2, 4]
        for mine, theirs in zip(got, reference, strict=True):
            for name in ("valid", "other"):
                a, b = mine["eval_sources"][name], theirs["eval_sources"][name]
                assert a["masked_tokens"] == b["masked_tokens"], (config, name)  # the same seeded masks
                assert a["accuracy"] == b["accuracy"] and a["characters"] == b["characters"]
                assert a["loss"] == pytest.approx(b["loss"], rel=SAME_STEPS), (config, mine["step"], name)
                assert a["bits_per_char"] == pytest.approx(b["bits_per_char"], rel=SAME_STEPS), (config, name)
            assert mine["eval_characters"] == theirs["eval_characters"]
            assert mine["eval_bits_per_char"] == pytest.approx(theirs["eval_bits_per_char"], rel=SAME_STEPS)


def test_streamed_sources_are_each_evaluated_and_capped(runs: dict, tiny_model: Path, corpus: dict, other: Path,
                                                        tmp_path: Path) -> None:
    """--streaming: each held-out file is its own stream, --max_eval_samples texts of each."""
    out = tmp_path / "stream"
    assert main(sources_args(tiny_model, corpus, out, corpus["valid"], other,
                             extra=("--streaming", "--max_eval_samples", "5", "--report", "false"))) == 0
    first, capped = evals(out)[0], json.loads((out / "summary.json").read_text())["eval_before"]
    assert list(first["eval_sources"]) == ["valid", "other"]
    assert capped["num_tokens"] == sum(s["masked_tokens"] for s in first["eval_sources"].values())
    whole = evals(runs["two"])[0]["eval_sources"]  # every text of each file, map-style
    assert all(0 < first["eval_sources"][name]["masked_tokens"] < whole[name]["masked_tokens"] / 4 for name in whole)


def resumable_copy(runs: dict, tmp_path: Path) -> Path:
    """The 'two' run as it stood after its checkpoint at step 2 (its metrics.jsonl is trimmed on resume)."""
    out = tmp_path / "resumed"
    shutil.copytree(runs["two"], out)
    for later in ("summary.json", "final", "report.html", "report_plots", "checkpoints/step-0000004"):
        path = out / later
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return out


def test_a_resume_keeps_the_sources_before_training_and_reaches_the_same_figures(runs: dict, tiny_model: Path,
                                                                                 corpus: dict, other: Path,
                                                                                 tmp_path: Path) -> None:
    out = resumable_copy(runs, tmp_path)
    assert main(sources_args(tiny_model, corpus, out, corpus["valid"], other,
                             extra=("--resume_from_checkpoint", "latest"))) == 0
    summary, straight = json.loads((out / "summary.json").read_text()), evals(runs["two"])
    assert summary["eval_before"]["sources"] == straight[0]["eval_sources"]
    for name, figures in straight[-1]["eval_sources"].items():
        assert summary["eval_after"]["sources"][name]["loss"] == pytest.approx(figures["loss"], rel=SAME_STEPS)


def test_a_resume_may_change_the_held_out_files_but_not_whether_there_are_any(
        runs: dict, tiny_model: Path, corpus: dict, other: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    """Other files change no step: accepted, with no figures before training compared. Dropping them
    would hold out a share of the training text instead: refused."""
    out = resumable_copy(runs, tmp_path)
    dropped = [a for i, a in enumerate(sources_args(tiny_model, corpus, out, corpus["valid"]))
               if a != "--validation_file" and not a.endswith("valid.txt")]
    assert main([*dropped, "--resume_from_checkpoint", "latest"]) == 2
    assert "data.validation_file" in capsys.readouterr().err
    assert main(sources_args(tiny_model, corpus, out, other, extra=("--resume_from_checkpoint", "latest"))) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_before"] is None and summary["eval_after"]["num_tokens"] > 0


@pytest.mark.parametrize("case", ["missing", "empty", "twice", "split", "prepare"])
def test_bad_validation_sources_are_one_line_and_exit_2_before_anything_is_written(
        case: str, tiny_model: Path, corpus: dict, other: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out, empty = tmp_path / "out", tmp_path / "empty.txt"
    empty.write_text("")
    files, extra = {"missing": [corpus["valid"], tmp_path / "nope.txt"], "empty": [corpus["valid"], empty],
                    "twice": [corpus["valid"], corpus["root"] / "." / "valid.txt"],
                    "split": [corpus["valid"], other], "prepare": [corpus["valid"], other]}[case], ()
    if case == "split":
        extra = ("--validation_split_percentage", "10")
    if case == "prepare":
        code = prep.main(["--model_name_or_path", str(tiny_model), "--train_file", str(corpus["train"]),
                          "--output_dir", str(out), "--validation_file", *map(str, files)])
    else:
        code = main(sources_args(tiny_model, corpus, out, *files, extra=extra))
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 2 and len(err) == 1, err
    expected = {"missing": "nope.txt: no such file", "empty": "empty.txt: the file is empty", "twice": "given twice",
                "split": "give one of the two", "prepare": "prepare writes one held-out set"}[case]
    assert expected in err[0]
    assert not out.exists()
