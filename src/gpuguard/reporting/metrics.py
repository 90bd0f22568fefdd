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

from pathlib import Path
from typing import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from gpuguard.errors import BadInputError
from gpuguard.host.echo import cut
from gpuguard.host.statefile import load
from gpuguard.reporting.metrics_file import SPEC, AnySeries, Histogram, MetricsValues, Series
from gpuguard.reporting.metrics_state import COUNTER, FAMILIES, GAUGE, HISTOGRAM, Family
from gpuguard.reporting.npd import CONDITIONS

go_float: Callable[[float], str] = floatToGoString  # how a Histogram spells its bounds


class MetricsFileError(BadInputError):
    """metrics.json is missing, unreadable or not what the daemon writes."""


def _family(family: Family, series: Sequence[AnySeries]) -> Metric:
    if family.kind == COUNTER:
        c = CounterMetricFamily(family.name, family.help, labels=family.labels)
        for s in series:
            if isinstance(s, Series):
                c.add_metric(list(s.labels), s.value, created=s.created)
        return c
    if family.kind == GAUGE:
        g = GaugeMetricFamily(family.name, family.help, labels=family.labels)
        for s in series:
            if isinstance(s, Series):
                g.add_metric(list(s.labels), s.value)
        return g
    h = HistogramMetricFamily(family.name, family.help, labels=family.labels)
    for s in series:
        if not isinstance(s, Histogram):
            continue
        cumulative, buckets = 0.0, []
        for bound, n in zip([*s.bounds, float("inf")], s.counts):
            cumulative += n
            buckets.append((go_float(bound), cumulative))
        h.add_metric(list(s.labels), buckets, s.sum)
        if s.created is not None:  # the family has no argument for it
            h.add_sample(family.name + "_created", dict(zip(family.labels, s.labels)), s.created)
    return h


def families(values: MetricsValues) -> list[Metric]:
    """Every family in FAMILIES' order, with its values (ValueError when a series does
    not fit its family: a label count that differs, a histogram where a gauge was)."""
    out = []
    for f in FAMILIES:
        series = values.families.get(f.name, ())
        for s in series:
            if len(s.labels) != len(f.labels):
                raise ValueError(f"{f.name}: labels are not {len(f.labels)} strings")
            if isinstance(s, Histogram) != (f.kind == HISTOGRAM):
                raise ValueError(f"{f.name}: not a {f.kind}'s series")
        out.append(_family(f, series))
    return out


class StateCollector:
    """A prometheus_client collector for one metrics.json document (families built once,
    so a bad document fails before registration). Not the library's Collector base
    class: Ubuntu 22.04's prometheus_client 0.9 has none, and register() needs only
    collect()."""

    def __init__(self, values: MetricsValues) -> None:
        self.metrics = families(values)

    def collect(self) -> Iterator[Metric]:
        yield from self.metrics


def render(values: MetricsValues) -> bytes:
    """The text exposition (format 0.0.4) of a metrics.json document."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(values))  # type: ignore[arg-type]
    return generate_latest(registry)


def with_switch(values: MetricsValues, disabled: bool) -> MetricsValues:
    """`values` with gpuguard_disabled as the off switch is now; while it is set every
    node condition is unknown (nothing is checked: as `gpuguard npd` says), whatever the
    daemon's last pass found."""
    families = {**values.families, "gpuguard_disabled": (Series((), float(disabled)),)}
    if disabled:
        families["gpuguard_node_condition"] = ()
        families["gpuguard_node_condition_status"] = tuple(
            Series((c.type, label), float(label == "unknown"))
            for c in CONDITIONS
            for label in ("true", "false", "unknown")
        )
    return MetricsValues(families)


def render_file(path: Path, disabled: bool = False) -> bytes:
    """render() of the file the daemon wrote (metrics_file.SPEC's loader), with
    gpuguard_disabled as the off switch is now; MetricsFileError, one line, otherwise.
    With the switch set and no file (the daemon does not run), the families without
    values: gpuguard_disabled 1 still says why."""
    got = load(path, SPEC)
    if got.value is not None:
        values = got.value
    elif got.absent and disabled:
        values = MetricsValues({})
    else:
        why = f"{path}: does not exist — is gpuguard.service running?" if got.absent else got.why
        raise MetricsFileError(why)
    try:
        return render(with_switch(values, disabled))
    except ValueError as e:
        raise MetricsFileError(
            cut(f"{path}: not gpuguard's metrics ({e}); {SPEC.next_step}", 400)
        ) from None
