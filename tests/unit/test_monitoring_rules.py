"""deploy/monitoring/gpuguard.rules.yml under promtool: `check rules`, and `test rules`
for every alert, firing and not, on input series built from the real daemon's recorded
scrapes (tests/fixtures/metrics/, README.md there).

A case is a timeline per scrape target: each phase holds one recorded scrape for some
minutes (None: the endpoint did not answer, `up` 0). Where no recording has the state
an alert needs (a failed or declined repair, an F2 re-grant, a lost device, another
version), the phase rewrites a recorded sample's label or value and says so in its
name; the metric and label names stay the recorded ones. The daemon's last pass time is
the sample's own time (the recordings' Unix times lie in 2026, promtool starts at 0).
Annotations are checked by `promtool check rules` (their templates) and dropped from
the copy tested here, so the expectations name labels only."""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO, require_tool

MONITORING = REPO / "deploy/monitoring"
RULES = MONITORING / "gpuguard.rules.yml"
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


CKPT = ("kind", "checkpoint-repaired")
GPU_CAPACITY = {  # kube-state-metrics' series for three GPU nodes (not a gpuguard scrape)
    "kube_node_status_capacity{"
    f'job="kube-state-metrics",node="{n}",resource="nvidia_com_gpu",unit="integer"'
    "}": ["8+0x120"]
    for n in ("gpu-a", "gpu-b", "gpu-c")
}

CASES = [
    Case("GpuguardKubeletCheckpointStale", one(P("healthy", 60), P("observe-damaged", 60)), 50, []),
    Case("GpuguardKubeletCheckpointStale", one(P("healthy", 60), P("observe-damaged", 60)), 80, []),
    Case(
        "GpuguardKubeletCheckpointStale",
        one(P("healthy", 60), P("observe-damaged", 60)),
        110,
        [{**cond("KubeletCheckpointStale"), "severity": "warning"}],
    ),
    Case("GpuguardGPUCountMismatch", one(P("healthy", 30), P("repaired", 60)), 25, []),
    Case(
        "GpuguardGPUCountMismatch",
        one(P("healthy", 30), P("repaired", 60)),
        85,
        [{**cond("GPUCountMismatch"), "severity": "warning"}],
    ),
    Case(
        "GpuguardGPUDeviceAccessLost",
        one(P("healthy", 30), P("healthy", 30, rewrite=condition_true("GPUDeviceAccessLost"))),
        33,
        [],
    ),
    Case(
        "GpuguardGPUDeviceAccessLost",
        one(P("healthy", 30), P("healthy", 30, rewrite=condition_true("GPUDeviceAccessLost"))),
        40,
        [{**cond("GPUDeviceAccessLost"), "severity": "critical"}],
    ),
    Case("GpuguardGPUDevicePluginStale", one(P("healthy", 60), P("observe-damaged", 60)), 110, []),
    Case(
        "GpuguardGPUDevicePluginStale",
        one(P("healthy", 30), P("healthy", 30, rewrite=condition_true("GPUDevicePluginStale"))),
        50,
        [{**cond("GPUDevicePluginStale"), "severity": "warning"}],
    ),
    Case("GpuguardConditionUnknown", one(P("healthy", 30), P("unknown", 90)), 80, []),
    Case(
        "GpuguardConditionUnknown",
        one(P("healthy", 30), P("unknown", 90)),
        100,
        [{**cond("KubeletCheckpointStale", "unknown"), "severity": "warning"}],
    ),
    Case(
        "GpuguardConditionUnknown", one(P("healthy", 30), P("disabled", 90, passing=False)), 110, []
    ),
    Case("GpuguardDown", one(P("healthy", 30), P(None, 30)), 35, []),
    Case("GpuguardDown", one(P("healthy", 30), P(None, 30)), 50, [{"severity": "warning"}]),
    Case("GpuguardNotPassing", one(P("healthy", 30), P("healthy", 30, passing=False)), 45, []),
    Case(
        "GpuguardNotPassing",
        one(P("healthy", 30), P("healthy", 30, passing=False)),
        55,
        [{"severity": "warning"}],
    ),
    Case("GpuguardNotPassing", one(P("healthy", 30), P("disabled", 30, passing=False)), 55, []),
    Case(
        "GpuguardAbsent",
        (
            Target("gpu-a", (P("healthy", 120),)),
            Target("gpu-c", (P("disabled", 120, passing=False),)),
        ),
        25,
        [],
        extra=GPU_CAPACITY,
    ),
    Case(
        "GpuguardAbsent",
        (
            Target("gpu-a", (P("healthy", 120),)),
            Target("gpu-c", (P("disabled", 120, passing=False),)),
        ),
        40,
        [{"node": "gpu-b", "severity": "warning"}],
        extra=GPU_CAPACITY,
    ),
    Case("GpuguardRepairsFailing", one(P("healthy", 30), P("repaired", 60)), 60, []),
    Case(
        "GpuguardRepairsFailing",
        one(
            P("healthy", 30),
            P(
                "repaired",
                30,
                rewrite=relabel("gpuguard_actions_total", "outcome", "done", "failed", only=CKPT),
            ),
        ),
        40,
        [{"kind": "checkpoint-repaired", "severity": "warning"}],
    ),
    Case(
        "GpuguardRepairsDeclined",
        one(
            P("healthy", 30),
            P(
                "repaired",
                120,
                rewrite=relabel("gpuguard_actions_total", "outcome", "done", "declined", only=CKPT),
            ),
        ),
        140,
        [],  # one decline, long ago: nothing keeps declining
    ),
    Case(
        "GpuguardRepairsDeclined",
        one(
            P("healthy", 30),
            P(
                "repaired",
                120,
                rewrite=relabel(
                    "gpuguard_actions_total",
                    "outcome",
                    "done",
                    "declined",
                    lambda m: 1 + m // 10,
                    only=CKPT,
                ),
            ),
        ),
        140,
        [{"kind": "checkpoint-repaired", "severity": "warning"}],
    ),
    Case(
        "GpuguardRepeatedRepairs",
        one(
            P("healthy", 30),
            P(
                "repaired",
                240,
                rewrite=relabel(
                    "gpuguard_actions_total", "kind", "checkpoint-repaired", "cgroup-v1-allow"
                ),
            ),
        ),
        260,
        [],  # one re-grant
    ),
    Case(
        "GpuguardRepeatedRepairs",
        one(
            P("healthy", 30),
            P(
                "repaired",
                240,
                rewrite=relabel(
                    "gpuguard_actions_total",
                    "kind",
                    "checkpoint-repaired",
                    "cgroup-v1-allow",
                    lambda m: 1 + m // 30,
                ),
            ),
        ),
        260,
        [{"severity": "warning"}],
    ),
    Case(
        "GpuguardObservePendingRepairs",
        one(P("healthy", 30), P("observe-damaged", 60), P("repaired", 60)),
        140,
        [],  # repaired: the dry-run count stays, the mode is repair
    ),
    Case(
        "GpuguardObservePendingRepairs",
        one(P("healthy", 30), P("observe-damaged", 60), P("repaired", 60)),
        85,
        [{"severity": "warning"}],
    ),
    Case(
        "GpuguardDisabledTooLong",
        one(P("healthy", 60), P("disabled", 1500, passing=False)),
        1450,
        [],
    ),
    Case(
        "GpuguardDisabledTooLong",
        one(P("healthy", 60), P("disabled", 1500, passing=False)),
        1550,
        [{"severity": "warning"}],
        interval=3,
    ),
    Case(
        "GpuguardVersionSkew",
        (Target("gpu-a", (P("healthy", 3000),)), Target("gpu-b", (P("healthy", 3000),))),
        2950,
        [],
        interval=3,
    ),
    Case(
        "GpuguardVersionSkew",
        (
            Target("gpu-a", (P("healthy", 3000),)),
            Target(
                "gpu-b",
                (
                    P(
                        "healthy",
                        3000,
                        rewrite=relabel("gpuguard_build_info", "version", "0.1.0", "0.2.0"),
                    ),
                ),
            ),
        ),
        2950,
        [{"severity": "info"}],
        interval=3,
        per_target=False,
    ),
]


