"""`--torch_compile`: the encoder's repeated layer and the MLM head compiled, the fast paths kept.

Regional compilation, as torchtitan and ModernBERT do it: each layer of the encoder's stack is compiled
in place (`Module.compile`), and since torch 2.5 dynamo traces a layer's code once and reuses the graph
for every layer of the same class (the layers differ only in their parameters, which are inputs), so a
12-layer model compiles one layer, not twelve. The embeddings and the loss stay eager: they are a few
kernels each. What the fast paths need stays as it was:

- `--last_layer_subset`: the last layer runs `fast_paths.subset_forward` on the masked positions. That
  function is compiled on its own (`MaskedLMLoss.subset_forward`) and the layer module itself is not, so
  hooks on it (FSDP's gathers) still run around it.
- `--mlm_head masked`: the head is compiled on the (N, H) rows of the masked positions.

Shapes: N (masked tokens in the batch) changes with every batch, M (the last layer's query width) is
rounded to a multiple of 8, T changes with `--line_by_line`. Dynamo compiles each region for the first
shapes it meets and, at the first change, once more with that dimension symbolic; then no more. Training
and evaluation (dropout on and off) are one recompilation more each. tests/test_compile.py counts them.

Compiled in place before `accelerator.prepare`, so before DDP or FSDP2 wraps the model, the order
torchtitan uses (activation checkpointing, then compile, then FSDP): with --gradient_checkpointing,
transformers checkpoints each layer's call, which now is the compiled call. Parameter names, so
checkpoints, are unchanged.

Dropout: in a compiled region Inductor draws its own random numbers (a Philox stream whose seed it takes
from torch's default generator at each call), so a compiled run's dropout masks differ from an eager run's
of the same seed; `--dropout_draws auto` keeps torch's dropout there, which Inductor fuses into its kernels
(the 16-bit draws, asked for, would run as a kernel of their own). The seed still comes from the default
generator, whose state every checkpoint saves, so a compiled run resumed draws what the uninterrupted
compiled run draws.
"""

from __future__ import annotations

from typing import Any

import torch

from mlm_ddp.model import fast_paths


def repeated_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The encoder's stack: the longest ModuleList whose modules are all of one class, or None."""
    lists = [m for m in model.modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) and len({type(x) for x in m}) == 1]
    return max(lists, key=len) if lists else None


def compile_regions(model: torch.nn.Module, head: torch.nn.Module | None, subset: bool,
                    options: dict[str, Any]) -> list[str]:
    """Compile, in place, each layer of `model`'s stack (all but the last with `subset`, whose forward is
    then `subset_forward`, compiled by the caller) and `head`, with torch.compile's `options`. Returns what
    was compiled, for the log."""
    layers = repeated_layers(model)
    done = []
    if layers is not None:
        compiled = list(layers)[:-1] if subset else list(layers)
        for layer in compiled:
            layer.compile(**options)
        if compiled:
            done.append(f"{len(compiled)} x {type(compiled[0]).__name__} (one graph, reused)")
    if subset:
        done.append("the last layer on the masked positions")
    if head is not None:
        head.compile(**options)
        done.append(f"the MLM head ({type(head).__name__})")
    return done


def compiled_subset_forward(options: dict[str, Any]) -> Any:
    """`fast_paths.subset_forward`, compiled: the layer is an argument, so one graph serves the model."""
    return torch.compile(fast_paths.subset_forward, **options)
