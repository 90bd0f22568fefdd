"""The daemon's side of the metrics: their values, kept without a client library, and
the files written after every pass.

The daemon counts passes, findings and actions here and writes the values after every
pass, atomically (actuate.files), as JSON to /run/gpuguard/metrics.json (FORMAT below).
What turns them into Prometheus's text format is metrics.py, with prometheus_client,
run where the metrics are read: `gpuguard metrics [--serve]` (gpuguard-metrics.socket;
the daemon itself never listens, its unit denies IP). Importing prometheus_client would
cost the daemon ~4 MB of resident memory and load `ssl` (its exposition module imports
it unconditionally), so the daemon imports it only when an operator sets
`[Metrics] TextfileDirectory=`: node_exporter's textfile collector needs the text file
itself, rewritten on every pass (docs/metrics.md gives the figure).

FAMILIES is the one list of metric names, types, help texts and labels; the values
follow prometheus_client's rules (a labelled series appears at its first use, a counter
remembers when it was created, an unlabelled one starts at 0 with the daemon), so the
rendered text is what the library's own Counter/Gauge/Histogram gave
(tests/unit/test_metrics_render.py).
"""

from __future__ import annotations

import sys
import time
from collections import Counter as Tally
from dataclasses import dataclass
from typing import Callable, Optional

from gpuguard import __commit__, package_version
from gpuguard.host.echo import cut
from gpuguard.reporting.metrics_file import FORMAT as FORMAT
from gpuguard.reporting.metrics_file import STATE_FILE as STATE_FILE
from gpuguard.reporting.metrics_file import STATE_MAX as STATE_MAX
from gpuguard.reporting.metrics_file import AnySeries, Histogram, MetricsValues, Series
from gpuguard.reporting.npd import CONDITIONS, DEFAULT_MAX_AGE, STATE_NAMES, evaluate
from gpuguard.reporting.status import PassRecord, Status
from gpuguard.steps.registry import CONTAINER_ACCESS, GPU_COUNT, READMIT

TEXTFILE_NAME = "gpuguard.prom"
# From a 5 ms container re-grant to a pass that restarts kubelet (tens of seconds).
PASS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# From one container re-granted at once to hundreds while systemd is busy (bench/README).
RELOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
REPAIR_HISTOGRAM = "gpuguard_reload_repair_seconds"
RESET_HISTOGRAM = "gpuguard_runtime_reset_repair_seconds"
DENIED_KINDS = frozenset({"container-device-denied", "v2-report-only"})
MISSING_LIBRARY = (
    "python3-prometheus-client is not installed, so gpuguard cannot render its metrics "
    "in Prometheus's format — install it (python3-prometheus_client on RHEL)"
)


def unimportable(e: ImportError) -> Optional[str]:
    """Why the renderer (prometheus_client) cannot be imported, in one line; None when
    the import that failed is gpuguard's own (a bug). A module the library needs that is
    missing is named (Debian's python3-prometheus-client imports python3-decorator's
    `decorator`): "not installed" would send the operator to the wrong package."""
    name = e.name or ""
    top = name.split(".")[0]
    if top == "gpuguard":
        return None
    if top == "prometheus_client":
        return MISSING_LIBRARY
    if not top:
        return f"prometheus_client cannot be imported ({cut(str(e), 120)}); reinstall it"
    return (
        f"prometheus_client cannot be imported: the module '{cut(name, 60)}' it needs is "
        f"missing — install it (python3-{cut(top, 60)}, a dependency of "
        "python3-prometheus-client)"
    )


COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
Key = tuple[str, ...]
Render = Callable[[MetricsValues], bytes]


@dataclass(frozen=True)
class Family:
    name: str  # a counter's without `_total`, as prometheus_client names it
    kind: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()  # a histogram's upper bounds (+Inf implied)


