"""`python -m mlm_ddp.submit --nodes 2 [submit flags] [train flags]`: the same `train(cfg)`, submitted
to Slurm through Submitit, requeued and resumed on preemption or timeout.

One Submitit task per training process: per GPU on GPU nodes, `--procs_per_node` CPU processes
otherwise. Each task is one rank, so no launcher runs inside the job: `mlm_ddp.distributed` reads the
Slurm variables Submitit's `srun` sets (rank, world size, master = first node, port from the job id).

Preemption and timeout: Slurm (via Submitit's `--signal`) sends USR2 to every task. Inside `train`,
mlm_ddp's own handler catches it on every rank (Submitit's would checkpoint on rank 0 only, submitit
#9): all ranks save one checkpoint at the next step boundary. Rank 0 then requeues the job, and the
requeued job reruns this same task with `--resume_from_checkpoint auto`.

Every attempt resumes `--output_dir`, so `--overwrite_output_dir` is refused before submission. A run
that already finished ends as a success (its summary.json is the result). Bad input found on the
cluster (a BadInput) ends every task with one line and exit 2, never a traceback or a requeue.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from transformers import HfArgumentParser

from mlm_ddp.cluster import launcher as distributed
from mlm_ddp.config import _doc, checks, parse_args
from mlm_ddp.data import check_files, data_notes
from mlm_ddp.errors import EXIT_BAD_INPUT, EXIT_REQUEUE, AlreadyFinished, BadInput, Preempted
from mlm_ddp.train import check_inputs, setup_logging, train

BAD_INPUT_PREFIX = "mlm_ddp.submit: error: "  # how a task's bad-input line starts; --wait looks for it


class TrainTask:
    """What every Submitit task runs. Picklable: it holds only the training flags."""

    def __init__(self, train_argv: list[str]) -> None:
        self.train_argv = train_argv

    def __call__(self) -> dict[str, Any]:
        setup_logging()
        # flags given later win: a user's own --resume_from_checkpoint overrides auto
        cfg = parse_args(["--resume_from_checkpoint", "auto", *self.train_argv])
        try:
            return dataclasses.asdict(train(cfg))
        except AlreadyFinished:
            # a finished run submitted again: nothing to do, which is a success, not a failed job
            summary = json.loads((Path(cfg.run.output_dir) / "summary.json").read_text())
            print(f"mlm_ddp.submit: --output_dir {cfg.run.output_dir} holds a finished run ({summary['steps']} "
                  "steps): nothing to do", file=sys.stderr, flush=True)
            return summary
        except BadInput as err:
            # bad input seen only on the cluster: it fails the same way on every attempt, so one line
            # and exit 2 on every task, and no requeue
            line = f"{BAD_INPUT_PREFIX}{err}"
            print(line, file=sys.stderr, flush=True)
            record_failure(line)
            sys.exit(EXIT_BAD_INPUT)
        except Preempted as stop:
            topo = distributed.detect(cuda_devices=0)
            print(f"mlm_ddp.submit: {stop}", file=sys.stderr, flush=True)
            if topo.rank == 0 and topo.job_id is not None:
                # the signals every rank agreed on, so rank 0 knows even when another task got one first
                if warning_signal() in (stop.signal_name or "").split(","):
                    distributed.requeue(topo)
                    print(f"mlm_ddp.submit: requeued job {topo.job_id}", file=sys.stderr, flush=True)
                else:  # scancel, or Slurm ending the job itself: the checkpoint is saved, the job ends
                    print(f"mlm_ddp.submit: not requeued: {stop.signal_name} is not the preemption warning "
                          f"({warning_signal()}); resubmit the same command to continue", file=sys.stderr, flush=True)
            # no result: Submitit must not record the job as done; a requeued or resubmitted run finishes it
            sys.exit(EXIT_REQUEUE)

    def checkpoint(self) -> Any:
        """Submitit's own preemption path (a signal before training started): rerun as is."""
        import submitit

        return submitit.helpers.DelayedSubmission(TrainTask(self.train_argv))


def warning_signal() -> str:
    """The signal Slurm sends ahead of a preemption or the time limit (`--signal`, as Submitit sets it)."""
    from submitit.core.job_environment import JobEnvironment

    return "SIG" + JobEnvironment.USR_SIG


