"""`python -m mlm_ddp.report OUTPUT_DIR [OUTPUT_DIR ...] [--out report.html]`: see one run or compare several.

Reads each run's `metrics.jsonl` (and `config.yaml`, `summary.json`, `stopped.json` when present) and
writes an HTML page with no external resources, beside it a folder of PNG plots (training and eval
loss, eval perplexity, against optimizer steps and against tokens trained on; learning rate; tokens/s),
and prints a short summary. Several runs are overlaid, each labelled with the settings in which its
config differs from the others. `mlm_ddp.train` writes `report.html` into its --output_dir when it
finishes (turn off with `--report false`).
"""

from __future__ import annotations

import argparse
import html
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from mlm_ddp.cluster.durable import unwritable
from mlm_ddp.errors import BadInput
from mlm_ddp.probe.compare import describe_change

MARKER = "<!-- written by mlm_ddp.report -->"  # a page without it is never overwritten
# settings that name or place a run rather than change what it trains
NOT_A_DIFFERENCE = {"output_dir", "overwrite_output_dir", "resume_from_checkpoint"}


@dataclass(frozen=True)
class Run:
    """What one output folder says about its run."""

    path: Path
    name: str
    records: list[dict[str, Any]]  # metrics.jsonl, one dict per line, in order
    settings: dict[str, Any] | None  # config.yaml flattened to flag -> value; None without one
    summary: dict[str, Any] | None  # summary.json of a finished run
    stopped: dict[str, Any] | None  # stopped.json of a run stopped by a signal

    def points(self, key: str, x: str = "step") -> tuple[list[float], list[float]]:
        """(x values, values) of the records holding `key`; x is "step" or "tokens_seen" (0 before
        the first step, where only the initial evaluation is logged)."""
        xs, ys = [], []
        for record in self.records:
            value = record.get(key)
            if key.startswith(SOURCE_KEY):  # a held-out source's eval loss (--validation_file a b ...)
                value = ((record.get("eval_sources") or {}).get(key[len(SOURCE_KEY):]) or {}).get("loss")
            where = record.get(x, 0 if x == "tokens_seen" and record["step"] == 0 else None)
            if isinstance(value, (int, float)) and isinstance(where, (int, float)):  # NaN kept: a run diverged
                xs.append(where)
                ys.append(value)
        return xs, ys

    def status(self) -> str:
        last = max(r["step"] for r in self.records)
        if self.summary is not None:
            return "finished"
        if self.stopped is not None:
            return f"stopped on {self.stopped.get('reason', 'a stop signal')} at step {self.stopped.get('step', last)}"
        return f"unfinished (running, or crashed): last logged step {last}"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl; a clear error naming the file and line for anything else."""
    if not path.is_file():
        raise BadInput(f"{path} does not exist: {path.parent} is not an mlm_ddp output folder, or its run "
                          "has not logged a step yet")
    records = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise BadInput(f"{path} line {number}: not valid JSON ({err.msg} at column {err.colno}); "
                              "a run killed while writing leaves a cut last line: delete that line") from err
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise BadInput(f"{path} line {number}: not a metrics record (a JSON object with an integer "
                              f"'step'): {line[:80]!r}")
        records.append(record)
    if not records:
        raise BadInput(f"{path} is empty: the run has not logged anything yet (it logs every "
                          "--logging_steps optimizer steps)")
    return records


def read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise BadInput(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from err


def read_settings(path: Path) -> dict[str, Any] | None:
    """config.yaml as flag -> value (the sections' fields are the flags, unique across sections)."""
    if not path.is_file():
        return None
    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise BadInput(f"{path}: not valid YAML ({err})") from err
    if not isinstance(tree, dict):
        raise BadInput(f"{path}: not an mlm_ddp config (expected sections model/data/training/run)")
    return {k: v for section in tree.values() if isinstance(section, dict) for k, v in section.items()}


def run_names(paths: Sequence[Path]) -> list[str]:
    """The folder names, or more of each path where two runs share a folder name."""
    names = [p.name or str(p) for p in paths]
    return names if len(set(names)) == len(names) else [str(p) for p in paths]


def read_runs(folders: Sequence[str | Path]) -> list[Run]:
    paths = [Path(f) for f in folders]
    for path in paths:
        if not path.is_dir():
            raise BadInput(f"{path} is not a folder: pass the --output_dir of a run")
    return [
        Run(path, name, read_metrics(path / "metrics.jsonl"), read_settings(path / "config.yaml"),
            read_json(path / "summary.json"), read_json(path / "stopped.json"))
        for path, name in zip(paths, run_names(paths), strict=True)
    ]


def differences(runs: Sequence[Run]) -> list[str]:
    """The flags whose values differ between the runs' configs, in config order."""
    known = [r.settings for r in runs if r.settings is not None]
    if len(runs) < 2 or not known:
        return []
    flags = list(dict.fromkeys(k for s in known for k in s))
    return [f for f in flags if f not in NOT_A_DIFFERENCE and len({repr(s.get(f)) for s in known}) > 1]


def label(run: Run, flags: Sequence[str]) -> str:
    if not flags:
        return run.name
    if run.settings is None:
        return f"{run.name} (no config.yaml)"
    return f"{run.name}: " + ", ".join(f"{f}={run.settings.get(f)}" for f in flags)


# ---------------------------------------------------------------------------------------------
# Plots: matplotlib's object API, no pyplot, so nothing global changes and no display is needed
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Panel:
    title: str
    x: str  # "step" or "tokens_seen"
    keys: tuple[str, ...]  # metrics drawn, each in its own line style
    ylabel: str
    log_y: bool = False


FIGURES: dict[str, tuple[Panel, ...]] = {
    "loss.png": (Panel("loss against optimizer steps", "step", ("loss", "eval_loss"), "loss (per masked token)"),
                 Panel("loss against tokens trained on", "tokens_seen", ("loss", "eval_loss"),
                       "loss (per masked token)")),
    "perplexity.png": (Panel("eval perplexity against steps", "step", ("perplexity",), "perplexity", True),
                       Panel("eval perplexity against tokens", "tokens_seen", ("perplexity",), "perplexity", True)),
    "schedule.png": (Panel("learning rate", "step", ("lr",), "learning rate"),
                     Panel("training throughput", "step", ("tokens_per_s",), "tokens/s (all processes)")),
    "gradients.png": (Panel("gradient norm before clipping", "step", ("grad_norm",), "global L2 norm", True),
                      Panel("gradient norm against tokens", "tokens_seen", ("grad_norm",), "global L2 norm", True)),
    # only where a run probed (--probe_train_file): before, at each evaluation (--probe_every_eval), after
    # (the evaluations' are on held-out training texts, before and after on the test set: drawn apart)
    "probe.png": (Panel("downstream probe accuracy against steps", "step", ("probe_accuracy", "probe_heldout_accuracy"),
                        "accuracy"),
                  Panel("downstream probe macro-F1 against steps", "step", ("probe_macro_f1", "probe_heldout_macro_f1"),
                        "macro-F1")),
}
STYLES = {"loss": dict(linestyle="-", label="train"), "eval_loss": dict(linestyle="--", marker="o", label="eval"),
          "perplexity": dict(linestyle="--", marker="o", label="eval"), "lr": dict(linestyle="-", label="lr"),
          "tokens_per_s": dict(linestyle="-", marker=".", label="tokens/s"),
          "grad_norm": dict(linestyle="-", label="gradient norm"),
          "probe_accuracy": dict(linestyle="--", marker="s", label="probe"),
          "probe_macro_f1": dict(linestyle="--", marker="s", label="probe"),
          "probe_heldout_accuracy": dict(linestyle=":", marker="^", label="probe, held-out"),
          "probe_heldout_macro_f1": dict(linestyle=":", marker="^", label="probe, held-out")}
X_LABELS = {"step": "optimizer step", "tokens_seen": "tokens trained on"}
SOURCE_KEY = "eval_sources/"  # + a held-out source's name: its eval loss, in Run.points
SOURCE_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")  # one per source; with more, no curve per source


def source_figure(runs: Sequence[Run]) -> dict[str, tuple[Panel, ...]]:
    """sources.png: each held-out source's eval loss (several --validation_file), where there are a few."""
    names = list(dict.fromkeys(name for run in runs for r in run.records for name in (r.get("eval_sources") or {})))
    if not names or len(names) > len(SOURCE_MARKERS):
        return {}
    keys = tuple(SOURCE_KEY + name for name in names)
    return {"sources.png": (Panel("eval loss per held-out source", "step", keys, "loss (per masked token)"),
                            Panel("eval loss per held-out source", "tokens_seen", keys, "loss (per masked token)"))}


def style(key: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """A metric's line style and legend label; a held-out source's: a marker of its own."""
    if key in STYLES:
        return STYLES[key]
    return dict(linestyle="--", marker=SOURCE_MARKERS[keys.index(key)], label=key[len(SOURCE_KEY):])


def plot(runs: Sequence[Run], labels: Sequence[str], folder: Path) -> list[Path]:
    """Writes FIGURES into `folder`; returns their paths."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda value, _: f"{value:,.0f}" if value >= 100 else f"{value:.3g}")
    # 120k, not 120000: token counts are long and the panels narrow
    short = FuncFormatter(lambda value, _: next((f"{value / size:g}{unit}" for size, unit in
                                                 ((1e9, "G"), (1e6, "M"), (1e3, "k")) if abs(value) >= size),
                                                f"{value:g}"))

    folder.mkdir(parents=True, exist_ok=True)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    written = []
    for filename, panels in {**FIGURES, **source_figure(runs)}.items():
        if not any(run.points(key, panel.x)[0] for run in runs for panel in panels for key in panel.keys):
            continue  # e.g. probe.png of runs without a probe
        fig = Figure(figsize=(9, 3.4 + 0.25 * len(runs)), layout="constrained")
        for ax, panel in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
            for run, color in zip(runs, colors, strict=True):
                for key in panel.keys:
                    xs, ys = run.points(key, panel.x)
                    drawn = {k: v for k, v in style(key, panel.keys).items() if k != "label"}
                    ax.plot(xs, ys, color=color, markersize=4, linewidth=1.4, **drawn)
            ax.set(title=panel.title, xlabel=X_LABELS[panel.x], ylabel=panel.ylabel)
            if panel.x == "tokens_seen":
                ax.xaxis.set_major_formatter(short)
            if panel.log_y:
                ax.set_yscale("log")
                # plain numbers (724, not 7.24 x 10^2); minor ticks labelled when under a decade is shown
                low, high = ax.get_ylim()
                ax.yaxis.set_major_formatter(plain)
                ax.yaxis.set_minor_formatter(plain if high < 10 * low else NullFormatter())
            ax.grid(alpha=0.3)
            if len(panel.keys) > 1:  # which line style is which metric
                ax.legend([Line2D([], [], color="gray", **{k: v for k, v in style(key, panel.keys).items()
                                                            if k != "label"}) for key in panel.keys],
                          [style(key, panel.keys)["label"] for key in panel.keys], fontsize=8)
        fig.legend([Line2D([], [], color=c, linewidth=2) for c in colors], labels, loc="outside lower center",
                   fontsize=8, frameon=False)
        path = folder / filename
        fig.savefig(path, dpi=80)
        written.append(path)
    return written


# ---------------------------------------------------------------------------------------------
# Summary and page
# ---------------------------------------------------------------------------------------------


def rate_text(rate: float) -> str:
    """0.15 -> '15%' (masking.percent's format; not imported from there: the report loads no torch)."""
    return f"{round(rate * 100, 4):g}%"


def eval_masking(run: Run) -> str:
    """The masking rate of the run's evaluations: as its records say it (a resume may change it: '30% -> 15%'),
    else its config's --eval_mlm_probability, else its --mlm_probability (a run of a version that
    evaluated at the training rate); '-' when nothing says or nothing was evaluated."""
    if not any("eval_loss" in r for r in run.records):
        return "-"
    rates = list(dict.fromkeys(r["eval_mlm_probability"] for r in run.records
                               if isinstance(r.get("eval_mlm_probability"), (int, float))))
    if not rates:
        settings = run.settings or {}
        rate = settings.get("eval_mlm_probability", settings.get("mlm_probability"))
        rates = [rate] if isinstance(rate, (int, float)) else []
    return " -> ".join(rate_text(r) for r in rates) or "-"


def facts(run: Run) -> dict[str, str]:
    """One run's headline numbers as display strings (the summary and the page's table)."""
    def first_last(key: str, fmt: Callable[[float], str]) -> str:
        _, values = run.points(key)
        return f"{fmt(values[0])} -> {fmt(values[-1])}" if values else "-"

    steps, perplexities = run.points("perplexity")
    _, tokens = run.points("tokens_seen")
    _, speeds = run.points("tokens_per_s")
    speed = (run.summary or {}).get("tokens_per_s")  # None there: the start that finished trained no step
    speed = statistics.median(speeds) if speed is None and speeds else speed
    best = min((i for i, p in enumerate(perplexities) if math.isfinite(p)), key=perplexities.__getitem__,
               default=None)
    return {
        "status": run.status(),
        "steps": str(max(r["step"] for r in run.records)),
        "tokens": f"{int(tokens[-1]):,}" if tokens else "-",
        "tokens/s": f"{speed:,.0f}" if speed is not None else "-",
        "wall time": f"{run.summary['wall_time_s']:.0f} s" if run.summary else "-",
        "train loss": first_last("loss", "{:.4f}".format),
        "eval loss": first_last("eval_loss", "{:.4f}".format),
        "perplexity": first_last("perplexity", "{:.2f}".format),
        "best perplexity": f"{perplexities[best]:.2f} at step {steps[best]}" if best is not None else "-",
        "eval accuracy": first_last("eval_accuracy", "{:.3f}".format),
        # the loss per character of the text the masked tokens cover: the figure to compare across tokenizers
        "bits per char": first_last("eval_bits_per_char", "{:.4f}".format),
        "eval masked": eval_masking(run),  # perplexities at other masking rates are not comparable
        # before training -> on final/ (probing.py), beside perplexity: did the adaptation help the task?
        "downstream probe accuracy": first_last("probe_accuracy", "{:.4f}".format),
        "downstream probe macro-F1": first_last("probe_macro_f1", "{:.4f}".format),
        # after - before, paired, with its 95% interval ("no measurable change" where it holds 0)
        "downstream probe change": (describe_change(delta) if (delta := ((run.summary or {}).get("probe") or {})
                                                               .get("change")) else "-"),
        "loss spikes": (", ".join(f"{count} {kind.replace('_', ' ')}" for kind, count in spikes.items())
                        if (spikes := (run.summary or {}).get("loss_spikes")) else "-"),
    }


def summary_text(runs: Sequence[Run], labels: Sequence[str]) -> str:
    lines = []
    for run, text in zip(runs, labels, strict=True):
        f = facts(run)
        lines.append(f"{text} ({run.path}): {f['status']}")
        lines.append(f"  {f['steps']} steps, {f['tokens']} tokens, {f['tokens/s']} tokens/s, wall {f['wall time']}")
        lines.append(f"  train loss {f['train loss']}; eval ({f['eval masked']} masked) loss {f['eval loss']}, "
                     f"perplexity {f['perplexity']} (best {f['best perplexity']}), accuracy {f['eval accuracy']}"
                     + (f", bits per character {f['bits per char']}" if f["bits per char"] != "-" else ""))
        if f["downstream probe accuracy"] != "-":
            lines.append(f"  downstream probe accuracy {f['downstream probe accuracy']}, macro-F1 "
                         f"{f['downstream probe macro-F1']}; change {f['downstream probe change']}")
    if unlike := unlike_masking(runs):
        lines.append(unlike)
    return "\n".join(lines)


def unlike_masking(runs: Sequence[Run]) -> str:
    """A warning when the runs' evaluations masked at different rates, else ''."""
    rates = {eval_masking(run) for run in runs}
    if len(rates) < 2:
        return ""
    return (f"note: these runs evaluated at different masking rates ({', '.join(sorted(rates))}): their eval "
            "losses and perplexities are not comparable (--eval_mlm_probability sets one rate for all)")


CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:960px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:90%}td,th{border:1px solid #ccc;padding:3px 8px;
text-align:left}th{background:#f3f3f3}img{max-width:100%}pre{background:#f7f7f7;padding:8px;
font-size:80%;overflow:auto}figure{margin:1em 0}"""


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    cells = lambda tag, row: "".join(f"<{tag}>{html.escape(str(c))}</{tag}>" for c in row)  # noqa: E731
    return ("<table><tr>" + cells("th", header) + "</tr>"
            + "".join("<tr>" + cells("td", row) + "</tr>" for row in rows) + "</table>")


def page(runs: Sequence[Run], labels: Sequence[str], flags: Sequence[str], images: Sequence[str]) -> str:
    columns = ["status", "steps", "tokens", "tokens/s", "wall time", "train loss", "eval masked", "eval loss",
               "perplexity", "best perplexity", "eval accuracy", "bits per char", "downstream probe accuracy",
               "downstream probe macro-F1", "downstream probe change"]
    parts = [f"<!DOCTYPE html>\n{MARKER}\n<html><head><meta charset='utf-8'><title>mlm_ddp report: "
             f"{html.escape(', '.join(r.name for r in runs))}</title><style>{CSS}</style></head><body>",
             "<h1>mlm_ddp run report</h1>",
             f"<p>{len(runs)} run(s), written {datetime.now():%Y-%m-%d %H:%M} by <code>python -m "
             "mlm_ddp.report</code>. Losses are per masked token; tokens are input tokens of all "
             "processes; bits per char: the masked tokens' loss per character they cover, the figure that "
             "compares runs of different tokenizers; first → last logged value.</p>",
             "<h2>Runs</h2>",
             table(["run", *columns], [[text, *(facts(run)[c].replace(" -> ", " → ") for c in columns)]
                                       for run, text in zip(runs, labels, strict=True)])]
    if unlike := unlike_masking(runs):
        parts.append(f"<p><strong>{html.escape(unlike)}</strong></p>")
    if flags:
        parts += ["<h2>What differs between the configs</h2>",
                  table(["run", *flags], [[r.name, *("(no config.yaml)" if r.settings is None else r.settings.get(f)
                                                     for f in flags)] for r in runs])]
    parts.append("<h2>Curves</h2>")
    parts += [f"<figure><img src='{html.escape(src)}' alt='{html.escape(src)}'></figure>" for src in images]
    parts.append("<h2>Configurations</h2>")
    for run in runs:
        config = run.path / "config.yaml"
        text = config.read_text() if config.is_file() else "(no config.yaml)"
        parts.append(f"<details><summary>{html.escape(run.name)}</summary><pre>{html.escape(text)}</pre></details>")
    return "\n".join(parts) + "\n</body></html>\n"


def default_out(folders: Sequence[str | Path]) -> Path:
    """One run: report.html inside it; several: report.html in the current folder."""
    return Path(folders[0]) / "report.html" if len(folders) == 1 else Path("report.html")


def write_report(folders: Sequence[str | Path], out: str | Path | None = None) -> tuple[Path, str]:
    """Writes the page and its plots (in `<name>_plots/` beside it); returns (page path, summary)."""
    # without --out the page goes into the run's folder: a RUN that is not one is said as such, not as an --out
    runs = read_runs(folders) if out is None else None
    out = Path(out) if out is not None else default_out(folders)
    if out.suffix != ".html":
        raise BadInput(f"--out {out}: name the report page with .html (its plots go beside it)")
    if (problem := unwritable(out.parent)) is not None:  # a read-only place: an OSError traceback after the plots
        raise BadInput(f"--out {out}: {problem}; choose another --out")
    runs = runs if runs is not None else read_runs(folders)
    if out.exists() and (not out.is_file() or MARKER not in out.read_text(errors="replace")[:200]):
        raise BadInput(f"--out {out} exists and is not a page mlm_ddp.report wrote: choose another --out, "
                          "or delete it yourself")
    plots = out.with_name(out.stem + "_plots")
    if plots.exists() and not plots.is_dir():
        raise BadInput(f"{plots} exists and is not a folder; the report's plots go there: remove it or "
                          "choose another --out")
    flags = differences(runs)
    labels = [label(run, flags) for run in runs]
    images = [f"{plots.name}/{p.name}" for p in plot(runs, labels, plots)]
    tmp = out.with_name(out.name + ".tmp")  # a reader never sees half a page
    tmp.write_text(page(runs, labels, flags, images))
    tmp.replace(out)
    return out, summary_text(runs, labels)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlm_ddp.report", description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("runs", nargs="+", metavar="OUTPUT_DIR", help="the --output_dir of one or more runs")
    p.add_argument("--out", default=None,
                   help="the HTML page to write (default: OUTPUT_DIR/report.html for one run, ./report.html "
                        "for several); the plots go to a folder beside it, named after it")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        out, summary = write_report(args.runs, args.out)
    except BadInput as err:
        print(f"mlm_ddp.report: error: {err}", file=sys.stderr)
        return 2
    print(summary)
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
