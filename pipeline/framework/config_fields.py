"""How config sections declare and check their fields: the range checks every section's `__post_init__` calls
(a config that exists is valid; the loader turns the ValueError into one line naming the key), the one bound for
every sequence length, and `path_field`, the marker of fields that name a path or URI."""
from __future__ import annotations

from dataclasses import field
from typing import Any


def at_least(section: str, obj: Any, minimum: float, *names: str) -> None:
    """ValueError naming `section.name` for the first field below `minimum` (every count, size and rate has one)."""
    for name in names:
        value = getattr(obj, name)
        if value < minimum:
            raise ValueError(f"{_key(section, name)} must be >= {minimum}, got {value}")


def above(section: str, obj: Any, minimum: float, *names: str) -> None:
    """ValueError naming `section.name` for the first field not strictly above `minimum` (rates, epsilons)."""
    for name in names:
        value = getattr(obj, name)
        if not value > minimum:
            raise ValueError(f"{_key(section, name)} must be > {minimum}, got {value}")


def within(section: str, obj: Any, name: str, low: float, high: float, *, low_open: bool = False,
           high_open: bool = False) -> None:
    """ValueError naming `section.name` unless low <= value <= high (> low with low_open, < high with high_open)."""
    value = getattr(obj, name)
    if not ((low < value if low_open else low <= value) and (value < high if high_open else value <= high)):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{_key(section, name)} must be in {interval}, got {value}")


# One bound for every sequence length of the project (pairs, pretrain phases, fine-tuning, features): room for
# [CLS] A [SEP] B [SEP], and no more than BERT's 512-row position table.
MIN_SEQ_LENGTH = 8
MAX_SEQ_LENGTH = 512


def sequence_length(section: str, obj: Any, name: str = "max_seq_length") -> None:
    """ValueError naming `section.name` unless the length is in [MIN_SEQ_LENGTH, MAX_SEQ_LENGTH]."""
    within(section, obj, name, MIN_SEQ_LENGTH, MAX_SEQ_LENGTH)


def one_of(section: str, obj: Any, name: str, allowed: tuple[str, ...]) -> None:
    """ValueError naming `section.name` unless the value is one of `allowed`."""
    value = getattr(obj, name)
    if value not in allowed:
        raise ValueError(f"{_key(section, name)} must be one of {', '.join(allowed)}, got {value!r}")


def _key(section: str, name: str) -> str:
    return f"{section}.{name}" if section else name  # "" = a top-level field (seed)


def path_field(default: Any = "") -> Any:
    """A field naming a local path or URI (or a tuple of them). The config loader makes every such field absolute
    on the driver (`jobs.services.configtools.resolve_paths`): code on a Ray worker never sees a relative path."""
    return field(default=default, metadata={"path": True})
