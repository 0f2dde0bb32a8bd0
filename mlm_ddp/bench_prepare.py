"""`python -m mlm_ddp.bench_prepare --corpus DIR --small DIR --medium DIR`: what preparing a corpus
buys, measured side by side in one run (docs/scale.md "Preparing a large corpus" holds the figures):

- tokens/s of `mlm_ddp.prepare` on `--medium` with 1 worker and with 2 (the same files, one after the
  other), against the 0.85M tokens/s per core anchor of HF tokenizers;
- peak memory (RSS) of a 1-worker prepare at `--medium` and at `--corpus`: it must not grow with the corpus;
- bytes on disk per token of the prepared folder;
- seconds from launch to the first training step, raw files (tokenized at start-up, a cold `datasets`
  cache) against the prepared folder, at `--small` and at `--corpus`;
- the arithmetic of docs/scale.md for 20 GB of text on 64 nodes, from these figures.

Every run is a fresh process; the default job's model and tokenizer (all-MiniLM-L6-v2) by default.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from transformers import HfArgumentParser

from mlm_ddp import compat
from mlm_ddp.config import _doc, parse_exactly
from mlm_ddp.errors import EXIT_BAD_INPUT, BadInput, say

ANCHOR_TOKENS_PER_S = 0.85e6  # one core of HF tokenizers (marin-community/marin#2829)
FIRST_STEP = "mlm_ddp.bench_prepare: first step after "
PROCESS_STARTED = time.time()  # this module's import: close to the process's start (python -m imports it first)


@dataclass
class BenchPrepareConfig:
    corpus: str | None = _doc("The whole corpus: a folder of .txt files.", default=None)
    medium: str | None = _doc("About 100 MB of it (tokens/s, memory).", default=None)
    small: str | None = _doc("About 50 MB of it (start-up time).", default=None)
    work: str | None = _doc("Scratch folder for the prepared folders and runs (default: a temporary one).",
                            default=None)
    model_name_or_path: str | None = _doc("Model and tokenizer (default: the embedded all-MiniLM-L6-v2).",
                                          default=None)
    max_seq_length: int = _doc("Block length.", default=128)

    def __post_init__(self) -> None:
        for name in ("corpus", "medium", "small"):
            value = getattr(self, name)
            if value is None or not Path(value).is_dir():
                raise BadInput(f"--{name} {value}: give a folder of .txt files")


def files_bytes(folder: str) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*.txt"))


def model_flags(cfg: BenchPrepareConfig) -> list[str]:
    return ["--model_name_or_path", cfg.model_name_or_path] if cfg.model_name_or_path else []


def timed(argv: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """(seconds, peak RSS of the process in MB, stderr) of `python -m ...argv`, a fresh process."""
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", *argv], stderr=err, stdout=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})})
        _, status, usage = os.wait4(proc.pid, 0)
        took = time.perf_counter() - started
        err.seek(0)
        text = err.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(argv[:1])} failed:\n{text[-3000:]}")
    return took, usage.ru_maxrss / 1024, text


def prepare(cfg: BenchPrepareConfig, source: str, out: Path, workers: int) -> tuple[float, float, dict]:
    """(tokens/s of the task's work, as its line says: start-up excluded; peak RSS MB; manifest) of one
    prepare into a fresh `out`."""
    _, rss, text = timed(["mlm_ddp.prepare", *model_flags(cfg), "--train_file", source, "--output_dir", str(out),
                          "--max_seq_length", str(cfg.max_seq_length), "--num_workers", str(workers),
                          "--validation_split_percentage", "1"])
    manifest = json.loads((out / "manifest.json").read_text())
    rate = re.search(r"\(([\d,]+) tokens/s on", text)
    if rate is None:
        raise RuntimeError(f"no tokens/s in prepare's output:\n{text[-2000:]}")
    return float(rate.group(1).replace(",", "")), rss, manifest


def one_file(folder: str, into: Path) -> Path:
    """The folder's .txt files concatenated, in name order, into one file (streamed)."""
    with open(into, "wb") as out:
        for path in sorted(Path(folder).rglob("*.txt")):
            with open(path, "rb") as handle:
                while block := handle.read(1 << 24):
                    out.write(block)
    return into


def first_step(cfg: BenchPrepareConfig, data_flags: list[str], work: Path, name: str) -> float:
    """Seconds from launch to the first training step of one process, with a cold `datasets` cache."""
    cache = work / f"cache-{name}"
    _, _, text = timed(["mlm_ddp.bench_prepare", "--first_step", *model_flags(cfg), *data_flags,
                        "--max_seq_length", str(cfg.max_seq_length), "--output_dir", str(work / f"run-{name}"),
                        "--max_train_steps", "1", "--validation_split_percentage", "1", "--max_eval_samples", "8"],
                       env={"HF_DATASETS_CACHE": str(cache)})
    # the line may follow a progress bar's unfinished line
    return float(text.rsplit(FIRST_STEP, 1)[1].split()[0])


def run_first_step(train_argv: list[str]) -> int:
    """Child: train until the first step begins, print the seconds since this process started, stop."""
    from mlm_ddp.config import parse_args
    from mlm_ddp.train import Hooks, train

    def at_beat(beat: object) -> None:
        if getattr(beat, "phase", None) == "forward/backward":
            since = time.time() - PROCESS_STARTED
            print(f"{FIRST_STEP}{since:.2f} s", file=sys.stderr, flush=True)
            os._exit(0)

    train(parse_args(train_argv), Hooks(on_beat=at_beat))
    return 1  # trained without a first step: not what was asked



def bench(cfg: BenchPrepareConfig) -> dict:
    work = Path(cfg.work or tempfile.mkdtemp(prefix="bench_prepare-"))
    work.mkdir(parents=True, exist_ok=True)
    sizes = {name: files_bytes(getattr(cfg, name)) for name in ("small", "medium", "corpus")}
    found: dict = {"bytes": sizes}
    for workers in (1, 2):
        rate, rss, manifest = prepare(cfg, cfg.medium, work / f"medium-{workers}", workers)
        found[f"medium_{workers}_workers"] = {"tokens_per_s": rate, "rss_mb": rss}
    found["scaling_1_to_2"] = found["medium_2_workers"]["tokens_per_s"] / found["medium_1_workers"]["tokens_per_s"]
    rate, rss, manifest = prepare(cfg, cfg.corpus, work / "corpus-1", 1)
    shard_bytes = sum(s["bytes"] for s in manifest["shards"])
    tokens = sum(manifest["counts"][s]["tokens"] for s in ("train", "eval"))
    found["corpus_1_worker"] = {"tokens_per_s": rate, "rss_mb": rss, "tokens": tokens,
                                "bytes_per_token": shard_bytes / tokens,
                                "text_bytes_per_token": sizes["corpus"] / tokens}
    small_prepared = work / "small-prepared"
    prepare(cfg, cfg.small, small_prepared, 2)
    for name, prepared in (("small", small_prepared), ("corpus", work / "corpus-1")):
        raw = one_file(getattr(cfg, name), work / f"{name}.txt")  # --train_file takes one file
        found[f"first_step_{name}"] = {"raw_s": first_step(cfg, ["--train_file", str(raw)], work, f"{name}-raw"),
                                       "prepared_s": first_step(cfg, ["--prepared_data", str(prepared)], work,
                                                                f"{name}-prepared")}
    return found


def scale_arithmetic(found: dict) -> str:
    """docs/scale.md's arithmetic for 20 GB of text on 64 nodes, from the measured figures."""
    per_worker = found["medium_1_workers"]["tokens_per_s"]
    text_per_token = found["corpus_1_worker"]["text_bytes_per_token"]
    tokens = 20e9 / text_per_token
    one = tokens / per_worker
    return (f"20 GB of text = {tokens / 1e9:.2f}G tokens ({text_per_token:.2f} bytes of text per token); one core at "
            f"{per_worker / 1e6:.2f}M tokens/s: {one / 3600:.1f} h in one process; a 64-node array of 16 cores each "
            f"({64 * 16} workers, if scaling stays linear): {one / (64 * 16) / 60:.1f} min; on disk "
            f"{tokens * found['corpus_1_worker']['bytes_per_token'] / 1e9:.1f} GB")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--first_step"]:
        return run_first_step(argv[1:])
    try:
        parser = HfArgumentParser(BenchPrepareConfig, prog="python -m mlm_ddp.bench_prepare", allow_abbrev=False)
        (cfg,) = parse_exactly(parser, argv)
        compat.check()
    except BadInput as err:
        say(f"mlm_ddp.bench_prepare: error: {err}")
        return EXIT_BAD_INPUT
    found = bench(cfg)
    print(json.dumps(found, indent=1))
    print(scale_arithmetic(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
