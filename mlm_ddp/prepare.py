"""`python -m mlm_ddp.prepare --train_file CORPUS --output_dir DIR`: tokenize and pack a corpus once, on
every core (`--num_workers`) and over Slurm array tasks (`--nodes N` through Submitit, or
`sbatch --array` with slurm/prepare.sh), into memory-mapped Arrow shards that `mlm_ddp.train`
reads with `--prepared_data DIR` (the folder's layout: mlm_ddp/data/prepared.py).

The same data and tokenizer flags as training. The unit of work is a chunk of `TOKENIZE_BATCH` texts
of one input file, packed on its own exactly as the map-style path packs one tokenization batch, so
the blocks of a file do not depend on how many workers or tasks share the work. Task i of N takes its
share of the input files, balanced by bytes (`data.stream.balance_shards`); it reads them in
chunks (memory stays bounded: at most 2 chunks per worker in flight), writes its shards into a
temporary folder and renames it into place with its marker. Running the same command again skips the
tasks that have their marker; the task that finds every part complete writes the manifest.
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing
import os
import resource
import shutil
import socket
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets import Features, Sequence, Value, load_dataset
from datasets.arrow_writer import ArrowWriter
from transformers import HfArgumentParser

from mlm_ddp import distributed
from mlm_ddp.checkpoint import write_atomic
from mlm_ddp.config import DataConfig, ModelConfig, _doc
from mlm_ddp.data import prepared as fmt
from mlm_ddp.data.pack import TOKENIZE_BATCH, tokenize_and_pack
from mlm_ddp.data.stream import balance_shards
from mlm_ddp.data.text import SUFFIX_BUILDERS, check_columns
from mlm_ddp.errors import EXIT_BAD_INPUT, BadInput, say

PROG = "mlm_ddp.prepare"
LONG_TEXT = 1_000_000  # characters of one text above which prepare warns (docs/prepare.md "Measured")


@dataclass
class PrepareConfig:
    """The flags of `python -m mlm_ddp.prepare` besides the data and tokenizer flags of training."""

    output_dir: str | None = _doc("The prepared folder to write; training reads it with --prepared_data.",
                                  default=None)
    num_workers: int | None = _doc("Tokenizing processes of each task (default: every core the task may use).",
                                   default=None)
    seed: int = _doc("Seed of the held-out split (without --validation_file: --validation_split_percentage "
                     "of the texts of every file, drawn per chunk).", default=42)
    task: int | None = _doc("This task's index, of --tasks (default: SLURM_ARRAY_TASK_ID in a Slurm array "
                            "job, else 0).", default=None)
    tasks: int | None = _doc("How many tasks share the files (default: SLURM_ARRAY_TASK_COUNT in a Slurm array "
                             "job, else 1).", default=None)
    nodes: int | None = _doc("Submit --nodes array tasks through Submitit, one per node, wait for them, and "
                             "write the manifest.", default=None)
    cpus_per_task: int | None = _doc("--nodes: CPU cores per task", default=None)
    mem_gb: float | None = _doc("--nodes: memory per task, GB", default=None)
    timeout_min: int = _doc("--nodes: time limit in minutes", default=24 * 60)
    partition: str | None = _doc("--nodes: Slurm partition", default=None)
    account: str | None = _doc("--nodes: Slurm account", default=None)
    cluster: Literal["slurm", "local", "debug"] = _doc("--nodes: slurm; local or debug (tests, one machine)",
                                                       default="slurm")
    overwrite_output_dir: bool = _doc("Remove an earlier prepare's plan, parts and manifest in --output_dir.",
                                      default=False)

    def __post_init__(self) -> None:
        if self.output_dir is None:
            raise BadInput("--output_dir is required: the folder to write the prepared corpus into")
        for name in ("num_workers", "tasks", "nodes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise BadInput(f"--{name} must be at least 1, got {value}")


# ---------------------------------------------------------------------------------------------
# the plan: which files, which settings, which task takes which file
# ---------------------------------------------------------------------------------------------


def expand(spec: str, flag: str) -> list[Path]:
    """A file, a folder (its files of a known suffix, recursively) or a glob -> files, sorted."""
    path = Path(spec)
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIX_BUILDERS)
    elif any(ch in spec for ch in "*?["):
        found = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
    else:
        found = [path] if path.is_file() else []
    if not found:
        raise BadInput(f"{flag} {spec}: no such file, or no {'/'.join(sorted(SUFFIX_BUILDERS))} file in it")
    for file in found:
        if file.suffix.lower() not in SUFFIX_BUILDERS:
            raise BadInput(f"{flag}: {file} has an unknown extension {file.suffix or '(none)'!r}; use one of "
                           f"{', '.join(sorted(SUFFIX_BUILDERS))}")
        try:
            size = file.stat().st_size
            with open(file, "rb"):
                pass
        except OSError as err:
            raise BadInput(f"{file}: cannot be read ({err.strerror or err})") from err
        if size == 0:
            raise BadInput(f"{file}: the file is empty; remove it from {flag} {spec}")
    return found


def inputs(data: DataConfig) -> list[dict[str, Any]]:
    """The input files in the order training reads their blocks: training files, then validation files."""
    if data.streaming:
        raise BadInput("--streaming: a prepared folder is read memory-mapped, not streamed; drop --streaming")
    if data.prepared_data is not None:
        raise BadInput("--prepared_data: that folder is prepared already; give the raw text (--train_file)")
    source = data.train_file or data.dataset_name
    if source is None:
        raise BadInput("give the corpus: --train_file (a file, a folder or a glob) or --dataset_name (a local "
                       "dataset folder)")
    flag = "--train_file" if data.train_file else "--dataset_name"
    if data.dataset_name is not None and not Path(data.dataset_name).is_dir():
        raise BadInput(f"--dataset_name {data.dataset_name}: prepare reads local files; download the dataset "
                       "first (its folder can be given here)")
    files = [("train", p) for p in expand(source, flag)]
    if data.validation_file is not None:
        files += [("eval", p) for p in expand(data.validation_file, "--validation_file")]
    suffixes = {SUFFIX_BUILDERS[p.suffix.lower()] for _, p in files}
    if len(suffixes) > 1:
        raise BadInput(f"the input files mix formats ({', '.join(sorted(suffixes))}); give files of one format")
    return [{"path": str(p.resolve()), "role": role, "bytes": p.stat().st_size} for role, p in files]


def make_plan(data: DataConfig, tokenizer: Any, seed: int, tasks: int) -> dict[str, Any]:
    files = inputs(data)
    held_out = 0.0 if data.validation_file is not None else data.validation_split_percentage
    return {
        "format_version": fmt.FORMAT_VERSION,
        "inputs": files,
        "tasks": tasks,
        "assignment": balance_shards([f["bytes"] for f in files], tasks, equal_counts=False),
        "settings": {
            "tokenizer": {"name": str(getattr(tokenizer, "name_or_path", "")),
                          "fingerprint": fmt.tokenizer_fingerprint(tokenizer), "vocab_size": len(tokenizer)},
            "max_seq_length": data.max_seq_length, "packing": fmt.packing(data),
            "word_continues": data.whole_word_mask, "text_column": data.text_column,
            "held_out_percent": held_out, "seed": seed, "texts_per_chunk": TOKENIZE_BATCH,
        },
    }


OWN_NAMES = (fmt.PLAN, fmt.MANIFEST, fmt.PARTS, "submitit")  # what a prepare writes at the folder's top


def fix_plan(folder: Path, plan: dict[str, Any], overwrite: bool) -> None:
    """Write the plan, or check that the folder's is this one: a relaunch must not mix parts of two plans."""
    path = folder / fmt.PLAN
    if overwrite:
        for name in (fmt.PLAN, fmt.MANIFEST, fmt.PARTS):
            target = folder / name
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    elif path.is_file():
        earlier = json.loads(path.read_text())
        if earlier == plan:
            return
        changed = [key for key in ("inputs", "tasks", "settings") if earlier.get(key) != plan.get(key)]
        raise BadInput(f"--output_dir {folder} holds a prepare of other {' and '.join(changed)}; run the same "
                       "command as before to finish it, choose another --output_dir, or pass "
                       "--overwrite_output_dir to start over")
    elif folder.is_dir() and any(p.name not in OWN_NAMES and not p.name.startswith(".tmp-") for p in folder.iterdir()):
        raise BadInput(f"--output_dir {folder} is not empty and holds no prepare ({fmt.PLAN}); choose another "
                       "folder")
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(plan, indent=1), shared=True)  # every task of the command writes the same


