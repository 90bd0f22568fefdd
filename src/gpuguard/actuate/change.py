"""A planned change as the actuators offer it: what makes it and what describes it,
the pair the engine's executor (engine/executor.py) runs one half of."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Change(Generic[T]):
    """One planned change: `make` makes it; `describe` says what it would make and
    changes nothing. `what` names its kind in the executor's counts."""

    what: str
    make: Callable[[], T]
    describe: Callable[[], T]


@dataclass(frozen=True)
class AsyncChange(Generic[T]):
    """A `Change` whose making awaits (a D-Bus call, a CRI stop); its description
    never does."""

    what: str
    make: Callable[[], Awaitable[T]]
    describe: Callable[[], T]


def unchanged() -> None:
    """The description of a change that says nothing itself (its caller does)."""
