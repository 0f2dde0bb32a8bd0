import re
from pathlib import Path

import pytest
import yaml

from mlm_ddp.config import Config, from_dict, load_recipe, parse_args
from mlm_ddp.errors import BadInput
from mlm_ddp.train import main as train_main

RUN_MLM_FLAGS = [
    "--model_name_or_path", "--tokenizer_name", "--train_file", "--validation_file", "--dataset_name",
    "--dataset_config_name", "--text_column", "--streaming", "--max_seq_length", "--mlm_probability",
    "--whole_word_mask", "--per_device_train_batch_size", "--per_device_eval_batch_size", "--learning_rate",
    "--weight_decay", "--lr_scheduler_type", "--num_warmup_steps", "--num_train_epochs", "--max_train_steps",
    "--gradient_accumulation_steps", "--mixed_precision", "--seed", "--output_dir", "--checkpointing_steps",
    "--resume_from_checkpoint", "--eval_steps", "--with_tracking", "--report_to", "--logging_steps",
    "--save_total_limit", "--overwrite_output_dir", "--max_eval_samples", "--config_overrides", "--config",
]


def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """In this process: `python -m mlm_ddp.train` runs this main (tests/test_train.py's exit code)."""
    with pytest.raises(SystemExit) as done:
        train_main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0, out
    for flag in RUN_MLM_FLAGS:
        assert flag in out, flag


def test_flags_fill_the_tree() -> None:
    cfg = parse_args(["--learning_rate", "3e-4", "--whole_word_mask", "--checkpointing_steps", "5",
                      "--mixed_precision", "bf16", "--output_dir", "x"])
    assert cfg.training.learning_rate == 3e-4
    assert cfg.data.whole_word_mask is True
    assert cfg.run.checkpointing_steps == "5"
    assert cfg.training.mixed_precision == "bf16"
    assert cfg.run.output_dir == "x"


def test_yaml_recipe_nested_or_flat_and_cli_wins(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"training": {"learning_rate": 2e-5, "seed": 7}, "max_seq_length": 64}))
    cfg = parse_args(["--config", str(recipe), "--seed", "9"])
    assert cfg.training.learning_rate == 2e-5
    assert cfg.data.max_seq_length == 64
    assert cfg.training.seed == 9  # the flag wins over the recipe


def test_written_config_is_a_valid_recipe(tmp_path: Path) -> None:
    cfg = parse_args(["--mlm_probability", "0.2", "--max_train_steps", "5", "--streaming"])
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    assert from_dict(load_recipe(path)) == cfg
    assert parse_args(["--config", str(path)]) == cfg


def test_unknown_yaml_key_is_named(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("training:\n  learnig_rate: 0.1\n")
    with pytest.raises(BadInput, match=r"unknown key training\.'learnig_rate'.*learning_rate"):
        parse_args(["--config", str(recipe)])


@pytest.mark.parametrize(("recipe", "message"), [
    ("training:\n", "section 'training' is empty; give its keys indented below it, or remove it"),
    ("model: bert-base-uncased\n", "section 'model' is not a mapping of keys \\(it holds str 'bert-base-uncased'\\)"),
])
def test_an_empty_or_flat_section_is_named_as_one(recipe: str, message: str, tmp_path: Path) -> None:
    """It was "unknown key 'training' (did you mean 'streaming'?)": the key is known, its value is not a section."""
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe)
    with pytest.raises(BadInput, match=message):
        load_recipe(path)


