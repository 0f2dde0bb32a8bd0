"""The model side of `mlm_ddp.probe`: load an encoder, turn texts into one vector each (the checkpoint's
own sentence-transformers pooling where it has one), and the short supervised fine-tune.

The pooling is read from the checkpoint's `modules.json` and its Pooling module's `config.json` and done
here with torch, so a plain transformers folder works and sentence-transformers is not needed to probe.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import (
    AutoModel,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    get_linear_schedule_with_warmup,
)

from mlm_ddp.compat import transformers as compat_transformers
from mlm_ddp.errors import BadInput, say
from mlm_ddp.loop import checkpoint as ckpt
from mlm_ddp.model.loading import _quiet_transformers, load_kwargs, max_positions
from mlm_ddp.model.tokenizer_files import check_tokenizer_files

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens")  # the ones done here, in sentence-transformers' order
# sentence-transformers' older Pooling config: one boolean per mode (what all-MiniLM-L6-v2 ships)
LEGACY_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
               "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
               "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
LONGEST = 512  # tokens: BERT's limit; a model that takes more is still probed on its first 512


@dataclass(frozen=True)
class Pooling:
    """How a checkpoint turns its last hidden states into one vector per text."""

    modes: tuple[str, ...] = ("mean",)  # concatenated in this order, as sentence-transformers does
    normalize: bool = False  # L2-normalise the pooled vector (a `Normalize` module in modules.json)
    max_seq_length: int | None = None  # sentence_bert_config.json's; None: the longest the model takes

    def describe(self) -> str:
        return "+".join(self.modes) + (" normalized" if self.normalize else "")

    @classmethod
    def from_folder(cls, folder: str | Path | None) -> Pooling:
        """The sentence-transformers recipe saved in `folder` (or a Hub name's cached copy), else the mean."""
        path = Path(folder) if folder is not None else None
        if path is not None and not path.is_dir():
            from huggingface_hub import try_to_load_from_cache

            try:
                cached = try_to_load_from_cache(str(folder), "modules.json")
            except ValueError:  # not a Hub name either (HFValidationError): loading the model will say so
                cached = None
            path = Path(cached).parent if isinstance(cached, str) else None
        if path is None or not (path / "modules.json").is_file():
            return cls()
        try:
            modules = json.loads((path / "modules.json").read_text())
            kinds = {m["type"].rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
            bert_config = path / "sentence_bert_config.json"
            longest = json.loads(bert_config.read_text()).get("max_seq_length") if bert_config.is_file() else None
            config = json.loads((path / kinds["Pooling"] / "config.json").read_text()) if "Pooling" in kinds else {}
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise BadInput(f"{path}: its sentence-transformers files (modules.json, the Pooling config) cannot be read "
                           f"({type(err).__name__}: {err}); fix them, or pass --pooling mean") from err
        mode = config.get("pooling_mode")
        if mode is None:  # the legacy booleans; none set means mean, as sentence-transformers reads them
            mode = [name for key, name in LEGACY_KEYS.items() if config.get(key)] or ["mean"]
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
        unknown = [m for m in modes if m not in POOLING_MODES]
        if unknown:
            raise BadInput(f"{path}: pooling mode {', '.join(unknown)} in its Pooling config is not one the probe "
                           f"does ({', '.join(POOLING_MODES)}); pass --pooling mean, cls or max")
        others = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
        if others:  # e.g. a Dense projection: the probe reads the pooled vector before it
            say(f"mlm_ddp.probe: warning: {path}: modules {', '.join(others)} are not applied; the probe uses the "
                "pooled hidden states")
        return cls(modes, "Normalize" in kinds, int(longest) if longest else None)


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """(B, T, H) last hidden states and (B, T) attention mask -> (B, len(modes) * H)."""
    hidden = hidden.float()
    weights = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    counts = weights.sum(dim=1).clamp(min=1e-9)  # (B, 1): the text's tokens
    vectors = []
    for mode in pooling.modes:
        if mode == "cls":  # the first real token: position 0 unless the tokenizer pads on the left
            first = mask.int().argmax(dim=1)  # (B,)
            vectors.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), first])
        elif mode == "max":
            vectors.append(hidden.masked_fill(weights == 0, float("-inf")).max(dim=1).values)
        else:
            summed = (hidden * weights).sum(dim=1)  # (B, H)
            vectors.append(summed / (counts if mode == "mean" else counts.sqrt()))
    pooled = torch.cat(vectors, dim=-1)
    return F.normalize(pooled, p=2, dim=1) if pooling.normalize else pooled


