"""The value types of gpuguard's configuration keys: parsing and formatting, systemd style.

Each type parses a value's text (raising ValueError with a hint the loader puts behind
`file:line:`) and formats a value back, so `gpuguard config` prints what a file would say.
Time spans follow systemd.time(7): `150ms`, `5min`, `2s 500ms`, a bare number is seconds.
"""

from __future__ import annotations

import math
import re
from typing import Any, Tuple

from gpuguard.host.numparse import clip, cut, parse_decimal


def closest(word: str, candidates: list[str]) -> list[str]:
    """The candidate a misspelt `word` most likely meant, if any: for error messages only,
    so difflib is loaded here and not by the daemon (0.3 MB of its RSS)."""
    import difflib

    return difflib.get_close_matches(word, candidates, n=1)


class ValueType:
    """How one key's text becomes a value and back.

    `parse` raises ValueError with "what is wrong; how to fix it" (no file:line; the
    loader adds that). `format(parse(text))` must parse back to the same value, which
    is what makes `Config.render()` round-trip.
    """

    describe: str = "string"
    # systemd: `Key=` resets a setting to its default. Types whose empty value means
    # something (optional values, lists) set this to False and parse "" themselves.
    empty_resets: bool = True

    def parse(self, text: str) -> Any:
        raise NotImplementedError

    def format(self, value: Any) -> str:
        return str(value)


class Bool(ValueType):
    describe = "boolean"
    _TRUE = ("yes", "true", "1", "on")
    _FALSE = ("no", "false", "0", "off")

    def parse(self, text: str) -> bool:
        low = text.lower()
        if low in self._TRUE:
            return True
        if low in self._FALSE:
            return False
        raise ValueError("not a boolean; use yes or no (also accepted: true/false, on/off, 1/0)")

    def format(self, value: Any) -> str:
        return "yes" if value else "no"


_USEC_PER = {
    "us": 1,
    "usec": 1,
    "\u00b5s": 1,  # micro sign
    "\u03bcs": 1,  # Greek mu, which some keyboards produce instead
    "ms": 1_000,
    "msec": 1_000,
    "s": 1_000_000,
    "sec": 1_000_000,
    "second": 1_000_000,
    "seconds": 1_000_000,
    "m": 60_000_000,
    "min": 60_000_000,
    "minute": 60_000_000,
    "minutes": 60_000_000,
    "h": 3_600_000_000,
    "hr": 3_600_000_000,
    "hour": 3_600_000_000,
    "hours": 3_600_000_000,
    "d": 86_400_000_000,
    "day": 86_400_000_000,
    "days": 86_400_000_000,
    "w": 604_800_000_000,
    "week": 604_800_000_000,
    "weeks": 604_800_000_000,
}
# Units used when formatting, largest first (weeks are left out: "14d" reads better).
_FORMAT_UNITS = (
    ("d", 86_400_000_000),
    ("h", 3_600_000_000),
    ("min", 60_000_000),
    ("s", 1_000_000),
    ("ms", 1_000),
    ("us", 1),
)
# ASCII digits only ([0-9], never \d); a number is at most _MAX_NUMBER characters, so
# nothing reaches Python's int conversion limit, and MAX_TIMESPAN_USEC bounds the sum.
_TIME_PART = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([^\s0-9.]*)")
_MAX_NUMBER = 30
_SCALE: int = 10**_MAX_NUMBER  # the sum's unit: 10**-_MAX_NUMBER microsecond
MAX_TIMESPAN_USEC = 365 * 86_400_000_000  # one year: no interval or delay needs more
_TIME_HINT = "use a number with a unit such as 150ms, 5min, 1h or 2s 500ms"


