"""`python -m tests.gpu.pace OUT`: the GPU measurement, one script that fits a short device slot.

Where the GPU step stands against the host's pace, on one GPU, in bf16:
1. the bench at BERT-base 256 x 128 and 64 x 512 and at MiniLM's shape 32 x 128 (config-built encoders with
   the shipped 30,522-word vocabulary, as the GPU suite's): (a) the HF recipe; (b) collating in the training
   thread; and, timed in the same alternation, (b) in 2 DataLoader workers, compiled, and both. Each with
   its ratio to (a), MFU against the bf16 matmul peak measured in the run, and (b)'s device time per step
   by kind of kernel (matmul, attention, optimizer, elementwise) from the profiler, and its host time per
   step without the profiler;
2. `mlm_ddp.train` itself at BERT-base 256 x 128 with the setting that won (workers and compile as the
   fastest variant had them), its tokens/s against that variant's bench figure.

Each result is written to OUT as it finishes (`bench-<model>-<batch>x<seq>.json` with the bench's printed
table beside it, `train.json`), so a slot that runs out still returns what finished. Runs on the CPU at tiny
sizes with MLM_DDP_GPU_SUITE_ON_CPU=1 (tests/test_gpu_suite.py runs it so, without the compiled variants,
which tests/test_compile.py covers on the CPU).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from tests.gpu.conftest import DRY_RUN, SHAPES, launch, pick, save_encoder, write_text

RUNS = pick([("bert-base", 256, 128), ("bert-base", 64, 512), ("minilm", 32, 128)],
            [("bert-base", 4, 32)])  # dry: one size, every other runs the same lines
BENCH_STEPS = pick(["--steps", "10", "--repeats", "3", "--warmup", "10", "--eval_blocks", "32"],
                   ["--steps", "2", "--repeats", "1", "--warmup", "1", "--eval_blocks", "2"])
VARIANTS = pick(["workers", "compiled", "compiled_workers"], ["workers"])
TRAIN_STEPS, TRAIN_TIMED_FROM = pick((60, 21), (4, 3))  # mlm_ddp.train: the steps, and the first one timed
LAUNCH_S = 240  # one bench (five recipes, two compilations) or the training run; then it is killed


def bench(model: Path, name: str, batch: int, seq: int, out: Path) -> dict:
    """One bench run with every variant; its JSON, also written to OUT with the printed table beside it."""
    proc = launch(["mlm_ddp.bench", "--model", str(model), "--precision", "bf16", "--batch", str(batch), "--seq",
                   str(seq), *BENCH_STEPS, "--workers", "0", "--variants", *VARIANTS, "--profile"], timeout=LAUNCH_S)
    stem = out / f"bench-{name}-{batch}x{seq}"
    stem.with_suffix(".txt").write_text(proc.stdout + proc.stderr[-4000:])
    if proc.returncode != 0:
        raise SystemExit(f"bench {name} {batch}x{seq} failed (exit {proc.returncode}); see {stem}.txt")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    fastest = max(result["variants"].items(), key=lambda item: item[1]["tokens_per_s"])
    ours = result["mlm_ddp"]
    print(f"bench {name} {batch}x{seq}: (b) {result['ratio']:.2f}x (a), MFU {ours['mfu']:.1%}, per step "
          f"device {ours['device_s_per_step'] * 1e3:.1f} ms, host {ours['host_s_per_step'] * 1e3:.1f} ms; "
          + ", ".join(f"{v} {r['ratio']:.2f}x" for v, r in result["variants"].items())
          + f"; fastest {fastest[0]}; (b) by kind: " + ", ".join(
              f"{k} {s * 1e3:.1f} ms" for k, s in sorted(result["seconds_by_kind"].items())), flush=True)
    return result


def train(model: Path, text: Path, batch: int, seq: int, variant: str, out: Path) -> dict:
    """mlm_ddp.train with the variant's workers and compile; tokens/s of its steps from TRAIN_TIMED_FROM on."""
    run = out / "train-run"
    flags = ["--model_name_or_path", str(model), "--train_file", str(text), "--max_seq_length", str(seq),
             "--per_device_train_batch_size", str(batch), "--mixed_precision", "bf16", "--max_train_steps",
             str(TRAIN_STEPS), "--logging_steps", "1", "--num_warmup_steps", "0", "--output_dir", str(run),
             "--dataloader_num_workers", "2" if "workers" in variant else "0"]
    flags += ["--torch_compile"] if "compiled" in variant else []
    started = time.monotonic()
    proc = launch(["mlm_ddp.train", *flags], timeout=LAUNCH_S)
    (out / "train.txt").write_text(proc.stderr[-6000:])
    if proc.returncode != 0:
        raise SystemExit(f"mlm_ddp.train failed (exit {proc.returncode}); see {out / 'train.txt'}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and r.get("step", 0) >= TRAIN_TIMED_FROM]
    result = {"variant": variant, "flags": flags, "tokens_per_s": statistics.median(rates), "steps_timed": len(rates),
              "wall_s": time.monotonic() - started}
    (out / "train.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tests.gpu.pace OUT_DIR", file=sys.stderr)
        return 2
    out = Path(args[0])
    out.mkdir(parents=True, exist_ok=True)
    encoders = {name: save_encoder(SHAPES[name], out / "encoders" / name) for name in {r[0] for r in RUNS}}
    results = {(name, batch, seq): bench(encoders[name], name, batch, seq, out) for name, batch, seq in RUNS}
    name, batch, seq = RUNS[0]
    first = results[RUNS[0]]
    variant, figures = max(first["variants"].items(), key=lambda item: item[1]["tokens_per_s"])
    text = write_text(out / "train-text.txt", tokens=TRAIN_STEPS * batch * seq)  # words: no epoch ends in the run
    trained = train(encoders[name], text, batch, seq, variant, out)
    print(f"mlm_ddp.train {name} {batch}x{seq} ({variant}): {trained['tokens_per_s']:,.0f} tokens/s against its "
          f"bench variant's {figures['tokens_per_s']:,.0f}: {trained['tokens_per_s'] / figures['tokens_per_s']:.2f}x"
          + (" (dry run: sizes too small to mean anything)" if DRY_RUN else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
