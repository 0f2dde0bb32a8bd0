"""Two ways a training step computes the same objective with less work (docs/performance.md).

* The last encoder layer on the masked positions only (`last_layer_subset`, NVIDIA's and MosaicBERT's
  trick): the MLM head reads the final hidden states at the ~15% masked positions, so the last layer
  needs keys and values at every position but queries, the attention output and the feed-forward only
  there. Same loss and gradients as the full layer (tests/test_fast_paths.py).
* Dropout's keep-masks from 16-bit random draws (`Dropout16`, `attention_dropout16`): torch's CPU
  dropout draws one `bernoulli_` double per element; four 16-bit uniforms cut from each 64-bit draw
  decide the same keep probability, up to 2^-16, for a quarter of the generator's work. The draws come
  from torch's default generator, whose state checkpoints save, so a resumed run draws the same masks.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from mlm_ddp.compat import transformers as compat_transformers

DRAW_BITS = 16
DRAW_LEVELS = 2**DRAW_BITS
ATTENTION_DROPOUT16 = "sdpa_dropout16"  # the name the attention function is registered under in transformers


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, device: torch.device) -> torch.Tensor:
    """A bool tensor of `shape`, each element True with probability round((1 - p) * 2^16) / 2^16.

    One int64 draw over the whole 64-bit range gives four independent uniform int16 values; an element
    is kept when its value is below the threshold (int16 runs from -2^15, hence the shift)."""
    n = math.prod(shape)
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-(2**63), None)
    threshold = round((1.0 - p) * DRAW_LEVELS) - DRAW_LEVELS // 2
    if threshold >= DRAW_LEVELS // 2:  # p under 2^-17 keeps all; 2^15 compared as int16 would wrap and keep none
        return torch.ones(shape, dtype=torch.bool, device=device)
    return (words.view(torch.int16)[:n] < threshold).view(shape)


def dropout16(x: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout with `keep_mask`'s draws: zero each element with probability p, scale the rest by 1/(1-p)
    (torch's scaling); the backward multiplies by the same mask and scale."""
    if p <= 0.0:
        return x
    if p >= 1.0:
        return torch.zeros_like(x)
    return x.mul(keep_mask(x.shape, p, x.device)).mul_(1.0 / (1.0 - p))


class Dropout16(torch.nn.Dropout):
    """nn.Dropout (same `p`, same place in the model, no state) drawing its masks with `dropout16`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout16(x, self.p) if self.training else x


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           dropout: float, scaling: float, draws16: bool) -> torch.Tensor:
    """Softmax attention, (B, h, Tq, d) x (B, h, Tk, d) -> (B, h, Tq, d). `mask` is None, bool (True:
    attend) or additive float, broadcastable to (B, h, Tq, Tk), as transformers builds them.

    Without dropout, or with torch's draws, it is torch's scaled_dot_product_attention. With 16-bit
    draws it is the computation sdpa's CPU kernel does when it has dropout (scores, softmax, dropout,
    weighted sum), only with `dropout16`."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(query.dtype)
    if dropout == 0.0 or not draws16:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling  # (B, h, Tq, Tk)
    boolean = mask is not None and mask.dtype == torch.bool
    if boolean:
        # a finite fill: with -inf a query with nothing to attend (a padded one whose sliding window holds only
        # padding) would be NaN, and its gradient would make every parameter's NaN; other rows are the same bits
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    elif mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if boolean:
        probs = probs.masked_fill(~mask.any(-1, keepdim=True), 0.0)  # such a query attends to nothing, as in sdpa
    return torch.matmul(dropout16(probs, dropout), value)


