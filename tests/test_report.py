"""The run report: HTML and PNG plots from real runs' metrics.jsonl, overlays, bad input."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from PIL import Image

from mlm_ddp.config import parse_args
from mlm_ddp.run.report import FIGURES, main, write_report
from mlm_ddp.train import train
from tests.conftest import tiny_args

BLUE, ORANGE = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)  # matplotlib's C0 and C1: the first two runs


@pytest.fixture(scope="module")
def runs(tiny_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two real tiny runs that differ in learning rate; only the first writes its report at the end."""
    root = tmp_path_factory.mktemp("report")
    first, second = root / "lr1e-3", root / "lr3e-3"
    train(parse_args(tiny_args(tiny_model, corpus, first, "--max_train_steps", "6", "--eval_steps", "3",
                               "--report", "true")))
    train(parse_args(tiny_args(tiny_model, corpus, second, "--max_train_steps", "6", "--eval_steps", "3",
                               "--learning_rate", "3e-3", "--report", "false")))
    return first, second


def referenced_images(page: Path) -> list[Path]:
    sources = re.findall(r"<img src='([^']+)'", page.read_text())
    return [page.parent / src for src in sources]


def colors(png: Path) -> set[tuple[int, int, int]]:
    with Image.open(png) as image:
        return {rgb for _, rgb in image.convert("RGB").getcolors(maxcolors=1 << 20)}


def test_training_writes_a_report_whose_plots_are_real_images(runs: tuple[Path, Path]) -> None:
    first, second = runs
    page = first / "report.html"
    assert page.is_file() and not (second / "report.html").exists()  # --report false
    text = page.read_text()
    assert "finished" in text and "lr1e-3" in text
    images = referenced_images(page)
    assert sorted(p.name for p in images) == sorted(set(FIGURES) - {"probe.png"})  # these runs have no probe
    for png in images:
        with Image.open(png) as image:
            image.verify()  # a PNG, not truncated
        with Image.open(png) as image:
            assert image.format == "PNG" and image.width >= 600 and image.height >= 250
        assert png.stat().st_size > 10_000
        assert BLUE in colors(png) and ORANGE not in colors(png)  # one run: one curve colour
        assert len(colors(png)) > 50  # text and antialiased curves, not a blank canvas


def test_two_runs_are_overlaid_with_what_differs(runs: tuple[Path, Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "compare" / "both.html"
    assert main([str(runs[0]), str(runs[1]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "lr1e-3: learning_rate=0.001" in printed and "lr3e-3: learning_rate=0.003" in printed
    assert f"report: {out}" in printed
    text = out.read_text()
    assert "What differs" in text and "<th>learning_rate</th>" in text
    images = referenced_images(out)
    # no probe.png: these runs have no probe
    assert [p.parent for p in images] == [tmp_path / "compare" / "both_plots"] * (len(FIGURES) - 1)
    for png in images:
        assert {BLUE, ORANGE} <= colors(png), png.name  # both runs drawn
    assert text.count(">finished<") == 2


def test_corrupt_or_empty_metrics_name_the_file_and_line(runs: tuple[Path, Path], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs[0], run)
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines[:4]) + "\n" + lines[4][:25] + "\n")  # cut while writing line 5
    assert main([str(run)]) == 2
    assert f"{metrics} line 5: not valid JSON" in capsys.readouterr().err

    metrics.write_text("\n".join(lines[:2] + ['["not", "a record"]']) + "\n")
    assert main([str(run)]) == 2
    assert f"{metrics} line 3: not a metrics record" in capsys.readouterr().err

    metrics.write_text("")
    assert main([str(run)]) == 2
    assert f"{metrics} is empty" in capsys.readouterr().err

    metrics.unlink()
    assert main([str(run)]) == 2
    assert f"{metrics} does not exist" in capsys.readouterr().err


def test_never_overwrites_a_page_it_did_not_write(runs: tuple[Path, Path], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    mine = tmp_path / "notes.html"
    mine.write_text("<html>my notes</html>")
    assert main([str(runs[0]), "--out", str(mine)]) == 2
    assert "is not a page mlm_ddp.report wrote" in capsys.readouterr().err
    assert mine.read_text() == "<html>my notes</html>"
    assert main([str(runs[0]), "--out", str(tmp_path / "report.txt")]) == 2
    assert "name the report page with .html" in capsys.readouterr().err
    # its own page is rewritten, as the end of every training run does
    page, summary = write_report([runs[0]], tmp_path / "again.html")
    assert write_report([runs[0]], page)[0] == page and "finished" in summary


def test_tokens_per_s_counts_training_time_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Evaluation and checkpoint saves pause the clock, so the throughput curve has no dips at them."""
    from mlm_ddp.loop import speed

    now = [100.0]
    monkeypatch.setattr(speed.time, "perf_counter", lambda: now[0])
    clock = speed.TrainingClock()
    now[0] += 2.0  # a training step
    assert clock.lap() == 2.0
    with clock.paused():
        now[0] += 30.0  # evaluation
    now[0] += 3.0
    with clock.paused():
        now[0] += 5.0  # checkpoint save
    assert clock.lap() == 3.0 and clock.training_s == 5.0


def test_a_diverged_run_shows_its_nan(runs: tuple[Path, Path], tmp_path: Path) -> None:
    run = tmp_path / "diverged"
    run.mkdir()
    lines = (runs[0] / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(lines + '{"step": 7, "loss": NaN, "tokens_seen": 1800}\n')
    page, summary = write_report([run])
    assert "unfinished" in summary and "train loss 6." in summary and "-> nan;" in summary
    assert all(png.stat().st_size > 10_000 for png in referenced_images(page))
