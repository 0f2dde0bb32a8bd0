"""argparse's names that are not its public API, which mlm_ddp reaches (see mlm_ddp/compat/__init__.py)."""

from __future__ import annotations

import argparse
import re
from typing import NoReturn

from mlm_ddp.compat import Reach

# a negative number as a flag's value, in scientific notation too: -1, -0.5, -.5, -5., -1e-3, -.5E+1
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def accept_negative_numbers(parser: argparse.ArgumentParser) -> None:
    """Make `parser` read every negative number after a flag as a value, -1e-3 and -.5E+1 included, for a
    parser none of whose flags looks like a number. argparse's own test for a negative number knows no
    exponent (on Python 3.11 to 3.13.0 at least), so `--learning_rate -1e-3` said "expected one argument";
    the test is the parser's `_negative_number_matcher`, with no public setting."""
    parser._negative_number_matcher = NEGATIVE_NUMBER


class _Refusing(argparse.ArgumentParser):
    """A parser that raises on a bad command line instead of printing it and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def _reads_negative_numbers() -> bool:
    parser = _Refusing(prog="check", add_help=False, allow_abbrev=False)
    parser.add_argument("--rate", type=float)
    parser.add_argument("--weights", type=float, nargs="+")
    accept_negative_numbers(parser)
    try:
        read = parser.parse_args(["--rate", "-1e-3", "--weights", "1", "-.5E+1", "-5."])
    except (ValueError, argparse.ArgumentError):
        return False
    return read.rate == -1e-3 and read.weights == [1.0, -5.0, -5.0]


REACHES: list[Reach] = [
    Reach("argparse", "argparse.ArgumentParser._negative_number_matcher", _reads_negative_numbers,
          "a negative number in scientific notation (--learning_rate -1e-3) read as a flag's value"),
]
