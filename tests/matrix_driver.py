"""Runs a list of training runs one after the other in this process (or in each process of one
`accelerate launch`), for tests.conftest.launch_runs: one start-up for many runs.

`python -m tests.matrix_driver CASES.json RESULTS_DIR`: CASES.json holds [{"id", "argv", "out", "root"?}];
each process writes RESULTS_DIR/results_<rank>.json with, per case, the exit code of
`mlm_ddp.train.main(argv)`, the seconds it took, what it wrote on stderr (its log: accelerate's logger
writes on the main process only) and the error lines in it, and (main process) what the run left (its
curve, checkpoints and summary's counts) and, where the case names a `root`, which files under it changed
and which of those lie outside the run's own folder.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import time
from contextlib import redirect_stderr
from pathlib import Path


def stat_snapshot(root: Path, skip: Path | None) -> dict[str, tuple[int, int]]:
    """path -> (size, mtime in ns) of every file under root, except under `skip`."""
    found = {}
    for path in root.rglob("*"):
        if skip is not None and (path == skip or skip in path.parents):
            continue
        if path.is_file():
            info = path.stat()
            found[str(path.relative_to(root))] = (info.st_size, info.st_mtime_ns)
    return found


def reset_accelerate() -> None:
    """main() builds a fresh Accelerator per run; accelerate keeps singleton state between them."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


class CurrentStderr:
    """A stream that writes to whatever sys.stderr is when it is written to: the logging handler is made
    once, by the first run, and each later run's lines must reach that run's capture."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    cases_file, results_dir = (argv or sys.argv[1:])[:2]
    from mlm_ddp.train import main as train_main
    from mlm_ddp.train import setup_logging

    setup_logging()
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(CurrentStderr())

    rank = int(os.environ.get("RANK", "0"))
    results = []
    for case in json.loads(Path(cases_file).read_text()):
        out, root = Path(case["out"]), Path(case["root"]) if case.get("root") else None
        # a failed run must change nothing at all; a finished one nothing outside its own folder
        watch = rank == 0 and root is not None
        before = stat_snapshot(root, None) if watch else {}
        captured = io.StringIO()
        started = time.monotonic()
        with redirect_stderr(captured):
            code = train_main(case["argv"])
        elapsed = time.monotonic() - started
        reset_accelerate()
        after = stat_snapshot(root, None) if watch else {}
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        outside = [k for k in changed if not (root / k).is_relative_to(out)] if watch else []
        left: dict = {}
        if rank == 0 and code == 0:  # what this run left, before a later resume into its folder changes it
            records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            summary = json.loads((out / "summary.json").read_text())
            left = {"curve": {r["step"]: r["loss"] for r in records if "loss" in r},
                    "summary_steps": summary["steps"], "tokens_seen": summary["tokens_seen"],
                    "sources": summary["sources"],
                    "checkpoints": sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*")),
                    "aside": sorted(str(p.relative_to(out)) for p in (out / "checkpoints").glob("abandoned-*/*"))}
        results.append({"id": case["id"], "out": case["out"], "exit": code, "elapsed": elapsed, "changed": changed,
                        "changed_outside": outside, **left, "log": captured.getvalue(),
                        "errors": [line for line in captured.getvalue().splitlines() if "error:" in line]})
        sys.stderr.write(f"[rank {rank}] case {case['id']}: exit {code} in {elapsed:.1f} s\n")
    Path(results_dir, f"results_{rank}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