def rules_without_annotations(tmp: Path) -> Path:
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    out = tmp / "rules.yml"
    out.write_text(yaml.safe_dump(doc))
    return out


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    require_tool("promtool")
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_rules() -> None:
    r = promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in r.stdout


def alerts() -> List[str]:
    doc = yaml.safe_load(RULES.read_text())
    return [r["alert"] for g in doc["groups"] for r in g["rules"]]


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    firing = {c.alert for c in CASES if c.fires}
    quiet = {c.alert for c in CASES if not c.fires}
    assert firing == quiet == set(alerts())


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.alert}-{c.at}m")
def test_alert(case: Case, tmp_path: Path) -> None:
    inputs: Dict[str, List[str]] = dict(case.extra)
    for target in case.targets:
        for name, vals in series(target, case.interval).items():
            inputs[name] = [compact(vals)]
    expected = []
    for fire in case.fires:
        node = fire.get("node", case.targets[0].node)
        target = next((t for t in case.targets if t.node == node and case.per_target), None)
        labels = {**(target.labels() if target else {}), **fire}
        expected.append({"exp_labels": labels})
    test = {
        "rule_files": [str(rules_without_annotations(tmp_path))],
        "evaluation_interval": f"{case.interval}m",
        "tests": [
            {
                "interval": f"{case.interval}m",
                "input_series": [{"series": k, "values": v[0]} for k, v in inputs.items()],
                "alert_rule_test": [
                    {"eval_time": f"{case.at}m", "alertname": case.alert, "exp_alerts": expected}
                ],
            }
        ],
    }
    path = tmp_path / "test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False, width=1 << 20))
    r = promtool("test", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