# ---------------------------------------------------------------------------------------------
# one task: its files, chunk by chunk, on its workers
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Packer:
    """What a worker does to one chunk (picklable; a worker process gets it once)."""

    tokenizer: Any
    max_seq_length: int
    word_continues: bool
    line_by_line: bool
    id_type: str  # the smallest unsigned type that holds every token id

    def schema(self) -> Features:
        columns = {"input_ids": Sequence(Value(self.id_type))}
        if self.word_continues:
            columns["word_continues"] = Sequence(Value("uint8"))
        return Features(columns)

    def table(self, texts: list[str]) -> pa.Table | None:
        packed = tokenize_and_pack(texts, self.tokenizer, self.max_seq_length, self.word_continues,
                                   self.line_by_line)
        if not packed["input_ids"]:
            return None
        return pa.table({name: pa.array(rows, type=pa.list_(pa.from_numpy_dtype(
            np.dtype(self.id_type if name == "input_ids" else "uint8")))) for name, rows in packed.items()})

    def __call__(self, chunk: tuple[list[str], list[bool]]) -> tuple[pa.Table | None, pa.Table | None, int]:
        """(train blocks, held-out blocks, non-blank texts) of one chunk."""
        texts, held = chunk
        kept = sum(1 for t in texts if isinstance(t, str) and t.strip())
        return (self.table([t for t, h in zip(texts, held, strict=True) if not h]),
                self.table([t for t, h in zip(texts, held, strict=True) if h]), kept)