FAMILIES = (
    Family("gpuguard_passes", COUNTER, "Reconciliation passes run."),
    Family(
        "gpuguard_pass_duration_seconds",
        HISTOGRAM,
        "Duration of a reconciliation pass.",
        buckets=PASS_BUCKETS,
    ),
    Family(
        REPAIR_HISTOGRAM,
        HISTOGRAM,
        "From systemd's end of a daemon-reload or reexec to the last device re-granted "
        "on it, for the reloads that left GPU containers without a device they were given.",
        buckets=RELOAD_BUCKETS,
    ),
    Family(
        RESET_HISTOGRAM,
        HISTOGRAM,
        "From seeing a GPU container's device access reset at runtime (its scope's "
        "DeviceAllow= set over the bus without the GPU, or its cgroup v1 devices.list "
        "rewritten behind systemd's back) to the grant in place again.",
        buckets=RELOAD_BUCKETS,
    ),
    Family("gpuguard_last_pass_timestamp_seconds", GAUGE, "When the last pass ended (Unix time)."),
    Family(
        "gpuguard_findings",
        COUNTER,
        "Findings reported by passes, by kind and step (a state that persists is "
        "counted again at each pass that sees it).",
        ("kind", "step"),
    ),
    Family(
        "gpuguard_open_findings",
        GAUGE,
        "Findings in each step's latest result, by kind and step.",
        ("kind", "step"),
    ),
    Family(
        "gpuguard_actions",
        COUNTER,
        "Changes gpuguard planned, by kind and outcome (done, skipped, dry-run, declined, failed).",
        ("kind", "outcome"),
    ),
    Family(
        "gpuguard_plugin_restarts",
        COUNTER,
        "Device plugin restarts by outcome (done, failed, declined, dry-run).",
        ("outcome",),
    ),
    Family(
        "gpuguard_gpu_containers", GAUGE, "GPU containers seen by the last container access check."
    ),
    Family(
        "gpuguard_gpu_containers_without_access",
        GAUGE,
        "GPU containers the last container access check found denied a device "
        "they were given (before its repair).",
    ),
    Family(
        "gpuguard_gpus",
        GAUGE,
        "GPUs counted at each layer (pci, nvml, kubelet) by the last GPU count check.",
        ("layer",),
    ),
    Family(
        "gpuguard_readmit_rejected_pods",
        GAUGE,
        "GPU pods kubelet rejected at its start (UnexpectedAdmissionError) that have not "
        "run since, as the re-admission bridge read them from kubelet's journal.",
    ),
    Family(
        "gpuguard_readmit_margin_seconds",
        GAUGE,
        "At kubelet's latest start: seconds from the re-admission bridge's devices "
        "healthy to kubelet's first pod admission, by resource (negative: kubelet judged "
        "its pods first); absent when not known.",
        ("resource",),
    ),
    Family(
        "gpuguard_node_condition",
        GAUGE,
        "1 while a node condition's problem is present, 0 while it is not; absent "
        "while unknown (the same answer as `gpuguard npd`).",
        ("condition",),
    ),
    Family(
        "gpuguard_node_condition_status",
        GAUGE,
        "Each node condition's state, as kube-state-metrics shows a node's: 1 for the "
        "status it has (true: the problem is present, false: it is not, unknown: it "
        "could not be judged), 0 for the others (the same answer as `gpuguard npd`).",
        ("condition", "status"),
    ),
    Family(
        "gpuguard_disabled",
        GAUGE,
        "1 while the off switch /etc/gpuguard/disabled is set (`gpuguard disable`: gpuguard "
        "changes nothing), else 0.",
    ),
    Family(
        "gpuguard_mode",
        GAUGE,
        "1 for the mode the daemon runs in: repair, or observe (Mode=observe: it reports and "
        "changes nothing).",
        ("mode",),
    ),
    Family(
        "gpuguard_build_info",
        GAUGE,
        "gpuguard's version (as dpkg and rpm show it), the commit it was built from and the "
        "Python running it (always 1).",
        ("version", "commit", "python"),
    ),
)
_BY_NAME = {f.name: f for f in FAMILIES}


