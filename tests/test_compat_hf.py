"""The reaches into datasets, transformers and argparse that tests/test_compat.py cannot take away by deleting
a module attribute (a signature, an instance attribute, a behaviour, a layout): each changed as a release
could change it, and `compat.check` ends in one line naming it. And what replaced a reach does what it did.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from mlm_ddp import compat
from mlm_ddp.compat import datasets as compat_datasets
from mlm_ddp.compat import transformers as compat_transformers
from mlm_ddp.errors import BadInput


def refused(library: str, name: str) -> str:
    """`check(library)`'s one line, which names `name` (a test fails if check passes)."""
    with pytest.raises(BadInput) as err:
        compat.check(library)
    line = str(err.value)
    assert "\n" not in line and name in line, line
    assert f"{library} {compat.installed_version(library)} has no " in line, line
    assert f"tested on {compat.tested_range(library)}" in line, line
    return line


def test_check_is_silent_on_the_installed_stack(capfd: pytest.CaptureFixture) -> None:
    """No warning at start-up: the resume check loads a shuffle buffer's state, which datasets warns about."""
    compat.check("datasets", "transformers", "argparse")
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")


# --------------------------------------------------------------------------------------------- transformers

def without(builder: Any, name: str) -> Any:
    """`builder` as a release without the keyword `name` has it (transformers 5.5's lack
    allow_is_bidirectional_skip, 5.1's call inputs_embeds input_embeds)."""
    signature = inspect.signature(builder)
    kept = [p for p in signature.parameters.values() if p.name != name]

    def changed(*args: Any, **kwargs: Any) -> Any:
        return builder(*args, **kwargs)

    changed.__signature__ = signature.replace(parameters=kept)  # type: ignore[attr-defined]
    return changed


