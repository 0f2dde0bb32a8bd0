"""How the probe reads its labels: strings as written, numbers by their value (a float column of
whole numbers, as one missing value leaves pandas' integers, reads as the integers; JSON's 1.0 and 1 are one
class), rows without a label or a text left out and named, a few-shot file read as a task and a column that
gives every row its own value refused. Real csv, json, jsonl and parquet files written in tmp_path; no model
loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlm_ddp.errors import BadInput
from mlm_ddp.probe.config import ProbeConfig
from mlm_ddp.probe.standalone import load_probe_data, main
from tests.test_probe import write


def test_labels_are_read_as_written_and_unusable_rows_are_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """No NA parsing ("NA", "None", "null", "N/A" are labels), "01" is not "1"; a row without
    a label (empty, null, NaN) or without text is left out, named by its row and counted in a warning."""
    written = ["01", "1", "NA", "None", "null", "N/A"]
    train = [{"text": f"text {i}", "label": written[i % 6]} for i in range(18)]
    train += [{"text": "no label", "label": ""}, {"text": "", "label": "1"}]  # rows 19 and 20
    data = load_probe_data(ProbeConfig(train_file=str(write(tmp_path / "train.csv", train)),
                                       test_file=str(write(tmp_path / "test.csv", train[:6]))))
    assert data.classes == sorted(written) and len(data.train_texts) == 18 and len(data.test_texts) == 6
    assert [data.classes[k] for k in data.test_labels] == written
    assert data.notes == [f"--train_file {tmp_path / 'train.csv'}: 2 of 20 rows left out; 1 without a 'label' "
                          "(row 19); 1 with an empty text (row 20) (rows numbered from 1, a csv's header not counted)"]
    jsonl = tmp_path / "train.jsonl"  # a NaN and a null label, and the numbers 1 and "01" as written
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in [{"text": "a", "label": 1}, {"text": "b", "label": "01"},
                                                             {"text": "c", "label": float("nan")},
                                                             {"text": "d", "label": None}] * 3))
    data = load_probe_data(ProbeConfig(train_file=str(jsonl), test_file=str(jsonl)))
    assert data.classes == ["01", "1"] and len(data.train_texts) == 6
    assert "6 of 12 rows left out; 6 without a 'label' (rows 3, 4, 7, 8, 11 and 1 more)" in data.notes[0]
    args = [str(tmp_path / "no-model"), "--train_file", str(jsonl), "--test_file", str(jsonl)]
    main(args)  # the model does not load; the warning came first
    assert "mlm_ddp.probe: warning: --train_file" in capsys.readouterr().err


def test_a_float_column_of_whole_numbers_reads_as_the_integers(tmp_path: Path) -> None:
    """One missing value makes pandas' integer column float; parquet then holds 0.0, 1.0, NaN and
    pandas' csv "0.0", "1.0", "". Both read as the classes '0' and '1' of a test file written with integers, and
    the row without a label is left out, named and counted."""
    import pandas as pd

    train = pd.DataFrame({"text": [f"text {i}" for i in range(12)], "label": [i % 2 for i in range(11)] + [None]})
    assert train["label"].dtype == "float64"
    test = pd.DataFrame({"text": ["a", "b", "c"], "label": [0, 1, 1]})
    for suffix, writer in ((".parquet", pd.DataFrame.to_parquet), (".csv", lambda df, path: df.to_csv(path,
                                                                                                     index=False))):
        writer(train, tmp_path / f"train{suffix}")
        writer(test, tmp_path / f"test{suffix}")
        data = load_probe_data(ProbeConfig(train_file=str(tmp_path / f"train{suffix}"),
                                           test_file=str(tmp_path / f"test{suffix}")))
        assert data.classes == ["0", "1"] and data.test_labels.tolist() == [0, 1, 1], suffix
        assert data.notes == [f"--train_file {tmp_path / f'train{suffix}'}: 1 of 12 rows left out; 1 without a "
                              "'label' (row 12) (rows numbered from 1, a csv's header not counted)"]
    assert "0.0" in (tmp_path / "train.csv").read_text()  # what pandas wrote
    # a csv column of other numbers, or of whole ones with one other label among them, is read as written
    (tmp_path / "decimals.csv").write_text("text,label\na,1.0\nb,2.5\nc,1.0\n")
    data = load_probe_data(ProbeConfig(train_file=str(tmp_path / "decimals.csv"),
                                       test_file=str(tmp_path / "decimals.csv")))
    assert data.classes == ["1.0", "2.5"]
    (tmp_path / "two_ways.csv").write_text("text,label\na,2.0\nb,1\nc,2.0\nd,1\n")
    with pytest.raises(BadInput, match=r"labels not in the training set: '2'; .* \('2' and '2.0' are one number "
                                       r"written two ways: a label written as text is read as written, so write "
                                       r"them alike\)"):
        load_probe_data(ProbeConfig(train_file=str(tmp_path / "two_ways.csv"),
                                    test_file=str(write(tmp_path / "twos.csv", [{"text": "e", "label": "2"}]))))


def test_json_numbers_are_their_values(tmp_path: Path) -> None:
    """JSON's 1.0 and 1 are one number, so one class; 1.5 is its own; the string "1.0" is written as a
    string, and stays one."""
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"text {i}", "label": label}) + "\n"
                             for i, label in enumerate([1.0, 1, 0, 0.0, 1.5, "1.0"] * 2)))
    data = load_probe_data(ProbeConfig(train_file=str(jsonl), test_file=str(jsonl)))
    assert data.classes == ["0", "1", "1.0", "1.5"]
    assert [data.classes[k] for k in data.train_labels[:6]] == ["1", "1", "0", "0", "1.5", "1.0"]


def test_a_few_shot_file_is_classes_and_a_column_of_identifiers_is_not(tmp_path: Path) -> None:
    """A few-shot training file (30 labels over 45 rows: more labels than half its rows) is a task, as
    its test file repeats the labels. A column that gives every row of both files its own value (an id, a text)
    is refused, even where the test file's values are all in the training file's (ids counted from 0 in each)."""
    few = write(tmp_path / "few.jsonl", [{"text": f"text {i}", "label": f"topic {i % 30}", "id": i}
                                         for i in range(45)])
    test = write(tmp_path / "test.jsonl", [{"text": f"test {i}", "label": f"topic {i % 30}", "id": i}
                                           for i in range(90)])
    data = load_probe_data(ProbeConfig(train_file=str(few), test_file=str(test)))
    assert len(data.classes) == 30 and len(data.train_texts) == 45
    with pytest.raises(BadInput, match=r"column 'id' gives nearly every row a label of its own \(45 distinct values "
                                       r"in 45 rows of --train_file .*, 40 in 40 rows of --test_file .*\): free "
                                       "text or an identifier, not classes. Pass --label_column"):
        load_probe_data(ProbeConfig(train_file=str(few), test_file=str(write(tmp_path / "ids.jsonl", [
            {"text": f"test {i}", "id": i} for i in range(40)])), label_column="id"))