class MetricsState:
    """Every metric's values, updated by observe_pass(), written as to_values()."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        start = clock()
        self.values: dict[str, dict[Key, float]] = {f.name: {} for f in FAMILIES}
        self.created: dict[str, dict[Key, float]] = {f.name: {} for f in FAMILIES}
        for f in FAMILIES:
            if not f.labels and f.kind != HISTOGRAM:
                self.values[f.name][()] = 0.0
                if f.kind == COUNTER:
                    self.created[f.name][()] = start
        # per histogram: a count per bucket (the last: above the highest bound), the sum
        self.buckets = {f.name: [0] * (len(f.buckets) + 1) for f in FAMILIES if f.buckets}
        self.sums = {name: 0.0 for name in self.buckets}
        self.start = start
        self.counted: Optional[int] = None  # the number of the last pass counted
        # per step, the actions its latest pass planned without making them (dry-run):
        # the same plan again is no new action (observe mode plans it every pass)
        self.planned: dict[str, set[tuple[str, str]]] = {}
        commit = __commit__ or "unknown"
        self.set(
            "gpuguard_build_info", 1, package_version(), commit, sys.version.split()[0]
        )  # platform's: not loaded for it

    def _series(self, name: str, labels: Key) -> dict[Key, float]:
        family = _BY_NAME[name]
        if len(labels) != len(family.labels):
            raise ValueError(f"{name}: labels {family.labels}, got {labels}")
        series = self.values[name]
        if labels not in series:
            series[labels] = 0.0
            if family.kind == COUNTER:
                self.created[name][labels] = self.clock()
        return series

    def inc(self, name: str, *labels: str) -> None:
        self._series(name, labels)[labels] += 1.0

    def set(self, name: str, value: float, *labels: str) -> None:
        self._series(name, labels)[labels] = float(value)

    def clear(self, name: str) -> None:
        """Drop every labelled series (a label set that no longer applies disappears)."""
        self.values[name].clear()
        self.created[name].clear()

    def observe(self, name: str, seconds: float) -> None:
        """One observation of the histogram `name`."""
        counts = self.buckets[name]
        self.sums[name] += seconds
        for i, bound in enumerate(_BY_NAME[name].buckets):
            if seconds <= bound:
                counts[i] += 1
                return
        counts[-1] += 1

    def observe_duration(self, seconds: float) -> None:
        self.observe("gpuguard_pass_duration_seconds", seconds)

    def observe_pass(self, last_pass: PassRecord, status: Status) -> None:
        """Count one pass (each once, by its number: the daemon stopped by the off switch
        writes its status again) and refresh the gauges from each step's latest result,
        the mode and the off switch."""
        if last_pass.number != self.counted:
            self.counted = last_pass.number
            self._count(last_pass)
        steps = status.steps
        self.clear("gpuguard_open_findings")
        for name, st in steps.items():
            for (kind, step), n in Tally((f.kind, name) for f in st.findings).items():
                self.set("gpuguard_open_findings", n, kind, step)
        access = steps.get(CONTAINER_ACCESS)
        if access is not None and access.pass_number == last_pass.number:
            if "gpu_containers" in access.gauges:
                self.set("gpuguard_gpu_containers", access.gauges["gpu_containers"])
            denied = {
                f.fields.get("CONTAINER_ID") for f in access.findings if f.kind in DENIED_KINDS
            }
            self.set("gpuguard_gpu_containers_without_access", len(denied))
        counts = steps[GPU_COUNT].gauges if GPU_COUNT in steps else {}
        for layer in ("pci", "nvml", "kubelet"):
            if f"gpus_{layer}" in counts:
                self.set("gpuguard_gpus", counts[f"gpus_{layer}"], layer)
        readmit = steps[READMIT].gauges if READMIT in steps else {}
        self.set("gpuguard_readmit_rejected_pods", readmit.get("readmit_rejected_pods", 0))
        self.clear("gpuguard_readmit_margin_seconds")  # absent when unknown
        for key, seconds in readmit.items():
            if key.startswith("readmit_margin_seconds:"):
                resource = key.partition(":")[2]
                self.set("gpuguard_readmit_margin_seconds", seconds, resource)
        self.clear("gpuguard_mode")
        self.set("gpuguard_mode", 1, status.mode)
        self.set("gpuguard_disabled", 1 if status.off_switch is not None else 0)
        self.clear("gpuguard_node_condition")
        self.clear("gpuguard_node_condition_status")
        for c in CONDITIONS:
            code, _ = evaluate(c, steps, last_pass.ended, DEFAULT_MAX_AGE)
            state = STATE_NAMES[code]
            if state != "unknown":
                self.set("gpuguard_node_condition", 1 if state == "problem" else 0, c.type)
            for name, label in (("problem", "true"), ("ok", "false"), ("unknown", "unknown")):
                self.set("gpuguard_node_condition_status", int(state == name), c.type, label)

    def _count(self, last_pass: PassRecord) -> None:
        self.inc("gpuguard_passes")
        self.observe_duration(last_pass.duration_ms / 1000.0)
        self.set("gpuguard_last_pass_timestamp_seconds", last_pass.ended)
        for f in last_pass.findings:
            self.inc("gpuguard_findings", f.kind, f.reconciler)
        planned: dict[str, set[tuple[str, str]]] = {r: set() for r in last_pass.reconcilers}
        for o in last_pass.outcomes:
            if o.status == "dry-run":
                planned.setdefault(o.reconciler, set()).add((o.kind, o.target))
                if (o.kind, o.target) in self.planned.get(o.reconciler, ()):
                    continue  # still planned: counted when the plan appeared
            self.inc("gpuguard_actions", o.kind, o.status)
            if o.kind == "restart-plugin":
                self.inc("gpuguard_plugin_restarts", o.status)
        self.planned.update(planned)

    def to_values(self) -> MetricsValues:
        """metrics.json's model: per family, its series in the order they appeared; a
        counter's with `created` (Unix time), the histogram's with its bounds."""
        families: dict[str, tuple[AnySeries, ...]] = {}
        for f in FAMILIES:
            if f.kind == HISTOGRAM:
                families[f.name] = (
                    Histogram(
                        (),
                        f.buckets,
                        tuple(float(n) for n in self.buckets[f.name]),
                        self.sums[f.name],
                        self.start,
                    ),
                )
                continue
            created = self.created[f.name]
            families[f.name] = tuple(
                Series(k, v, created.get(k)) for k, v in self.values[f.name].items()
            )
        return MetricsValues(families)
