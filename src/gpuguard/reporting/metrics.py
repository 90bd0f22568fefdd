"""The daemon's metrics (metrics.json, metrics_state.py) in Prometheus's text format,
rendered with the standard client library.

A custom collector yields prometheus_client's Counter/Gauge/HistogramMetricFamily from
the JSON into a registry of its own (no process/platform defaults: node_exporter
already has them, and a textfile must not repeat them), and generate_latest() writes
the text. Imported where the metrics are read (`gpuguard metrics [--serve]`), and by
the daemon only when `[Metrics] TextfileDirectory=` asks it for the text file
(metrics_state.py says why). Without python3-prometheus-client, importing this module
raises ImportError and the callers say so (metrics_state.MISSING_LIBRARY).
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from gpuguard.errors import BadInputError
from gpuguard.host import safeio
from gpuguard.reporting.metrics_state import COUNTER, FAMILIES, FORMAT, GAUGE, STATE_MAX, Family

go_float: Callable[[float], str] = floatToGoString  # how a Histogram spells its bounds


class MetricsFileError(BadInputError):
    """metrics.json is missing, unreadable or not what the daemon writes."""


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} is not a number")
    return float(value)


def _labels(series: Mapping[str, Any], family: Family) -> list[str]:
    labels = series.get("labels")
    if (
        not isinstance(labels, list)
        or len(labels) != len(family.labels)
        or not all(isinstance(v, str) for v in labels)
    ):
        raise ValueError(f"{family.name}: labels are not {len(family.labels)} strings")
    return labels


def _family(family: Family, series: Sequence[Mapping[str, Any]]) -> Metric:
    if family.kind == COUNTER:
        c = CounterMetricFamily(family.name, family.help, labels=family.labels)
        for s in series:
            created = s.get("created")
            c.add_metric(
                _labels(s, family),
                _number(s.get("value"), f"{family.name} value"),
                created=None if created is None else _number(created, f"{family.name} created"),
            )
        return c
    if family.kind == GAUGE:
        g = GaugeMetricFamily(family.name, family.help, labels=family.labels)
        for s in series:
            g.add_metric(_labels(s, family), _number(s.get("value"), f"{family.name} value"))
        return g
    h = HistogramMetricFamily(family.name, family.help, labels=family.labels)
    for s in series:
        labels = _labels(s, family)
        bounds = [_number(b, f"{family.name} bound") for b in s.get("bounds") or ()]
        counts = [_number(n, f"{family.name} count") for n in s.get("counts") or ()]
        if len(counts) != len(bounds) + 1 or bounds != sorted(bounds):
            raise ValueError(f"{family.name}: bounds and counts do not match")
        cumulative, buckets = 0.0, []
        for bound, n in zip([*bounds, float("inf")], counts):
            cumulative += n
            buckets.append((go_float(bound), cumulative))
        h.add_metric(labels, buckets, _number(s.get("sum"), f"{family.name} sum"))
        if s.get("created") is not None:  # the family has no argument for it
            created = _number(s["created"], f"{family.name} created")
            h.add_sample(family.name + "_created", dict(zip(family.labels, labels)), created)
    return h


def families(doc: Any) -> list[Metric]:
    """Every family in FAMILIES' order, with the values in `doc` (ValueError if it is
    not what metrics_state writes)."""
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    if doc.get("format") != FORMAT:
        raise ValueError(
            f"format {doc.get('format')!r}, this gpuguard reads format {FORMAT} (restart "
            "gpuguard.service and gpuguard-metrics.service after an upgrade)"
        )
    values = doc.get("families")
    if not isinstance(values, dict):
        raise ValueError("no families")
    out = []
    for f in FAMILIES:
        series = values.get(f.name, [])
        if not isinstance(series, list) or not all(isinstance(s, dict) for s in series):
            raise ValueError(f"{f.name}: not a list of series")
        out.append(_family(f, series))
    return out


class StateCollector:
    """A prometheus_client collector for one metrics.json document (families built once,
    so a bad document fails before registration). Not the library's Collector base
    class: Ubuntu 22.04's prometheus_client 0.9 has none, and register() needs only
    collect()."""

    def __init__(self, doc: Any) -> None:
        self.metrics = families(doc)

    def collect(self) -> Iterator[Metric]:
        yield from self.metrics


def render(doc: Mapping[str, Any]) -> bytes:
    """The text exposition (format 0.0.4) of a metrics.json document."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(doc))  # type: ignore[arg-type]
    return generate_latest(registry)


def render_file(path: Path, disabled: bool = False) -> bytes:
    """render() of the file the daemon wrote, with gpuguard_disabled as the off switch is
    now; MetricsFileError, one line, otherwise. With the switch set and no file (the
    daemon does not run), the families without values: gpuguard_disabled 1 still says
    why."""
    try:
        data, _st = safeio.read_bytes(
            path,
            what="metrics state",
            max_bytes=STATE_MAX,
            missing="does not exist — is gpuguard.service running?",
            next_step="gpuguard.service writes it after every pass; restart it",
        )
    except safeio.UnsafeFileError as e:
        if not disabled or e.errno != errno.ENOENT:
            raise
        data = json.dumps({"format": FORMAT, "families": {}}).encode()
    try:
        doc = json.loads(data)
        if isinstance(doc, dict) and isinstance(doc.get("families"), dict):
            doc["families"]["gpuguard_disabled"] = [{"labels": [], "value": float(disabled)}]
        return render(doc)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError included
        raise MetricsFileError(
            f"{path}: not gpuguard's metrics ({e}) — gpuguard.service rewrites it after its "
            "next pass; restart it if this stays"
        ) from None
