"""The rendered metrics are what prometheus_client's own Counter/Gauge/Histogram gave
before the daemon kept its values without the library: byte for byte, `_created` series
included, for the same passes. `Reference` below is gpuguard's former Metrics class,
unchanged but for its name; it is the oracle, not code the project runs."""

from __future__ import annotations

import json
import platform
import re
import time
from collections import Counter as Tally
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuguard import __commit__, package_version
from gpuguard.host.statefile import SchemaError
from gpuguard.reporting.metrics import render
from gpuguard.reporting.metrics_file import SPEC, Histogram, MetricsValues, Series
from gpuguard.reporting.metrics_state import (
    DENIED_KINDS,
    PASS_BUCKETS,
    RELOAD_BUCKETS,
    REPAIR_HISTOGRAM,
    RESET_HISTOGRAM,
    MetricsState,
)
from gpuguard.reporting.npd import CONDITIONS, DEFAULT_MAX_AGE, OK, PROBLEM, UNKNOWN, evaluate
from gpuguard.reporting.status import PassRecord, Status
from gpuguard.steps.registry import CONTAINER_ACCESS, GPU_COUNT, READMIT
from unit.test_metrics import DENIED, a_pass, a_pass_doc, outcome, typed

T0 = 1_700_000_000.25


class Reference:
    """Every gpuguard metric, in a registry of its own (no process/platform defaults:
    node_exporter already has them, and a textfile must not repeat them)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry(auto_describe=True)
        self.passes = Counter("gpuguard_passes", "Reconciliation passes run.", registry=r)
        self.pass_duration = Histogram(
            "gpuguard_pass_duration_seconds",
            "Duration of a reconciliation pass.",
            buckets=PASS_BUCKETS,
            registry=r,
        )
        self.reload_repair = Histogram(
            "gpuguard_reload_repair_seconds",
            "From systemd's end of a daemon-reload or reexec to the last device re-granted "
            "on it, for the reloads that left GPU containers without a device they were given.",
            buckets=RELOAD_BUCKETS,
            registry=r,
        )
        self.reset_repair = Histogram(
            "gpuguard_runtime_reset_repair_seconds",
            "From seeing a GPU container's device access reset at runtime (its scope's "
            "DeviceAllow= set over the bus without the GPU, or its cgroup v1 devices.list "
            "rewritten behind systemd's back) to the grant in place again.",
            buckets=RELOAD_BUCKETS,
            registry=r,
        )
        self.last_pass = Gauge(
            "gpuguard_last_pass_timestamp_seconds",
            "When the last pass ended (Unix time).",
            registry=r,
        )
        self.findings = Counter(
            "gpuguard_findings",
            "Findings reported by passes, by kind and step (a state that persists is "
            "counted again at each pass that sees it).",
            ["kind", "step"],
            registry=r,
        )
        self.open_findings = Gauge(
            "gpuguard_open_findings",
            "Findings in each step's latest result, by kind and step.",
            ["kind", "step"],
            registry=r,
        )
        self.actions = Counter(
            "gpuguard_actions",
            "Changes gpuguard planned, by kind and outcome (done, skipped, dry-run, "
            "declined, failed).",
            ["kind", "outcome"],
            registry=r,
        )
        self.plugin_restarts = Counter(
            "gpuguard_plugin_restarts",
            "Device plugin restarts by outcome (done, failed, declined, dry-run).",
            ["outcome"],
            registry=r,
        )
        self.gpu_containers = Gauge(
            "gpuguard_gpu_containers",
            "GPU containers seen by the last container access check.",
            registry=r,
        )
        self.gpu_containers_denied = Gauge(
            "gpuguard_gpu_containers_without_access",
            "GPU containers the last container access check found denied a device "
            "they were given (before its repair).",
            registry=r,
        )
        self.gpus = Gauge(
            "gpuguard_gpus",
            "GPUs counted at each layer (pci, nvml, kubelet) by the last GPU count check.",
            ["layer"],
            registry=r,
        )
        self.readmit_rejected = Gauge(
            "gpuguard_readmit_rejected_pods",
            "GPU pods kubelet rejected at its start (UnexpectedAdmissionError) that have not "
            "run since, as the re-admission bridge read them from kubelet's journal.",
            registry=r,
        )
        self.readmit_margin = Gauge(
            "gpuguard_readmit_margin_seconds",
            "At kubelet's latest start: seconds from the re-admission bridge's devices "
            "healthy to kubelet's first pod admission, by resource (negative: kubelet judged "
            "its pods first); absent when not known.",
            ["resource"],
            registry=r,
        )
        self.condition = Gauge(
            "gpuguard_node_condition",
            "1 while a node condition's problem is present, 0 while it is not; absent "
            "while unknown (the same answer as `gpuguard npd`).",
            ["condition"],
            registry=r,
        )
        self.condition_status = Gauge(
            "gpuguard_node_condition_status",
            "Each node condition's state, as kube-state-metrics shows a node's: 1 for the "
            "status it has (true: the problem is present, false: it is not, unknown: it "
            "could not be judged), 0 for the others (the same answer as `gpuguard npd`).",
            ["condition", "status"],
            registry=r,
        )
        # added after the library was dropped: the same Gauges it would have had
        self.disabled = Gauge(
            "gpuguard_disabled",
            "1 while the off switch /etc/gpuguard/disabled is set (`gpuguard disable`: "
            "gpuguard changes nothing), else 0.",
            registry=r,
        )
        self.mode = Gauge(
            "gpuguard_mode",
            "1 for the mode the daemon runs in: repair, or observe (Mode=observe: it reports "
            "and changes nothing).",
            ["mode"],
            registry=r,
        )
        build = Gauge(
            "gpuguard_build_info",
            "gpuguard's version (as dpkg and rpm show it), the commit it was built from and the "
            "Python running it (always 1).",
            ["version", "commit", "python"],
            registry=r,
        )
        build.labels(package_version(), __commit__ or "unknown", platform.python_version()).set(1)

    def observe_pass(self, last_pass: PassRecord, status: Status) -> None:
        """Count one pass and refresh the gauges from each step's latest result."""
        self.passes.inc()
        self.pass_duration.observe(last_pass.duration_ms / 1000.0)
        self.last_pass.set(last_pass.ended)
        for f in last_pass.findings:
            self.findings.labels(f.kind, f.reconciler).inc()
        for o in last_pass.outcomes:
            self.actions.labels(o.kind, o.status).inc()
            if o.kind == "restart-plugin":
                self.plugin_restarts.labels(o.status).inc()
        steps = status.steps
        self.open_findings.clear()
        for name, st in steps.items():
            for (kind, step), n in Tally((f.kind, name) for f in st.findings).items():
                self.open_findings.labels(kind, step).set(n)
        access = steps.get(CONTAINER_ACCESS)
        if access is not None and access.pass_number == last_pass.number:
            if "gpu_containers" in access.gauges:
                self.gpu_containers.set(access.gauges["gpu_containers"])
            denied = {
                f.fields.get("CONTAINER_ID") for f in access.findings if f.kind in DENIED_KINDS
            }
            self.gpu_containers_denied.set(len(denied))
        counts = steps[GPU_COUNT].gauges if GPU_COUNT in steps else {}
        for layer in ("pci", "nvml", "kubelet"):
            if f"gpus_{layer}" in counts:
                self.gpus.labels(layer).set(counts[f"gpus_{layer}"])
        readmit = steps[READMIT].gauges if READMIT in steps else {}
        self.readmit_rejected.set(readmit.get("readmit_rejected_pods", 0))
        self.readmit_margin.clear()
        for key, seconds in readmit.items():
            if key.startswith("readmit_margin_seconds:"):
                self.readmit_margin.labels(key.partition(":")[2]).set(seconds)
        self.mode.clear()
        self.mode.labels(status.mode).set(1)
        self.disabled.set(1 if status.off_switch is not None else 0)
        self.condition.clear()
        self.condition_status.clear()
        for c in CONDITIONS:
            code, _ = evaluate(c, steps, last_pass.ended, DEFAULT_MAX_AGE)
            if code in (OK, PROBLEM):
                self.condition.labels(c.type).set(1 if code == PROBLEM else 0)
            for want, label in ((PROBLEM, "true"), (OK, "false"), (UNKNOWN, "unknown")):
                self.condition_status.labels(c.type, label).set(int(code == want))

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def passes() -> list[tuple[PassRecord, Status]]:
    """Passes that use every family: findings and actions, one with label values that
    need escaping, durations in and beyond the buckets, a step gone from the status."""
    first = a_pass(1)
    odd = dict(DENIED, kind='a"b\\c\nd')
    second_last, second_steps = a_pass_doc(2)
    second_last = {
        **second_last,
        "duration_ms": 75_000.0,
        "findings": [odd],
        "outcomes": [outcome("restart-plugin", "failed"), outcome('x"y', "done")],
    }
    second_steps["container_access"]["findings"] = [odd, DENIED]
    second_steps["readmit"] = {
        **second_steps["gpu_count"],
        "findings": [],
        "gauges": {"readmit_rejected_pods": 2, "readmit_margin_seconds:nvidia.com/gpu": -0.031},
    }
    third_last, third_steps = a_pass_doc(3)
    third_last = {**third_last, "duration_ms": 5.0, "findings": [], "outcomes": []}
    del third_steps["gpu_count"]
    return [first, typed(second_last, second_steps), typed(third_last, third_steps)]