def record_failure(line: str) -> None:
    """Leave `line` as this task's outcome where Submitit looks for it. A task that exits without a
    result file leaves `job.results()` (and so --wait) polling sacct, forever on a cluster without
    accounting; with this file it raises at once with the line instead of a traceback."""
    import submitit
    from submitit.core import utils

    env = submitit.JobEnvironment()
    if env.cluster == "debug":  # the task runs in the submitting process: its exit ends that process
        return
    with utils.temporary_save_path(env.paths.result_pickle) as tmp:  # what submitit writes on an exception
        utils.cloudpickle_dump(("error", line), tmp)


def failure_line(job: Any, err: Exception) -> tuple[str, int]:
    """One line and an exit code for a job that did not succeed, from the error `job.results()`
    raised (Submitit's message holds the task's outcome or traceback, then the log paths)."""
    text = str(err)
    bad_input = re.search(f"^{re.escape(BAD_INPUT_PREFIX)}(.*)$", text, re.MULTILINE)
    if bad_input:
        return f"job {job.job_id} stopped on bad input, on every task, not requeued: {bad_input.group(1)}", \
            EXIT_BAD_INPUT
    lines = [line for line in text.split("You can check full logs")[0].splitlines() if line.strip("- ")]
    return f"job {job.job_id} failed: {lines[-1] if lines else type(err).__name__} (log: {job.paths.stderr})", 1


@dataclass
class SubmitConfig:
    """The flags of `python -m mlm_ddp.submit` itself; every other flag is a training flag."""

    nodes: int = _doc("nodes (default 1)", default=1)
    gpus_per_node: int = _doc("GPUs per node; one task per GPU (default 0: CPU)", default=0)
    procs_per_node: int = _doc("CPU only: training processes per node, one task each (default 1)", default=1)
    cpus_per_task: int | None = _doc("CPU cores per task", default=None)
    mem_gb: float | None = _doc("memory per node, GB", default=None)
    timeout_min: int = _doc("time limit in minutes (default 1440)", default=24 * 60)
    partition: str | None = _doc("Slurm partition", default=None)
    account: str | None = _doc("Slurm account", default=None)
    qos: str | None = _doc("Slurm QOS", default=None)
    constraint: str | None = _doc("Slurm node constraint", default=None)
    job_dir: str | None = _doc("folder for Submitit's files and the job logs (default: <output_dir>/submitit)",
                               default=None)
    cluster: Literal["slurm", "local", "debug"] = _doc(
        "slurm; local (one process on this machine, no Slurm); debug (in this process)", default="slurm")
    signal_delay_s: int = _doc("seconds before the time limit at which Slurm warns the job (default 120)",
                               default=120)
    wait: bool = _doc("follow the job to its end and return its status", default=False)

    def __post_init__(self) -> None:
        checks.at_least("--nodes", self.nodes, 1)
        checks.not_negative("--gpus_per_node", self.gpus_per_node)
        checks.at_least("--procs_per_node", self.procs_per_node, 1)
        if self.cluster != "slurm" and (self.nodes > 1 or self.gpus_per_node > 1 or self.procs_per_node > 1):
            raise BadInput(f"--cluster {self.cluster} runs one process on this machine: use --nodes 1 and "
                           "one process, or --cluster slurm")
        # Slurm would take these and run a job that fails later, or with nonsense (a negative warning time)
        checks.at_least("--timeout_min", self.timeout_min, 1, " minute")
        checks.at_least("--cpus_per_task", self.cpus_per_task, 1)
        checks.positive("--mem_gb", self.mem_gb)
        checks.within("--signal_delay_s", self.signal_delay_s, 0, 60 * self.timeout_min,
                      hint=f" (seconds, within --timeout_min's {60 * self.timeout_min} s)")


def make_parser() -> HfArgumentParser:
    return HfArgumentParser(
        SubmitConfig, prog="python -m mlm_ddp.submit",
        allow_abbrev=False,  # a training flag is never taken for ours (--node is not --nodes)
        formatter_class=argparse.HelpFormatter,  # the help texts name their defaults (the HF default repeats them)
        description="Submit mlm_ddp.train through Submitit. Flags not listed here are training flags "
                    "(python -m mlm_ddp.train --help); they are checked before anything is submitted.")


