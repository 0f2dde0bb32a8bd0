"""The paths beside the tested ones: another run's folder, an attempt that saved nothing, a model
that lacks sdpa or does not load, torn files, a resume from an older checkpoint, a main process that
works longer than --ddp_timeout, old torch. Each ends finished, or with exit 2 and one line and
nothing changed. (Generated configurations: tests/test_matrix.py.)"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForMaskedLM

from mlm_ddp.errors import EXIT_BAD_INPUT, EXIT_REQUEUE, BadInput
from mlm_ddp.loop.checkpoint import SAFE_LOADING_TORCH, check_safe_loading
from mlm_ddp.run.report import facts, read_runs
from mlm_ddp.train import Hooks, main
from tests.conftest import (
    CONFIGS,
    LAUNCH,
    REPO,
    free_port,
    read_metrics,
    run_module,
    tiny_args,
    tiny_family_model,
    train_losses,
)
from tests.test_reliability import snapshot

QUICK = ["--report", "false", "--cpu_threads", "1"]


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("mlm_ddp.train: error:")]


@pytest.fixture(scope="module")
def finished(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(tiny_args(tiny_model, corpus, out, "--max_train_steps", "4", "--checkpointing_steps", "2",
                          *QUICK)) == 0
    return out


def copy_run(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def stop_in(step: int | None) -> Hooks:
    """SIGUSR1 to this process at its first beat of `step` (any step: its first beat), as a preemption would."""
    sent: list[int] = []

    def on_beat(beat) -> None:
        if not sent and (step is None or beat.step == step):
            sent.append(beat.step)
            os.kill(os.getpid(), signal.SIGUSR1)
    return Hooks(on_beat=on_beat)


# --- the output folder, whatever the resume source --------------------------------------------------


def test_a_checkpoint_is_continued_in_another_folder_only_if_it_holds_no_run_or_is_overwritten(
        finished: Path, tiny_model: Path, corpus: dict, tmp_path: Path, capsys) -> None:
    other = copy_run(finished, tmp_path / "other")
    source = str(finished / "checkpoints" / "step-0000002")
    before = snapshot(tmp_path), snapshot(finished)
    args = tiny_args(tiny_model, corpus, other, "--max_train_steps", "4", "--checkpointing_steps", "2", *QUICK,
                     "--resume_from_checkpoint", source)
    assert main(args) == EXIT_BAD_INPUT
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and f"--output_dir {other} holds another run" in lines[0], lines
    assert (snapshot(tmp_path), snapshot(finished)) == before  # neither run touched

    assert main([*args, "--overwrite_output_dir"]) == 0  # asked for: the other run is replaced
    assert sorted(train_losses(other)) == [3, 4]
    assert train_losses(other) == {s: v for s, v in train_losses(finished).items() if s > 2}
    assert snapshot(finished) == before[1]

    # a checkpoint inside the folder that --overwrite_output_dir would delete: refused
    own = str(other / "checkpoints" / "step-0000004")
    assert main([*args[:-2], "--resume_from_checkpoint", own, "--overwrite_output_dir"]) == EXIT_BAD_INPUT
    assert "which --overwrite_output_dir would delete" in capsys.readouterr().err


def test_a_stop_right_after_resuming_another_runs_checkpoint_saves_it_in_this_folder(
        finished: Path, tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = tiny_args(tiny_model, corpus, out, "--max_train_steps", "4", "--checkpointing_steps", "2", *QUICK)
    source = str(finished / "checkpoints" / "step-0000002")
    assert main([*args, "--resume_from_checkpoint", source], stop_in(None)) == EXIT_REQUEUE  # before step 3
    record = json.loads((out / "stopped.json").read_text())
    assert record["step"] == 2 and record["checkpoint"] == str(out / "checkpoints" / "step-0000002")
    assert (out / "checkpoints" / "step-0000002" / "COMPLETE").exists()  # named, so written here
    assert main([*args, "--resume_from_checkpoint", "auto"]) == 0  # the requeue continues it, not step 0
    assert train_losses(out) == {s: v for s, v in train_losses(finished).items() if s > 2}


def test_a_finished_run_trained_further_is_unfinished_until_it_ends(
        finished: Path, tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    out = copy_run(finished, tmp_path / "run")
    args = tiny_args(tiny_model, corpus, out, "--max_train_steps", "6", "--checkpointing_steps", "2", *QUICK,
                     "--allow_lr_jump")
    assert main([*args, "--resume_from_checkpoint", "latest"], stop_in(6)) == EXIT_REQUEUE  # preempted after step 5
    assert not (out / "summary.json").exists()  # no longer finished: its summary kept aside, not lost
    assert json.loads((out / "previous_summary.json").read_text())["steps"] == 4
    assert facts(read_runs([out])[0])["status"] == "stopped on signal SIGUSR1 at step 5"
    assert main([*args, "--resume_from_checkpoint", "auto"]) == 0  # the requeue trains on, to step 6
    assert json.loads((out / "summary.json").read_text())["steps"] == 6
    assert sorted(train_losses(out)) == list(range(1, 7))


def test_a_finished_run_resumed_at_its_end_has_nothing_to_do(finished: Path, tiny_model: Path, corpus: dict,
                                                              tmp_path: Path, capsys) -> None:
    out = copy_run(finished, tmp_path / "run")
    before = snapshot(out)
    assert main(tiny_args(tiny_model, corpus, out, "--max_train_steps", "4", "--checkpointing_steps", "2", *QUICK,
                          "--resume_from_checkpoint", "latest")) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"mlm_ddp.train: --output_dir {out} holds a finished run: nothing to do"), lines
    assert snapshot(out) == before  # summary.json, final/ and its card as the run left them


def test_a_run_killed_after_its_last_checkpoint_reports_its_evaluation_and_no_speed(
        finished: Path, tiny_model: Path, corpus: dict, tmp_path: Path, caplog) -> None:
    out = copy_run(finished, tmp_path / "run")
    (out / "summary.json").unlink()  # killed after the checkpoint of its last step, before the summary
    with caplog.at_level("INFO"):
        assert main(tiny_args(tiny_model, corpus, out, "--max_train_steps", "4", "--checkpointing_steps", "2",
                              *QUICK, "--resume_from_checkpoint", "auto")) == 0
    assert "no step trained: resumed at its last step" in caplog.text
    done, old = (json.loads((run / "summary.json").read_text()) for run in (out, finished))
    assert done["steps"] == 4 and done["tokens_per_s"] is None and done["mfu"] is None  # not a speed of 0
    assert done["eval_after"]["loss"] == pytest.approx(old["eval_after"]["loss"], rel=1e-6)
    assert "held-out perplexity after training" in (out / "final" / "README.md").read_text()
    shown = facts(read_runs([out])[0])  # the report: the logged steps' tokens/s, where the summary has none
    assert shown["status"] == "finished" and shown["tokens/s"] != "-"


def test_auto_starts_over_an_attempt_of_the_same_run_that_saved_nothing(
        tiny_model: Path, corpus: dict, tmp_path: Path, capsys, caplog) -> None:
    out = tmp_path / "run"
    first = tiny_args(tiny_model, corpus, out, "--max_train_steps", "3", "--checkpointing_steps", "50", *QUICK)
    assert main(first) == 0
    for name in ("summary.json", "final"):  # as if killed at the end, before its first checkpoint
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
    capsys.readouterr()
    # another run's unfinished folder is not the same run: refused, untouched
    before = snapshot(out)
    assert main([*first, "--learning_rate", "2e-3", "--resume_from_checkpoint", "auto"]) == EXIT_BAD_INPUT
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "holds another run" in lines[0] and "its config.yaml differs" in lines[0], lines
    assert snapshot(out) == before
    # the same run (only resumable settings differ): started over
    with caplog.at_level("INFO"):
        assert main([*first, "--logging_steps", "2", "--resume_from_checkpoint", "auto"]) == 0
    assert "an earlier attempt of this run saved no checkpoint" in caplog.text
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [2, 3]
    assert json.loads((out / "summary.json").read_text())["steps"] == 3


# --- the model is checked before anything is written ------------------------------------------------


@pytest.fixture(scope="module")
def tiny_deberta(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer DebertaV2ForMaskedLM (no sdpa kernel in transformers) with the tiny tokenizer."""
    return tiny_family_model("deberta-v2", tiny_model, tmp_path_factory.mktemp("tiny_deberta"))


