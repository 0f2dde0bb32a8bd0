"""final/ of a sentence-transformers source loads as the same sentence-transformers pipeline:
the files that describe it are copied, the encoder is the trained one, and damaged files are refused
before training."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mlm_ddp.config import ModelConfig, parse_args
from mlm_ddp.errors import BadInput
from mlm_ddp.run import st_files
from mlm_ddp.train import train
from tests.conftest import tiny_args

PIPELINE = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]
FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling/config.json")
SENTENCES = ["The list is sorted in place.", "A function returns a value.", "Exceptions are raised"]


def make_st_model(encoder: Path, root: Path) -> Path:
    """The tiny encoder as a sentence-transformers checkpoint: CLS pooling (not the mean a folder
    without modules.json gets), then normalisation; like all-MiniLM-L6-v2, no 2_Normalize/ folder."""
    shutil.copytree(encoder, root)
    (root / "modules.json").write_text(json.dumps(PIPELINE, indent=2))
    (root / "1_Pooling").mkdir()
    (root / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False,
         "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
    (root / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32, "do_lower_case": False}))
    (root / "config_sentence_transformers.json").write_text(json.dumps({"__version__": {"sentence_transformers":
                                                                                        "2.0.0"}}))
    return root


@pytest.fixture(scope="module")
def st_model(tiny_fresh_head: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_st_model(tiny_fresh_head, tmp_path_factory.mktemp("st") / "model")


@pytest.fixture(scope="module")
def st_run(st_model: Path, corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("st_run") / "run"
    train(parse_args(tiny_args(st_model, corpus, out, "--max_train_steps", "2")))
    return out


def test_final_keeps_the_pipeline_files(st_run: Path, st_model: Path) -> None:
    final = st_run / "final"
    for name in FILES:
        assert json.loads((final / name).read_text()) == json.loads((st_model / name).read_text()), name
    assert not (final / "2_Normalize").exists()  # the source has none: Normalize saves no files
    assert "It also loads with sentence-transformers, with its source's pipeline (Transformer -> Pooling -> " \
           "Normalize)" in (final / "README.md").read_text()


def test_final_loads_as_the_same_pipeline_around_the_trained_encoder(st_run: Path, st_model: Path) -> None:
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    final = st_run / "final"
    source, tuned = SentenceTransformer(str(st_model), device="cpu"), SentenceTransformer(str(final), device="cpu")
    assert [type(m) for m in tuned] == [type(m) for m in source]
    assert [type(m).__name__ for m in tuned] == ["Transformer", "Pooling", "Normalize"]
    assert tuned[1].get_config_dict() == source[1].get_config_dict()
    assert tuned.max_seq_length == source.max_seq_length == 32
    embeddings = tuned.encode(SENTENCES, convert_to_tensor=True)  # (3, 32)
    assert torch.allclose(embeddings.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-5)
    # the same numbers from transformers alone: final/'s encoder, its CLS hidden state, L2-normalised
    tokenizer, encoder = AutoTokenizer.from_pretrained(final), AutoModel.from_pretrained(final).eval()
    with torch.no_grad():
        batch = tokenizer(SENTENCES, padding=True, truncation=True, max_length=32, return_tensors="pt")
        cls = encoder(**batch).last_hidden_state[:, 0]  # (3, 32)
    assert torch.allclose(embeddings, torch.nn.functional.normalize(cls, dim=1), atol=1e-5)
    # the trained encoder, not the source's
    assert not torch.allclose(embeddings, source.encode(SENTENCES, convert_to_tensor=True), atol=1e-4)


def test_a_model_without_modules_json_gets_none_of_them(tiny_fresh_head: Path, corpus: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(parse_args(tiny_args(tiny_fresh_head, corpus, out, "--max_train_steps", "2")))
    final = out / "final"
    assert (final / "config.json").is_file()
    assert not [name for name in (*FILES, "1_Pooling", "2_Normalize") if (final / name).exists()]
    assert "sentence-transformers" not in (final / "README.md").read_text()


@pytest.mark.parametrize("damage, named", [
    (lambda m: (m / "modules.json").write_text("[{"), "modules.json is not readable JSON"),
    (lambda m: (m / "modules.json").write_text(json.dumps({"0": PIPELINE[0]})), "holds a JSON dict, not the list"),
    (lambda m: (m / "modules.json").write_text(json.dumps([{"name": "0", "path": ""}])), "entry 0"),
    (lambda m: (m / "modules.json").write_text(json.dumps([*PIPELINE[:1], {**PIPELINE[1], "path": "../1_Pooling"}])),
     "module path '../1_Pooling' is not a relative folder"),
    (lambda m: (m / "1_Pooling" / "config.json").write_text("{"), "1_Pooling/config.json is not readable JSON"),
    (lambda m: (m / "sentence_bert_config.json").write_text("[]"), "sentence_bert_config.json holds a JSON list"),
])
def test_damaged_files_are_refused_by_name(st_model: Path, tmp_path: Path, damage, named: str) -> None:
    model = shutil.copytree(st_model, tmp_path / "model")
    damage(model)
    with pytest.raises(BadInput, match="remove modules.json to fine-tune the folder as a plain transformers") as err:
        st_files.check(ModelConfig(model_name_or_path=str(model)))
    assert named in str(err.value)


def test_a_damaged_source_is_refused_before_anything_is_written(st_model: Path, corpus: dict, tmp_path: Path) -> None:
    model = shutil.copytree(st_model, tmp_path / "model")
    (model / "modules.json").write_text("not json")
    with pytest.raises(BadInput, match="modules.json is not readable JSON"):
        train(parse_args(tiny_args(model, corpus, tmp_path / "run", "--max_train_steps", "2")))
    assert not (tmp_path / "run").exists()


def test_a_dense_module_and_a_transformer_in_a_subfolder(st_model: Path, tmp_path: Path) -> None:
    """Module folders are copied whole (a Dense's weights with them); a transformer module in a subfolder
    holds the untrained encoder, so final/'s modules.json points it at final/'s root, the trained one."""
    from accelerate import PartialState

    PartialState()  # accelerate's logger needs it; a run has it from its Accelerator
    model = shutil.copytree(st_model, tmp_path / "model")
    (model / "0_Transformer").mkdir()
    (model / "sentence_bert_config.json").rename(model / "0_Transformer" / "sentence_bert_config.json")
    (model / "2_Dense").mkdir()
    (model / "2_Dense" / "config.json").write_text(json.dumps({"in_features": 32, "out_features": 8}))
    (model / "2_Dense" / "model.safetensors").write_bytes(b"weights")
    modules = [{**PIPELINE[0], "path": "0_Transformer"}, PIPELINE[1],
               {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]
    (model / "modules.json").write_text(json.dumps(modules))
    staging = tmp_path / "staging"
    staging.mkdir()
    st_files.copy_into(ModelConfig(model_name_or_path=str(model)), staging)
    assert json.loads((staging / "modules.json").read_text()) == [PIPELINE[0], *modules[1:]]
    assert (staging / "2_Dense" / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((staging / "sentence_bert_config.json").read_text())["max_seq_length"] == 32
    assert not (staging / "0_Transformer").exists()


def test_a_hub_name_is_found_in_the_local_cache_only(st_model: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--someone--tiny-st"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(st_model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert st_files.source_folder(ModelConfig(model_name_or_path="someone/tiny-st")) == repo / "snapshots" / commit
    assert st_files.read_pipeline(ModelConfig(model_name_or_path="someone/tiny-st")).short_types() == [
        "Transformer", "Pooling", "Normalize"]
    assert st_files.source_folder(ModelConfig(model_name_or_path="someone/not-cached")) is None
    assert st_files.source_folder(ModelConfig(model_type="bert")) is None  # from scratch: no source
