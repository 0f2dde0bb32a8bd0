"""torch's Flight Recorder, set up for every run: each process group keeps a ring of its last collectives
(`TORCH_FR_BUFFER_SIZE`), and the dumps go to `OUTPUT_DIR/flight_recorder/rank_N`.

What it gives, checked on torch 2.13 (docs/scale.md, "Naming a hang"):
- NCCL: every rank dumps on a collective timeout by itself (`TORCH_NCCL_DUMP_ON_TIMEOUT`), and torch's
  analyzer (`torchfrtrace OUTPUT_DIR/flight_recorder -p rank_`) names the rank that did not join.
- gloo: entries are recorded (with `collective_seq_id`), but no dump is written on a timeout, an entry's
  state stays "scheduled", and `torchfrtrace` fails on gloo's dumps (KeyError in its process-group
  table). mlm_ddp dumps a rank's ring itself when a collective fails or its watchdog names a hang
  (`dump`), and `summary` reads the dumps as the analyzer would: per group, the last collective each
  rank entered; the rank behind is the one that did not join.
"""

from __future__ import annotations

import pickle
from collections.abc import MutableMapping
from pathlib import Path

from mlm_ddp.cluster.durable import write_atomic
from mlm_ddp.compat.torch import flight_recorder_dump

FOLDER = "flight_recorder"
PREFIX = "rank_"
ENTRIES = "2000"  # a ring of 2,000 collectives: a few steps' worth, ~1 MB per rank in a dump
OURS = "MLM_DDP_FR_DUMP_TEMP_FILE"  # the dump prefix mlm_ddp set, told apart from one the user set


def configure(env: MutableMapping[str, str], output_dir: str | Path) -> None:
    """Turn the recorder on for the process groups formed after this, unless the user set it up already:
    a buffer, dumps under `output_dir`, and NCCL's dump on timeout. Only the environment: the folder
    is made with the run's first write (`make_folder`)."""
    if "TORCH_FR_BUFFER_SIZE" not in env and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env:
        env["TORCH_FR_BUFFER_SIZE"] = ENTRIES
    # this run's folder, unless the user chose one: a value mlm_ddp set for an earlier run of this process
    # (or of the process that started this one, which inherits it) is replaced
    if env.get("TORCH_FR_DUMP_TEMP_FILE") in (None, env.get(OURS)):
        env["TORCH_FR_DUMP_TEMP_FILE"] = env[OURS] = str(Path(output_dir).resolve() / FOLDER / PREFIX)
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


def make_folder(env: MutableMapping[str, str]) -> None:
    """The folder NCCL's dumps are written into (it writes none where the folder is missing)."""
    prefix = env.get("TORCH_FR_DUMP_TEMP_FILE")
    if prefix:
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)


def dump(env: MutableMapping[str, str], rank: int) -> Path | None:
    """This process's recorded collectives (every backend's) into `TORCH_FR_DUMP_TEMP_FILE` + rank, the file
    NCCL writes on its own timeout (gloo writes none; an earlier attempt's is replaced); None where the
    recorder is off, cannot be read, or the file cannot be written."""
    prefix = env.get("TORCH_FR_DUMP_TEMP_FILE")
    if not prefix:
        return None
    path = Path(f"{prefix}{rank}")
    try:
        write_atomic(path, flight_recorder_dump())
    except (RuntimeError, OSError):
        return None
    return path


def last_collectives(trace: dict) -> dict[str, tuple[int, str]]:
    """Per process group (its id), the last collective this rank entered: (its sequence number, its name)."""
    last: dict[str, tuple[int, str]] = {}
    for entry in trace.get("entries", []):
        if entry.get("is_p2p"):
            continue
        group, seq = str(entry.get("pg_id")), int(entry.get("collective_seq_id", 0))
        if seq > last.get(group, (-1, ""))[0]:
            last[group] = (seq, str(entry.get("profiling_name", "")))
    return last


def summary(output_dir: str | Path) -> str | None:
    """One line from the dumps in `output_dir`: on the group where the ranks' last collectives differ,
    the rank(s) that entered the fewest; None without dumps. Ranks without a dump are named as such (a
    process killed, frozen or aborted before it could write one)."""
    folder = Path(output_dir) / FOLDER
    traces = {}
    for path in sorted(folder.glob(f"{PREFIX}*")):
        rank = path.name.removeprefix(PREFIX)
        if not rank.isdigit():
            continue
        try:
            traces[int(rank)] = pickle.loads(path.read_bytes())  # our own run's dumps, as torchfrtrace reads them
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError):
            continue
    if not traces:
        return None
    last = {rank: last_collectives(trace) for rank, trace in traces.items()}
    if len(last) == 1:
        (rank, groups), = last.items()
        entered = "; ".join(f"on group {g}, #{seq} ({name})" for g, (seq, name) in sorted(groups.items()))
        return (f"flight recorder: only rank {rank} left a dump in {folder}, nothing to compare with; its last "
                f"collectives: {entered or 'none'}")
    groups = sorted({group for per_rank in last.values() for group in per_rank})
    for group in groups:
        seqs = {rank: per_rank.get(group, (0, ""))[0] for rank, per_rank in last.items()}
        if len(set(seqs.values())) > 1:
            low, high = min(seqs.values()), max(seqs.values())
            behind = [rank for rank, seq in seqs.items() if seq == low]
            name = next(per_rank[group][1] for per_rank in last.values() if per_rank.get(group, (0,))[0] == high)
            return (f"flight recorder: on process group {group}, rank(s) {', '.join(map(str, behind))} entered "
                    f"collective #{low}, the others #{high} ({name}): the former never joined it; dumps of "
                    f"{len(traces)} rank(s) in {folder}")
    return (f"flight recorder: the {len(traces)} rank(s) with a dump in {folder} all entered the same last "
            "collectives; a rank without a dump is the one to look at")
