"""metrics_text.py renders what prometheus_client renders, byte for byte, less the
`_created` series: the same operations on both give the same text, which
prometheus_client's own parser reads back."""

from __future__ import annotations

import math
from typing import Any

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuguard import metrics_text
from gpuguard.metrics import PASS_BUCKETS, Metrics
from unit.test_metrics import a_pass


def _same_ops(lib: Any, registry: Any) -> None:
    c = lib.Counter("t_passes", 'Passes \\ run,\n"quoted".', registry=registry)
    c.inc()
    c.inc(2)
    h = lib.Histogram("t_seconds", "Durations.", buckets=PASS_BUCKETS, registry=registry)
    for v in (0.004, 0.005, 0.04, 7.0, 100.0):
        h.observe(v)
    g = lib.Gauge("t_gauge", "Labelled.", ["kind", "step"], registry=registry)
    g.labels('a"b\\c\nd', "x").set(1e20)
    g.labels("big", "y").set(1_700_000_000.123456)
    g.labels("small", "y").set(-0.25)
    g.labels("inf", "y").set(math.inf)
    lib.Gauge("t_empty", "No series yet.", ["layer"], registry=registry)
    lib.Gauge("t_plain", "Unlabelled, never set.", registry=registry)
    lc = lib.Counter("t_actions", "By outcome.", ["kind", "outcome"], registry=registry)
    lc.labels("cgroup-v1-allow", "done").inc()
    lc.labels("cgroup-v1-allow", "done").inc()
    lc.labels("restart-plugin", "declined").inc()
    cleared = lib.Gauge("t_cleared", "Cleared.", ["condition"], registry=registry)
    cleared.labels("gone").set(1)
    cleared.clear()
    cleared.labels("back").set(0)


def _without_created(text: str) -> str:
    def name(line: str) -> str:  # "# HELP name ...", "# TYPE name ...", "name{...} value"
        parts = line.split()
        return (parts[2] if line.startswith("#") else parts[0]).split("{")[0]

    return "".join(line + "\n" for line in text.splitlines() if not name(line).endswith("_created"))


def test_the_text_is_prometheus_clients_less_the_created_series() -> None:
    ours = metrics_text.Registry()
    _same_ops(metrics_text, ours)
    theirs = prometheus_client.CollectorRegistry(auto_describe=True)
    _same_ops(prometheus_client, theirs)
    want = _without_created(prometheus_client.generate_latest(theirs).decode())
    got = ours.render().decode()
    assert "_created" not in got
    assert got == want
    names = {f.name for f in text_string_to_metric_families(got)}
    assert names == {"t_passes", "t_seconds", "t_gauge", "t_empty", "t_plain", "t_actions"} | {
        "t_cleared"
    }


def test_the_daemons_metrics_parse_and_count_as_before() -> None:
    m = Metrics()
    m.observe_pass(*a_pass())
    text = m.exposition().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["gpuguard_passes"].type == "counter"
    assert fams["gpuguard_pass_duration_seconds"].type == "histogram"
    assert [s.value for s in fams["gpuguard_passes"].samples] == [1.0]


@pytest.mark.parametrize(
    ("value", "spelled"),
    [
        (3, "3.0"),
        (0.04, "0.04"),
        (1e20, "1e+20"),
        (1_700_000_000.5, "1.7000000005e+09"),
        (-2.5, "-2.5"),
        (math.inf, "+Inf"),
        (-math.inf, "-Inf"),
        (math.nan, "NaN"),
    ],
)
def test_numbers_are_spelled_as_go_does(value: float, spelled: str) -> None:
    assert metrics_text.go_float(value) == spelled
    from prometheus_client.utils import floatToGoString

    assert floatToGoString(value) == spelled


def test_wrong_label_counts_and_falling_counters_are_bugs() -> None:
    r = metrics_text.Registry()
    c = metrics_text.Counter("t", "T.", ["a"], registry=r)
    with pytest.raises(ValueError, match="labels"):
        c.labels("x", "y")
    with pytest.raises(ValueError, match="only goes up"):
        c.labels("x").inc(-1)
