"""The whole tree (`Config`) and how it is filled: a YAML recipe (nested by section or flat) and flags,
the flags winning; written back, resolved, as a valid recipe. `mlm_ddp.config` is the public surface."""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import shlex
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from transformers import HfArgumentParser

from mlm_ddp.compat import argparse as compat_argparse
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


# text fields whose YAML has a natural other form: a list for a comma list, a mapping for key=value pairs, a whole
# number for a count of steps (the field also takes 'epoch'); the flags give them as text. Each: what it takes.
COMMA_LISTS = {name: "a comma list or a list of strings" for name in ("report_to", "stop_signals", "fsdp_wrap_classes")}
KEY_VALUES = {"config_overrides": "'key=value,...' text or a mapping of key: value"}
STEPS_OR_WORD = {"checkpointing_steps": "a whole number of steps or 'epoch'"}
SOURCE_LISTS = ("train_file",)  # a list item may be a mapping of path, weight and name (mixture.py checks it)
_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _shown(value: Any, text: bool) -> str:
    """A recipe's value as the user wrote it; where text was wanted, what YAML made of an unquoted word."""
    if isinstance(value, (datetime.date, datetime.datetime)):
        return f"{value} (YAML reads it as a date: quote it)" if text else str(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (YAML reads yes/no/on/off unquoted as true/false: quote it)" if text \
            else str(value).lower()
    return repr(value)


# the words a bool flag takes, in any case (HfArgumentParser's)
TRUE_WORDS, FALSE_WORDS = ("yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")


def text_to_bool(text: str) -> bool:
    """A bool flag's value from its text as HfArgumentParser reads it; ValueError for another word."""
    if text.lower() in TRUE_WORDS:
        return True
    if text.lower() in FALSE_WORDS:
        return False
    raise ValueError(text)


def _scalar(value: Any, kind: Any, key: str) -> Any:
    """One value as a field of type `kind` holds it (ValueError if it cannot be): text converted as its flag's is
    (YAML reads 5e-5 as text, and a quoted '0.15' is what the flag takes), an int where a float goes."""
    if typing.get_origin(kind) is Literal:
        # YAML reads an unquoted no or off as false: where the choices hold that word, it is what was written
        word = next((w for w in ("no", "off") if w in typing.get_args(kind)), None)
        if value is False and word is not None:
            return word
        kind = str  # its choices are _check_choices' (the message lists them)
    if kind is str:
        if isinstance(value, str):
            return value
        if key in COMMA_LISTS and isinstance(value, list) and all(isinstance(v, str) for v in value):
            return ",".join(value)
        if key in KEY_VALUES and isinstance(value, dict) and all(
                isinstance(v, (str, int, float, bool)) for v in value.values()):
            return ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in value.items())
        if key in STEPS_OR_WORD and isinstance(value, int) and not isinstance(value, bool):
            return str(value)
    elif isinstance(value, bool) or value is None:
        if kind is bool and value is not None:
            return value
    elif isinstance(value, str):
        return text_to_bool(value) if kind is bool else kind(value)
    elif kind is int and isinstance(value, int) or kind is float and isinstance(value, (int, float)):
        return kind(value)
    raise ValueError(value)


def _typed(key: str, value: Any, hint: Any, source: str) -> Any:
    """`value` as the field `key` (annotated `hint`) holds it; BadInput naming the key and the value otherwise."""
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    many = typing.get_origin(hint) is list
    kind = typing.get_args(hint)[0] if many else hint
    choices = typing.get_args(kind) if typing.get_origin(kind) is Literal else ()
    wanted = ({**COMMA_LISTS, **KEY_VALUES, **STEPS_OR_WORD}.get(key) or _KINDS.get(kind)
              or f"one of {', '.join(map(str, choices))}")
    if many:
        wanted = f"a list of {wanted.removeprefix('an ').removeprefix('a ')}s"
    if optional:
        wanted += " or null"
    try:
        if not many:
            return _scalar(value, kind, key)
        # one value where a list goes is a list of one, as `--validation_file a` is
        items = value if isinstance(value, list) else [value]
        return [item if key in SOURCE_LISTS and isinstance(item, dict) else _scalar(item, kind, key)
                for item in items]
    except ValueError:
        raise BadInput(f"{source}: {key} must be {wanted}, got {_shown(value, kind is str or bool(choices))}") from None


def check_types(flat: dict[str, Any], source: str) -> dict[str, Any]:
    """A recipe's (or a config.yaml's) flat values checked against the fields' annotations and brought to their
    types, before any section is built: argparse converts only a flag's text, so without this an 8.5 batch size
    or a null learning rate reached the run and failed it after its folder was written."""
    hints = {name: hint for cls in SECTIONS.values() for name, hint in typing.get_type_hints(cls).items()}
    return {key: _typed(key, value, hints[key], source) for key, value in flat.items()}


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
        if key in SECTIONS and not isinstance(value, dict):  # else "unknown key 'training'", which it is not
            what = "empty" if value is None else f"not a mapping of keys (it holds {type(value).__name__} {value!r})"
            raise BadInput(f"{source}: section {key!r} is {what}; give its keys indented below it, or remove it")
        if key in SECTIONS:
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
    return check_types(_flatten_recipe(recipe, str(path)), str(path))


def make_parser() -> HfArgumentParser:
    parser = HfArgumentParser(
        tuple(SECTIONS.values()),
        prog="mlm_ddp.train",
        description="Masked-language-model fine-tuning of BERT-family models on Accelerate.",
        # a prefix is not a flag: --max_train_step is refused, not read as --max_train_steps, and a recipe's
        # rule that asks whether --learning_rate was given (`given`) sees every flag as it is spelled
        allow_abbrev=False,
    )
    # "--learning_rate -1e-3" is a value, not a flag: no flag of ours looks like a number
    compat_argparse.accept_negative_numbers(parser)
    parser.add_argument(
        "--config", default=None, metavar="RECIPE.yaml",
        help="YAML recipe (nested by section or flat), or the name of a shipped one (dapt, tapt, modernbert: "
             "docs/recipes.md); flags given on the command line win.",
    )
    return parser


def from_dict(values: dict[str, Any], source: str = "config") -> Config:
    """A Config from flat or nested values (a config.yaml's: `source` names it), validated (BadInput on a bad or
    unknown value)."""
    flat = check_types(_flatten_recipe(values, source), source)
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
