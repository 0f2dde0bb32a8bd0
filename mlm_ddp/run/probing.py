"""The downstream probe inside a training run (`--probe_train_file`, `--probe_test_file`): did the MLM
training help the user's labeled task? `mlm_ddp.probe` scores the starting model before training and
`final/` after it, with the same splits, seeds and subsamples, so `before` is what the standalone probe
gives for the starting model.

Like with like: each figure carries the settings that made it (`probe.settings`: mode, protocol, texts per
label, seeds, the files' hashes). `before` is kept in the run's folder (`probe_before.json`, with its
per-seed predictions); a resumed run reuses it only where its settings are today's, and otherwise measures
`before` again, with today's settings, on the starting model.

The probe runs on the main process alone; the others wait for its figures in the gloo group of
`MainProcessWait`, whose timeout is the patient `--save_timeout` (docs/design.md, pitfall 14), so a long probe
never trips `--ddp_timeout`. A probe that fails says why and the run goes on: the model it scores is
already saved. The files are checked in preflight (`check`), before anything is written.

`--probe_every_eval` (`EveryEval`) also probes at each evaluation. The model is written as final/ is (every
rank takes part: FSDP gathers its shards) into a folder beside final/ and probed there. Choosing on the
test set would make the chosen model's test score a biased one, so each evaluation's probe trains on part
of the probe's training texts and is scored on the rest (`held_out`: a seeded, stratified split); the
folder of the best held-out accuracy so far is kept as best_probe/, the others are removed. At the end
best_probe/ is scored on the test set once, and that figure is reported apart from the one it was chosen
by.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from accelerate import Accelerator
from accelerate.logging import get_logger

from mlm_ddp.cluster.collectives import MainProcessWait
from mlm_ddp.cluster.durable import write_atomic
from mlm_ddp.config import Config, RunConfig
from mlm_ddp.errors import BadInput
from mlm_ddp.probe.compare import change, describe_change, differences, settings
from mlm_ddp.probe.config import ProbeConfig
from mlm_ddp.probe.standalone import ProbeData, check_probe_data, load_probe_data, probe
from mlm_ddp.run.run_folder import BEST_PROBE, BEST_PROBE_FILE, RunFolder, replace_folder

logger = get_logger(__name__)
FIGURES = ("accuracy", "macro_f1")  # what summary.json, metrics.jsonl and the card carry of each result
HELD_OUT, SPLIT_SEED = 0.2, 0  # --probe_every_eval chooses best_probe/ on this share of the training texts
BEFORE_FILE = "probe_before.json"  # in the run's folder: the starting model's figures, settings and predictions


def probe_config(run: RunConfig) -> ProbeConfig:
    cfg = ProbeConfig(train_file=run.probe_train_file, test_file=run.probe_test_file,
                      text_column=run.probe_text_column, label_column=run.probe_label_column, mode=run.probe_mode,
                      protocol=run.probe_protocol, max_train_per_label=run.probe_max_train_per_label,
                      seeds=run.probe_seeds)
    cfg.flag_prefix = "probe_"  # its errors name the training run's flags
    return cfg


def check(cfg: Config) -> None:
    """Preflight: the probe's files hold a task it can score, and 'before' can be the model training starts from
    (BadInput otherwise)."""
    from mlm_ddp.model.loading import from_scratch

    if not cfg.run.probing():
        return
    check_probe_data(probe_config(cfg.run))
    model = cfg.model
    changed = [flag for flag, on in (("--config_name", model.config_name is not None),
                                     ("--config_overrides", bool(model.config_overrides)),
                                     ("--tokenizer_name", model.tokenizer_name not in (None, model.model_name_or_path)),
                                     ("--trust_remote_code", model.trust_remote_code)) if on]
    if changed and not from_scratch(model):
        raise BadInput(f"--probe_train_file with {', '.join(changed)}: the probe's 'before' reads the starting "
                       "checkpoint's folder, which is not the model training starts from with these; drop them, "
                       "or drop the probe flags and probe the two models with python -m mlm_ddp.probe")


def source_folder(cfg: Config) -> str | None:
    """The starting model's folder (None: a model trained from scratch has no starting features)."""
    from mlm_ddp.model.loading import from_scratch, resolve_model_path

    return None if from_scratch(cfg.model) else str(resolve_model_path(cfg.model))