def chunks(file: dict[str, Any], index: int, settings: dict[str, Any]) -> Iterator[tuple[list[str], list[bool]]]:
    """The file's texts, `TOKENIZE_BATCH` at a time (the map-style path's tokenization batch), each
    with its held-out draws (seeded by the file and the chunk: the same whoever reads it)."""
    path, column = file["path"], settings["text_column"]
    builder = SUFFIX_BUILDERS[Path(path).suffix.lower()]
    try:
        stream = load_dataset(builder, data_files=[path], split="train", streaming=True)
        for number, batch in enumerate(stream.iter(batch_size=TOKENIZE_BATCH)):
            check_columns(list(batch), column, path)
            texts = batch[column]
            for row, text in enumerate(texts):
                if isinstance(text, str) and len(text) > LONG_TEXT:
                    say(f"{PROG}: warning: {path}, text {number * TOKENIZE_BATCH + row + 1}: {len(text) / 1e6:.1f}M "
                        "characters in one text; the tokenizer holds all its tokens at once (measured: 4 GB for "
                        "27M characters): split such texts into lines")
            if file["role"] == "eval":
                held = [True] * len(texts)
            else:
                draws = np.random.default_rng([settings["seed"], index, number]).random(len(texts))
                held = (draws * 100 < settings["held_out_percent"]).tolist()
            yield texts, held
    except BadInput:
        raise
    except Exception as err:  # noqa: BLE001 - pyarrow, json and csv readers each raise their own types
        raise BadInput(f"{path}: cannot be read as {builder} ({type(err).__name__}: {str(err)[:300]})") from err


class Workers:
    """`packer` on `count` processes, made once per task: `map` runs it over items in order, with at
    most 2 per worker in flight (Pool.imap would read the whole input ahead); one worker runs it here.
    A worker that dies (killed for memory) fails the task with WorkerDied, where a multiprocessing.Pool
    would wait for its result forever."""

    def __init__(self, packer: Packer, count: int) -> None:
        self.packer, self.count, self.pool = packer, count, None

    def __enter__(self) -> Workers:
        if self.count > 1:
            context = multiprocessing.get_context("spawn")  # a fork would copy the tokenizer's thread state
            self.pool = ProcessPoolExecutor(self.count, mp_context=context, initializer=_set_packer,
                                            initargs=(self.packer,))
        return self

    def __exit__(self, *_exc: Any) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def map(self, items: Iterator[Any]) -> Iterator[Any]:
        if self.pool is None:
            yield from map(self.packer, items)
            return
        pending: deque = deque()
        try:
            for item in items:
                pending.append(self.pool.submit(_pack, item))
                if len(pending) >= 2 * self.count:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool as err:
            raise WorkerDied(f"a tokenizing worker process died ({err}): killed for memory? A warning above names "
                             "any text long enough; lower --num_workers or split such texts, then run the same "
                             "command again (complete parts are kept)") from err


