"""A trained model loaded for use: from a run's `final/`, any transformers masked-LM folder, or a
checkpoint folder (its `config.yaml` names the base model and tokenizer; its weights are the trained
ones). `mlm_ddp.predict` and the probe's features load through here, so neither entry point is
imported by the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate import PartialState

from mlm_ddp.config import ModelConfig, from_dict
from mlm_ddp.errors import BadInput
from mlm_ddp.loop import checkpoint as ckpt
from mlm_ddp.model.loading import inner_state_dict, load_model, load_model_config, load_tokenizer

WEIGHTS_FILE = "model.safetensors"  # what accelerate's save_state writes for an unsharded model


def load_checkpoint_model(path: Path) -> tuple[torch.nn.Module, Any]:
    """The trained weights of a checkpoint folder on the model its config.yaml names."""
    from safetensors.torch import load_file
    from transformers import AutoModelForMaskedLM

    cfg = from_dict(yaml.safe_load((path / "config.yaml").read_text()), str(path / "config.yaml"))
    tokenizer = load_tokenizer(cfg.model)
    model_config = load_model_config(cfg.model, tokenizer)
    if not (path / WEIGHTS_FILE).exists():
        raise BadInput(f"{path} has no {WEIGHTS_FILE} (an FSDP checkpoint keeps sharded weights): "
                          "predict from the run's final/ folder instead")
    model = AutoModelForMaskedLM.from_config(model_config)
    # the checkpoint holds mlm_ddp's MaskedLMLoss, whose transformers model is its `.model`
    weights = inner_state_dict(load_file(path / WEIGHTS_FILE))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    model.tie_weights()
    state = model.state_dict()
    loaded = {state[k].data_ptr() for k in weights if k in state}
    untied = [k for k in missing if state[k].data_ptr() not in loaded]  # tied copies are not saved twice
    if unexpected or untied:
        raise BadInput(f"{path / WEIGHTS_FILE} does not fit {type(model).__name__} of its config.yaml "
                          f"(missing {untied[:3]}, unexpected {unexpected[:3]})")
    return model, tokenizer


def load_for_prediction(name: str) -> tuple[torch.nn.Module, Any]:
    """(masked-LM model in eval mode, tokenizer) from a final/ folder, a model folder or a checkpoint."""
    PartialState()  # accelerate's logger, which load_model warns through, needs one
    path = Path(name)
    if (path / ckpt.STATE_FILE).exists():
        if not ckpt.is_complete(path):
            raise BadInput(f"{path} is an incomplete checkpoint (no {ckpt.MARKER} marker): a save was interrupted; "
                              "use a complete checkpoint or final/")
        model, tokenizer = load_checkpoint_model(path)
    else:
        if path.exists() and not (path / "config.json").exists():
            raise BadInput(f"{path} is neither a model folder (no config.json) nor a checkpoint folder "
                              f"(no {ckpt.STATE_FILE}); pass a run's final/ or checkpoints/step-N folder")
        model_cfg = ModelConfig(model_name_or_path=name)
        tokenizer = load_tokenizer(model_cfg, fix="save the model's tokenizer into it")
        torch.manual_seed(0)  # a checkpoint without an MLM head gets the same fresh head every time
        model = load_model(model_cfg, load_model_config(model_cfg, tokenizer))
    return model.eval(), tokenizer
