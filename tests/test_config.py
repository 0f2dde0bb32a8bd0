from pathlib import Path

import pytest
import yaml

from mlm_ddp.config import Config, from_dict, load_recipe, parse_args
from mlm_ddp.errors import BadInput
from tests.conftest import run_module

RUN_MLM_FLAGS = [
    "--model_name_or_path", "--tokenizer_name", "--train_file", "--validation_file", "--dataset_name",
    "--dataset_config_name", "--text_column", "--streaming", "--max_seq_length", "--mlm_probability",
    "--whole_word_mask", "--per_device_train_batch_size", "--per_device_eval_batch_size", "--learning_rate",
    "--weight_decay", "--lr_scheduler_type", "--num_warmup_steps", "--num_train_epochs", "--max_train_steps",
    "--gradient_accumulation_steps", "--mixed_precision", "--seed", "--output_dir", "--checkpointing_steps",
    "--resume_from_checkpoint", "--eval_steps", "--with_tracking", "--report_to", "--logging_steps",
    "--save_total_limit", "--overwrite_output_dir", "--max_eval_samples", "--config_overrides", "--config",
]


def test_help_lists_every_flag() -> None:
    proc = run_module(["mlm_ddp.train", "--help"])
    assert proc.returncode == 0, proc.stderr
    for flag in RUN_MLM_FLAGS:
        assert flag in proc.stdout, flag


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


def test_cli_error_exits_2() -> None:
    proc = run_module(["mlm_ddp.train", "--mlm_probability", "2"])
    assert proc.returncode == 2
    assert "--mlm_probability must be strictly between 0 and 1, got 2.0" in proc.stderr
    # an unknown flag: test_layout's test_a_mistyped_flag_is_named_not_a_traceback, every tool in one process


def test_defaults_are_valid() -> None:
    assert Config() == parse_args([])