class WorkerDied(Exception):
    """A worker process of the task ended without its result."""


_PACKER: list[Packer] = []  # the packer of a worker process, set once by the pool's initializer


def _set_packer(packer: Packer) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: the pool is the parallelism
    _PACKER.append(packer)


def _pack(item: Any) -> Any:
    return _PACKER[0](item)


def write_file(workers: Workers, file: dict[str, Any], index: int, settings: dict[str, Any],
               into: Path) -> dict[str, Any]:
    """One input file's shards into `into`; returns its counts."""
    counts: dict[str, Any] = {"file": index, "texts": 0, **{s: {"blocks": 0, "tokens": 0} for s in fmt.SPLITS}}
    writers: dict[str, ArrowWriter] = {}
    for train, held, texts in workers.map(chunks(file, index, settings)):
        counts["texts"] += texts
        for split, table in (("train", train), ("eval", held)):
            if table is None:
                continue
            if split not in writers:
                shard = into / fmt.shard_name(split, index)
                writers[split] = ArrowWriter(features=workers.packer.schema(), path=str(shard))
            writers[split].write_table(table)
            counts[split]["blocks"] += table.num_rows
            counts[split]["tokens"] += int(pc.sum(pc.list_value_length(table["input_ids"])).as_py() or 0)
    for writer in writers.values():
        writer.finalize()
        writer.close()
    if counts["texts"] == 0:
        raise BadInput(f"{file['path']}: holds no texts (every line or {settings['text_column']!r} value is blank)")
    return counts