def test_key_in_wrong_section_is_named(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model:\n  seed: 3\n")
    with pytest.raises(BadInput, match="model.seed belongs in section 'training'"):
        parse_args(["--config", str(recipe)])


@pytest.mark.parametrize("value", ["0", "1", "1.5", "-0.1"])
def test_mlm_probability_outside_open_unit_interval(value: str) -> None:
    with pytest.raises(BadInput, match="--mlm_probability must be strictly between 0 and 1"):
        parse_args(["--mlm_probability", value])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"lr_scheduler_type": "sawtooth"},
         "--lr_scheduler_type sawtooth: not a schedule transformers knows; use one of linear"),
        ({"checkpointing_steps": "often"}, "--checkpointing_steps must be a positive integer or 'epoch'"),
        ({"streaming": True}, "--streaming needs --max_train_steps"),
        ({"per_device_train_batch_size": 0}, "--per_device_train_batch_size must be at least 1"),
        ({"config_overrides": "hidden_dropout_prob"}, "not of the form key=value"),
        ({"dataset_name": "wikitext", "train_file": "a.txt"}, "either --dataset_name or --train_file"),
    ],
)
def test_bad_values_are_named(values: dict, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        from_dict(values)


@pytest.mark.parametrize(("argv", "message"), [
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--adam_beta1", "1.5"], r"--adam_beta1 must be in \[0, 1\), got 1.5"),
    (["--adam_beta2=-0.1"], r"--adam_beta2 must be in \[0, 1\), got -0.1"),
    (["--adam_epsilon=-1"], "--adam_epsilon must be >= 0, got -1.0"),
    # a negative number in scientific notation is a value, not a flag (argparse took it for one)
    (["--learning_rate", "-1e-3"], "--learning_rate must be positive, got -0.001"),
    (["--learning_rate", "-.5E+1"], "--learning_rate must be positive, got -5.0"),
])
def test_what_torch_or_argparse_refused_with_a_traceback_is_named(argv: list[str], message: str) -> None:
    with pytest.raises(BadInput, match=message):
        parse_args(argv)


def test_cli_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code = train_main(["--mlm_probability", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--mlm_probability must be strictly between 0 and 1, got 2.0" in err
    # an unknown flag: test_layout's test_a_mistyped_flag_is_named_not_a_traceback, every tool in one process


def test_defaults_are_valid() -> None:
    assert Config() == parse_args([])


def _wrong_values(hint: object) -> list[object]:
    """Values of another type than the annotation `hint` takes, as a YAML recipe can hold them."""
    import datetime
    import types
    import typing

    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    inner = next(a for a in args if a is not type(None)) if optional else hint
    wrong: list[object] = [[[1]], {"a": [1]}]  # a list of lists, a mapping of lists: never a field's value
    if not optional:
        wrong.append(None)
    if typing.get_origin(inner) is list:
        return [*wrong, [1.5] if typing.get_args(inner)[0] is str else ["x"]]
    # false is what YAML makes of an unquoted no or off: a choice where the choices hold that word
    worded = typing.get_origin(inner) is typing.Literal and {"no", "off"} & set(typing.get_args(inner))
    false = [] if worded else [False]
    return [*wrong, *{int: [8.5, True, "eight"], float: [True, "abc", [1, 2]], bool: [2, "maybe"]}.get(
        inner, [1.5, datetime.date(2024, 1, 1), *false])]  # text (a Literal is text too)


def _every_field() -> list[tuple[str, object]]:
    import dataclasses
    import typing

    from mlm_ddp.config.tree import SECTIONS

    return [(f.name, value) for cls in SECTIONS.values() for f in dataclasses.fields(cls)
            for value in _wrong_values(typing.get_type_hints(cls)[f.name])]


@pytest.mark.parametrize(("key", "value"), _every_field(), ids=lambda v: v if isinstance(v, str) else repr(v)[:20])
def test_a_wrong_typed_value_of_any_field_is_one_line_naming_the_key(key: str, value: object, tmp_path: Path) -> None:
    """Every field of the tree, given a value of another type in a recipe or a checkpoint's config.yaml: argparse
    converts only a flag's text, so these reached the run (an 8.5 batch size failed it after its folder was
    written; a null learning rate, a list of epochs, a mapping were tracebacks; 2 for a bool passed)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({key: value}))
    for build in (lambda: from_dict(load_recipe(recipe)), lambda: from_dict({key: value})):
        with pytest.raises(BadInput) as refused:
            build()
        assert "\n" not in str(refused.value) and re.search(rf"\b{key}\b", str(refused.value)), refused.value


@pytest.mark.parametrize(("recipe", "field", "expected"), [
    ("config_overrides: {hidden_dropout_prob: 0, is_decoder: false}", ("model", "config_overrides"),
     "hidden_dropout_prob=0,is_decoder=false"),
    ("report_to: [tensorboard, wandb]", ("run", "report_to"), "tensorboard,wandb"),
    ("stop_signals: [SIGTERM]", ("run", "stop_signals"), "SIGTERM"),
    ("checkpointing_steps: 500", ("run", "checkpointing_steps"), "500"),
    ("learning_rate: 5e-5", ("training", "learning_rate"), 5e-5),  # YAML reads it as text: the flag's reading
    ("num_train_epochs: 2", ("training", "num_train_epochs"), 2.0),
    ("validation_file: v.txt", ("data", "validation_file"), ["v.txt"]),
    ("mixed_precision: no", ("training", "mixed_precision"), "no"),  # YAML reads the unquoted word as false
    ("on_loss_spike: off", ("run", "on_loss_spike"), "off"),
])
def test_the_natural_yaml_forms_are_taken(recipe: str, field: tuple[str, str], expected: object,
                                          tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe + "\n")
    value = getattr(getattr(parse_args(["--config", str(path)]), field[0]), field[1])
    assert value == expected and type(value) is type(expected)


def test_each_value_check_refuses_exactly_outside_its_bound() -> None:
    """config/checks.py over generated values around each bound: refused iff outside, in one line naming the
    flag, the bound and the value; a value left unset passes."""
    import random

    from mlm_ddp.config import checks

    rng = random.Random(0)
    cases = [(lambda v: checks.at_least("--n", v, 1), lambda v: v >= 1, "--n must be at least 1, got "),
             (lambda v: checks.not_negative("--n", v), lambda v: v >= 0, "--n must be >= 0, got "),
             (lambda v: checks.positive("--n", v), lambda v: v > 0, "--n must be positive, got "),
             (lambda v: checks.above("--n", v, 1), lambda v: v > 1, "--n must be above 1, got "),
             (lambda v: checks.within("--n", v, 0, 1), lambda v: 0 <= v < 1, "--n must be in [0, 1), got ")]
    for check, allowed, words in cases:
        check(None)
        for value in [0, 1, -1, 0.5, 2] + [rng.choice([rng.randint(-3, 3), rng.uniform(-2, 2)]) for _ in range(50)]:
            if allowed(value):
                check(value)
                continue
            with pytest.raises(BadInput) as refused:
                check(value)
            assert str(refused.value) == f"{words}{value}"