@pytest.mark.parametrize("builder", ["create_bidirectional_mask", "create_bidirectional_sliding_window_mask"])
@pytest.mark.parametrize("keyword", ["allow_is_bidirectional_skip", "inputs_embeds"])
def test_a_mask_builder_without_a_keyword_is_one_line_at_check(builder: str, keyword: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import masking_utils

    monkeypatch.setattr(masking_utils, builder, without(getattr(masking_utils, builder), keyword))
    refused("transformers", f"transformers.masking_utils.{builder}")


def test_a_mask_builder_that_would_swallow_the_keyword_in_its_kwargs_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The keyword taken by `**kwargs` only is a keyword the builder may no longer read: not enough."""
    from transformers import masking_utils

    def builder(config: Any, inputs_embeds: Any, attention_mask: Any, **kwargs: Any) -> Any:
        raise AssertionError("never called by check")

    monkeypatch.setattr(masking_utils, "create_bidirectional_mask", builder)
    refused("transformers", "transformers.masking_utils.create_bidirectional_mask")


def test_the_masks_built_before_the_forward_are_the_builders_own() -> None:
    """`bidirectional_masks` is transformers' builder called as mlm_ddp calls it: (B, 1, T, T), True: attend."""
    import transformers

    config = transformers.BertConfig(hidden_size=8, num_attention_heads=2, intermediate_size=8, num_hidden_layers=1,
                                     vocab_size=16, attn_implementation="sdpa")
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    built = compat_transformers.bidirectional_masks(config, mask, {"full_attention"})["full_attention"]
    assert built.shape == (2, 1, 4, 4) and built.dtype == torch.bool
    assert torch.equal(built, mask.bool()[:, None, None, :].expand(2, 1, 4, 4))


def test_a_bert_layer_laid_out_otherwise_is_one_line_at_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A release that renames a part of BERT's layer the subset forward calls (here attention.self.query)."""
    from transformers.models.bert import modeling_bert

    class Renamed(modeling_bert.BertLayer):
        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            self.attention.self.q = self.attention.self.query
            del self.attention.self.query

    assert compat_transformers.is_bert_layer(modeling_bert.BertLayer(modeling_bert.BertConfig(
        hidden_size=8, num_attention_heads=2, intermediate_size=8)))
    monkeypatch.setattr(modeling_bert, "BertLayer", Renamed)
    refused("transformers", "transformers.models.bert.modeling_bert.BertLayer")


def test_an_init_that_draws_over_a_loaded_tensor_is_one_line_at_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A release whose init functions no longer read `_is_hf_initialized` (they would skip or redraw otherwise
    than the probe's head expects)."""
    from transformers import initialization

    monkeypatch.setattr(initialization, "zeros_", lambda tensor: tensor.zero_())
    refused("transformers", "_is_hf_initialized")


def test_the_check_of_the_bert_layer_draws_nothing_from_torchs_generator() -> None:
    state = torch.random.get_rng_state()
    compat.check("transformers")
    assert torch.equal(state, torch.random.get_rng_state())


def test_the_attention_backend_is_transformers_public_flag() -> None:
    """`is_backend_compatible()` is the class flag the mask and attention functions are looked up by."""
    import transformers

    from mlm_ddp.model import fast_paths

    config = transformers.BertConfig(hidden_size=8, num_attention_heads=2, intermediate_size=8, num_hidden_layers=1,
                                     vocab_size=16)
    for model in (transformers.BertForMaskedLM(config), transformers.DebertaV2ForMaskedLM(
            transformers.DebertaV2Config(hidden_size=8, num_attention_heads=2, intermediate_size=8,
                                         num_hidden_layers=1, vocab_size=16))):
        assert fast_paths.backend_compatible(model) is type(model).is_backend_compatible()
    assert not fast_paths.backend_compatible(torch.nn.Linear(2, 2))


# --------------------------------------------------------------------------------------------- datasets

def test_a_stream_without_its_examples_iterable_is_one_line_at_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A release that keeps a stream's pipeline under another name: the instance attribute reads None."""
    from datasets import IterableDataset

    monkeypatch.setattr(IterableDataset, "_ex_iterable", property(lambda self: None, lambda self, value: None),
                        raising=False)
    refused("datasets", "datasets.IterableDataset._ex_iterable")


def test_a_file_builder_that_names_its_files_otherwise_is_one_line_at_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from datasets.packaged_modules.text import text

    def shards(self: Any, files: list[str], files_iterables: Any) -> Any:
        yield from files

    monkeypatch.setattr(text.Text, "_generate_shards", shards)
    refused("datasets", "base_files")


def test_the_files_of_a_file_stream_are_found(tmp_path: Path) -> None:
    """What `shard_files` reads of a real file stream, under a skip (the held-out share)."""
    from datasets import load_dataset

    files = [tmp_path / f"part{i}.txt" for i in range(3)]
    for i, path in enumerate(files):
        path.write_text(f"a{i}\nb{i}\n")
    ds = load_dataset("text", data_files=[str(f) for f in files], split="train", streaming=True)
    assert compat_datasets.shard_files(ds.skip(2)) == [str(f) for f in files]
    assert compat_datasets.skip_take(ds.skip(2).take(3)) == (2, 3)
    assert compat_datasets.shard_files(ds.shuffle(seed=0, buffer_size=1)) is not None  # under the shuffle too


def test_a_shuffle_buffer_that_keeps_a_text_between_reads_is_one_line_at_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The buffer as datasets before 5.1 filled it: one text kept back, so a state dict names the text after
    the next one, and a resume skips one."""
    from datasets import iterable_dataset

    def full_buffer(self: Any) -> Any:
        rng = copy.deepcopy(self.generator)
        buffer: list[Any] = []
        for row in self.ex_iterable:
            if len(buffer) < self.buffer_size:
                buffer.append(row)
                continue
            i = int(rng.integers(0, self.buffer_size))
            yield buffer[i]
            buffer[i] = row
        yield from buffer

    monkeypatch.setattr(iterable_dataset.BufferShuffledExamplesIterable, "__iter__", full_buffer)
    monkeypatch.setattr(iterable_dataset.BufferShuffledExamplesIterable, "iter_arrow", property(lambda self: None))
    refused("datasets", "empty one-text shuffle buffer between reads")


def test_a_resumed_stream_says_nothing_of_its_shuffle_buffer(capfd: pytest.CaptureFixture) -> None:
    from datasets import IterableDataset

    ds = IterableDataset.from_dict({"text": ["a", "b", "c"]}).shuffle(seed=0, buffer_size=1)
    rows = iter(ds)
    next(rows)
    resumed = IterableDataset.from_dict({"text": ["a", "b", "c"]}).shuffle(seed=0, buffer_size=1)
    compat_datasets.load_stream_state(resumed, ds.state_dict())
    assert [row["text"] for row in resumed] == [row["text"] for row in rows]
    assert "shuffle buffer" not in capfd.readouterr().err


def test_prepare_refuses_a_moved_name_in_one_line_before_it_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capfd: pytest.CaptureFixture) -> None:
    from datasets import arrow_writer

    from mlm_ddp import prepare

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one text\n")
    monkeypatch.delattr(arrow_writer, "ArrowWriter")
    assert prepare.main(["--train_file", str(corpus), "--output_dir", str(tmp_path / "out")]) == 2
    err = capfd.readouterr().err
    assert len(err.splitlines()) == 1 and "datasets.arrow_writer.ArrowWriter" in err, err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------- argparse

def test_a_parser_that_no_longer_reads_the_matcher_is_one_line_at_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A release that keeps its negative-number test elsewhere: what mlm_ddp sets is not what is read."""
    stock = re.compile(r"^-\d+$|^-\d*\.\d+$")  # argparse's own, without exponents
    monkeypatch.setattr(argparse._ActionsContainer, "_negative_number_matcher",
                        property(lambda self: stock, lambda self, value: None), raising=False)
    refused("argparse", "argparse.ArgumentParser._negative_number_matcher")


@dataclasses.dataclass
class Flags:
    on: bool = False


def test_a_recipes_bool_words_are_the_bool_flags_words() -> None:
    """config.tree's own words for a bool read from a recipe are HfArgumentParser's for the flag."""
    from transformers import HfArgumentParser

    from mlm_ddp.config.tree import FALSE_WORDS, TRUE_WORDS, text_to_bool

    parser = HfArgumentParser(Flags)
    for word in (*TRUE_WORDS, *FALSE_WORDS, "YES", "False", "T", "n"):
        (flags,) = parser.parse_args_into_dataclasses(["--on", word])
        assert text_to_bool(word) is flags.on, word
    for word in ("2", "maybe", "on", ""):
        with pytest.raises(SystemExit):
            parser.parse_args_into_dataclasses(["--on", word])
        with pytest.raises(ValueError):
            text_to_bool(word)
