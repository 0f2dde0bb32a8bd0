"""--config_overrides applied to the model's config, and the model they make checked before anything is written.
transformers checks some values only when it builds the model (a hidden size that is not a multiple of the number
of attention heads): that was a traceback, or a line that blamed --model_name_or_path."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForMaskedLM

from mlm_ddp.errors import BadInput


def apply_overrides(config: Any, overrides: str | None, trust_remote_code: bool) -> None:
    """Edit `config` by --config_overrides; BadInput naming the flag and transformers' reason if it refuses a key,
    a value, or the model they make (built on the meta device: no memory, no weights, a fraction of a second).
    Given the flag's values, not the model section: the section stays with loading, which owns it."""
    if not overrides:
        return
    try:
        config.update_from_string(overrides)
        with torch.device("meta"):
            AutoModelForMaskedLM.from_config(config, trust_remote_code=trust_remote_code)
    except ValueError as err:
        reason = " ".join(str(err).split())
        raise BadInput(f"--config_overrides {overrides!r}: transformers refuses it ({reason})") from err
