"""final/ stays a sentence-transformers model when its source is one.

A sentence-transformers checkpoint (the default all-MiniLM-L6-v2 among them) is a transformers model
at its root plus files that describe the pipeline around it: `modules.json` (the modules in order),
`sentence_bert_config.json` (the root transformer's settings), `config_sentence_transformers.json`,
and one folder per further module (`1_Pooling/`, `2_Dense/` with its weights, ...). `save_pretrained`
writes only the transformers part, and `SentenceTransformer(final)` without `modules.json` silently
builds plain mean pooling without normalisation: other embeddings than the source's pipeline gives.
So `copy_into` puts those files into final/'s staging folder, and `check` refuses, before training,
only what would make final/ unloadable. The training itself changes none of them: the pipeline's
encoder is final/'s root, the model that was trained.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from accelerate.logging import get_logger

from mlm_ddp.config import ModelConfig
from mlm_ddp.errors import BadInput
from mlm_ddp.model.loading import from_scratch, resolve_model_path

logger = get_logger(__name__)
MODULES = "modules.json"  # sentence-transformers treats a folder as its own model when this file exists
SBERT_CONFIG = "sentence_bert_config.json"  # the transformer module's settings (max_seq_length, ...)
ROOT_FILES = (SBERT_CONFIG, "config_sentence_transformers.json")
FIX = f"repair it, or remove {MODULES} to fine-tune the folder as a plain transformers model"


@dataclass(frozen=True)
class Pipeline:
    """The source's sentence-transformers description, read and checked."""

    source: Path  # the folder modules.json was found in (a Hub name: its snapshot in the local cache)
    modules: list[dict[str, Any]]  # modules.json's entries, in order; what final/'s modules.json holds

    def short_types(self) -> list[str]:
        return [entry["type"].rsplit(".", 1)[-1] for entry in self.modules]


def source_folder(model: ModelConfig) -> Path | None:
    """The folder the run's weights come from: the given folder, the embedded default's, or a Hub
    name's snapshot in the local cache (never the network: a run may be offline, and a download at
    its end could fail after hours of training). None when trained from scratch or not found."""
    if from_scratch(model):
        return None
    try:
        name = resolve_model_path(model)
    except BadInput:  # no model at all is load_tokenizer's error to report, not this module's
        return None
    if Path(name).is_dir():
        return Path(name)
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(name, MODULES)
    except ValueError:  # not a Hub repository name (huggingface_hub's validation error)
        return None
    return Path(found).parent if isinstance(found, str) else None


def _root_relative(path: Any, where: Path) -> str:
    """A module's folder as modules.json names it, checked as sentence-transformers checks it when
    loading (no absolute path, no '..'): it is copied into final/ and must stay inside it."""
    windows = PureWindowsPath(path) if isinstance(path, str) else None
    if windows is None or windows.anchor or ".." in windows.parts or "\0" in path:
        raise BadInput(f"{where}: module path {path!r} is not a relative folder inside the model; sentence-"
                       f"transformers refuses to load it: {FIX}")
    return PurePosixPath(*windows.parts).as_posix() if windows.parts else ""


def _json(path: Path, kind: type) -> Any:
    try:
        value = json.loads(path.read_text(encoding="utf8"))
    except (OSError, ValueError) as err:
        raise BadInput(f"{path} is not readable JSON ({err}); sentence-transformers could not load final/ with "
                       f"it: {FIX}") from err
    if not isinstance(value, kind):
        raise BadInput(f"{path} holds a JSON {type(value).__name__}, not the {kind.__name__} sentence-"
                       f"transformers reads: {FIX}")
    return value