def test_a_model_without_sdpa_trains_with_eager_attention(tiny_deberta: Path, corpus: dict, tmp_path: Path,
                                                           caplog) -> None:
    out = tmp_path / "run"
    with caplog.at_level("INFO"):
        assert main(tiny_args(tiny_deberta, corpus, out, "--max_train_steps", "2", *QUICK)) == 0
    assert "DebertaV2ForMaskedLM has no sdpa attention" in caplog.text
    assert re.search(r"model: DebertaV2ForMaskedLM, .*attention eager", caplog.text)
    # it trained: finite losses, the held-out loss (the same masks before and after) lower, new weights
    losses = train_losses(out)
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["eval_after"]["loss"] < summary["eval_before"]["loss"]
    start, final = (AutoModelForMaskedLM.from_pretrained(path) for path in (tiny_deberta, out / "final"))
    assert type(final).__name__ == "DebertaV2ForMaskedLM"
    moved = [n for n, p in final.state_dict().items() if not torch.equal(p, start.state_dict()[n])]
    assert {n.split(".")[1] for n in moved if n.startswith("deberta.")} >= {"embeddings", "encoder"}


@pytest.mark.parametrize(("case", "message"), [
    ("corrupt_weights", "the model could not be loaded"),
    ("not_a_masked_lm", "has no masked-LM head"),
])
def test_a_model_that_cannot_be_trained_is_refused_before_the_old_run_is_removed(
        case: str, message: str, finished: Path, tiny_model: Path, corpus: dict, tmp_path: Path, capsys) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    if case == "corrupt_weights":
        weights = model / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "model_type": "gpt2", "architectures": ["GPT2Model"]}))
    out = copy_run(finished, tmp_path / "run")
    before = snapshot(out)
    code = main(tiny_args(model, corpus, out, "--max_train_steps", "2", "--overwrite_output_dir", *QUICK))
    lines = error_lines(capsys.readouterr().err)
    assert code == EXIT_BAD_INPUT and len(lines) == 1 and message in lines[0], lines
    assert snapshot(out) == before  # the run --overwrite_output_dir would have replaced is still there