def score(cfg: Config, accelerator: Accelerator, wait: MainProcessWait, model: str | None,
          name: str) -> dict[str, Any] | None:
    """The probe's figures of the model in folder `model` (`name`: 'before training', ...), on every rank;
    None where the run has no probe, or the probe failed (said)."""
    if not cfg.run.probing() or model is None:
        return None
    figures = None
    if accelerator.is_main_process:
        figures = score_here(cfg.run, accelerator, model, name)
    return wait.broadcast(figures)


def score_here(run: RunConfig, accelerator: Accelerator, model: str, name: str,
               data: ProbeData | None = None) -> dict[str, Any] | None:
    """The main process's probe of folder `model`, logged; None (said) where it fails."""
    try:
        figures = probe(model, None, probe_config(run), accelerator.device, data=data)
    except Exception as err:  # the model is saved already: the run goes on and says what failed
        logger.warning("the probe %s failed (%s: %s); the run goes on without it", name, type(err).__name__, err)
        return None
    logger.info("probe %s (%s, %s protocol, seeds: %s, %d of %d training texts each): accuracy %.4f ± %.4f, macro-F1 "
                "%.4f ± %.4f; majority class %.4f", name, figures["mode"], figures["protocol"], figures["seeds"],
                figures["n_train"], figures["n_train_available"], figures["accuracy"], figures["accuracy_std"],
                figures["macro_f1"], figures["macro_f1_std"], figures["majority_accuracy"])
    return figures


def held_out(data: ProbeData) -> ProbeData:
    """The probe's training texts split in two (HELD_OUT of them held out; seeded, stratified where every label has
    two texts): train on the rest, score on the held-out ones. best_probe/ is chosen on these, not the test set."""
    from sklearn.model_selection import train_test_split

    rows = np.arange(len(data.train_labels))
    try:
        fit, held = train_test_split(rows, test_size=HELD_OUT, random_state=SPLIT_SEED, stratify=data.train_labels)
    except ValueError:  # a label with one text, or fewer held-out texts than labels: a plain seeded split
        fit, held = train_test_split(rows, test_size=HELD_OUT, random_state=SPLIT_SEED)
    fit, held = np.sort(fit), np.sort(held)
    return ProbeData([data.train_texts[i] for i in fit], data.train_labels[fit], [data.train_texts[i] for i in held],
                     data.train_labels[held], data.classes)


def record(figures: dict[str, Any] | None, name: str, step: int) -> dict[str, Any]:
    """A metrics.jsonl line for `figures` ({} where there are none); an evaluation's are held-out figures."""
    if figures is None:
        return {}
    if name == "eval":
        return {"step": step, "probe": name, **{f"probe_heldout_{key}": figures[key] for key in FIGURES}}
    return {"step": step, "probe": name, **{f"probe_{key}": figures[key] for key in (*FIGURES, "majority_accuracy")},
            "probe_accuracy_std": figures["accuracy_std"], "probe_macro_f1_std": figures["macro_f1_std"]}


def earlier_before(folders: list[Path], wanted: dict[str, Any]) -> dict[str, Any] | None:
    """A resumed run's 'before': the figures its first attempt (or a decay branch's source) kept in
    `BEFORE_FILE`, where they were made with the settings `wanted`; None (said why) where they must be made
    again."""
    kept = []
    for folder in folders:
        try:
            kept.append(json.loads((folder / BEFORE_FILE).read_text()))
        except (OSError, ValueError):
            continue
        if kept[-1].get("settings") == wanted:
            logger.info("probe before training: the figures of %s (made with today's settings)", folder / BEFORE_FILE)
            return kept[-1]
    if kept:
        logger.warning("the probe's settings changed since %s was measured (%s): 'before' is measured again with "
                       "today's settings, on the starting model", BEFORE_FILE, differences(kept[0].get("settings"),
                                                                                            wanted))
    elif folders:
        logger.warning("no %s with the settings that made the earlier 'before': it is measured again, on the starting "
                       "model", BEFORE_FILE)
    return None