def attention_dropout16(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        **_: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (AttentionInterface): (B, Tq, h, d), no weights."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return attend(query, key, value, attention_mask, dropout, scale, draws16=True).transpose(1, 2).contiguous(), None


def use_dropout16(model: torch.nn.Module) -> list[str]:
    """Swap every nn.Dropout of `model` for a Dropout16 of the same p and, where the model's attention
    goes through transformers' AttentionInterface with sdpa, the attention function for one that draws
    its dropout the same way. Returns what was swapped, for the log."""
    swapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is torch.nn.Dropout:
                setattr(module, child_name, Dropout16(child.p, child.inplace))
                swapped.append(f"{name}.{child_name}" if name else child_name)
    done = [f"{len(swapped)} dropout modules"] if swapped else []
    if attention_interface_ready(model):
        from transformers import AttentionInterface, AttentionMaskInterface

        AttentionInterface.register(ATTENTION_DROPOUT16, attention_dropout16)
        # and sdpa's masks (bool, True: attend): a name without a mask function gets no mask at all,
        # so padding would be attended
        AttentionMaskInterface.register(ATTENTION_DROPOUT16, AttentionMaskInterface()["sdpa"])
        model.set_attn_implementation(ATTENTION_DROPOUT16)
        done.append("attention dropout")
    return done


def attention_interface_ready(model: torch.nn.Module) -> bool:
    """Whether the model looks its attention function up by name (transformers 5 models that support
    it) and runs sdpa now: the only case the registered function replaces."""
    config = getattr(model, "config", None)
    return (transformers_major() >= 5 and backend_compatible(model) and hasattr(model, "set_attn_implementation")
            and compat_transformers.attn_implementation(config) == "sdpa")


def backend_compatible(model: torch.nn.Module) -> bool:
    """Whether a transformers model looks its attention function (and mask function) up by name, in
    AttentionInterface (transformers 5 models that support it): its `is_backend_compatible()`."""
    compatible = getattr(model, "is_backend_compatible", None)
    return bool(compatible()) if callable(compatible) else False


def transformers_major() -> int:
    """The installed transformers' major version: the fast paths are built on 5.x's layer and
    attention-function interfaces (4.x models run torch's dropout and the full last layer)."""
    import transformers

    return int(transformers.__version__.split(".")[0])


def subset_unsupported(model: Any) -> str | None:
    """Why `last_layer_subset` cannot run on this transformers model, or None when it can: it needs a
    BERT-style last layer (attention.self.{query,key,value}, attention.output, intermediate, output)
    with absolute positions and no cross-attention (`compat.transformers.bert_layer_parts`)."""
    if transformers_major() < 5:
        return "transformers < 5 layers return tuples"  # the encoder would read row 0 of the (N, H) output
    base = getattr(model, "base_model", None)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        return "its encoder has no `encoder.layer` list"
    last = layers[-1]
    if not compat_transformers.is_bert_layer(last):
        return f"its last layer ({type(last).__name__}) is not a BERT-style layer"
    config = model.config
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return "it is configured as a decoder"
    if getattr(config, "position_embedding_type", "absolute") not in (None, "absolute"):
        return f"its attention uses {config.position_embedding_type} positions"
    return None


def last_layer(model: Any) -> torch.nn.Module:
    return model.base_model.encoder.layer[-1]


def subset_forward(layer: torch.nn.Module, positions: tuple[torch.Tensor, torch.Tensor, torch.Tensor], draws16: bool,
                   hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *_: Any,
                   **__: Any) -> torch.Tensor:
    """A BERT-style layer's forward, (B, T, H) -> (N, H) for the N loss positions of (B, T), in row-major
    order. `positions` is positions.loss_layout's (loss_positions (N,), loss_order (B, M), loss_slots (N,)):
    each row's loss positions gathered first, padded to the row with the most, rounded up to a multiple of
    positions.WIDTH_MULTIPLE (at least 1, so that shapes stay non-empty and every parameter stays in the
    graph); the padding slots are real positions whose
    results are dropped. Every shape is known from the indices' shapes: nothing is read back to the host."""
    parts = compat_transformers.bert_layer_parts(layer)
    batch, seq, hidden = hidden_states.shape
    heads, size = parts.heads, parts.head_size
    flat, order, slots = positions
    width = order.shape[1]
    rows = hidden_states.gather(1, order[..., None].expand(batch, width, hidden))  # (B, M, H)

    def split(x: torch.Tensor, length: int) -> torch.Tensor:  # (B, L, h*d) -> (B, h, L, d)
        return x.view(batch, length, heads, size).transpose(1, 2)

    query = split(parts.query(rows), width)
    key, value = split(parts.key(hidden_states), seq), split(parts.value(hidden_states), seq)
    mask = None
    if attention_mask is not None:  # (B or 1, 1 or h, T or 1, T): the rows of the gathered queries
        full = attention_mask.expand(batch, attention_mask.shape[1], seq, seq)
        mask = full.gather(2, order[:, None, :, None].expand(batch, full.shape[1], width, seq))
    dropout = parts.attention_dropout.p if layer.training else 0.0
    context = attend(query, key, value, mask, dropout, size**-0.5, draws16)  # (B, h, M, d)
    context = context.transpose(1, 2).reshape(batch * width, heads * size).index_select(0, slots)  # (N, H)
    attention_output = parts.attention_output(context, hidden_states.reshape(-1, hidden).index_select(0, flat))
    return parts.output(parts.intermediate(attention_output), attention_output)


@contextlib.contextmanager
def last_layer_on(model: Any, positions: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                  draws16: bool, forward: Any = subset_forward) -> Iterator[None]:
    """Within it, the model's encoder returns the last layer's output at the loss `positions` only,
    (N, H) instead of (B, T, H): its last layer's forward is `forward` (`subset_forward`, or it compiled)
    for this one call. The layer is still called through its module, so hooks on it (FSDP's gathers) run
    as before."""
    layer = last_layer(model)
    layer.forward = functools.partial(forward, layer, positions, draws16)
    try:
        yield
    finally:
        del layer.forward
