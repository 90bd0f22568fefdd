"""deploy/monitoring/gpuguard.rules.yml under promtool: `check rules`, and `test rules`
for every alert, firing and not, on input series built from the real daemon's recorded
scrapes (tests/fixtures/metrics/, README.md there).

A case is a timeline per scrape target: each phase holds one recorded scrape for some
minutes (None: the endpoint did not answer, `up` 0). Where no recording has the state
an alert needs (a failed or declined repair, re-grants again and again, a stale device
plugin, another version), the phase rewrites a recorded sample's label or value and says so in its
name; the metric and label names stay the recorded ones. The daemon's last pass time is
the sample's own time (the recordings' Unix times lie in 2026, promtool starts at 0).
Annotations are checked by `promtool check rules` (their templates) and dropped from
the copy tested here, so the expectations name labels only."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Dict, List, Sequence

import pytest
import yaml

from conftest import REPO, require_tool
from unit.promtool_series import (
    Case,
    P,
    Target,
    compact,
    cond,
    condition_true,
    one,
    relabel,
    series,
)


def _recorded_version() -> str:
    """The version label the recorded scrapes carry (the checkout's, unstamped)."""
    text = (REPO / "tests/fixtures/metrics/healthy.prom").read_text()
    m = re.search(r'^gpuguard_build_info\{[^}]*version="([^"]*)"', text, re.M)
    assert m, "healthy.prom has no gpuguard_build_info"
    return m[1]


RECORDED = _recorded_version()

MONITORING = REPO / "deploy/monitoring"
RULES = MONITORING / "gpuguard.rules.yml"

CKPT = ("kind", "checkpoint-repaired")
GPU_CAPACITY = {  # kube-state-metrics' series for three GPU nodes (not a gpuguard scrape)
    "kube_node_status_capacity{"
    f'job="kube-state-metrics",node="{n}",resource="nvidia_com_gpu",unit="integer"'
    "}": ["8+0x120"]
    for n in ("gpu-a", "gpu-b", "gpu-c")
}

NOT_READY_AT_30 = {
    'kube_node_status_condition{condition="Ready",job="kube-state-metrics",node="gpu-a",'
    'status="true"}': ["1x29 0x30"]
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
        one(P("observe-access-lost", 20), P("access-repaired", 30)),
        3,
        [],
    ),
    Case(
        "GpuguardGPUDeviceAccessLost",
        one(P("observe-access-lost", 20), P("access-repaired", 30)),
        10,
        [{**cond("GPUDeviceAccessLost"), "severity": "critical"}],
    ),
    Case(
        "GpuguardGPUDeviceAccessLost",
        one(P("observe-access-lost", 20), P("access-repaired", 30)),
        40,
        [],
    ),
    Case("GpuguardGPUDevicePluginStale", one(P("healthy", 60), P("observe-damaged", 60)), 110, []),
    Case(
        "GpuguardGPUDevicePluginStale",
        one(P("healthy", 30), P("healthy", 30, rewrite=condition_true("GPUDevicePluginStale"))),
        50,
        [{**cond("GPUDevicePluginStale"), "severity": "warning"}],
    ),
    Case(
        "GpuguardGPUPodsRejected",
        one(P("healthy", 30), P("healthy", 30, rewrite=condition_true("GPUPodsRejected"))),
        33,
        [],
    ),
    Case(
        "GpuguardGPUPodsRejected",
        one(P("healthy", 30), P("healthy", 30, rewrite=condition_true("GPUPodsRejected"))),
        40,
        [{**cond("GPUPodsRejected"), "severity": "warning"}],
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
    Case(  # the node went NotReady: the node's alert, not gpuguard's
        "GpuguardDown", one(P("healthy", 30), P(None, 30)), 50, [], extra=NOT_READY_AT_30
    ),
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
    Case(  # gpu-c scraped but down: GpuguardDown's, not this alert's
        "GpuguardAbsent",
        (Target("gpu-a", (P("healthy", 120),)), Target("gpu-c", (P(None, 120),))),
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
    Case("GpuguardRepeatedRepairs", one(P("healthy", 30), P("access-repaired", 240)), 260, []),
    Case(  # a re-grant every 30 minutes
        "GpuguardRepeatedRepairs",
        one(
            P("healthy", 30),
            P(
                "access-repaired",
                240,
                rewrite=relabel(
                    "gpuguard_actions_total",
                    "outcome",
                    "done",
                    "done",
                    lambda m: 1 + m // 30,
                    only=("kind", "cgroup-v1-allow"),
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
    Case(  # the off switch (the daemon then says observe too): GpuguardDisabledTooLong's
        "GpuguardObservePendingRepairs",
        one(P("healthy", 30), P("observe-damaged", 30), P("disabled", 60, passing=False)),
        110,
        [],
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
                        rewrite=relabel(
                            "gpuguard_build_info", "version", RECORDED, RECORDED + ".other"
                        ),
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


def run_case(
    case: Case, tmp_path: Path, rules: Path, annotations: Sequence[Dict[str, str]] = ()
) -> subprocess.CompletedProcess[str]:
    inputs: Dict[str, List[str]] = dict(case.extra)
    for target in case.targets:
        for name, vals in series(target, case.interval).items():
            inputs[name] = [compact(vals)]
    expected: List[Dict[str, Dict[str, str]]] = []
    for i, fire in enumerate(case.fires):
        node = fire.get("node", case.targets[0].node)
        target = next((t for t in case.targets if t.node == node and case.per_target), None)
        expected.append({"exp_labels": {**(target.labels() if target else {}), **fire}})
        if annotations:
            expected[-1]["exp_annotations"] = annotations[i]
    test = {
        "rule_files": [str(rules)],
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
    return promtool("test", "rules", str(path))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.alert}-{c.at}m")
def test_alert(case: Case, tmp_path: Path) -> None:
    r = run_case(case, tmp_path, rules_without_annotations(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr


def test_annotations_render_with_the_alerts_labels_and_value(tmp_path: Path) -> None:
    """The shipped rules, annotations included, as Alertmanager receives them."""
    (case,) = [c for c in CASES if c.alert == "GpuguardRepairsFailing" and c.fires]
    base = "https://github.com/gpuguard/gpuguard/blob/main/docs/alerts.md"
    want = {
        "summary": "gpuguard repairs are failing on gpu-a",
        "description": "In the last hour 1 checkpoint-repaired repair(s) failed on gpu-a:9835. "
        "The journal says why (journalctl -u gpuguard -p warning).",
        "runbook_url": f"{base}#gpuguardrepairsfailing",
    }
    r = run_case(case, tmp_path, RULES, [want])
    assert r.returncode == 0, r.stdout + r.stderr