def run_task(folder: Path, plan: dict[str, Any], task: int, packer: Packer, workers: int) -> bool:
    """Task `task` of the plan, unless its part is complete; False when it was (nothing done)."""
    tasks, settings = plan["tasks"], plan["settings"]
    name = fmt.task_dir_name(task, tasks)
    parts = folder / fmt.PARTS
    final = parts / name
    if fmt.part_complete(folder, task, tasks):
        say(f"{PROG}: task {task} of {tasks}: already complete ({final})")
        return False
    parts.mkdir(parents=True, exist_ok=True)
    for leftover in parts.glob(f".tmp-{name}.*"):  # an attempt that was killed: never read, removed
        shutil.rmtree(leftover, ignore_errors=True)
    if final.exists():  # a part without its marker (not written by this version's rename): never read
        shutil.rmtree(final)
    tmp = parts / f".tmp-{name}.{socket.gethostname()}.{os.getpid()}"
    tmp.mkdir()
    started, files = time.perf_counter(), plan["assignment"][task]
    with Workers(packer, workers) as pool:
        records = [write_file(pool, plan["inputs"][index], index, settings, tmp) for index in files]
    write_atomic(tmp / fmt.PART_FILE, json.dumps({"task": task, "tasks": tasks, "files": records}, indent=1))
    write_atomic(tmp / fmt.MARKER, "ok\n")
    try:
        os.rename(tmp, final)
    except OSError:  # another attempt of this task finished first: its part stands
        shutil.rmtree(tmp, ignore_errors=True)
    took = time.perf_counter() - started
    tokens = sum(r[s]["tokens"] for r in records for s in fmt.SPLITS)
    rss = [resource.getrusage(who).ru_maxrss / 1024 for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    say(f"{PROG}: task {task} of {tasks}: {len(files)} file(s), {sum(r['texts'] for r in records)} texts, "
        f"{tokens} tokens in {took:.1f} s ({tokens / max(took, 1e-9):,.0f} tokens/s on {workers} worker(s)); "
        f"peak memory {rss[0]:.0f} MB in this process" + (f", {rss[1]:.0f} MB in the largest worker" if workers > 1
                                                           else ""))
    return True


# ---------------------------------------------------------------------------------------------
# the manifest: once every part is complete
# ---------------------------------------------------------------------------------------------


def finalize(folder: Path, plan: dict[str, Any]) -> dict[str, Any] | None:
    """Check every part and write the manifest; None (and a line) while some part has no marker."""
    tasks, settings = plan["tasks"], plan["settings"]
    names = [fmt.task_dir_name(t, tasks) for t in range(tasks)]
    missing = [t for t in range(tasks) if not fmt.part_complete(folder, t, tasks)]
    if missing:
        say(f"{PROG}: {tasks - len(missing)} of {tasks} task(s) complete; task(s) {', '.join(map(str, missing))} "
            "not yet: the manifest is written when every part is (run the same command again for a task that died)")
        return None
    records = {}
    for name in names:
        part = json.loads((folder / fmt.PARTS / name / fmt.PART_FILE).read_text())
        records.update({r["file"]: (name, r) for r in part["files"]})
    shards, totals = [], {"texts": 0, **{s: {"blocks": 0, "tokens": 0} for s in fmt.SPLITS}}
    for split in fmt.SPLITS:
        for index in range(len(plan["inputs"])):
            name, record = records[index]
            if record[split]["blocks"] == 0:
                continue
            path = folder / fmt.PARTS / name / fmt.shard_name(split, index)
            shards.append({"path": str(path.relative_to(folder)), "split": split, "file": index,
                           "bytes": path.stat().st_size, **record[split]})
            for key in ("blocks", "tokens"):
                totals[split][key] += record[split][key]
    totals["texts"] = sum(r["texts"] for _, r in records.values())
    seq = settings["max_seq_length"]
    for split in fmt.SPLITS:
        totals[split]["padding"] = totals[split]["blocks"] * seq - totals[split]["tokens"]
    manifest = {"format_version": fmt.FORMAT_VERSION, "tokenizer": settings["tokenizer"], "max_seq_length": seq,
                "packing": settings["packing"], "word_continues": settings["word_continues"],
                "held_out_percent": settings["held_out_percent"], "seed": settings["seed"], "counts": totals,
                "sources": plan["inputs"], "tasks": tasks, "shards": shards}
    write_atomic(folder / fmt.MANIFEST, json.dumps(manifest, indent=1), shared=True)  # maybe by two last tasks
    for leftover in (folder / fmt.PARTS).glob(".tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    train, held = totals["train"], totals["eval"]
    say(f"{PROG}: {folder}: {train['blocks']} training blocks ({train['tokens']} tokens), {held['blocks']} held-out "
        f"blocks, from {totals['texts']} texts in {len(plan['inputs'])} file(s); train with --prepared_data {folder}")
    return manifest


# ---------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------


def which_task(opts: PrepareConfig) -> tuple[int, int]:
    task, tasks = distributed.array_task()
    task = opts.task if opts.task is not None else task
    tasks = opts.tasks if opts.tasks is not None else tasks
    if not 0 <= task < tasks:
        raise BadInput(f"--task {task} is not one of the {tasks} task(s) (0 to {tasks - 1})")
    return task, tasks


def planned(model: ModelConfig, data: DataConfig, opts: PrepareConfig, tasks: int) -> tuple[Any, Path, dict]:
    """(the tokenizer, the folder, its plan): the plan made, and written or checked against the folder's."""
    from mlm_ddp.model import load_tokenizer

    tokenizer = load_tokenizer(model, needs_word_ids=data.whole_word_mask)
    folder = Path(opts.output_dir)
    plan = make_plan(data, tokenizer, opts.seed, tasks)
    fix_plan(folder, plan, opts.overwrite_output_dir)
    return tokenizer, folder, plan


def prepare(model: ModelConfig, data: DataConfig, opts: PrepareConfig, task: int, tasks: int) -> dict | None:
    """Plan (or check the plan), run this task, and write the manifest if every part is complete."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker, the main process's included
    if opts.overwrite_output_dir and tasks > 1:
        raise BadInput("--overwrite_output_dir with several tasks: one task would remove what the others write; "
                       f"remove {opts.output_dir} before submitting the array, or use --nodes, which removes it first")
    tokenizer, folder, plan = planned(model, data, opts, tasks)
    packer = Packer(tokenizer, data.max_seq_length, data.whole_word_mask, data.line_by_line,
                    "uint16" if len(tokenizer) <= 2**16 else "uint32")
    workers = opts.num_workers or len(os.sched_getaffinity(0))
    try:
        try:
            run_task(folder, plan, task, packer, workers)
        except OSError:
            if not fmt.part_complete(folder, task, tasks):
                raise
            # another attempt of this task completed it, and a finalize removed this attempt's folder
            say(f"{PROG}: task {task} of {tasks}: completed by another attempt")
        return finalize(folder, plan)
    except OSError as err:  # a full disk, a quota, a folder that went away
        raise BadInput(f"--output_dir {folder}: could not be written ({err.strerror or err}); free space or fix it "
                       "and run the same command again: complete parts are kept, this task is redone") from err


class PrepareTask:
    """What each Submitit array task runs (picklable: the configs only)."""

    def __init__(self, model: ModelConfig, data: DataConfig, opts: PrepareConfig) -> None:
        self.model, self.data, self.opts = model, data, opts

    def __call__(self, task: int) -> bool:
        return prepare(self.model, self.data, self.opts, task, self.opts.nodes) is not None


def submit(model: ModelConfig, data: DataConfig, opts: PrepareConfig) -> dict | None:
    """--nodes N: the plan here, N array tasks through Submitit, wait, then the manifest here."""
    import submitit

    _, folder, plan = planned(model, data, opts, opts.nodes)
    executor = submitit.AutoExecutor(folder=folder / "submitit" / "%j", cluster=opts.cluster)
    params: dict[str, Any] = dict(name="mlm_ddp.prepare", nodes=1, tasks_per_node=1, timeout_min=opts.timeout_min)
    params.update({k: v for k, v in (("cpus_per_task", opts.cpus_per_task), ("mem_gb", opts.mem_gb)) if v})
    if opts.cluster == "slurm":
        params.update({f"slurm_{k}": v for k, v in (("partition", opts.partition), ("account", opts.account)) if v})
    executor.update_parameters(**params)
    todo = [t for t in range(opts.nodes) if not fmt.part_complete(folder, t, opts.nodes)]
    jobs = executor.map_array(PrepareTask(model, data, replace(opts, overwrite_output_dir=False)), todo)
    say(f"{PROG}: submitted {len(jobs)} array task(s) of {opts.nodes}: job {jobs[0].job_id.split('_')[0]}, logs in "
        f"{folder / 'submitit'}" if jobs else f"{PROG}: every task is complete")
    for task, job in zip(todo, jobs, strict=True):
        try:
            job.result()
        except Exception as err:  # noqa: BLE001 - submitit raises the task's outcome: its line, or a traceback
            lines = [line for line in str(err).splitlines() if line.strip()]
            raise TaskFailed(f"task {task} (job {job.job_id}) failed: {lines[-1] if lines else err}; run the same "
                             f"command again to redo the tasks without a marker (log: {job.paths.stderr})") from err
    return finalize(folder, plan)


class TaskFailed(Exception):
    """An array task of --nodes ended without its part."""


def make_parser() -> HfArgumentParser:
    return HfArgumentParser(
        (ModelConfig, DataConfig, PrepareConfig), prog=f"python -m {PROG}", allow_abbrev=False,
        formatter_class=argparse.HelpFormatter,
        description="Tokenize and pack a corpus once into memory-mapped shards; train with --prepared_data DIR. "
                    "Takes the data and tokenizer flags of mlm_ddp.train (the others are refused).")


def main(argv: list[str] | None = None) -> int:
    try:
        model, data, opts = make_parser().parse_args_into_dataclasses(args=argv)
        if opts.nodes is not None:
            manifest = submit(model, data, opts)
        else:
            manifest = prepare(model, data, opts, *which_task(opts))
    except BadInput as err:
        say(f"{PROG}: error: {err}")
        return EXIT_BAD_INPUT
    except (TaskFailed, WorkerDied) as err:
        say(f"{PROG}: error: {err}")
        return 1
    return 0 if manifest is not None or opts.nodes is None else 1


if __name__ == "__main__":
    sys.exit(main())
