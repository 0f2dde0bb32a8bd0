"""The downstream probe inside a training run (`--probe_train_file`, `--probe_test_file`): did the MLM
training help the user's labeled task? `mlm_ddp.probe` scores the starting model before training and
`final/` after it, with the same splits, seeds and subsamples, so `before` is what the standalone probe
gives for the starting model.

The probe runs on the main process alone; the others wait for its figures in the gloo group of
`MainProcessWait`, whose timeout is the patient `--save_timeout` (DESIGN.md, pitfall 14), so a long probe
never trips `--ddp_timeout`. A probe that fails says why and the run goes on: the model it scores is
already saved. The files are checked in preflight (`check`), before anything is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.logging import get_logger

from mlm_ddp.collectives import MainProcessWait
from mlm_ddp.config import Config, RunConfig
from mlm_ddp.durable import write_atomic
from mlm_ddp.probe import ProbeConfig, check_probe_data, probe

logger = get_logger(__name__)
FIGURES = ("accuracy", "macro_f1")  # what summary.json, metrics.jsonl and the card carry of each result


def probe_config(run: RunConfig) -> ProbeConfig:
    return ProbeConfig(train_file=run.probe_train_file, test_file=run.probe_test_file,
                       text_column=run.probe_text_column, label_column=run.probe_label_column, mode=run.probe_mode,
                       max_train_per_label=run.probe_max_train_per_label, seeds=run.probe_seeds)


def check(run: RunConfig) -> None:
    """Preflight: the probe's files hold a task it can score (BadInput otherwise)."""
    if run.probing():
        check_probe_data(probe_config(run))


def source_folder(cfg: Config) -> str | None:
    """The starting model's folder (None: a model trained from scratch has no starting features)."""
    from mlm_ddp.model import from_scratch, resolve_model_path

    return None if from_scratch(cfg.model) else str(resolve_model_path(cfg.model))


def score(cfg: Config, accelerator: Accelerator, wait: MainProcessWait, model: str | None,
          name: str) -> dict[str, Any] | None:
    """The probe's figures of the model in folder `model` ('before' or 'after': `name`), on every rank;
    None where the run has no probe, or the probe failed (said)."""
    if not cfg.run.probing() or model is None:
        return None
    figures = None
    if accelerator.is_main_process:
        try:
            figures = probe(model, None, probe_config(cfg.run), accelerator.device)
        except Exception as err:  # the model is saved already: the run goes on and says what failed
            logger.warning("the probe %s training failed (%s: %s); the run goes on without it", name,
                           type(err).__name__, err)
        if figures is not None:
            logger.info("probe %s training (%s, %s seeds, %d training texts each): accuracy %.4f ± %.4f, "
                        "macro-F1 %.4f ± %.4f; majority class %.4f", name, figures["mode"], figures["seeds"],
                        figures["n_train"], figures["accuracy"], figures["accuracy_std"], figures["macro_f1"],
                        figures["macro_f1_std"], figures["majority_accuracy"])
    return wait.broadcast(figures)


def record(figures: dict[str, Any] | None, name: str, step: int) -> dict[str, Any]:
    """A metrics.jsonl line for `figures` ({} where there are none)."""
    if figures is None:
        return {}
    return {"step": step, "probe": name, **{f"probe_{key}": figures[key] for key in (*FIGURES, "majority_accuracy")},
            "probe_accuracy_std": figures["accuracy_std"], "probe_macro_f1_std": figures["macro_f1_std"]}


def earlier_before(metrics: Path) -> dict[str, Any] | None:
    """A resumed run's 'before': the figures its first attempt wrote to metrics.jsonl."""
    from mlm_ddp.run_log import read_metrics_lines

    if not metrics.exists():
        return None
    for _line, line in read_metrics_lines(metrics):
        if line.get("probe") == "before":
            return {key: line[f"probe_{key}"] for key in (*FIGURES, "majority_accuracy")} | {
                "accuracy_std": line["probe_accuracy_std"], "macro_f1_std": line["probe_macro_f1_std"]}
    return None


def summary(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """summary.json's "probe": {"before": {...}, "after": {...}}, each with accuracy and macro_f1."""
    if before is None and after is None:
        return None
    keep = (*FIGURES, "accuracy_std", "macro_f1_std", "majority_accuracy", "mode", "seeds", "n_train", "n_test")
    return {name: {k: v for k, v in figures.items() if k in keep} if figures else None
            for name, figures in (("before", before), ("after", after))}


def line(probed: dict[str, Any] | None) -> str:
    """The closing line's part: '; probe accuracy 0.7012 -> 0.7240, macro-F1 0.6950 -> 0.7180'."""
    if not probed or not probed.get("before") or not probed.get("after"):
        return ""
    before, after = probed["before"], probed["after"]
    return (f"; probe accuracy {before['accuracy']:.4f} -> {after['accuracy']:.4f}, "
            f"macro-F1 {before['macro_f1']:.4f} -> {after['macro_f1']:.4f}")


def add_to_card(final: Path, probed: dict[str, Any] | None, cfg: RunConfig, is_main: bool) -> None:
    """The probe's figures as a section of final/README.md (written after final/ is: the card is
    replaced whole, never half)."""
    card = final / "README.md"
    if not is_main or not probed or not card.exists():
        return
    rows = [f"| {name} | {f['accuracy']:.4f} ± {f['accuracy_std']:.4f} | {f['macro_f1']:.4f} ± {f['macro_f1_std']:.4f} "
            f"| {f['majority_accuracy']:.4f} |" for name, f in probed.items() if f]
    section = ("\n## Downstream probe\n\n"
               f"`python -m mlm_ddp.probe` ({cfg.probe_mode}, {cfg.probe_seeds} seeds, "
               f"{cfg.probe_max_train_per_label or 'all'} training texts per label) on "
               f"`{Path(cfg.probe_train_file).name}` / `{Path(cfg.probe_test_file).name}`:\n\n"
               "| model | accuracy | macro-F1 | majority class |\n| --- | ---: | ---: | ---: |\n"
               + "\n".join(rows) + "\n")
    write_atomic(card, card.read_text() + section)


def before_training(cfg: Config, accelerator: Accelerator, wait: MainProcessWait, log: Any, beat: Any, step: int,
                    resumed: bool) -> dict[str, Any] | None:
    """The starting model's figures (a resumed run: those its first attempt wrote), as metrics.jsonl's
    step-0 probe line. `log`: the RunLog; `beat`: the heartbeat's."""
    if not cfg.run.probing():
        return None
    if resumed:
        return earlier_before(log.path)
    beat(step, "probe")
    figures = score(cfg, accelerator, wait, source_folder(cfg), "before")
    log.write(record(figures, "before", 0), with_tokens=False)
    return figures


def after_training(cfg: Config, accelerator: Accelerator, wait: MainProcessWait, log: Any, beat: Any, step: int,
                   final: Path, before: dict[str, Any] | None) -> dict[str, Any] | None:
    """final/'s figures, written to metrics.jsonl and the model card; summary.json's "probe"."""
    if not cfg.run.probing():
        return None
    beat(step, "probe")
    after = score(cfg, accelerator, wait, str(final), "after")
    log.write(record(after, "after", step), with_tokens=False)
    probed = summary(before, after)
    add_to_card(final, probed, cfg.run, accelerator.is_main_process)
    return probed