def sequence_length(requested: int | None, pooling: Pooling, model_config: Any, tokenizer: Any) -> int:
    """--max_seq_length, else the checkpoint's sentence-transformers length, else the model's (at most 512)."""
    limit = max_positions(model_config, tokenizer)
    length = requested or pooling.max_seq_length or min(limit, LONGEST)
    if length > limit:
        raise BadInput(f"--max_seq_length {length} is longer than the model takes ({limit} tokens); pass at most "
                       f"{limit}")
    return length


def load_encoder(name: str) -> tuple[PreTrainedModel, Any]:
    """(encoder, tokenizer) of a model folder, a Hub name, a run's final/ or one of its checkpoints/step-N."""
    if is_checkpoint(name):
        from mlm_ddp.loop.trained import load_for_prediction  # the checkpoint protocol: its config.yaml, its weights

        model, tokenizer = load_for_prediction(name)
        return model.base_model, tokenizer
    try:
        with _quiet_transformers():  # a masked LM's head and a missing pooler are no concern of the probe
            tokenizer = AutoTokenizer.from_pretrained(name)
            model = AutoModel.from_pretrained(name, **load_kwargs(False))
    except (OSError, ValueError) as err:
        raise BadInput(f"model {name!r} could not be loaded ({type(err).__name__}: {str(err).strip()[:300]}); "
                       "pass a model folder, a run's final/ or checkpoints/step-N folder") from err
    check_tokenizer_files(name, tokenizer, "save the model's tokenizer into it")
    return model, tokenizer


def batches(tokenizer: Any, texts: list[str], batch_size: int, length: int) -> Iterator[tuple[list[int], dict]]:
    """(indices into texts, padded batch), texts of similar length together: little padding to compute."""
    ids = tokenizer(texts, truncation=True, max_length=length)["input_ids"]
    order = sorted(range(len(texts)), key=lambda i: len(ids[i]))
    for start in range(0, len(order), batch_size):
        chosen = order[start:start + batch_size]
        yield chosen, tokenizer.pad({"input_ids": [ids[i] for i in chosen]}, return_tensors="pt")


@torch.no_grad()
def encode(model: PreTrainedModel, tokenizer: Any, texts: list[str], pooling: Pooling, batch_size: int,
           length: int, device: torch.device, desc: str = "features") -> np.ndarray:
    """(N, D) float32 features of `texts`, in their order. The model ends on `device` (all of it: a head left
    behind would part from its tied embeddings) and in the train/eval mode it came in."""
    was_training = model.training
    encoder = model.to(device).eval().base_model  # a masked LM's encoder: its head is not needed
    out = np.zeros((len(texts), 0), dtype=np.float32)
    with tqdm(total=len(texts), desc=desc, unit="text", leave=False) as bar:
        for chosen, batch in batches(tokenizer, texts, batch_size, length):
            batch = {k: v.to(device) for k, v in batch.items()}
            hidden = encoder(**batch).last_hidden_state  # (B, T, H)
            vectors = pool(hidden, batch["attention_mask"], pooling).cpu().numpy()
            if out.shape[1] == 0:
                out = np.zeros((len(texts), vectors.shape[1]), dtype=np.float32)
            out[chosen] = vectors
            bar.update(len(chosen))
    model.train(was_training)
    return out


@dataclass(frozen=True)
class FinetuneRecipe:
    """The short supervised fine-tune (finetune mode); see ProbeConfig for the defaults and their source."""

    learning_rate: float
    epochs: int
    batch_size: int
    length: int
    warmup_ratio: float = 0.1
    weight_decay: float = 0.01  # BERT's AdamW; not on biases and LayerNorm weights
    max_grad_norm: float = 1.0  # BERT's clipping


def own_random_state(device: torch.device) -> contextlib.AbstractContextManager:
    """Seeds and fresh weights drawn inside leave the caller's random state (training's) as it was."""
    devices = [] if device.type != "cuda" else [torch.cuda.current_device() if device.index is None else device.index]
    return torch.random.fork_rng(devices=devices)


