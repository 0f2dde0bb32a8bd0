"""The table of what a user gets wrong, tool by tool, and what each entry point says. A refusal is exit 2 and
one error line naming the flag and the fix, no traceback, nothing written in the output folder; a silent mistake
(accepted, likely not meant) is one warning line and the run goes on. Every case runs in this process through the
tool's own `main(argv)` (or, for the warnings, the preflight that logs them), before any model is trained: seconds
for the whole table."""

from __future__ import annotations

import io
import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import tiny_args

# a place no one may write, root included: sysfs refuses a new file there (a read-only mount refuses it alike)
READ_ONLY = Path("/sys/mlm_ddp_refusals")


def files(root: Path, model: Path) -> dict[str, Path]:
    """The bad inputs of the table, written once per test in its own folder."""
    made = {"folder": root / "texts", "latin1": root / "latin1.txt", "binary": root / "valid.txt",
            "latin1_yaml": root / "r.yaml", "numbers": root / "numbers.jsonl", "file": root / "plain.txt",
            "task": root / "task.csv", "typed_yaml": root / "typed.yaml", "no_tokenizer": root / "no_tokenizer",
            "latin1_task": root / "task_latin1.jsonl", "latin1_task_csv": root / "task_latin1.csv"}
    made["folder"].mkdir()
    (made["folder"] / "a.txt").write_text("some words\n")
    made["latin1"].write_bytes("café au lait\nsecond line\n".encode("latin-1") * 20)
    made["binary"].write_bytes(bytes(range(255, -1, -1)) * 4)
    made["latin1_yaml"].write_bytes("seed: 7\n# r\xe9glages\n".encode("latin-1"))
    # an id and a score beside the text: --text_column 0 or id names numbers, which pack into zero blocks
    made["numbers"].write_text("".join(json.dumps({"id": i, "text": f"text number {i} of a few words"}) + "\n"
                                       for i in range(40)))
    made["file"].write_text("a user's file\n")
    made["no_tokenizer"].mkdir()  # the tiny model without its tokenizer's files: transformers 5 builds one of [UNK]
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(model / name, made["no_tokenizer"] / name)
    made["typed_yaml"].write_text("gradient_accumulation_steps: 2.5\n")  # a count that is not whole
    made["latin1_task"].write_bytes("".join(json.dumps({"text": f"caf\xe9 {i}", "label": i % 2}, ensure_ascii=False)
                                            + "\n" for i in range(20)).encode("latin-1"))
    made["latin1_task_csv"].write_bytes(("text,label\n" + "".join(f"caf\xe9 {i},{i % 2}\n" for i in range(20)))
                                        .encode("latin-1"))
    made["task"].write_text("text,label\n" + "".join(f"text {i},{i % 2}\n" for i in range(20)))  # a probe's task
    return made


def main_of(tool: str) -> Callable[[list[str]], int]:
    import mlm_ddp.bench
    import mlm_ddp.predict
    import mlm_ddp.prepare
    import mlm_ddp.probe.standalone
    import mlm_ddp.run.report
    import mlm_ddp.submit
    import mlm_ddp.tokenizer
    import mlm_ddp.train

    return {"train": mlm_ddp.train.main, "prepare": mlm_ddp.prepare.main, "tokenizer": mlm_ddp.tokenizer.main,
            "report": mlm_ddp.run.report.main, "predict": mlm_ddp.predict.main, "probe": mlm_ddp.probe.standalone.main,
            "submit": mlm_ddp.submit.main, "bench": mlm_ddp.bench.main}[tool]


