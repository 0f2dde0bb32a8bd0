"""Fill-mask predictions from a run's final/ folder and from its checkpoints."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from mlm_ddp.config import parse_args
from mlm_ddp.errors import BadInput
from mlm_ddp.predict import fill_mask, load_for_prediction, main
from mlm_ddp.train import train
from tests.conftest import tiny_args


@pytest.fixture(scope="module")
def trained_run(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("predict") / "run"
    train(parse_args(tiny_args(tiny_model, corpus, out, "--max_train_steps", "3", "--checkpointing_steps", "3")))
    return out


def test_k_predictions_per_mask_and_the_checkpoint_predicts_what_final_does(trained_run: Path) -> None:
    final = load_for_prediction(str(trained_run / "final"))
    checkpoint = load_for_prediction(str(trained_run / "checkpoints" / "step-0000003"))
    text = "the [MASK] of the [MASK] is a list"
    from_final = fill_mask(*final, text, top_k=4)
    assert len(from_final) == 2 and all(len(preds) == 4 for preds in from_final)
    assert all(p.token and 0 < p.score <= 1 for preds in from_final for p in preds)
    assert all(preds[0].score >= preds[-1].score for preds in from_final)
    # the checkpoint of the last step holds the weights final/ was saved from
    assert fill_mask(*checkpoint, text, top_k=4) == from_final


def test_compare_prints_the_base_model_beside_the_tuned_one(trained_run: Path, tiny_model: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    assert main([str(trained_run / "final"), "the [MASK] is here", "--top_k", "3", "--compare", str(tiny_model)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "the [MASK] is here" and str(tiny_model) in out[1]
    rows = out[2:]
    assert [r.split()[0] for r in rows] == ["1.", "2.", "3."] and all(len(r.split()) == 5 for r in rows)


def test_texts_from_stdin(trained_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("a [MASK] b\n\nc [MASK] d\n"))
    assert main([str(trained_run / "final"), "--top_k", "2"]) == 0
    out = capsys.readouterr().out
    assert "a [MASK] b" in out and "c [MASK] d" in out


def test_text_without_a_mask_token_is_a_clear_error(trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(trained_run / "final"), "no mask here"]) == 2
    assert "no [MASK] in 'no mask here'" in capsys.readouterr().err
    with pytest.raises(BadInput, match="neither a model folder"):
        load_for_prediction(str(trained_run / "checkpoints"))


def test_options_anywhere_and_what_a_user_gets_wrong_are_one_line(trained_run: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture) -> None:
    final = str(trained_run / "final")
    assert main([final, "--top_k", "2", "a [MASK] b"]) == 0  # an option between the model and the texts
    assert "a [MASK] b" in capsys.readouterr().out
    cases = [
        ([final, "--top_k", "601", "a [MASK] b"],
         "--top_k 601 is above the model's vocabulary of 600 tokens; use --top_k 600 or less"),
        # 64 positions: the mask comes after 140 pieces of "word", cut away by truncation, though the user wrote it
        ([final, "word " * 70 + "[MASK]"], "[MASK] lies past the model's maximum of 64 tokens (the text has 143)"),
        ([final, "a [MASK] \udce9 b"], "not UTF-8 text (surrogates not allowed); give texts in UTF-8"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err  # beside transformers' loading bar
        errors = [line for line in err.splitlines() if line.startswith("mlm_ddp.predict: error: ")]
        assert len(errors) == 1 and message in errors[0] and "Traceback" not in err, err
    # bytes on stdin that are not UTF-8, read as a terminal or a pipe reads them (strict)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 [MASK]\n"), encoding="utf-8"))
    assert main([final]) == 2
    assert "stdin is not UTF-8 text (invalid continuation byte at byte 3)" in capsys.readouterr().err
