"""transformers's names that are not its public API, which mlm_ddp reaches (see mlm_ddp/compat/__init__.py).

Where transformers has a public way, mlm_ddp's code uses it instead: `PreTrainedModel.is_backend_compatible()`
(whether a model looks its attention function up by name), `AttentionMaskInterface` (registering a mask
function), `set_attn_implementation`.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, NamedTuple

import torch

from mlm_ddp.compat import Reach

# transformers' mask builder of each kind of attention layer, in transformers.masking_utils (transformers 5)
MASK_BUILDERS = {"full_attention": "create_bidirectional_mask",
                 "sliding_attention": "create_bidirectional_sliding_window_mask"}
# the keywords `bidirectional_masks` calls them with
MASK_KEYWORDS = ("config", "inputs_embeds", "attention_mask", "allow_is_bidirectional_skip")


def major() -> int:
    """The installed transformers' major version."""
    import transformers

    return int(transformers.__version__.split(".")[0])


def attn_implementation(config: Any) -> str | None:
    """The attention implementation a model's config names ('sdpa', 'eager', a registered name), None where
    it names none: transformers keeps it as `_attn_implementation` (its own accessor, with no public one)."""
    return getattr(config, "_attn_implementation", None)


def supports_sdpa(model_class: type) -> bool:
    """Whether a transformers model class has an sdpa attention."""
    return bool(getattr(model_class, "_supports_sdpa", False))


def no_split_modules(model: Any) -> list[str]:
    """The module classes a transformers model names as never to be split across devices (its layers), sorted."""
    return sorted(getattr(model, "_no_split_modules", None) or [])


def bidirectional_masks(config: Any, attention_mask: torch.Tensor, kinds: set[str]) -> dict[str, torch.Tensor]:
    """{layer kind: the mask transformers' own builder makes of `attention_mask` (B, T) for it}, told not to
    skip a mask it could (all ones), so each is built: sdpa's (B, 1, T, T) boolean mask (True: attend).
    `kinds`: 'full_attention', 'sliding_attention'."""
    masking_utils = importlib.import_module("transformers.masking_utils")
    # the builders read the batch, length, device (and eager's dtype) off the embeddings: (B, T, 0)
    shape = attention_mask.new_empty((*attention_mask.shape, 0), dtype=torch.float32)
    return {kind: getattr(masking_utils, MASK_BUILDERS[kind])(config=config, inputs_embeds=shape,
                                                              attention_mask=attention_mask,
                                                              allow_is_bidirectional_skip=False)
            for kind in sorted(kinds)}


class BertLayerParts(NamedTuple):
    """The parts of a BERT-style encoder layer that a forward of its own calls."""

    query: torch.nn.Module  # attention.self.query: Linear (H, H)
    key: torch.nn.Module
    value: torch.nn.Module
    heads: int  # attention.self.num_attention_heads
    head_size: int  # attention.self.attention_head_size
    attention_dropout: torch.nn.Module  # attention.self.dropout: its p is the attention probabilities' dropout
    attention_output: torch.nn.Module  # attention.output(context, input): dense, dropout, residual LayerNorm
    intermediate: torch.nn.Module  # intermediate(x): dense and activation
    output: torch.nn.Module  # output(intermediate, attention output): dense, dropout, residual LayerNorm


def bert_layer_parts(layer: torch.nn.Module) -> BertLayerParts:
    """The parts of a BERT-style layer (BertLayer, RobertaLayer, ...); AttributeError where it has none."""
    attention: Any = layer.attention.self
    return BertLayerParts(attention.query, attention.key, attention.value, attention.num_attention_heads,
                          attention.attention_head_size, attention.dropout, layer.attention.output,
                          layer.intermediate, layer.output)


def is_bert_layer(layer: torch.nn.Module) -> bool:
    """Whether `layer` is laid out as BERT's (`bert_layer_parts`)."""
    try:
        parts = bert_layer_parts(layer)
    except AttributeError:
        return False
    return (all(isinstance(p, torch.nn.Linear) for p in (parts.query, parts.key, parts.value))
            and isinstance(parts.heads, int) and isinstance(parts.head_size, int)
            and isinstance(parts.attention_dropout, torch.nn.Dropout)
            and all(isinstance(p, torch.nn.Module) for p in parts[6:]))


