"""--with_tracking: TensorBoard by default, wandb and MLflow through accelerate's trackers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mlm_ddp.config import parse_args
from mlm_ddp.errors import BadInput
from mlm_ddp.train import train
from tests.conftest import read_metrics, tiny_args


def logged(out: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(out) if key in r}


def tensorboard_scalars(out: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (out / "logs" / "mlm_ddp").glob("events.out.tfevents.*")  # subfolders: the hparams
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    return {e.step: e.value for e in accumulator.Scalars(tag)}


def test_every_tracker_records_what_metrics_jsonl_records(tiny_model: Path, corpus: dict, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow

    monkeypatch.setenv("WANDB_MODE", "offline")  # a real wandb run, written for `wandb sync`
    for name in ("WANDB_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "tracked"
    train(parse_args(tiny_args(tiny_model, corpus, out, "--max_train_steps", "4", "--eval_steps", "2",
                               "--with_tracking", "--report_to", "all", "--report", "false")))
    losses, evals = logged(out, "loss"), logged(out, "eval_loss")
    assert sorted(losses) == [1, 2, 3, 4] and sorted(evals) == [0, 2, 4]

    assert tensorboard_scalars(out, "loss") == pytest.approx(losses)
    assert tensorboard_scalars(out, "eval_loss") == pytest.approx(evals)

    (wandb_run,) = (out / "logs" / "wandb").glob("offline-run-*/run-*.wandb")
    assert wandb_run.stat().st_size > 1000

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out / 'logs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("mlm_ddp").experiment_id])
    assert run.info.run_name == "tracked" and run.data.params["learning_rate"] == "0.001"
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert history == pytest.approx(losses)


def test_a_tracker_that_is_not_installed_is_a_clear_error(tiny_model: Path, corpus: dict, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb"
                        else real_find_spec(name, *a))
    out = tmp_path / "untracked"
    with pytest.raises(BadInput, match=r"--report_to wandb: the package 'wandb' is not installed \(pip install"):
        train(parse_args(tiny_args(tiny_model, corpus, out, "--with_tracking", "--report_to", "wandb")))
    assert not out.exists()  # refused before anything was written
    with pytest.raises(BadInput, match="--report_to 'comet': unknown tracker; use tensorboard, wandb, mlflow"):
        train(parse_args(tiny_args(tiny_model, corpus, out, "--with_tracking", "--report_to", "comet")))