def parse_timespan(text: str) -> float:
    """Parse a systemd.time(7) span ("5min", "2s 500ms", "1.5h", bare "300" = seconds).

    Sums exactly, in units of 10**-_MAX_NUMBER microsecond (every part has at most
    _MAX_NUMBER digits), and converts to float seconds once, so that format_timespan()
    and parse_timespan() are exact inverses at microsecond resolution. Integers, not
    `fractions.Fraction`: that module and `decimal` cost the daemon about 0.5 MB.
    """
    text = text.strip()
    if not text:
        raise ValueError(f"empty time span; {_TIME_HINT}")
    total: int = 0  # in 10**-_MAX_NUMBER microsecond
    pos = 0
    while pos < len(text):
        m = _TIME_PART.match(text, pos)
        if m is None:
            raise ValueError(f"not a time span; {_TIME_HINT}")
        number, unit = m.group(1), m.group(2)
        if len(number) > _MAX_NUMBER:
            raise ValueError(f"number {clip(number)} is too long; {_TIME_HINT}")
        if not unit:
            # systemd reads a bare number as seconds, but only as the whole value:
            # "2 500ms" is more likely a typo than 2.5 s.
            if pos != 0 or m.end() != len(text):
                raise ValueError(f"{clip(number)} has no unit; {_TIME_HINT}")
            unit = "s"
        if unit not in _USEC_PER:
            close = closest(unit, list(_USEC_PER))
            hint = f"did you mean {cut(number)}{close[0]}?" if close else _TIME_HINT
            raise ValueError(f"unknown time unit {clip(unit)}; {hint}")
        whole, _, frac = number.partition(".")
        shift: int = 10 ** (_MAX_NUMBER - len(frac))  # frac has at most _MAX_NUMBER digits
        total += int(whole + frac or "0") * _USEC_PER[unit] * shift
        if total > MAX_TIMESPAN_USEC * _SCALE:
            raise ValueError("longer than a year; use a span of 365d or less")
        pos = m.end()
    usec, rest = divmod(total, _SCALE)
    if 2 * rest > _SCALE or (2 * rest == _SCALE and usec % 2):  # half to even, as round()
        usec += 1
    return usec / 1_000_000


def format_timespan(seconds: float) -> str:
    """Format seconds the way systemd does ("5min", "2s 500ms"); "0" for zero."""
    scaled = seconds * 1_000_000
    if not math.isfinite(scaled):  # parse_timespan() never returns one; defensive
        return "infinity"
    usec = round(scaled)
    if usec == 0:
        return "0"
    parts = []
    for name, size in _FORMAT_UNITS:
        count, usec = divmod(usec, size)
        if count:
            parts.append(f"{count}{name}")
    return " ".join(parts)


class TimeSpan(ValueType):
    """A time span in seconds (float); `optional`: empty means None (not set)."""

    def __init__(self, minimum: float = 0.0, *, optional: bool = False) -> None:
        self.minimum = minimum
        self.optional = optional
        self.empty_resets = not optional
        low = f" >= {format_timespan(minimum)}" if minimum else ""
        self.describe = f"time span{low}" + (", or empty for none" if optional else "")

    def parse(self, text: str) -> float | None:
        if self.optional and not text:
            return None
        value = parse_timespan(text)
        if value < self.minimum:
            raise ValueError(f"must be at least {format_timespan(self.minimum)}")
        return value

    def format(self, value: Any) -> str:
        return "" if value is None else format_timespan(value)


class Int(ValueType):
    def __init__(self, minimum: int, maximum: int) -> None:
        self.minimum = minimum
        self.maximum = maximum
        self.describe = f"integer {minimum}..{maximum}"

    def parse(self, text: str) -> int:
        # int() would also take "1_000", " 12 " and Unicode digits; accept only what we
        # would print.
        if not re.fullmatch(r"[+-]?[0-9]+", text):
            raise ValueError(f"not an integer; use a whole number {self.minimum}..{self.maximum}")
        value = parse_decimal(text, lo=self.minimum, hi=self.maximum, signed=True)
        if value is None:
            raise ValueError(f"out of range; use a number {self.minimum}..{self.maximum}")
        return value


