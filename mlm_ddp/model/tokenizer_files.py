"""Whether a model folder holds its tokenizer. transformers 5 does not fail on a folder without the tokenizer's
files: it builds a tokenizer of the special tokens only, with which every word is [UNK], and a run trains (or a
prediction, a probe, an extension reports) on that without a word of complaint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlm_ddp.errors import BadInput


def check_tokenizer_files(name: str, tokenizer: Any, fix: str) -> None:
    """BadInput unless the local folder `name` holds one of the files the loaded tokenizer's class reads its
    vocabulary from (a Hub name's files are the Hub's, and a class that names none cannot be judged)."""
    folder = Path(name)
    wanted = sorted(set(getattr(type(tokenizer), "vocab_files_names", {}).values()))
    if folder.is_dir() and wanted and not any((folder / file).is_file() for file in wanted):
        raise BadInput(f"{name} has no tokenizer files ({' / '.join(wanted)}); {fix}")