def summary(before: dict[str, Any] | None, after: dict[str, Any] | None, best: dict[str, Any] | None = None,
            delta: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """summary.json's "probe": {"before": {...}, "after": {...}, "change": {...}}, each figure with accuracy and
    macro_f1 (and per seed), the change with its 95% intervals, and with --probe_every_eval "best": the best
    evaluation's, with its step and folder."""
    if before is None and after is None and best is None:
        return None
    kept = {name: {k: v for k, v in figures.items() if k in KEPT} if figures else None
            for name, figures in (("before", before), ("after", after))}
    return kept | ({"change": delta} if delta is not None else {}) | ({"best": best} if best is not None else {})


def compare(run: RunConfig, accelerator: Accelerator, wait: MainProcessWait, before: dict[str, Any] | None,
            after: dict[str, Any] | None) -> dict[str, Any] | None:
    """after - before with its 95% intervals (probe_compare.change), on every rank; None where either is
    missing or the two do not compare (said: e.g. a probe file changed during the run)."""
    if before is None or after is None:
        return None
    delta = None
    if accelerator.is_main_process:
        try:
            delta = change(before, after, load_probe_data(probe_config(run)).test_labels)
        except ValueError as err:
            logger.warning("the probe's 'before' and 'after' do not compare: %s; no change is reported", err)
        else:
            logger.info("probe change after training: %s", describe_change(delta))
    return wait.broadcast(delta)


def change_record(delta: dict[str, Any] | None) -> dict[str, float]:
    """The change's fields of metrics.jsonl's "after" line."""
    if delta is None:
        return {}
    return {f"probe_change_{key}{end}": value for key in FIGURES
            for end, value in (("", delta[key]), ("_ci95_low", delta[f"{key}_ci95"][0]),
                               ("_ci95_high", delta[f"{key}_ci95"][1]))}


def line(probed: dict[str, Any] | None) -> str:
    """The closing line's part: '; probe accuracy 0.7012 -> 0.7240, macro-F1 0.6950 -> 0.7180'."""
    if not probed or not probed.get("after"):
        return ""
    if not probed.get("before"):
        return f"; probe accuracy {probed['after']['accuracy']:.4f}, macro-F1 {probed['after']['macro_f1']:.4f}"
    before, after, best, delta = probed["before"], probed["after"], probed.get("best"), probed.get("change")
    return (f"; probe accuracy {before['accuracy']:.4f} -> {after['accuracy']:.4f}, "
            f"macro-F1 {before['macro_f1']:.4f} -> {after['macro_f1']:.4f}"
            + (f" (change: {describe_change(delta)})" if delta else " (settings differ: no change reported)")
            + (f" (best {best['folder']}/: step {best['step']}, chosen on held-out accuracy "
               f"{best['heldout_accuracy']:.4f}" + (f"; test accuracy {best['test']['accuracy']:.4f}"
                                                     if best.get("test") else "") + ")" if best else ""))


def add_to_card(final: Path, probed: dict[str, Any] | None, cfg: RunConfig, is_main: bool) -> None:
    """The probe's figures as a section of final/README.md (written after final/ is: the card is
    replaced whole, never half)."""
    card = final / "README.md"
    if not is_main or not probed or not card.exists():
        return
    best = probed.get("best") or {}
    shown = {"before": probed.get("before"), "after": probed.get("after"),
             f"best (step {best.get('step')}, {BEST_PROBE}/, chosen on held-out texts)": best.get("test")}
    rows = [f"| {name} | {f['accuracy']:.4f} ± {f['accuracy_std']:.4f} | {f['macro_f1']:.4f} ± "
            f"{f['macro_f1_std']:.4f} | {f['majority_accuracy']:.4f} |" for name, f in shown.items() if f]
    used = next(iter(f for f in shown.values() if f), None)
    if used is None:
        return
    section = ("\n## Downstream probe\n\n"
               f"`python -m mlm_ddp.probe` ({used['mode']}, {used['protocol']} protocol, seeds: {used['seeds']}, "
               f"{used['n_train']} of {used['n_train_available']} labeled training texts) on "
               f"`{Path(cfg.probe_train_file).name}` / `{Path(cfg.probe_test_file).name}`:\n\n"
               "| model | accuracy | macro-F1 | majority class |\n| --- | ---: | ---: | ---: |\n"
               + "\n".join(rows) + "\n"
               + (f"\nThe change after - before, paired (the same subsamples, seeds and test texts), with the 95% "
                  f"interval over the test texts and seeds: {describe_change(probed['change'])}"
                  ".\n" if probed.get("change") else ""))
    write_atomic(card, card.read_text() + section)


def before_training(cfg: Config, accelerator: Accelerator, wait: MainProcessWait, log: Any, beat: Any, step: int,
                    resumed: bool) -> dict[str, Any] | None:
    """The starting model's figures, kept in the run's folder (`BEFORE_FILE`) and as metrics.jsonl's step-0
    probe line. A resumed run reuses its first attempt's where they were made with today's settings, and
    otherwise measures them again. `log`: the RunLog; `beat`: the heartbeat's."""
    if not cfg.run.probing():
        return None
    if accelerator.is_main_process:  # the rows the probe leaves out (no label, no text), said once
        for note in load_probe_data(probe_config(cfg.run)).notes:
            logger.warning("probe: %s", note)
    earlier = None
    if resumed and accelerator.is_main_process:
        earlier = earlier_before([metrics.parent for metrics in log.origins()], settings(probe_config(cfg.run)))
    earlier = wait.broadcast(earlier)
    if earlier is not None:
        return earlier
    beat(step, "probe")
    figures = score(cfg, accelerator, wait, source_folder(cfg), "before training")
    if figures is not None and accelerator.is_main_process:
        write_atomic(Path(cfg.run.output_dir) / BEFORE_FILE, json.dumps(figures))
    log.write(record(figures, "before", 0), with_tokens=False)
    return figures


def after_training(cfg: Config, accelerator: Accelerator, wait: MainProcessWait, log: Any, beat: Any, step: int,
                   final: Path, before: dict[str, Any] | None, every: EveryEval) -> dict[str, Any] | None:
    """final/'s figures, written to metrics.jsonl and the model card; summary.json's "probe", with best_probe/
    (--probe_every_eval) scored on the test set once."""
    if not cfg.run.probing():
        return None
    beat(step, "probe")
    after = score(cfg, accelerator, wait, str(final), "after training")
    delta = compare(cfg.run, accelerator, wait, before, after)
    log.write(record(after, "after", step) | (change_record(delta) if after else {}), with_tokens=False)
    probed = summary(before, after, every.scored_best(step, after), delta)
    add_to_card(final, probed, cfg.run, accelerator.is_main_process)
    return probed


class EveryEval:
    """The probe inside this run, made once with the run's config (train.py passes it none later): the
    figures `before_training` and `after_training`, and --probe_every_eval: `at_eval(step)` after each
    evaluation, on every rank. The model is written into
    `.tmp-best_probe/` (every rank: FSDP gathers the shards), the main process probes that folder, and
    keeps it as best_probe/ (with probe.json) when its held-out accuracy beats every earlier evaluation's; a tie
    keeps the earlier. A resumed run starts from the best its folder holds, where it was chosen with today's
    settings."""

    def __init__(self, cfg: Config, accelerator: Accelerator, wait: MainProcessWait, folder: RunFolder, model: Any,
                 tokenizer: Any, beat: Any) -> None:
        self.cfg, self.accelerator, self.wait, self.folder = cfg, accelerator, wait, folder
        self.model, self.tokenizer, self.beat = model, tokenizer, beat
        self.on = cfg.run.probe_every_eval
        self.best: dict[str, Any] | None = read_best(folder.path / BEST_PROBE) if self.on else None
        if self.best is not None and ("heldout_accuracy" not in self.best
                                      or self.best.get("settings") != settings(probe_config(cfg.run))):
            logger.warning("%s/ was chosen otherwise (on the test set, or with other probe settings): the evaluations "
                           "from here choose anew", BEST_PROBE)
            self.best = None
        self.data: ProbeData | None = None  # the held-out split of the probe's training texts, read once (main)

    def before_training(self, log: Any, step: int, resumed: bool) -> dict[str, Any] | None:
        return before_training(self.cfg, self.accelerator, self.wait, log, self.beat, step, resumed)

    def after_training(self, log: Any, step: int, final: Path, before: dict[str, Any] | None) -> dict[str, Any] | None:
        return after_training(self.cfg, self.accelerator, self.wait, log, self.beat, step, final, before, self)

    def at_eval(self, step: int) -> dict[str, Any]:
        """This evaluation's probe fields for metrics.jsonl ({} without --probe_every_eval)."""
        if not self.on:
            return {}
        self.beat(step, "probe")
        tmp = self.folder.path / f".tmp-{BEST_PROBE}"
        self.wait.barrier()
        self.folder.write_model(self.accelerator, self.model, self.tokenizer, "", tmp)
        figures = None
        if self.accelerator.is_main_process:
            self.data = self.data or held_out(load_probe_data(probe_config(self.cfg.run)))
            figures = score_here(self.cfg.run, self.accelerator, str(tmp), f"at step {step} (held-out texts)",
                                 self.data)
            if figures is not None and (self.best is None or figures["accuracy"] > self.best["heldout_accuracy"]):
                self.best = {"step": step, "folder": BEST_PROBE, "heldout_accuracy": figures["accuracy"],
                             "heldout_macro_f1": figures["macro_f1"], "n_heldout": figures["n_test"],
                             "settings": figures["settings"]}
                keep_best(tmp, self.folder.path / BEST_PROBE, self.best, self.cfg)
            else:
                shutil.rmtree(tmp)
        figures, self.best = self.wait.broadcast((figures, self.best))
        return {} if figures is None else record(figures, "eval", step)

    def scored_best(self, step: int, after: dict[str, Any] | None) -> dict[str, Any] | None:
        """best_probe/'s record with its test-set figures ("test"), scored once, here; at the last step its
        weights are final/'s, whose figures `after` are."""
        if self.best is None:
            return None
        folder = str(self.folder.path / BEST_PROBE)
        test = after if self.best["step"] == step else score(self.cfg, self.accelerator, self.wait, folder,
                                                             "of best_probe/ on the test set")
        self.best = self.best | {"test": {k: v for k, v in test.items() if k in KEPT} if test else None}
        if self.accelerator.is_main_process:
            write_atomic(self.folder.path / BEST_PROBE / BEST_PROBE_FILE, json.dumps(self.best, indent=2) + "\n")
        return self.best


# what summary.json and best_probe/probe.json keep of a probe's figures
KEPT = (*FIGURES, "accuracy_std", "macro_f1_std", "majority_accuracy", "mode", "protocol", "seeds", "n_train",
        "n_train_available", "n_test", "accuracy_per_seed", "macro_f1_per_seed", "settings")


def read_best(folder: Path) -> dict[str, Any] | None:
    """best_probe/probe.json of an earlier attempt of this run (None: none kept yet)."""
    try:
        return json.loads((folder / BEST_PROBE_FILE).read_text())
    except (OSError, ValueError):
        return None


def keep_best(tmp: Path, best_dir: Path, best: dict[str, Any], cfg: Config) -> None:
    """The probed folder `tmp`, with its card and probe.json, becomes best_probe/ (written whole, then renamed)."""
    (tmp / BEST_PROBE_FILE).write_text(json.dumps(best, indent=2) + "\n")
    (tmp / "README.md").write_text(
        f"# The best downstream probe of {cfg.run.output_dir}\n\n"
        f"The model at optimizer step {best['step']}: of the evaluations of `--probe_every_eval`, its probe scored "
        f"the best accuracy on the held-out {HELD_OUT:.0%} of the probe's training texts (seed {SPLIT_SEED}), "
        f"{best['heldout_accuracy']:.4f} (macro-F1 {best['heldout_macro_f1']:.4f}, {best['n_heldout']} texts). "
        f"Its figures on the test set, scored once at the end of training, are in `{BEST_PROBE_FILE}` (\"test\") and "
        "the run's summary.json. The model at the end of training is `final/`, whose card describes the run.\n")
    replace_folder(tmp, best_dir)
