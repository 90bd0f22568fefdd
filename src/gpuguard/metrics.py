"""The daemon's state as Prometheus metrics.

Built once in main and updated after every pass; the exposition (Prometheus's text
format, rendered by metrics_text.py, which says why without a client library) goes to
two places, both read by others so the daemon itself never listens on the network (its
unit denies IP):

- /run/gpuguard/metrics.prom, served over HTTP by gpuguard-metrics.socket (off
  until an operator enables that socket; docs/metrics.md, docs/hardening.md);
- `[Metrics] TextfileDirectory=`/gpuguard.prom for node_exporter's textfile collector
  (off while empty).

Both are replaced atomically (actuate.files), so a scraper never sees half a file.
"""

from __future__ import annotations

import platform
from collections import Counter as Tally
from pathlib import Path
from typing import Any, Mapping, Optional

from gpuguard import __version__
from gpuguard.log import EventLog
from gpuguard.npd import CONDITIONS, DEFAULT_MAX_AGE, OK, PROBLEM, evaluate
from gpuguard.paths import Root
from gpuguard.steps.registry import CONTAINER_ACCESS, GPU_COUNT

RUNTIME_FILE = "/run/gpuguard/metrics.prom"
TEXTFILE_NAME = "gpuguard.prom"
# From a 5 ms container re-grant to a pass that restarts kubelet (tens of seconds).
PASS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DENIED_KINDS = frozenset({"container-device-denied", "v2-report-only"})


class Metrics:
    """Every gpuguard metric, in a registry of its own (no process/platform defaults:
    node_exporter already has them, and a textfile must not repeat them)."""

    def __init__(self) -> None:
        from gpuguard.metrics_text import Counter, Gauge, Histogram, Registry

        r = self.registry = Registry()
        self.passes = Counter("gpuguard_passes", "Reconciliation passes run.", registry=r)
        self.pass_duration = Histogram(
            "gpuguard_pass_duration_seconds",
            "Duration of a reconciliation pass.",
            buckets=PASS_BUCKETS,
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
        self.condition = Gauge(
            "gpuguard_node_condition",
            "1 while a node condition's problem is present, 0 while it is not; absent "
            "while unknown (the same answer as `gpuguard npd`).",
            ["condition"],
            registry=r,
        )
        build = Gauge(
            "gpuguard_build_info",
            "gpuguard's version and the Python running it (always 1).",
            ["version", "python"],
            registry=r,
        )
        build.labels(__version__, platform.python_version()).set(1)

    def observe_pass(self, last_pass: Mapping[str, Any], status: Mapping[str, Any]) -> None:
        """Count one pass (the daemon's last_pass document) and refresh the gauges from
        the status document (each step's latest result)."""
        self.passes.inc()
        self.pass_duration.observe(float(last_pass.get("duration_ms", 0.0)) / 1000.0)
        self.last_pass.set(float(last_pass.get("ended", 0.0)))
        for f in last_pass.get("findings", ()):
            self.findings.labels(f["kind"], f["reconciler"]).inc()
        for o in last_pass.get("outcomes", ()):
            self.actions.labels(o["kind"], o["status"]).inc()
            if o["kind"] == "restart-plugin":
                self.plugin_restarts.labels(o["status"]).inc()
        steps: Mapping[str, Any] = status.get("steps") or {}
        self.open_findings.clear()
        for name, st in steps.items():
            for (kind, step), n in Tally((f["kind"], name) for f in st["findings"]).items():
                self.open_findings.labels(kind, step).set(n)
        access = steps.get(CONTAINER_ACCESS)
        if access is not None and access.get("pass") == last_pass.get("number"):
            gauges = access.get("gauges") or {}
            if "gpu_containers" in gauges:
                self.gpu_containers.set(gauges["gpu_containers"])
            denied = {
                f["fields"].get("CONTAINER_ID")
                for f in access["findings"]
                if f["kind"] in DENIED_KINDS
            }
            self.gpu_containers_denied.set(len(denied))
        counts = (steps.get(GPU_COUNT) or {}).get("gauges") or {}
        for layer in ("pci", "nvml", "kubelet"):
            if counts.get(f"gpus_{layer}") is not None:
                self.gpus.labels(layer).set(counts[f"gpus_{layer}"])
        self.condition.clear()
        now = float(last_pass.get("ended", 0.0))
        for c in CONDITIONS:
            code, _ = evaluate(c, {"steps": steps}, now, DEFAULT_MAX_AGE)
            if code in (OK, PROBLEM):
                self.condition.labels(c.type).set(1 if code == PROBLEM else 0)

    def exposition(self) -> bytes:
        return self.registry.render()


class MetricsOutput:
    """The daemon's side: count each pass, write the files, report an error once."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.errors: frozenset[str] = frozenset()
        self.broken = False

    def after_pass(
        self,
        last_pass: Mapping[str, Any],
        status: Mapping[str, Any],
        root: Root,
        textfile_dir: Optional[str],
        log: EventLog,
    ) -> None:
        """publish(), with its errors logged once; a bug here disables the metrics and is
        logged, and never stops the daemon's repairs."""
        if self.broken:
            return
        try:
            errors = self.publish(last_pass, status, root, textfile_dir)
        except Exception as e:
            self.broken = True
            log.event(
                "metrics-failed",
                f"metrics disabled: {type(e).__name__}: {e}",
                level="error",
                exc=e,
            )
            return
        for error in errors:
            log.warning(error)

    def publish(
        self,
        last_pass: Mapping[str, Any],
        status: Mapping[str, Any],
        root: Root,
        textfile_dir: Optional[str],
    ) -> list[str]:
        """Update and write; the errors not reported by the previous call."""
        self.metrics.observe_pass(last_pass, status)
        paths = [root.path(RUNTIME_FILE)]
        if textfile_dir:
            paths.append(root.path(textfile_dir) / TEXTFILE_NAME)
        errors = frozenset(export(self.metrics.exposition(), paths))
        new, self.errors = sorted(errors - self.errors), errors
        return new


def make_output() -> MetricsOutput:
    """The daemon's metrics and their files."""
    return MetricsOutput(make_metrics())


def make_metrics() -> Metrics:
    return Metrics()


def export(data: bytes, paths: list[Path]) -> list[str]:
    """Replace each file atomically; the errors, one line each (the caller logs them).

    Into directories that must already exist (node_exporter's textfile directory belongs
    to its package and often to its user): never created here, never made root-only."""
    from gpuguard.actuate.files import atomic_replace

    errors = []
    for p in paths:
        try:
            atomic_replace(p, data, mode=0o644, uid=None, gid=None)
        except OSError as e:
            errors.append(f"cannot write metrics to {p}: {e.strerror}")
    return errors