# --- torn files, an older checkpoint ----------------------------------------------------------------


def test_a_torn_summary_is_not_a_finished_run(finished: Path, tiny_model: Path, corpus: dict, tmp_path: Path,
                                              capsys) -> None:
    out = copy_run(finished, tmp_path / "run")
    summary = (out / "summary.json").read_text()
    (out / "summary.json").write_text(summary[: len(summary) // 2])
    assert main(tiny_args(tiny_model, corpus, out, "--max_train_steps", "4", "--checkpointing_steps", "2", *QUICK,
                          "--resume_from_checkpoint", "auto")) == 0
    assert "holds a finished run" not in capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


@pytest.mark.parametrize("where", ["last", "middle"])
def test_a_torn_metrics_line(where: str, finished: Path, tiny_model: Path, corpus: dict, tmp_path: Path,
                             capsys) -> None:
    out = copy_run(finished, tmp_path / "run")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    if where == "last":  # a kill while writing the line of step 5, after the checkpoint of step 4
        lines.append(lines[-1].replace('"step": 4', '"step": 5')[:15])
    else:
        lines[2] = lines[2][:15]
    (out / "metrics.jsonl").write_text("\n".join(lines) + ("" if where == "last" else "\n"))
    args = tiny_args(tiny_model, corpus, out, "--max_train_steps", "6", "--checkpointing_steps", "2", *QUICK,
                     "--resume_from_checkpoint", "latest", "--allow_lr_jump")
    if where == "last":  # what a killed run leaves: dropped, the run continues
        assert main(args) == 0
        assert sorted(train_losses(out)) == list(range(1, 7))
        return
    before = snapshot(out)
    assert main(args) == EXIT_BAD_INPUT
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "metrics.jsonl line 3: not valid JSON" in lines[0], lines
    assert snapshot(out) == before


def test_resuming_an_older_checkpoint_sets_the_later_ones_aside(finished: Path, tiny_model: Path, corpus: dict,
                                                                tmp_path: Path) -> None:
    out = copy_run(finished, tmp_path / "run")
    old_four = snapshot(out / "checkpoints" / "step-0000004")
    # a new, shorter future from step 2 that keeps one checkpoint: rotation must keep the new step 3,
    # not the abandoned step 4 (which `latest` would then pick)
    assert main(tiny_args(tiny_model, corpus, out, "--max_train_steps", "3", "--checkpointing_steps", "3", *QUICK,
                          "--save_total_limit", "1", "--allow_lr_jump", "--resume_from_checkpoint",
                          str(out / "checkpoints" / "step-0000002"))) == 0
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["abandoned-after-step-0000002", "step-0000003"], names
    aside = out / "checkpoints" / "abandoned-after-step-0000002"
    assert sorted(p.name for p in aside.iterdir()) == ["step-0000004"]
    assert snapshot(aside / "step-0000004") == old_four  # kept as it was
    assert sorted(train_losses(out)) == [1, 2, 3]


# --- the main process alone works longer than --ddp_timeout ----------------------------------------


def test_main_process_saves_longer_than_the_ddp_timeout_without_failing_the_others(
        tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    # rank 0 sleeps 6 s inside every checkpoint save (after the files, before the marker) while the
    # other rank waits; --ddp_timeout 3 would fail a wait on the training group
    proc = run_module([*LAUNCH, "--config_file", str(CONFIGS / "cpu_ddp.yaml"), "--main_process_port",
                       str(free_port()), "-m", "tests.fault_driver", "--slow_save_s", "6",
                       *tiny_args(tiny_model, corpus, out, "--max_train_steps", "2", "--checkpointing_steps", "2",
                                  "--ddp_timeout", "3", *QUICK)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "checkpoints" / "step-0000002" / "COMPLETE").exists()
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


# --- old torch ---------------------------------------------------------------------------------------


def test_the_torch_floor_is_where_every_checkpoint_load_is_weights_only() -> None:
    floor = re.search(r'^\s*"torch>=([\d.]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert floor is not None and tuple(map(int, floor.group(1).split("."))) >= SAFE_LOADING_TORCH
    with pytest.raises(BadInput, match=r"resuming needs torch >= 2.4 \(installed: 2.3.1\+cu121\)"):
        check_safe_loading("2.3.1+cu121")
    check_safe_loading("2.4.0")
    check_safe_loading("2.13.0+cpu")