# (case, tool, its flags given the fixtures, the flag the line names, what the line says). `m`: the tiny model,
# `c`: the corpus, `o`: the output folder (not made), `f`: files(); train's and submit's flags follow tiny_args.
CASES: list[tuple[str, str, Callable[..., list[str]], str, str]] = [
    # train (and the tokenizer tool, which loads text as training does)
    ("train_folder_as_file", "train", lambda m, c, o, f: ["--train_file", str(f["folder"])],
     "--train_file", r"is a folder, not a file; give one of its files, or prepare the folder"),
    ("tokenizer_folder_as_file", "tokenizer", lambda m, c, o, f: ["--train_file", str(f["folder"]), "--output_dir",
                                                                  str(o)],
     "--train_file", "is a folder, not a file"),
    ("missing_tokenizer_path", "train", lambda m, c, o, f: ["--tokenizer_name", "./no/such/tokenizer"],
     "--tokenizer_name", r"\./no/such/tokenizer: no such folder; give an existing local folder, or a Hub id"),
    ("missing_model_path", "train", lambda m, c, o, f: ["--model_name_or_path", str(o.parent / "no" / "model")],
     "--model_name_or_path", "no such folder"),
    ("missing_probe_model", "probe", lambda m, c, o, f: [str(o.parent / "no" / "model"), "--train_file",
                                                         str(f["task"]), "--test_file", str(f["task"])],
     "MODEL", "no such folder"),
    ("missing_predict_model", "predict", lambda m, c, o, f: ["./no/such/model", "a [MASK] b"], "MODEL",
     "no such folder"),
    # a model folder without its tokenizer's files: transformers 5 gave one of the special tokens only
    ("prepare_no_tokenizer", "prepare", lambda m, c, o, f: ["--model_name_or_path", str(f["no_tokenizer"]),
                                                           "--train_file", str(c["train"]), "--output_dir", str(o),
                                                           "--max_seq_length", "32"],
     "no_tokenizer", r"has no tokenizer files \(tokenizer.json / vocab.txt\); pass --tokenizer_name"),
    ("predict_no_tokenizer", "predict", lambda m, c, o, f: [str(f["no_tokenizer"]), "a [MASK] b"], "no_tokenizer",
     "has no tokenizer files .*; save the model's tokenizer into it"),
    ("probe_no_tokenizer", "probe", lambda m, c, o, f: [str(f["no_tokenizer"]), "--train_file", str(f["task"]),
                                                        "--test_file", str(f["task"])],
     "no_tokenizer", "has no tokenizer files"),
    ("extend_no_tokenizer", "tokenizer", lambda m, c, o, f: ["--extend", str(f["no_tokenizer"]), "--train_file",
                                                             str(c["train"]), "--output_dir", str(o),
                                                             "--num_new_tokens", "5"],
     "no_tokenizer", "has no tokenizer files"),
    ("numeric_text_column", "train", lambda m, c, o, f: ["--train_file", str(f["numbers"]), "--validation_file",
                                                         str(f["numbers"]), "--text_column", "id"],
     "--text_column", r"column 'id' holds int64 values, not text; pass --text_column with a column of text \(text\)"),
    ("numeric_text_column_stream", "train", lambda m, c, o, f: ["--train_file", str(f["numbers"]), "--validation_file",
                                                                str(f["numbers"]), "--text_column", "id",
                                                                "--streaming", "--max_train_steps", "2"],
     "--text_column", "column 'id' holds int64 values, not text"),
    ("prepare_numeric_text_column", "prepare", lambda m, c, o, f: ["--model_name_or_path", str(m), "--train_file",
                                                                   str(f["numbers"]), "--text_column", "id",
                                                                   "--output_dir", str(o), "--max_seq_length", "32",
                                                                   "--num_workers", "1"],
     "--text_column", "column 'id' holds int values, not text"),
    # done before: non-UTF-8 data and config, numbers torch refused, the probe's own flags
    ("latin1_train", "train", lambda m, c, o, f: ["--train_file", str(f["latin1"])],
     "--train_file", r"not UTF-8 text \(byte 0xe9 at offset 3\); save it as UTF-8, e.g. iconv"),
    ("binary_validation", "train", lambda m, c, o, f: ["--validation_file", str(f["binary"])],
     "--validation_file", r"not UTF-8 text \(byte 0xff at offset 0\)"),
    ("latin1_config", "train", lambda m, c, o, f: ["--config", str(f["latin1_yaml"])], "--config", "not UTF-8 text"),
    # a recipe's value of another type: argparse converts only text, so it failed the run after its folder was made
    ("recipe_wrong_type", "train", lambda m, c, o, f: ["--config", str(f["typed_yaml"])],
     "typed.yaml: gradient_accumulation_steps", "must be an integer, got 2.5"),
    ("seed_negative", "train", lambda m, c, o, f: ["--seed", "-1"], "--seed", "must be >= 0, got -1"),
    ("adam_beta1", "train", lambda m, c, o, f: ["--adam_beta1", "1.5"], "--adam_beta1", r"must be in \[0, 1\)"),
    ("adam_epsilon", "train", lambda m, c, o, f: ["--adam_epsilon=-1"], "--adam_epsilon", "must be >= 0"),
    ("learning_rate_scientific", "train", lambda m, c, o, f: ["--learning_rate", "-1e-3"], "--learning_rate",
     "must be positive, got -0.001"),
    ("missing_probe_file", "train", lambda m, c, o, f: ["--probe_train_file", str(o.parent / "missing.csv"),
                                                        "--probe_test_file", str(f["numbers"])],
     "--probe_train_file", "no such file"),
    # a probe's labeled texts that are not UTF-8: a UnicodeDecodeError traceback (json), a vague datasets error (csv)
    ("probe_latin1_jsonl", "probe", lambda m, c, o, f: [str(m), "--train_file", str(f["latin1_task"]), "--test_file",
                                                        str(f["task"])],
     "--train_file", r"task_latin1.jsonl: not UTF-8 text \(byte 0xe9 at offset 13\); save it as UTF-8"),
    ("probe_latin1_csv", "probe", lambda m, c, o, f: [str(m), "--train_file", str(f["task"]), "--test_file",
                                                      str(f["latin1_task_csv"])],
     "--test_file", r"task_latin1.csv: not UTF-8 text \(byte 0xe9 at offset 14\)"),
    ("train_probe_latin1", "train", lambda m, c, o, f: ["--probe_train_file", str(f["latin1_task"]),
                                                        "--probe_test_file", str(f["task"])],
     "--probe_train_file", r"not UTF-8 text \(byte 0xe9 at offset 13\)"),
    # an override transformers refuses only when it builds the model: a traceback (from scratch), or a line that
    # blamed --model_name_or_path
    ("overrides_model_refuses", "train", lambda m, c, o, f: ["--config_overrides", "hidden_size=33"],
     "--config_overrides", r"'hidden_size=33': transformers refuses it \(The hidden size \(33\) is not a multiple"),
    ("prepare_overrides_from_scratch", "prepare", lambda m, c, o, f: ["--model_type", "bert", "--tokenizer_name",
                                                                      str(m), "--train_file", str(c["train"]),
                                                                      "--output_dir", str(o), "--max_seq_length", "32",
                                                                      "--config_overrides",
                                                                      "hidden_size=33,num_attention_heads=2"],
     "--config_overrides", "transformers refuses it"),
    # read-only places and a file where a folder goes
    ("train_read_only", "train", lambda m, c, o, f: ["--output_dir", str(READ_ONLY / "run")], "--output_dir",
     r"/sys cannot be written \(.*\); choose another --output_dir"),
    ("train_under_a_file", "train", lambda m, c, o, f: ["--output_dir", str(f["file"] / "run")], "--output_dir",
     r"plain.txt is a file, not a folder; choose another --output_dir"),
    ("prepare_read_only", "prepare", lambda m, c, o, f: ["--model_name_or_path", str(m), "--train_file",
                                                         str(c["train"]), "--output_dir", str(READ_ONLY / "p"),
                                                         "--max_seq_length", "32"],
     "--output_dir", "cannot be written"),
    ("prepare_into_a_file", "prepare", lambda m, c, o, f: ["--model_name_or_path", str(m), "--train_file",
                                                           str(c["train"]), "--output_dir", str(f["file"]),
                                                           "--max_seq_length", "32"],
     "--output_dir", "plain.txt is a file, not a folder"),
    ("tokenizer_read_only", "tokenizer", lambda m, c, o, f: ["--train_file", str(c["train"]), "--output_dir",
                                                             str(READ_ONLY / "tok")],
     "--output_dir", "cannot be written"),
    ("report_read_only", "report", lambda m, c, o, f: [str(o), "--out", str(READ_ONLY / "r.html")], "--out",
     "cannot be written"),
    ("report_of_a_file", "report", lambda m, c, o, f: [str(f["file"])], "plain.txt",  # it spoke of an --out not given
     "is not a folder: pass the --output_dir of a run"),
    # prepare: a corpus the model cannot read, a bad input file
    ("prepare_seq_above_model", "prepare", lambda m, c, o, f: ["--model_name_or_path", str(m), "--train_file",
                                                               str(c["train"]), "--output_dir", str(o),
                                                               "--max_seq_length", "4096"],
     "--max_seq_length", "4096 is above the model's maximum of 64 tokens; use --max_seq_length 64 or less"),
    ("prepare_latin1", "prepare", lambda m, c, o, f: ["--model_name_or_path", str(m), "--train_file",
                                                      str(f["latin1"]), "--output_dir", str(o), "--max_seq_length",
                                                      "32"],
     "--train_file", r"not UTF-8 text \(byte 0xe9 at offset 3\)"),
    # prepare's output among its inputs: listed as corpus by the rerun, which failed, and --overwrite_output_dir then
    # removed the finished prepare
    ("prepare_into_its_input", "prepare", lambda m, c, o, f: ["--model_name_or_path", str(m), "--train_file",
                                                              str(f["folder"]), "--output_dir",
                                                              str(f["folder"] / "prepared"), "--max_seq_length", "32"],
     "--output_dir", "is inside the --train_file folder .*texts, whose files are read as the corpus"),
    ("prepare_into_its_held_out", "prepare", lambda m, c, o, f: ["--model_name_or_path", str(m), "--train_file",
                                                                 str(c["train"]), "--validation_file", str(f["folder"]),
                                                                 "--output_dir", str(f["folder"]),
                                                                 "--max_seq_length", "32"],
     "--output_dir", "is the --validation_file folder"),
    # submit: what train would refuse, before anything is submitted (--cluster local: with or without Slurm here)
    ("submit_seq_above_model", "submit", lambda m, c, o, f: ["--cluster", "local", "--max_seq_length", "128"],
     "--max_seq_length", "128 is above the model's maximum of 64 tokens"),
    ("submit_latin1", "submit", lambda m, c, o, f: ["--cluster", "local", "--train_file", str(f["latin1"])],
     "--train_file", r"not UTF-8 text \(byte 0xe9 at offset 3\)"),
    ("submit_timeout_0", "submit", lambda m, c, o, f: ["--cluster", "local", "--timeout_min", "0"], "--timeout_min",
     "must be at least 1 minute"),
    ("submit_mem_negative", "submit", lambda m, c, o, f: ["--cluster", "local", "--mem_gb", "-4"], "--mem_gb",
     "must be positive"),
    ("submit_signal_negative", "submit", lambda m, c, o, f: ["--cluster", "local", "--signal_delay_s", "-5"],
     "--signal_delay_s", r"must be in \[0, 86400\), got -5"),
    # bench and predict, done before
    ("bench_steps_0", "bench", lambda m, c, o, f: ["--model_name_or_path", str(m), "--steps", "0"], "--steps",
     "must be at least 1"),
    ("bench_watchdog_cost_0", "bench", lambda m, c, o, f: ["--watchdog_cost", "512", "0"], "--watchdog_cost",
     "must be at least 1 rank, got 0"),
    ("predict_top_k_above_vocab", "predict", lambda m, c, o, f: [str(m), "a [MASK] b", "--top_k", "601"], "--top_k",
     "601 is above the model's vocabulary of 600 tokens; use --top_k 600 or less"),
]
TRAIN_LIKE = {"train", "submit"}  # their flags start from tiny_args


