"""`python -m mlm_ddp.prepare --train_file CORPUS --output_dir DIR`: tokenize and pack a corpus once, on
every core (`--num_workers`) and over Slurm array tasks (`--nodes N` through Submitit, or
`sbatch --array` with slurm/prepare.sh), into memory-mapped Arrow shards that `mlm_ddp.train`
reads with `--prepared_data DIR` (the folder's layout: mlm_ddp/data/prepared.py).

The same data and tokenizer flags as training, and the same splits (`--dataset_name FOLDER` by
`datasets`' own rules: mlm_ddp/data/sources.py). The unit of work is a chunk of `TOKENIZE_BATCH` rows of
one split, its files read one after the other, packed on its own exactly as the map-style path packs
one tokenization batch: the blocks do not depend on the workers or tasks, and with a validation split
they are the map-style path's (a held-out share is drawn per text: docs/prepare.md). Task i of N takes
its share of the input files, balanced by bytes (`data.stream.balance_shards`), and the chunks that
begin in them; it reads them (memory stays bounded: at most 2 chunks per worker in flight), writes its
shards into a temporary folder, flushes them to the disk, and renames the folder into place with its
marker. Running the same command again skips the tasks that have their marker; the task that finds
every part complete checks every shard against its part's record and writes the manifest.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow.compute as pc
from transformers import HfArgumentParser

from mlm_ddp import compat
from mlm_ddp.cluster import launcher as distributed
from mlm_ddp.cluster.durable import fsync_dir, unwritable, write_atomic
from mlm_ddp.compat import datasets as compat_datasets
from mlm_ddp.config import DataConfig, ModelConfig, _doc, checks, parse_exactly
from mlm_ddp.data import prepared as fmt
from mlm_ddp.data.pack import TOKENIZE_BATCH
from mlm_ddp.data.pool import Packer, WorkerDied, Workers
from mlm_ddp.data.sources import PROG, Corpus, FileRead, count_rows, one_corpus, owned_chunks, reader, resolve
from mlm_ddp.data.stream import balance_shards
from mlm_ddp.data.text import data_notes
from mlm_ddp.errors import EXIT_BAD_INPUT, BadInput, say


@dataclass
class PrepareData(DataConfig):
    """The data flags as prepare takes them: one corpus, refused as several before the mixture's own checks
    (which would ask for --train_weights) run."""

    def __post_init__(self) -> None:
        one_corpus(self.train_file)
        super().__post_init__()


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
            checks.at_least(f"--{name}", getattr(self, name), 1)


# ---------------------------------------------------------------------------------------------
# the plan: which files, which settings, which task takes which file
# ---------------------------------------------------------------------------------------------


def make_plan(data: DataConfig, corpus: Corpus, tokenizer: Any, seed: int, tasks: int) -> dict[str, Any]:
    """The input files in the order training reads their blocks (training files, then validation files)."""
    files = [{"path": str(p.resolve()), "role": role, "bytes": p.stat().st_size}
             for role in fmt.SPLITS for p in corpus.splits[role]]
    held_out = 0.0 if corpus.splits["eval"] else data.validation_split_percentage  # as training holds out
    return {
        "format_version": fmt.FORMAT_VERSION,
        "inputs": files,
        "left_out": corpus.left_out,
        "tasks": tasks,
        "assignment": balance_shards([f["bytes"] for f in files], tasks, equal_counts=False),
        "settings": {
            "tokenizer": {"name": str(getattr(tokenizer, "name_or_path", "")),
                          "fingerprint": fmt.tokenizer_fingerprint(tokenizer), "vocab_size": len(tokenizer)},
            "max_seq_length": data.max_seq_length, "packing": fmt.packing(data),
            "word_continues": data.whole_word_mask, "text_column": data.text_column,
            "builder": corpus.builder, "builder_options": corpus.options,
            "held_out_percent": held_out, "seed": seed, "texts_per_chunk": TOKENIZE_BATCH,
        },
    }


OWN_NAMES = (fmt.PLAN, fmt.MANIFEST, fmt.PARTS, fmt.ROWS, "submitit")  # what a prepare writes at the folder's top


def fix_plan(folder: Path, plan: dict[str, Any], overwrite: bool) -> None:
    """Write the plan, or check that the folder's is this one: a relaunch must not mix parts of two plans."""
    path = folder / fmt.PLAN
    if overwrite:
        for name in (fmt.PLAN, fmt.MANIFEST, fmt.PARTS, fmt.ROWS):
            target = folder / name
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    elif path.is_file():
        earlier = json.loads(path.read_text())
        if earlier == plan:
            return
        changed = [key for key in ("inputs", "tasks", "settings") if earlier.get(key) != plan.get(key)] or ["inputs"]
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