def reinitialise(model: Any, parts: list[torch.nn.Module]) -> None:
    """Draw every parameter of `parts` (modules of `model`) anew with the model's own initialisation
    (`_init_weights`), loaded or not: transformers 5's init functions skip a tensor flagged
    `_is_hf_initialized` (what it loaded), so each part's flags are cleared before it is drawn."""
    for part in parts:
        for module in part.modules():
            module._is_hf_initialized = False
            for param in module.parameters(recurse=False):
                param._is_hf_initialized = False
        part.apply(model._init_weights)


# ---------------------------------------------------------------------------------------------
# the feature checks


def _builder_takes_our_keywords(name: str) -> bool:
    """The builder is there and takes each of `MASK_KEYWORDS` by name (a `**kwargs` would swallow a keyword
    it no longer reads). Not used below transformers 5 (the 2-D mask goes to the model as it is)."""
    if major() < 5:
        return True
    parameters = inspect.signature(getattr(importlib.import_module("transformers.masking_utils"), name)).parameters
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return all(key in parameters and parameters[key].kind in named for key in MASK_KEYWORDS)


def _config_names_attention() -> bool:
    import transformers

    return hasattr(transformers.PretrainedConfig, "_attn_implementation")


def _model_flag(name: str) -> bool:
    """PreTrainedModel declares `name` (each model class sets its own value)."""
    import transformers

    return hasattr(transformers.PreTrainedModel, name)


def _bert_layer_is_laid_out_so() -> bool:
    import transformers

    modeling_bert = importlib.import_module("transformers.models.bert.modeling_bert")
    config = transformers.BertConfig(hidden_size=4, num_attention_heads=1, intermediate_size=4, num_hidden_layers=1,
                                     vocab_size=8)
    with torch.device("meta"):  # no memory, no draw from torch's generator
        layer = modeling_bert.BertLayer(config)
    return is_bert_layer(layer)


def _init_weights_is_there() -> bool:
    import transformers

    return callable(getattr(transformers.PreTrainedModel, "_init_weights", None))


def _init_skips_flagged_tensors() -> bool:
    """transformers 5's init functions leave a tensor flagged `_is_hf_initialized` and draw one whose flag is
    cleared (below 5, `_init_weights` draws every tensor: the flag is not read)."""
    if major() < 5:
        return True
    init = importlib.import_module("transformers.initialization")
    tensor = torch.ones(1)
    tensor._is_hf_initialized = True
    init.zeros_(tensor)
    kept = bool(tensor[0] == 1)
    tensor._is_hf_initialized = False
    init.zeros_(tensor)
    return kept and bool(tensor[0] == 0)


REACHES: list[Reach] = [
    Reach("transformers", "transformers.PretrainedConfig._attn_implementation", _config_names_attention,
          "the attention a model runs: sdpa's prebuilt padding mask, the 16-bit attention dropout, the start-up log"),
    Reach("transformers", "transformers.PreTrainedModel._supports_sdpa", lambda: _model_flag("_supports_sdpa"),
          "--attn_implementation sdpa, or eager with a warning for a model without it"),
    Reach("transformers", "transformers.PreTrainedModel._no_split_modules", lambda: _model_flag("_no_split_modules"),
          "the module classes FSDP shards as units when --fsdp_wrap_classes is not given"),
    Reach("transformers", "transformers.masking_utils.create_bidirectional_mask",
          lambda: _builder_takes_our_keywords(MASK_BUILDERS["full_attention"]),
          "taking inputs_embeds and allow_is_bidirectional_skip by name: a padded batch's sdpa mask, built before "
          "the forward"),
    Reach("transformers", "transformers.masking_utils.create_bidirectional_sliding_window_mask",
          lambda: _builder_takes_our_keywords(MASK_BUILDERS["sliding_attention"]),
          "taking inputs_embeds and allow_is_bidirectional_skip by name: ModernBERT's sliding-window sdpa mask, "
          "built before the forward"),
    Reach("transformers", "transformers.models.bert.modeling_bert.BertLayer", _bert_layer_is_laid_out_so,
          "--last_layer_subset: the parts of BERT's layer (attention.self.query/key/value, attention.output, "
          "intermediate, output) its forward on the masked positions calls; a model laid out otherwise runs its "
          "full last layer, with one log line, for the same loss"),
    Reach("transformers", "transformers.PreTrainedModel._init_weights", _init_weights_is_there,
          "mlm_ddp.probe's classifier head drawn anew from a seed, the same for every model of one architecture"),
    Reach("transformers", "_is_hf_initialized flag read by transformers.initialization's init functions",
          _init_skips_flagged_tensors, "mlm_ddp.probe's classifier head drawn anew, though it was loaded"),
]
