"""metrics.json, the daemon's metric values between it and their renderers, as a typed,
versioned state file (host/statefile.py).

The daemon writes `MetricsValues` after every pass (metrics_output.py, through
actuate/statefile.py); `gpuguard metrics [--serve]` and the textfile renderer read them
through `SPEC`, so a file that is missing, unsafe, malformed, of another format or out
of range is one line (a 503 on a scrape), never a traceback or an unanswered request.
Every family is one of FAMILIES (metrics_state.py) with its labels; a series' value is a
finite number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Union

from gpuguard.host.statefile import TIME_MAX, Obj, SchemaError, StateFile, number

STATE_FILE = "/run/gpuguard/metrics.json"
FORMAT = 1  # metrics.json's layout; a reader refuses another
STATE_MAX = 4 * 1024 * 1024  # a busy node's is a few KB
VALUE_MAX = 2.0**63  # a counter or gauge: finite, within what Prometheus keeps exactly enough
MAX_SERIES = 10_000


@dataclass(frozen=True)
class Series:
    labels: tuple[str, ...]
    value: float
    created: Union[float, None] = None  # a counter's creation time (Unix)


@dataclass(frozen=True)
class Histogram:
    labels: tuple[str, ...]
    bounds: tuple[float, ...]  # upper bounds, +Inf implied
    counts: tuple[float, ...]  # per bucket (not cumulative), the last above the highest bound
    sum: float
    created: Union[float, None] = None


AnySeries = Union[Series, Histogram]


@dataclass(frozen=True)
class MetricsValues:
    families: Mapping[str, tuple[AnySeries, ...]]  # by family name, series in order of use


def _labels(o: Obj) -> tuple[str, ...]:
    return o.texts("labels", max_items=8, max_len=1024)


def _series(v: Any, where: str) -> AnySeries:
    o = Obj(v, where)
    created = o.opt_real("created", lo=0.0, hi=TIME_MAX)
    if o.has("bounds"):
        bounds = o.items("bounds", lambda x, w: number(x, w, 0.0, VALUE_MAX), max_items=64)
        counts = o.items("counts", lambda x, w: number(x, w, 0.0, VALUE_MAX), max_items=65)
        if len(counts) != len(bounds) + 1 or list(bounds) != sorted(bounds):
            raise SchemaError(f"{where}: bounds and counts do not match")
        return Histogram(
            _labels(o), bounds, counts, o.real("sum", lo=-VALUE_MAX, hi=VALUE_MAX), created
        )
    return Series(_labels(o), o.real("value", lo=-VALUE_MAX, hi=VALUE_MAX), created)


def _parse(o: Obj) -> MetricsValues:
    return MetricsValues(
        o.mapping(
            "families",
            lambda v, w: tuple(_series(x, f"{w}[{i}]") for i, x in enumerate(_list(v, w))),
            max_items=256,
        )
    )


def _list(v: Any, where: str) -> list[Any]:
    if not isinstance(v, list):
        raise SchemaError(f"{where}: not a list of series")
    if len(v) > MAX_SERIES:
        raise SchemaError(f"{where}: {len(v)} series (at most {MAX_SERIES})")
    return v


def series_json(s: AnySeries) -> dict[str, Any]:
    created = {} if s.created is None else {"created": s.created}
    if isinstance(s, Histogram):
        return {
            "labels": list(s.labels),
            "bounds": list(s.bounds),
            "counts": list(s.counts),
            "sum": s.sum,
            **created,
        }
    return {"labels": list(s.labels), "value": s.value, **created}


def _render(m: MetricsValues) -> dict[str, Any]:
    return {"families": {k: [series_json(s) for s in v] for k, v in m.families.items()}}


SPEC: StateFile[MetricsValues] = StateFile(
    path=STATE_FILE,
    what="metrics state",
    version=FORMAT,
    parse=_parse,
    render=_render,
    max_bytes=STATE_MAX,
    mode=0o644,
    dir_mode=0o755,
    version_key="format",
    next_step="gpuguard.service rewrites it after its next pass; restart gpuguard.service "
    "and gpuguard-metrics.service after an upgrade",
)