def writable_job_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise BadInput(f"--job_dir {path}: cannot be written ({err.strerror or err})") from err
    return path


def submit(args: SubmitConfig, train_argv: list[str]) -> Any:
    import submitit

    cfg = parse_args(train_argv)  # every training flag checked here, before anything is submitted
    if cfg.run.overwrite_output_dir:
        out = cfg.run.output_dir
        raise BadInput(f"--overwrite_output_dir: every attempt of this job, requeues included, resumes "
                          f"--output_dir {out} (--resume_from_checkpoint auto), so it cannot erase it; remove "
                          f"{out} yourself or choose another --output_dir, and submit without --overwrite_output_dir")
    check_inputs(cfg)  # what train refuses before it starts: the model, --max_seq_length, the probe's files
    check_files(cfg.data)  # and what loading its data would: a folder, a missing file, text that is not UTF-8
    for note in data_notes(cfg.data):
        print(f"mlm_ddp.submit: warning: {note}", file=sys.stderr)
    if args.cluster == "slurm" and (missing := [c for c in ("sbatch", "srun") if shutil.which(c) is None]):
        raise BadInput(f"--cluster slurm: {' and '.join(missing)} not found on PATH (submit from a Slurm login node), "
                       "or run here with --cluster local or --cluster debug")
    job_dir = Path(args.job_dir or Path(cfg.run.output_dir) / "submitit")
    made = next((p for p in reversed([job_dir, *job_dir.parents]) if not p.exists()), None)  # the top folder made
    before = set(job_dir.iterdir()) if made is None and job_dir.is_dir() else set()
    writable_job_dir(job_dir)
    tasks = args.gpus_per_node or args.procs_per_node
    executor = submitit.AutoExecutor(folder=job_dir / "%j", cluster=args.cluster)
    params: dict[str, Any] = dict(name="mlm_ddp", nodes=args.nodes, tasks_per_node=tasks,
                                  timeout_min=args.timeout_min)
    if args.cpus_per_task:
        params["cpus_per_task"] = args.cpus_per_task
    if args.gpus_per_node:
        params["gpus_per_node"] = args.gpus_per_node
    if args.mem_gb:
        params["mem_gb"] = args.mem_gb
    if args.cluster == "slurm":
        params.update(slurm_signal_delay_s=args.signal_delay_s,
                      **{f"slurm_{k}": v for k, v in (("partition", args.partition), ("account", args.account),
                                                       ("qos", args.qos), ("constraint", args.constraint)) if v})
    executor.update_parameters(**params)
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):  # submitit prints sbatch's lines, then raises with them
            job = executor.submit(TrainTask(train_argv))
    except submitit.core.utils.FailedJobError as err:  # sbatch refused it: a partition, an account, a limit
        for path in [made] if made is not None else set(job_dir.iterdir()) - before:  # what this call wrote
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        lines = [re.sub(r"^sbatch: error: ", "", line.strip()) for line in str(err).splitlines() if line.strip()]
        raise BadInput(f"Slurm refused the job: {'; '.join(lines) or type(err).__name__}") from None
    sys.stderr.write(said.getvalue())
    return job


def main(argv: list[str] | None = None) -> int:
    try:
        # the flags that are not ours are the training flags, passed on as given (parse_known_args)
        args, train_argv = make_parser().parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
        job = submit(args, train_argv)
    except BadInput as err:
        print(f"mlm_ddp.submit: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"submitted job {job.job_id} ({args.nodes} node(s))")
    if args.cluster != "debug":
        print(f"  log: {job.paths.stdout}\n  errors: {job.paths.stderr}\n  follow: tail -f {job.paths.stderr}")
    if not args.wait:
        return 0
    started = time.monotonic()
    try:
        result = job.results()[0]  # one result per task; rank 0's describes the run
    except Exception as err:  # submitit raises the task's outcome: our one line, or its traceback
        line, code = failure_line(job, err)
        print(f"mlm_ddp.submit: {line}", file=sys.stderr)
        return code
    print(f"job {job.job_id} finished in {time.monotonic() - started:.0f} s: {result['steps']} steps, "
          f"model in {result['final_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