def file_rows(folder: Path, plan: dict[str, Any], index: int, known: dict[int, int]) -> int:
    """The rows of input `index`: known here, shared in the folder by the task that counted them, or
    counted now (and shared): a task needs those of every file before its own in their split."""
    if index not in known:
        path = folder / fmt.ROWS / f"f{index:05d}.json"
        try:
            known[index] = json.loads(path.read_text())["rows"]
        except (OSError, ValueError, KeyError):
            settings = plan["settings"]
            known[index] = count_rows(plan["inputs"][index]["path"], settings["builder"], settings["builder_options"])
            path.parent.mkdir(exist_ok=True)
            write_atomic(path, json.dumps({"rows": known[index]}), shared=True)  # the same, whoever counts
    return known[index]


def drawn(chunks: Iterator[tuple[int, list[Any]]], role: str, settings: dict[str, Any]) -> Iterator[tuple]:
    """Each chunk's texts with their held-out draws, seeded by the chunk's number in its split: the same
    whoever reads it. A validation file is held out whole."""
    for number, texts in chunks:
        if role == "eval":
            yield texts, [True] * len(texts)
        else:
            draws = np.random.default_rng([settings["seed"], number]).random(len(texts))
            yield texts, (draws * 100 < settings["held_out_percent"]).tolist()


def write_file(workers: Workers, folder: Path, plan: dict[str, Any], index: int, known: dict[int, int],
               into: Path) -> dict[str, Any]:
    """The shards of the chunks that begin in input `index`, into `into`, each flushed to the disk;
    returns their counts."""
    settings, file = plan["settings"], plan["inputs"][index]
    split = [i for i, f in enumerate(plan["inputs"]) if f["role"] == file["role"]]
    at = split.index(index)
    start = sum(file_rows(folder, plan, i, known) for i in split[:at])
    seen = FileRead()
    chunks = owned_chunks([plan["inputs"][i]["path"] for i in split[at:]], start,
                          reader(settings["builder"], settings["builder_options"], settings["text_column"]), seen)
    counts: dict[str, Any] = {"file": index, "texts": 0, **{s: {"blocks": 0, "tokens": 0} for s in fmt.SPLITS}}
    writers: dict[str, Any] = {}  # datasets' Arrow writers (compat.datasets.arrow_writer)
    for train, held, texts in workers.map(drawn(chunks, file["role"], settings)):
        counts["texts"] += texts
        for name, table in (("train", train), ("eval", held)):
            if table is None:
                continue
            if name not in writers:
                shard = into / fmt.shard_name(name, index)
                writers[name] = compat_datasets.arrow_writer(workers.packer.schema(), str(shard))
            writers[name].write_table(table)
            counts[name]["blocks"] += table.num_rows
            counts[name]["tokens"] += int(pc.sum(pc.list_value_length(table["input_ids"])).as_py() or 0)
    for name, writer in writers.items():
        writer.finalize()
        writer.close()
        shard = into / fmt.shard_name(name, index)
        with open(shard, "rb") as handle:  # on the disk before the part's marker: a complete part is never short
            os.fsync(handle.fileno())
        counts[name]["bytes"] = shard.stat().st_size
    if seen.texts == 0:
        raise BadInput(f"{file['path']}: holds no texts (every line or {settings['text_column']!r} value is blank)")
    if known.setdefault(index, seen.rows) != seen.rows:
        raise BadInput(f"{file['path']}: {seen.rows} rows read, {known[index]} counted before: the file changed "
                       "since this prepare began; pass --overwrite_output_dir to start over once it is final")
    return counts


