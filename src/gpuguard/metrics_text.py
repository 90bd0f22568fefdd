"""Counters, gauges and a histogram in Prometheus's text format (0.0.4), without a client
library.

Why not prometheus_client: importing it loads its HTTP servers, urllib, wsgiref, email
and ssl (libssl), about 3.9 MB of the daemon's resident memory at idle (bench/README.md),
for the one function the daemon calls, the text rendering. What the daemon needs of the
format is small: the names, types, label escaping and number spelling below are
prometheus_client's (its `floatToGoString`), and tests/unit/test_metrics_text.py checks
the output against prometheus_client's own exposition and parser, the integration test
against promtool and a real Prometheus. What it leaves out: the `_created` series.
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator, Sequence

Labels = tuple[str, ...]


def go_float(value: float) -> str:
    """A sample value as Prometheus (Go) spells it: 3.0, 1e+20, 1.7e+09, +Inf."""
    d = float(value)
    if d == math.inf:
        return "+Inf"
    if d == -math.inf:
        return "-Inf"
    if math.isnan(d):
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:  # Go switches to exponents sooner than Python
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return s


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _sample(name: str, names: Sequence[str], values: Labels, value: float) -> str:
    if not names:
        return f"{name} {go_float(value)}\n"
    labels = ",".join(f'{n}="{_escape_label(v)}"' for n, v in zip(names, values))
    return f"{name}{{{labels}}} {go_float(value)}\n"


class Registry:
    """The metric families, rendered in the order they were made."""

    def __init__(self) -> None:
        self.families: list[_Family] = []

    def render(self) -> bytes:
        return "".join(line for f in self.families for line in f.lines()).encode()


class _Family:
    kind = ""

    def __init__(
        self, name: str, doc: str, labelnames: Iterable[str] = (), *, registry: Registry
    ) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = tuple(labelnames)
        self.values: dict[Labels, float] = {} if self.labelnames else {(): 0.0}
        registry.families.append(self)

    @property
    def exposed_name(self) -> str:
        return self.name

    def _key(self, values: Sequence[str]) -> Labels:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: labels {self.labelnames}, got {tuple(values)}")
        key = tuple(str(v) for v in values)
        self.values.setdefault(key, 0.0)
        return key

    def lines(self) -> Iterator[str]:
        yield f"# HELP {self.exposed_name} {_escape_help(self.doc)}\n"
        yield f"# TYPE {self.exposed_name} {self.kind}\n"
        for key, value in self.values.items():
            yield _sample(self.exposed_name, self.labelnames, key, value)


class _Child:
    def __init__(self, family: _Family, key: Labels) -> None:
        self.family = family
        self.key = key

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0 and isinstance(self.family, Counter):
            raise ValueError(f"{self.family.name}: a counter only goes up")
        self.family.values[self.key] += amount

    def set(self, value: float) -> None:
        self.family.values[self.key] = float(value)


class Counter(_Family):
    kind = "counter"

    @property
    def exposed_name(self) -> str:
        return self.name + "_total"

    def labels(self, *values: str) -> _Child:
        return _Child(self, self._key(values))

    def inc(self, amount: float = 1.0) -> None:
        _Child(self, self._key(())).inc(amount)


class Gauge(_Family):
    kind = "gauge"

    def labels(self, *values: str) -> _Child:
        return _Child(self, self._key(values))

    def set(self, value: float) -> None:
        _Child(self, self._key(())).set(value)

    def clear(self) -> None:
        """Drop every labelled series (a label set that no longer applies disappears)."""
        if self.labelnames:
            self.values.clear()


class Histogram(_Family):
    """Unlabelled, with fixed upper bounds (+Inf added)."""

    kind = "histogram"

    def __init__(self, name: str, doc: str, *, buckets: Sequence[float], registry: Registry):
        super().__init__(name, doc, registry=registry)
        self.bounds = (*(float(b) for b in buckets if b != math.inf), math.inf)
        self.counts = [0] * len(self.bounds)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.total += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break

    def lines(self) -> Iterator[str]:
        yield f"# HELP {self.name} {_escape_help(self.doc)}\n"
        yield f"# TYPE {self.name} histogram\n"
        cumulative = 0
        for bound, n in zip(self.bounds, self.counts):
            cumulative += n
            yield _sample(f"{self.name}_bucket", ("le",), (go_float(bound),), cumulative)
        yield _sample(f"{self.name}_count", (), (), cumulative)
        yield _sample(f"{self.name}_sum", (), (), self.total)