def read_pipeline(model: ModelConfig) -> Pipeline | None:
    """The source's pipeline (None: the source is no sentence-transformers model). BadInput when its
    files are damaged in a way that would make final/ unloadable by sentence-transformers."""
    source = source_folder(model)
    if source is None or not (source / MODULES).is_file():
        return None
    entries = _json(source / MODULES, list)
    for index, entry in enumerate(entries):
        if not (isinstance(entry, dict) and all(isinstance(entry.get(key), str) for key in ("name", "type"))
                and "path" in entry):
            raise BadInput(f"{source / MODULES}: entry {index} ({entry!r}) lacks a string 'name', 'type' or a "
                           f"'path'; sentence-transformers reads all three: {FIX}")
        entry["path"] = _root_relative(entry["path"], source / MODULES)
        folder = source / entry["path"]
        if entry["path"] and folder.exists() and not folder.is_dir():
            raise BadInput(f"{source / MODULES}: module {entry['name']!r} lives in {folder}, which is a file, not "
                           f"a folder: {FIX}")
        for config in sorted(folder.glob("*.json")) if entry["path"] else []:
            _json(config, dict)  # a module's config that does not parse fails its load
    for name in ROOT_FILES:
        if (source / name).is_file():
            _json(source / name, dict)
    return Pipeline(source, entries)


def check(model: ModelConfig) -> None:
    """Refuse, before training, a source whose sentence-transformers files would make final/ unloadable."""
    read_pipeline(model)


def copy_into(model: ModelConfig, staging: Path) -> Pipeline | None:
    """Copy the source's sentence-transformers files into final/'s staging folder (main process), so that
    `SentenceTransformer(final)` rebuilds the source's pipeline around the trained encoder. `check` ran
    before training; files damaged since then leave final/ a plain transformers model, with a warning:
    a run must not lose its trained model to them."""
    try:
        pipeline = read_pipeline(model)
    except BadInput as err:
        logger.warning("final/ gets no sentence-transformers files: %s", err)
        return None
    if pipeline is None:
        return None
    source, entries = pipeline.source, [dict(entry) for entry in pipeline.modules]
    for entry in entries:
        code = entry["type"].rsplit(".", 1)[0].replace(".", "/") + ".py"  # a custom module's own code file
        if not entry["type"].startswith("sentence_transformers.") and (source / code).is_file():
            (staging / code).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / code, staging / code)
        if not entry["path"]:
            continue
        if entry["type"].rsplit(".", 1)[-1] == "Transformer":
            # the encoder in a subfolder is the untrained one: final/'s root is the model trained
            if (source / entry["path"] / SBERT_CONFIG).is_file() and not (source / SBERT_CONFIG).is_file():
                shutil.copyfile(source / entry["path"] / SBERT_CONFIG, staging / SBERT_CONFIG)
            logger.info("final/%s: module %r points at final/'s root (the trained encoder), not at %s/",
                        MODULES, entry["name"], entry["path"])
            entry["path"] = ""
        elif (source / entry["path"]).is_dir():
            shutil.copytree(source / entry["path"], staging / entry["path"])  # follows a Hub cache's links
        elif not entry["type"].endswith(".Normalize"):  # Normalize alone saves no files
            logger.warning("%s lists module %r (%s) in %s/, which %s lacks: final/ has no such folder either; if "
                           "SentenceTransformer cannot load final/ without it, copy the folder in (a Hub model: "
                           "download it whole with `hf download REPO`)", MODULES, entry["name"], entry["type"],
                           entry["path"], source)
    for name in ROOT_FILES:
        if (source / name).is_file() and not (staging / name).exists():
            shutil.copyfile(source / name, staging / name)
    # written last: it is what makes sentence-transformers read the rest
    (staging / MODULES).write_text(json.dumps(entries, indent=2), encoding="utf8")
    logger.info("final/ keeps the source's sentence-transformers pipeline (%s) from %s",
                " -> ".join(pipeline.short_types()), source)
    return pipeline


def card_line(model: ModelConfig) -> str:
    """The model card's line on loading final/ with sentence-transformers ('' when it is none)."""
    try:
        pipeline = read_pipeline(model)
    except BadInput:
        return ""
    if pipeline is None:
        return ""
    steps = " -> ".join(pipeline.short_types())
    return (f"It also loads with sentence-transformers, with its source's pipeline ({steps}): "
            "`SentenceTransformer(\"PATH_OR_REPO\")`.\n\n")