@pytest.fixture
def frozen_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: T0)


@pytest.mark.usefixtures("frozen_time")
def test_the_rendered_text_is_what_the_librarys_own_metrics_gave() -> None:
    reference, state = Reference(), MetricsState(clock=lambda: T0)
    assert render(state.to_values()) == reference.exposition()  # before any pass
    for (last, status), repair in zip(passes(), (0.004, 0.3, 7.5)):
        reference.reload_repair.observe(repair)
        state.observe(REPAIR_HISTOGRAM, repair)
        reference.reset_repair.observe(repair / 100)
        state.observe(RESET_HISTOGRAM, repair / 100)
        reference.observe_pass(last, status)
        state.observe_pass(last, status)
        # through the file, as gpuguard metrics reads it
        doc = SPEC.decode(SPEC.encode(state.to_values()))
        assert render(doc) == reference.exposition()
    text = render(doc).decode()
    assert "gpuguard_passes_created 1.70000000025e+09" in text
    assert 'gpuguard_pass_duration_seconds_bucket{le="+Inf"} 3.0' in text
    assert 'gpuguard_reload_repair_seconds_bucket{le="0.005"} 1.0' in text
    assert "gpuguard_reload_repair_seconds_sum 7.804" in text
    assert 'kind="a\\"b\\\\c\\nd"' in text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"gpuguard_passes", "gpuguard_pass_duration_seconds", "gpuguard_gpus"} <= names


