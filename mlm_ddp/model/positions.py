"""Where a batch carries its loss, as indices the model gathers by: computed once per batch on the host
by the collator, where reading a count costs nothing, so that the model finds the masked positions on
the GPU without a data-dependent shape (boolean indexing and `nonzero` each drain the GPU's queue, in the
forward and again in the backward). The model computes the same on its device for a batch without them.
Knows neither the data nor the model: a boolean (B, T) in, indices out."""

from __future__ import annotations

import torch

KEYS = ("loss_positions", "loss_order", "loss_slots")
# loss_order's width M is rounded up to a multiple of this (at most T). M is the query length of the last
# layer's attention on the masked positions (fast_paths.subset_forward). Exact, it changes with the batch (the
# most masked tokens in a row), and CUDA's cuDNN attention builds a plan for each length it meets: on an H200,
# MiniLM 32 x 128 met 10 lengths in 150 steps, and each first meeting made a ~20 ms step take 114-170 ms
# (none with cuDNN's attention switched off). Rounded, the run met 3 lengths. The extra slots are real
# positions whose results are dropped, as the short rows' are already.
WIDTH_MULTIPLE = 8


def loss_layout(selected: torch.Tensor) -> dict[str, torch.Tensor]:
    """For `selected` (B, T), the positions that carry a loss:

    - loss_positions (N,): their indices in the flattened (B*T,), row-major (the order of x[selected]);
    - loss_order (B, M): each row's positions, those selected first in their order, cut to M: the most
      any row has, rounded up to a multiple of WIDTH_MULTIPLE, at most T (at least 1: no shape is empty);
    - loss_slots (N,): the indices in the flattened (B*M,) of loss_order's slots that are selected,
      row-major (so x.gather(order)[slots] is x[selected]).
    """
    counts = selected.sum(dim=1)  # (B,)
    most = int(counts.max()) if selected.numel() else 0
    width = max(1, min(selected.shape[1], -(-most // WIDTH_MULTIPLE) * WIDTH_MULTIPLE))
    order = torch.argsort((~selected).to(torch.int8), dim=1, stable=True)[:, :width]  # (B, M)
    valid = torch.arange(width, device=selected.device)[None, :] < counts[:, None]  # (B, M)
    return {"loss_positions": selected.reshape(-1).nonzero().squeeze(1), "loss_order": order,
            "loss_slots": valid.reshape(-1).nonzero().squeeze(1)}
