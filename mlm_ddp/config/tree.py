"""The whole tree (`Config`) and how it is filled: a YAML recipe (nested by section or flat) and flags,
the flags winning; written back, resolved, as a valid recipe. `mlm_ddp.config` is the public surface."""

from __future__ import annotations

import dataclasses
import difflib
import re
import shlex
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from transformers import HfArgumentParser

from mlm_ddp.config.run import RunConfig
from mlm_ddp.config.sections import DataConfig, ModelConfig
from mlm_ddp.config.training import TrainingConfig
from mlm_ddp.errors import BadInput

RECIPES = Path(__file__).resolve().parents[1] / "recipes"  # the shipped recipes (docs/recipes.md)
SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "run": RunConfig,
}


@dataclass
class Config:
    """The whole run: one section per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        for section in (self.model, self.data, self.training, self.run):
            _check_choices(section)
        if self.data.streaming and self.training.max_train_steps is None:
            raise BadInput(
                "--streaming needs --max_train_steps: a stream has no length to count epochs by"
            )
        if self.data.streaming and self.run.checkpointing_steps == "epoch":
            raise BadInput(
                "--checkpointing_steps epoch does not work with --streaming: a stream's epoch end is "
                "only known once it is reached; give a number of steps"
            )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The resolved settings, as config.yaml, checkpoints and trackers record them (a secret is not)."""
        values = dataclasses.asdict(self)
        values["run"]["hub_token"] = None
        return values

    def command_line(self) -> str:
        """A `python -m mlm_ddp.train` command line that gives this config (its non-default flags)."""
        words = ["python", "-m", "mlm_ddp.train"]
        defaults = Config().to_dict()
        for section, values in self.to_dict().items():
            for name, value in values.items():
                if isinstance(value, list) and value != defaults[section][name]:  # --validation_file a b
                    words += [f"--{name}", *map(str, value)]
                elif value is not None and value != defaults[section][name]:
                    words += [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]
        return shlex.join(words)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _check_choices(section: Any) -> None:
    """Literal-typed fields hold one of their choices (a YAML recipe bypasses argparse's check)."""
    for f in dataclasses.fields(section):
        choices = typing.get_args(f.type) if typing.get_origin(f.type) is Literal else ()
        if not choices and isinstance(f.type, str) and f.type.startswith("Literal["):
            choices = tuple(yaml.safe_load("[" + f.type[len("Literal["):-1] + "]"))
        value = getattr(section, f.name)
        if choices and value not in choices:
            raise BadInput(f"--{f.name} must be one of {', '.join(map(str, choices))}; got {value!r}")


def _field_owner() -> dict[str, str]:
    """Flat field name -> section name (names are unique across sections, so flags can be flat)."""
    owner: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in owner, f"duplicate config field {f.name}"
            owner[f.name] = section
    return owner


def _flatten_recipe(recipe: Any, source: str) -> dict[str, Any]:
    """Accept a recipe nested by section (as config.yaml is written) or flat; reject unknown keys."""
    if recipe is None:
        return {}
    if not isinstance(recipe, dict):
        raise BadInput(f"{source}: expected a mapping of config keys, got {type(recipe).__name__}")
    owner = _field_owner()
    flat: dict[str, Any] = {}

    def put(key: str, value: Any, where: str) -> None:
        if key not in owner:
            close = difflib.get_close_matches(key, list(owner), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise BadInput(f"{source}: unknown key {where}{key!r}{hint}")
        flat[key] = value

    for key, value in recipe.items():
        if key in SECTIONS and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                if owner.get(sub_key, key) != key:
                    raise BadInput(
                        f"{source}: key {key}.{sub_key} belongs in section {owner[sub_key]!r}"
                    )
                put(sub_key, sub_value, f"{key}.")
        else:
            put(key, value, "")
    return flat


def shipped_recipes() -> dict[str, Path]:
    """The recipes inside the package (mlm_ddp/recipes/NAME.yaml), by name: `--config NAME`."""
    return {p.stem: p for p in sorted(RECIPES.glob("*.yaml"))}


def load_recipe(path: str | Path) -> dict[str, Any]:
    """Read a YAML recipe (a file, or the name of a shipped one) into flat field values, with errors that
    name the file and key. A file of that name wins over a shipped recipe."""
    path = Path(path)
    if not path.is_file() and str(path) in shipped_recipes():
        path = shipped_recipes()[str(path)]
    if not path.is_file():
        raise BadInput(f"--config {path}: no such file, nor a shipped recipe ({', '.join(shipped_recipes())})")
    try:
        recipe = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise BadInput(f"--config {path}: not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8") from err
    except yaml.YAMLError as err:
        raise BadInput(f"--config {path}: not valid YAML: {err}") from err
    return _flatten_recipe(recipe, str(path))


def make_parser() -> HfArgumentParser:
    parser = HfArgumentParser(
        tuple(SECTIONS.values()),
        prog="mlm_ddp.train",
        description="Masked-language-model fine-tuning of BERT-family models on Accelerate.",
        # a prefix is not a flag: --max_train_step is refused, not read as --max_train_steps, and a recipe's
        # rule that asks whether --learning_rate was given (`given`) sees every flag as it is spelled
        allow_abbrev=False,
    )
    # argparse reads "-1e-3" as a flag (its test for a negative number knows no exponent), so "--learning_rate
    # -1e-3" said "expected one argument"; no flag of ours looks like a number, so any number is a value
    parser._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
    parser.add_argument(
        "--config", default=None, metavar="RECIPE.yaml",
        help="YAML recipe (nested by section or flat), or the name of a shipped one (dapt, tapt, modernbert: "
             "docs/recipes.md); flags given on the command line win.",
    )
    return parser


def from_dict(values: dict[str, Any]) -> Config:
    """A Config from flat or nested values, validated (BadInput on a bad or unknown value)."""
    flat = _flatten_recipe(values, "config")
    owner = _field_owner()
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for key, value in flat.items():
        sections[owner[key]][key] = value
    try:
        built = {name: SECTIONS[name](**kw) for name, kw in sections.items()}
    except TypeError as err:
        raise BadInput(str(err)) from err
    return Config(**built)


def parse_args(argv: list[str] | None = None) -> Config:
    """Flags and/or `--config recipe.yaml` -> a validated Config (flags win over the recipe).

    argparse errors (an unknown flag, a wrong type) exit with status 2, as BadInput does in main().
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser()
    known, _ = parser.parse_known_args(argv)
    if known.config is not None:
        recipe = load_recipe(known.config)
        if given(argv, "learning_rate") and not given(argv, "lr_reference_batch"):
            recipe.pop("lr_reference_batch", None)  # the user's rate is for the user's batch
        parser.set_defaults(**recipe)
    parsed = parse_exactly(parser, argv)  # one dataclass per section, then a Namespace holding --config
    return Config(*parsed[: len(SECTIONS)])


def parse_exactly(parser: HfArgumentParser, argv: list[str] | None) -> tuple[Any, ...]:
    """The parser's dataclasses (and a Namespace for its plain arguments, if any). A flag it does not know
    is refused as argparse refuses one (usage, the flag, exit 2) instead of HfArgumentParser's ValueError
    traceback, so that a typo reads as one in every tool."""
    *parsed, rest = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return tuple(parsed)


def given(argv: list[str], name: str) -> bool:
    """Whether the flag --name is on the command line (`--name V` or `--name=V`; HfArgumentParser also takes
    the spelling with dashes)."""
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    return any(word.split("=", 1)[0] in spellings for word in argv)
