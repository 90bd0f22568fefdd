"""promtool unit-test input series from the recorded scrapes (tests/fixtures/metrics/):
a timeline per scrape target, each phase one recorded scrape held for some minutes,
optionally rewritten (a label or a value) where no recording has the state a test
needs. Used by test_monitoring_rules.py."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO

FIXTURES = REPO / "tests/fixtures/metrics"

Labels = Tuple[Tuple[str, str], ...]
Sample = Tuple[str, Labels, float]
#: (metric name, labels, value, minute within the phase) -> the sample, or None to drop it
Rewrite = Callable[[str, Labels, float, int], Optional[Tuple[Labels, float]]]


@functools.cache
def recorded(name: str) -> Tuple[Sample, ...]:
    out = []
    for family in text_string_to_metric_families((FIXTURES / f"{name}.prom").read_text()):
        for s in family.samples:
            out.append((s.name, tuple(sorted(s.labels.items())), float(s.value)))
    return tuple(out)


@dataclass(frozen=True)
class Phase:
    scrape: Optional[str]  # a recorded file's name; None: the endpoint did not answer
    minutes: int
    rewrite: Optional[Rewrite] = None
    passing: bool = True  # False: the daemon stopped, its last pass time stays


@dataclass(frozen=True)
class Target:
    node: str
    phases: Tuple[Phase, ...]

    def labels(self) -> Dict[str, str]:
        return {"job": "gpuguard", "instance": f"{self.node}:9835", "node": self.node}


def series(target: Target, interval: int) -> Dict[str, List[str]]:
    """promtool input series (`name{labels}` -> one value or `_` per sample)."""
    values: Dict[str, List[str]] = {}
    t, total, last_pass = 0, 0, 0
    for ph in target.phases:
        total += ph.minutes // interval

    def put(name: str, labels: Labels, i: int, v: str) -> None:
        merged = {**dict(labels), **target.labels()}
        body = ",".join(f'{k}="{merged[k]}"' for k in sorted(merged))
        values.setdefault(f"{name}{{{body}}}", ["_"] * total)[i] = v

    i = 0
    for ph in target.phases:
        for step in range(ph.minutes // interval):
            minute = step * interval
            put("up", (), i, "0" if ph.scrape is None else "1")
            if ph.passing:
                last_pass = t * 60
            for name, labels, value in recorded(ph.scrape) if ph.scrape else ():
                got = ph.rewrite(name, labels, value, minute) if ph.rewrite else (labels, value)
                if got is None:
                    continue
                if name == "gpuguard_last_pass_timestamp_seconds":
                    got = (got[0], float(last_pass))
                put(name, got[0], i, repr(got[1]))
            t += interval
            i += 1
    return values


def compact(values: Sequence[str]) -> str:
    """promtool's expanding notation for a list of samples: runs of `_` as `_xN`,
    arithmetic runs as `a+bxN` (a, then N more, each b larger)."""
    out: List[str] = []
    i = 0
    while i < len(values):
        j = i + 1
        if values[i] == "_":
            while j < len(values) and values[j] == "_":
                j += 1
            out.append(f"_x{j - i}" if j - i > 1 else "_")
        else:
            a = float(values[i])
            step = float(values[j]) - a if j < len(values) and values[j] != "_" else 0.0
            while j < len(values) and values[j] != "_" and float(values[j]) == a + step * (j - i):
                j += 1
            out.append(f"{values[i]}+{step!r}x{j - i - 1}" if j - i > 1 else values[i])
        i = j
    return " ".join(out)


def relabel(
    metric: str,
    key: str,
    old: str,
    new: str,
    value: Optional[Callable[[int], float]] = None,
    only: Tuple[str, str] = ("", ""),
) -> Rewrite:
    """`metric`'s series with label key=old (and the label `only`, when given) become
    key=new (the value from `value`, given the minute within the phase, when given)."""

    def rewrite(name: str, labels: Labels, v: float, minute: int) -> Optional[Tuple[Labels, float]]:
        if name == metric and (key, old) in labels and (only[0] == "" or only in labels):
            labels = tuple(sorted((k, new if k == key else x) for k, x in labels))
            return labels, v if value is None else value(minute)
        return labels, v

    return rewrite


def condition_true(condition: str) -> Rewrite:
    """healthy.prom with `condition`'s status true instead of false."""

    def rewrite(name: str, labels: Labels, v: float, minute: int) -> Optional[Tuple[Labels, float]]:
        d = dict(labels)
        if name == "gpuguard_node_condition_status" and d["condition"] == condition:
            return labels, float(d["status"] == "true")
        if name == "gpuguard_node_condition" and d["condition"] == condition:
            return labels, 1.0
        return labels, v

    return rewrite


@dataclass(frozen=True)
class Case:
    alert: str
    targets: Tuple[Target, ...]
    at: int  # minutes
    fires: Sequence[Dict[str, str]]  # each firing alert's labels beside the target's
    interval: int = 1
    extra: Dict[str, List[str]] = field(default_factory=dict)  # other exporters' series
    per_target: bool = True  # False: an aggregate over targets, without their labels


def one(*phases: Phase, node: str = "gpu-a") -> Tuple[Target, ...]:
    return (Target(node, phases),)


def P(scrape: Optional[str], minutes: int, **kw: object) -> Phase:
    return Phase(scrape, minutes, **kw)  # type: ignore[arg-type]


def cond(condition: str, status: str = "true") -> Dict[str, str]:
    return {"condition": condition, "status": status}