@pytest.mark.parametrize(("case", "tool", "flags", "flag", "message"), CASES, ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_naming_the_flag_and_nothing_is_written(
        case: str, tool: str, flags: Callable[..., list[str]], flag: str, message: str, tiny_model: Path,
        corpus: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    made = files(tmp_path, tiny_model)
    argv = flags(tiny_model, corpus, out, made)
    if tool in TRAIN_LIKE:
        argv = tiny_args(tiny_model, corpus, out, "--max_train_steps", "2", *argv)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    capsys.readouterr()
    try:
        code = main_of(tool)(argv)
    except SystemExit as exited:  # a refusal while the flags are parsed (argparse's own exit)
        code = exited.code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error:" in line]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert flag in errors[0] and re.search(message, errors[0]), errors[0]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written, nothing left
    assert not READ_ONLY.exists()


def test_a_truncated_mask_and_stdin_not_utf8_are_one_line(tiny_model: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture) -> None:
    """predict's cases that need their own input: a [MASK] cut by truncation (64 positions), bytes on stdin."""
    main = main_of("predict")
    assert main([str(tiny_model), "word " * 70 + "[MASK]"]) == 2
    assert "[MASK] lies past the model's maximum of 64 tokens" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 [MASK]\n"), encoding="utf-8"))
    assert main([str(tiny_model)]) == 2
    assert "stdin is not UTF-8 text" in capsys.readouterr().err


def test_a_silent_mistake_is_one_warning_line_and_the_run_goes_on(tiny_model: Path, corpus: dict, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    """Accepted as given, each said once before the run starts: a weight with one source, a held-out file that is
    a training file (by train and by prepare), a folder of the user's own files (kept: a run touches only its own
    names), a probe scored on its own training set."""
    from mlm_ddp.config import parse_args
    from mlm_ddp.probe.config import ProbeConfig
    from mlm_ddp.probe.standalone import load_probe_data
    from mlm_ddp.train import preflight

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("a user's own file")
    same = f"{corpus['train'].parent}/./{corpus['train'].name}"  # the same file, written otherwise
    cfg = parse_args(tiny_args(tiny_model, corpus, out, "--train_weights", "0.3", "--validation_file", str(same)))
    notes = preflight(cfg).notes
    expected = ["--train_weights 0.3 with one --train_file: a weight is a share among several sources",
                f"--validation_file {same} is also a --train_file: the held-out loss is then measured on text",
                f"--output_dir {out} holds files of no run (notes.txt): the run's files go beside them"]
    assert len(notes) == len(expected) and all(n.startswith(e) for n, e in zip(notes, expected, strict=True)), notes
    assert all("\n" not in note for note in notes)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # preflight writes nothing
    capsys.readouterr()
    assert main_of("prepare")(["--model_name_or_path", str(tiny_model), "--train_file", str(corpus["train"]),
                               "--validation_file", same, "--output_dir", str(tmp_path / "prepared"),
                               "--max_seq_length", "32", "--num_workers", "1"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warned) == 1 and warned[0].startswith(f"mlm_ddp.prepare: warning: {expected[1]}"), warned
    labeled = tmp_path / "task.csv"
    labeled.write_text("text,label\n" + "".join(f"text {i},{i % 2}\n" for i in range(20)))
    probe_notes = load_probe_data(ProbeConfig(train_file=str(labeled), test_file=str(labeled))).notes
    assert len(probe_notes) == 1, probe_notes
    assert probe_notes[0].startswith(f"--train_file {labeled} is also the test set (--test_file {labeled})")


if sys.platform != "linux":  # /sys is Linux's
    pytestmark = pytest.mark.skip("the read-only place of the table is Linux's /sys")
