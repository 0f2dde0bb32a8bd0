"""What a training step's speed means: its matmul FLOPs per token, the device's peak measured the
way the models run, and MFU (model FLOPs utilisation: achieved FLOP/s over that peak), as
`mlm_ddp.train` logs it and `mlm_ddp.bench` prints it; the training clock that times the steps alone."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from accelerate import Accelerator

FLOP_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
TRAINING_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # accelerate's mixed_precision -> matmul dtype


class TrainingClock:
    """Seconds spent training, without evaluation and checkpoint saves, so that tokens/s measures
    the training step alone."""

    def __init__(self) -> None:
        self.training_s, self._lap_start, self._paused_s = 0.0, time.perf_counter(), 0.0

    @contextmanager
    def paused(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._paused_s += time.perf_counter() - start

    def lap(self) -> float:
        """Training seconds since the previous lap."""
        now = time.perf_counter()
        elapsed = max(now - self._lap_start - self._paused_s, 1e-9)
        self.training_s += elapsed
        self._lap_start, self._paused_s = now, 0.0
        return elapsed


def training_flops_per_token(model_config: Any, seq: int, head_fraction: float,
                             last_layer_fraction: float = 1.0) -> float:
    """Matmul FLOPs of forward + backward (3x forward) per input token of a BERT-style encoder + MLM head.

    Per layer: Q, K, V, output projections (4 H^2) and the MLP (2 H I), 2 FLOPs per multiply-add,
    plus attention scores and the weighted sum (2 x 2 T H). The head (transform H^2 + decoder H V) runs
    on `head_fraction` of the tokens: 1 for the full head, the masked share for the masked-only one.
    The last layer's queries, output projection, MLP and attention run on `last_layer_fraction` of the
    tokens (the masked share with --last_layer_subset; its keys and values on all of them).
    Embedding lookups, norms and activations are not counted (they are not matmuls).
    """
    h, inner, layers = model_config.hidden_size, model_config.intermediate_size, model_config.num_hidden_layers
    keys_values = 2 * 2 * h * h
    per_query = 2 * (2 * h * h + 2 * h * inner) + 4 * seq * h
    encoder = layers * (keys_values + per_query) - (1.0 - last_layer_fraction) * per_query
    head = 2 * (h * h + h * model_config.vocab_size) * head_fraction
    return 3.0 * (encoder + head)


def measure_peak(accelerator: Accelerator, min_seconds: float = 1.0) -> float:
    """FLOP/s of a square matmul through the path the models take (F.linear under the run's
    autocast): the peak that MFU is measured against. On a CPU a plain bf16 `a @ b` takes a far
    slower kernel than autocast's, so it would not be the peak of anything the models run."""
    device = accelerator.device
    n = 8192 if device.type == "cuda" else 1024
    # its own generator: a resumed run measures after restoring the RNG states, and a draw from the
    # global generator would shift every dropout mask after it
    generator = torch.Generator(device=device).manual_seed(0)
    # operands already in the training dtype, as autocast's cached casts of the weights are: fp32 ones
    # would be cast again at every call, and the peak would be that of the matmul plus two casts
    dtype = TRAINING_DTYPES.get(accelerator.mixed_precision, torch.float32)
    a = torch.randn(n, n, device=device, generator=generator).to(dtype)
    b = torch.randn(n, n, device=device, generator=generator).to(dtype)
    best = math.inf
    start = time.perf_counter()
    with accelerator.autocast():
        while time.perf_counter() - start < min_seconds or best == math.inf:
            t = time.perf_counter()
            for _ in range(3):
                torch.nn.functional.linear(a, b)
            synchronize(device)
            best = min(best, (time.perf_counter() - t) / 3)
    return 2 * n**3 / best


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def flops_known(model_config: Any) -> bool:
    """Whether `training_flops_per_token` can count this config (DistilBERT names its sizes otherwise)."""
    return all(isinstance(getattr(model_config, name, None), int) for name in FLOP_FIELDS)


def peak_flops(peak_tflops: float | None, accelerator: Accelerator) -> float:
    """FLOP/s per device that MFU is measured against: --peak_tflops, else measured here (1 s)."""
    return peak_tflops * 1e12 if peak_tflops else measure_peak(accelerator)