def is_checkpoint(name: str) -> bool:
    return (Path(name) / ckpt.STATE_FILE).exists()


def finetune_source(model: str | PreTrainedModel, tokenizer: Any, scratch: Path) -> tuple[str, Any, Any]:
    """(folder that AutoModelForSequenceClassification loads a fresh copy from, tokenizer, model config): a model
    folder as it is; a model in memory, or a checkpoint's weights (inside accelerate's state), written to scratch."""
    if isinstance(model, str) and not is_checkpoint(model):
        encoder, own = load_encoder(model)
        return model, tokenizer or own, encoder.config
    if isinstance(model, str):
        model, tokenizer = load_encoder(model)
    model.save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)
    return str(scratch), tokenizer, model.config


def fresh_head(model: PreTrainedModel, seed: int) -> None:
    """Draw the classifier's head anew from `seed`, the same for every model of one architecture: a BERT pooler
    (inside the base model) and every module outside the base model. A masked LM's final/ has no pooler while
    its source may have a trained one: loaded as they are, two models with the same encoder would start from
    different heads, and their scores would differ for that alone."""
    torch.manual_seed(seed)
    base = model.base_model
    if base is model:  # no encoder apart from the head to tell them by: leave the model as it loaded
        return
    pooler = getattr(base, "pooler", None)
    head = ([pooler] if pooler is not None else []) + [module for module in model.children() if module is not base]
    compat_transformers.reinitialise(model, head)  # with the model's own initialisation, though it was loaded


def finetune(source: str, tokenizer: Any, texts: list[str], labels: np.ndarray, n_labels: int,
             test_texts: list[str], recipe: FinetuneRecipe, seed: int, device: torch.device) -> tuple[np.ndarray, list]:
    """Fine-tune a fresh sequence classifier from the folder `source` on (texts, labels); (test predictions, mean
    training loss of each epoch)."""
    try:
        with _quiet_transformers():  # the head is new by design: no warning about it
            model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=n_labels,
                                                                       **load_kwargs(False))
    except (OSError, ValueError) as err:
        raise BadInput(f"model {source!r} could not be loaded as a sequence classifier ({type(err).__name__}: "
                       f"{str(err).strip()[:300]})") from err
    fresh_head(model, seed)  # then the dropout draws follow from the seed (probe() forks the random state)
    model = model.to(device)
    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight", "norm.weight")
    params = list(model.named_parameters())
    optimizer = torch.optim.AdamW([
        {"params": [p for n, p in params if not n.endswith(no_decay)], "weight_decay": recipe.weight_decay},
        {"params": [p for n, p in params if n.endswith(no_decay)], "weight_decay": 0.0},
    ], lr=recipe.learning_rate)
    total = recipe.epochs * math.ceil(len(texts) / recipe.batch_size)
    schedule = get_linear_schedule_with_warmup(optimizer, math.ceil(recipe.warmup_ratio * total), total)
    encoded = tokenizer(texts, truncation=True, max_length=recipe.length)["input_ids"]
    order = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    with tqdm(total=total, desc=f"finetune (seed {seed})", unit="step", leave=False) as bar:
        for _ in range(recipe.epochs):
            # summed on the device, read once an epoch: no host sync per step on a GPU
            summed, seen = torch.zeros((), device=device), 0
            for chosen in torch.randperm(len(texts), generator=order).split(recipe.batch_size):
                batch = tokenizer.pad({"input_ids": [encoded[i] for i in chosen]}, return_tensors="pt").to(device)
                loss = model(**batch, labels=torch.as_tensor(labels[chosen.numpy()], device=device)).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad(set_to_none=True)
                summed, seen = summed + loss.detach() * len(chosen), seen + len(chosen)
                bar.update(1)
            losses.append(summed.item() / seen)
    model.eval()
    predictions = np.zeros(len(test_texts), dtype=np.int64)
    with torch.no_grad():
        for chosen, batch in batches(tokenizer, test_texts, recipe.batch_size, recipe.length):
            logits = model(**{k: v.to(device) for k, v in batch.items()}).logits  # (B, n_labels)
            predictions[chosen] = logits.argmax(dim=-1).cpu().numpy()
    return predictions, losses