class Choice(ValueType):
    def __init__(self, *choices: str) -> None:
        self.choices = choices
        self.describe = "one of " + ", ".join(choices)

    def parse(self, text: str) -> str:
        if text in self.choices:
            return text
        close = closest(text.lower(), list(self.choices))
        hint = f"did you mean {close[0]!r}?" if close else f"use one of {', '.join(self.choices)}"
        raise ValueError(f"not one of {', '.join(self.choices)}; {hint}")


class AbsPath(ValueType):
    """An absolute host path, kept as text (callers map it through Root.path())."""

    def __init__(self, *, optional: bool = False) -> None:
        self.optional = optional
        self.empty_resets = not optional
        self.describe = "absolute path" + (", or empty for none" if optional else "")

    def parse(self, text: str) -> str | None:
        if self.optional and not text:
            return None
        if not text.startswith("/"):
            raise ValueError("not an absolute path; write the full path starting with /")
        return text

    def format(self, value: Any) -> str:
        return "" if value is None else str(value)


_UNIT_NAME = re.compile(r"[A-Za-z0-9:_.\\@-]+\.service")


class ServiceUnit(ValueType):
    """A service unit's name; `optional`: empty means None (chosen at run time)."""

    def __init__(self, *, optional: bool = False) -> None:
        self.optional = optional
        self.empty_resets = not optional
        self.describe = "systemd service unit name" + (", or empty" if optional else "")

    def parse(self, text: str) -> str | None:
        if self.optional and not text:
            return None
        if _UNIT_NAME.fullmatch(text):
            return text
        if re.fullmatch(r"[A-Za-z0-9:_.\\@-]+", text) and "." not in text:
            raise ValueError(f"not a service unit name; did you mean '{cut(text)}.service'?")
        raise ValueError(
            "not a service unit name; write it as systemctl shows it, e.g. kubelet.service"
        )

    def format(self, value: Any) -> str:
        return "" if value is None else str(value)


_RESOURCE = re.compile(r"[A-Za-z0-9*?\[\]][A-Za-z0-9._*?\[\]-]*/[A-Za-z0-9._*?\[\]-]+")


class ResourcePattern(ValueType):
    describe = "extended resource name or glob"

    def parse(self, text: str) -> str:
        if _RESOURCE.fullmatch(text):
            return text
        raise ValueError(
            f"{clip(text)} is not an extended resource name or glob; "
            "write it like nvidia.com/gpu or nvidia.com/mig-*"
        )


class CriEndpoint(ValueType):
    describe = "CRI endpoint URL"

    def parse(self, text: str) -> str:
        if re.fullmatch(r"(unix|tcp|npipe)://\S+", text):
            return text
        raise ValueError("not a CRI endpoint; write it like unix:///run/containerd/containerd.sock")


_DNS_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*")


class NodeName(ValueType):
    """A Kubernetes Node's name (a DNS subdomain: lowercase); empty means None."""

    empty_resets = False
    describe = "Kubernetes node name, or empty"

    def parse(self, text: str) -> str | None:
        if not text:
            return None
        if len(text) <= 253 and _DNS_NAME.fullmatch(text):
            return text
        raise ValueError(
            f"{clip(text)} is not a Kubernetes node name; write it as `kubectl get nodes` "
            "shows it (lowercase letters, digits, '-' and '.')"
        )

    def format(self, value: Any) -> str:
        return "" if value is None else str(value)


class SpaceList(ValueType):
    """Space-separated items; empty means an empty list (systemd: `Key=` clears a list)."""

    empty_resets = False

    def __init__(self, item: ValueType) -> None:
        self.item = item
        self.describe = f"space-separated list of {item.describe}s"

    def parse(self, text: str) -> Tuple[Any, ...]:
        return tuple(self.item.parse(word) for word in text.split())

    def format(self, value: Any) -> str:
        return " ".join(self.item.format(v) for v in value)


# ------------------------------------------------------------------------ the key table