@pytest.mark.parametrize(
    ("doc", "reason"),
    [
        ([], "document: not an object"),
        ({"format": 2, "families": {}}, "format 2, this gpuguard reads version 1"),
        ({"format": 1}, "document.families: missing"),
        ({"format": 1, "families": {"gpuguard_passes": {}}}, "not a list of series"),
        (
            {"format": 1, "families": {"gpuguard_passes": [{"labels": [], "value": "1"}]}},
            "value: not a number",
        ),
        (
            {"format": 1, "families": {"gpuguard_passes": [{"labels": [], "value": 1e400}]}},
            "out of range",
        ),
        (
            {
                "format": 1,
                "families": {
                    "gpuguard_pass_duration_seconds": [
                        {"labels": [], "bounds": [1, 2], "counts": [1], "sum": 0}
                    ]
                },
            },
            "bounds and counts do not match",
        ),
    ],
)
def test_a_document_the_daemon_did_not_write_is_refused_with_the_reason(
    doc: Any, reason: str
) -> None:
    raw = json.dumps(doc).encode().replace(b"Infinity", b"1e400")
    with pytest.raises(SchemaError, match=re.escape(reason)):
        SPEC.decode(raw)


def test_a_series_that_does_not_fit_its_family_is_refused_with_the_reason() -> None:
    values = MetricsValues({"gpuguard_gpus": (Series((), 1.0),)})
    with pytest.raises(ValueError, match="gpuguard_gpus: labels are not 1 strings"):
        render(values)


def test_the_state_keeps_the_buckets_and_the_created_times_it_is_given() -> None:
    clock = iter([10.0, 20.0, 30.0]).__next__
    state = MetricsState(clock=clock)  # 10: the daemon's start
    state.inc("gpuguard_actions", "cgroup-v1-allow", "done")  # 20
    state.inc("gpuguard_actions", "cgroup-v1-allow", "done")  # no new series
    state.inc("gpuguard_findings", "k", "s")  # 30
    for seconds in (0.001, 0.005, 0.0051, 61.0):
        state.observe_duration(seconds)
    families = state.to_values().families
    assert families["gpuguard_passes"] == (Series((), 0.0, 10.0),)
    assert families["gpuguard_actions"] == (Series(("cgroup-v1-allow", "done"), 2.0, 20.0),)
    assert families["gpuguard_findings"][0].created == 30.0
    (hist,) = families["gpuguard_pass_duration_seconds"]
    assert isinstance(hist, Histogram)
    assert hist.bounds == PASS_BUCKETS
    assert hist.counts == tuple([2, 1] + [0] * (len(PASS_BUCKETS) - 2) + [1])
    with pytest.raises(ValueError, match="labels"):
        state.inc("gpuguard_actions", "only-one")
