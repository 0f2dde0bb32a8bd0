"""One way to check a flag's value: each function names the flag, the bound and the value given, in one line
(BadInput), and passes a value left unset (None). Every entry point's config checks its flags with these."""

from __future__ import annotations

from mlm_ddp.errors import BadInput

Number = int | float


def at_least(flag: str, value: Number | None, least: Number, unit: str = "") -> None:
    """`--steps must be at least 1, got 0` (`unit`: ' second', ' (the special tokens)', ...)."""
    if value is not None and value < least:
        raise BadInput(f"{flag} must be at least {least}{unit}, got {value}")


def not_negative(flag: str, value: Number | None, meaning: str = "", hint: str = "") -> None:
    """`--warmup must be >= 0, got -1` (`meaning`: ' (0: all)'; `hint`: '; the usual value is 1e-8')."""
    if value is not None and value < 0:
        raise BadInput(f"{flag} must be >= 0{meaning}, got {value}{hint}")


def positive(flag: str, value: Number | None) -> None:
    """`--learning_rate must be positive, got 0`."""
    if value is not None and value <= 0:
        raise BadInput(f"{flag} must be positive, got {value}")


def above(flag: str, value: Number | None, low: Number) -> None:
    """`--loss_spike_factor must be above 1, got 1`."""
    if value is not None and value <= low:
        raise BadInput(f"{flag} must be above {low}, got {value}")


def within(flag: str, value: Number | None, low: Number, high: Number, hint: str = "") -> None:
    """`--min_lr_ratio must be in [0, 1), got 1`: low included, high not."""
    if value is not None and not low <= value < high:
        raise BadInput(f"{flag} must be in [{low}, {high}), got {value}{hint}")