def run_task(folder: Path, plan: dict[str, Any], task: int, packer: Packer, workers: int) -> bool:
    """Task `task` of the plan, unless its part is complete; False when it was (nothing done)."""
    tasks = plan["tasks"]
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
    started, files, known = time.perf_counter(), plan["assignment"][task], {}
    if tasks > 1:  # the tasks of later files need these rows: count them first (cheap) and share them
        for index in files:
            file_rows(folder, plan, index, known)
    try:
        with Workers(packer, workers) as pool:
            records = [write_file(pool, folder, plan, index, known, tmp) for index in files]
    except BadInput:  # a bad input file: no half part is left behind (a killed task's is removed by the next)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_atomic(tmp / fmt.PART_FILE, json.dumps({"task": task, "tasks": tasks, "files": records}, indent=1))
    write_atomic(tmp / fmt.MARKER, "ok\n")  # last, once the shards and part.json are on the disk
    fsync_dir(tmp)  # every entry of the part on the disk before the rename makes it complete
    try:
        os.rename(tmp, final)
    except OSError:  # another attempt of this task finished first: its part stands
        shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(parts)  # the rename itself on the disk: a complete part stays complete after a crash
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
            check_shard(folder, path, record[split], name)
            shards.append({"path": str(path.relative_to(folder)), "split": split, "file": index, **record[split]})
            for key in ("blocks", "tokens"):
                totals[split][key] += record[split][key]
    totals["texts"] = sum(r["texts"] for _, r in records.values())
    seq = settings["max_seq_length"]
    for split in fmt.SPLITS:
        totals[split]["padding"] = totals[split]["blocks"] * seq - totals[split]["tokens"]
    manifest = {"format_version": fmt.FORMAT_VERSION, "tokenizer": settings["tokenizer"], "max_seq_length": seq,
                "packing": settings["packing"], "word_continues": settings["word_continues"],
                "held_out_percent": settings["held_out_percent"], "seed": settings["seed"], "counts": totals,
                "sources": plan["inputs"], "left_out": plan["left_out"], "tasks": tasks, "shards": shards}
    write_atomic(folder / fmt.MANIFEST, json.dumps(manifest, indent=1), shared=True)  # maybe by two last tasks
    for leftover in (folder / fmt.PARTS).glob(".tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    train, held = totals["train"], totals["eval"]
    say(f"{PROG}: {folder}: {train['blocks']} training blocks ({train['tokens']} tokens), {held['blocks']} held-out "
        f"blocks, from {totals['texts']} texts in {len(plan['inputs'])} file(s); train with --prepared_data {folder}")
    return manifest


def check_shard(folder: Path, path: Path, record: dict[str, int], part: str) -> None:
    """A shard holds what its task wrote before it marked its part complete, or that part is set aside
    (renamed to a temporary name, never read, redone by the next run of its task) and a line says so."""
    ds, problem = fmt.open_shard(path, record["blocks"], record["bytes"])
    if ds is not None:
        return
    with contextlib.suppress(OSError):  # another last task may have set it aside already
        os.rename(folder / fmt.PARTS / part, folder / fmt.PARTS / f".tmp-{part}.damaged")
    raise BadInput(f"{path}: {problem}, where its task wrote {record['blocks']} blocks in {record['bytes']} bytes "
                   f"before marking its part complete (lost in a crash, or changed since); part {part} is set aside: "
                   "run the same command again to redo that task")


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
    from mlm_ddp.model.loading import check_fits, from_scratch, load_model_config, load_tokenizer

    folder = Path(opts.output_dir)
    if (problem := unwritable(folder)) is not None:  # a read-only place, a file: a traceback at the first write
        raise BadInput(f"--output_dir {folder}: {problem}; choose another --output_dir")
    outside_the_inputs(folder, data)
    corpus = resolve(data)
    for split, files in corpus.left_out.items():
        say(f"{PROG}: the {split!r} split ({len(files)} file(s)) is left out, as training leaves it out")
    tokenizer = load_tokenizer(model, needs_word_ids=data.whole_word_mask)
    # training's own check, so that no corpus is written that the model cannot read (with only --tokenizer_name:
    # the tokenizer's limit; the model is named at training)
    given = model.model_name_or_path is not None or from_scratch(model)
    check_fits(data.max_seq_length, load_model_config(model, tokenizer) if given else None, tokenizer)
    plan = make_plan(data, corpus, tokenizer, opts.seed, tasks)
    fix_plan(folder, plan, opts.overwrite_output_dir)
    return tokenizer, folder, plan


def outside_the_inputs(folder: Path, data: DataConfig) -> None:
    """Refuse an --output_dir that is an input folder or inside one. Not left out of the listing instead: its
    plan.json and parts would still be read as text by any later reader of that folder (training on it, another
    prepare, this one's rerun, which then refused, and --overwrite_output_dir removed the finished prepare)."""
    out = folder.resolve()
    for flag, given in (("--train_file", data.train_file), ("--validation_file", data.validation_file)):
        for source in (Path(p) for p in given or []):
            if source.is_dir() and (out == source.resolve() or source.resolve() in out.parents):
                where = "is" if out == source.resolve() else "is inside"
                raise BadInput(f"--output_dir {folder} {where} the {flag} folder {source}, whose files are read as "
                               "the corpus; choose an --output_dir outside it")


def prepare(model: ModelConfig, data: DataConfig, opts: PrepareConfig, task: int, tasks: int) -> dict | None:
    """Plan (or check the plan), run this task, and write the manifest if every part is complete."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker, the main process's included
    if opts.overwrite_output_dir and tasks > 1:
        raise BadInput("--overwrite_output_dir with several tasks: one task would remove what the others write; "
                       f"remove {opts.output_dir} before submitting the array, or use --nodes, which removes it first")
    folder = Path(opts.output_dir)
    made = [p for p in (folder, folder / fmt.PLAN) if not p.exists()]  # what this call creates, if anything
    tokenizer, folder, plan = planned(model, data, opts, tasks)
    packer = Packer(tokenizer, data.max_seq_length, data.whole_word_mask, data.line_by_line,
                    "uint16" if len(tokenizer) <= 2**16 else "uint32")
    workers = opts.num_workers or len(os.sched_getaffinity(0))
    try:
        try:
            with cleared_on_bad_input(folder, made if tasks == 1 else []):
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


@contextlib.contextmanager
def cleared_on_bad_input(folder: Path, made: list[Path]) -> Iterator[None]:
    """A bad input file found while reading (a column that is not text, an unreadable row) leaves nothing of a
    prepare that this call began (`made`: the folder and plan it created; one task only, else another task may be
    using them): not a plan that a fixed rerun would have to match, nor half a part."""
    try:
        yield
    except BadInput:
        if folder / fmt.PLAN in made:
            for name in (fmt.PLAN, fmt.ROWS, fmt.PARTS):
                target = folder / name
                shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
            if folder in made and not any(folder.iterdir()):
                folder.rmdir()
        raise


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
        (ModelConfig, PrepareData, PrepareConfig), prog=f"python -m {PROG}", allow_abbrev=False,
        formatter_class=argparse.HelpFormatter,
        description="Tokenize and pack a corpus once into memory-mapped shards; train with --prepared_data DIR. "
                    "Takes the data and tokenizer flags of mlm_ddp.train (the others are refused).")


def main(argv: list[str] | None = None) -> int:
    try:
        compat.check()  # a library that moved a name mlm_ddp reaches: one line, before anything is read
        model, data, opts = parse_exactly(make_parser(), argv)
        for note in data_notes(data):  # as mlm_ddp.train warns them: taken as given, likely a mistake
            say(f"{PROG}: warning: {note}")
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
