"""deploy/monitoring/: the PrometheusRule is the rules file's groups (generated), the
manifests are what the API (kubernetes-validate) and prometheus-operator's CRDs accept
for the fields they use, the dashboard's queries parse (promtool) and every metric,
label and label value the rules and the dashboard name is one the real daemon serves
(tests/fixtures/metrics/) or documents (docs/metrics.md, the catalog's kinds)."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Set, Tuple

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO, require_tool

MON = REPO / "deploy/monitoring"
RULES = MON / "gpuguard.rules.yml"
DASHBOARD = MON / "gpuguard-dashboard.json"
FIXTURES = REPO / "tests/fixtures/metrics"
METRICS_MD = REPO / "docs/metrics.md"
K8S_VERSIONS = ["1.25.0", kubernetes_validate.latest_version()]
#: Labels the scrape adds (podmonitor.yaml, scrape-config.yml), and kube-state-metrics'.
TARGET_LABELS = {"job", "instance", "node"}
OTHER_EXPORTERS = {  # kube-state-metrics' (v2) and Prometheus's own
    "up": {"job", "instance", "node"},
    "kube_node_status_capacity": {"node", "resource"},
    "kube_node_status_condition": {"node", "condition", "status"},
}
#: docs/metrics.md's table: the values these labels take.
OUTCOMES = {"done", "skipped", "dry-run", "declined", "failed"}
# Grafana's variables, as a query sees them once they are set.
GRAFANA = {"$node": ".*", "$__rate_interval": "5m", "$__range": "1d"}


def load(name: str) -> Dict[str, Any]:
    doc = yaml.safe_load((MON / name).read_text())
    assert isinstance(doc, dict)
    return doc


def rule_exprs() -> List[str]:
    return [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def dashboard_targets() -> Iterator[Tuple[str, Dict[str, Any]]]:
    dash = json.loads(DASHBOARD.read_text())
    for panel in dash["panels"]:
        for target in panel.get("targets", ()):
            yield panel["title"], target


def dashboard_exprs() -> List[str]:
    out = []
    for _, target in dashboard_targets():
        expr = target["expr"]
        for var, value in GRAFANA.items():
            expr = expr.replace(var, value)
        out.append(expr)
    return out


# ------------------------------------------------------------------ one source


def test_prometheusrule_is_generated_from_the_rules_file() -> None:
    r = subprocess.run(
        [sys.executable, str(MON / "generate-prometheusrule"), "--check"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert load("prometheusrule.yaml")["spec"] == yaml.safe_load(RULES.read_text())


# ------------------------------------------------------------ Kubernetes objects

# The fields of prometheus-operator's CRDs (monitoring.coreos.com/v1) these manifests
# use, with their types as the CRDs declare them; anything else is refused, so a typo
# (which the API server would prune or reject) fails here.
STRING = {"type": "string"}
RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": STRING},
        "targetLabel": STRING,
        "replacement": STRING,
        "regex": STRING,
        "action": {"enum": ["replace", "keep", "drop", "labelmap", "labeldrop", "labelkeep"]},
    },
}
METADATA = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {
        "name": STRING,
        "namespace": STRING,
        "labels": {"type": "object", "additionalProperties": STRING},
    },
}
DURATION = {
    "type": "string",
    "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
    "(([0-9]+)s)?(([0-9]+)ms)?)$",
}
PODMONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": METADATA,
        "spec": {
            "type": "object",
            "required": ["selector", "podMetricsEndpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": STRING}
                    },
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchNames": {"type": "array", "items": STRING}},
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": STRING,
                            "path": STRING,
                            "scheme": {"enum": ["http", "https"]},
                            "interval": DURATION,
                            "scrapeTimeout": DURATION,
                            "relabelings": {"type": "array", "items": RELABEL},
                        },
                    },
                },
            },
        },
    },
}
PROMETHEUSRULE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": METADATA,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name", "rules"],
                        "additionalProperties": False,
                        "properties": {
                            "name": STRING,
                            "interval": DURATION,
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["expr"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "alert": STRING,
                                        "record": STRING,
                                        # the CRD's int-or-string; these are strings
                                        "expr": STRING,
                                        "for": DURATION,
                                        "labels": {
                                            "type": "object",
                                            "additionalProperties": STRING,
                                        },
                                        "annotations": {
                                            "type": "object",
                                            "additionalProperties": STRING,
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}
CRDS = {"podmonitor.yaml": PODMONITOR, "prometheusrule.yaml": PROMETHEUSRULE}


@pytest.mark.parametrize("name", sorted(CRDS))
def test_operator_objects_have_the_crds_fields(name: str) -> None:
    jsonschema.validate(load(name), CRDS[name])


@pytest.mark.parametrize(
    "name, path, value",
    [
        ("podmonitor.yaml", ("spec", "podMetricsEndpoints", 0, "intreval"), "60s"),
        ("podmonitor.yaml", ("spec", "podMetricsEndpoints", 0, "interval"), "1 minute"),
        ("prometheusrule.yaml", ("spec", "groups", 0, "rules", 0, "for"), "5 min"),
        ("prometheusrule.yaml", ("spec", "groups", 0, "rules", 0, "severity"), "page"),
    ],
)
def test_crd_check_catches_a_broken_field(name: str, path: Tuple[Any, ...], value: str) -> None:
    doc = copy.deepcopy(load(name))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, CRDS[name])


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", ["metrics-endpoints.yaml", "prometheus-rbac.yaml"])
def test_kubernetes_objects_validate(name: str, version: str) -> None:
    docs = list(yaml.safe_load_all((MON / name).read_text()))
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_prometheus_may_list_the_endpoint_pods() -> None:
    role, binding = yaml.safe_load_all((MON / "prometheus-rbac.yaml").read_text())
    ns = load("metrics-endpoints.yaml")["metadata"]["namespace"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == ns
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]


def test_podmonitor_scrapes_the_host_socket_on_the_installers_nodes() -> None:
    ds, pm = load("metrics-endpoints.yaml"), load("podmonitor.yaml")
    installer = yaml.safe_load((REPO / "deploy/daemonset.yaml").read_text())
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True  # the pod's IP is the node's: <IP>:9835 is the socket
    (port,) = spec["containers"][0]["ports"]
    assert port["containerPort"] == 9835
    socket = (REPO / "units/gpuguard-metrics.socket").read_text()
    assert "\nListenStream=9835\n" in socket
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == port["name"]
    assert (
        pm["spec"]["selector"]["matchLabels"].items()
        <= ds["spec"]["template"]["metadata"]["labels"].items()
    )
    assert pm["spec"]["namespaceSelector"]["matchNames"] == [ds["metadata"]["namespace"]]
    # the rules' job and node labels
    set_labels = {r["targetLabel"]: r for r in endpoint["relabelings"]}
    assert set_labels["job"]["replacement"] == "gpuguard"
    assert set_labels["node"]["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]
    # the same GPU nodes as the installer
    for key in ("affinity", "tolerations"):
        assert spec[key] == installer["spec"]["template"]["spec"][key]


def test_kustomization_names_existing_files() -> None:
    k = load("kustomization.yaml")
    for res in k["resources"]:
        assert (MON / res).is_file(), res
    for gen in k["configMapGenerator"]:
        for f in gen["files"]:
            assert (MON / f).is_file(), f
    # every manifest here is in it (the dashboard through its ConfigMap)
    listed = set(k["resources"]) | {f for g in k["configMapGenerator"] for f in g["files"]}
    assert listed == {p.name for p in MON.glob("*.yaml") if p.name != "kustomization.yaml"} | {
        DASHBOARD.name
    }


def test_scrape_config_passes_promtool(tmp_path: Path) -> None:
    """Debian's promtool is built without Kubernetes discovery: the relabelling and the
    rest are checked with the discovery swapped for a static target."""
    require_tool("promtool")
    doc = load("scrape-config.yml")
    (job,) = doc["scrape_configs"]
    assert job["job_name"] == "gpuguard" and job["kubernetes_sd_configs"] == [{"role": "node"}]
    del job["kubernetes_sd_configs"]
    job["static_configs"] = [{"targets": ["gpu-a:9835"]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(doc))
    r = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    targets = {r.get("target_label") for r in job["relabel_configs"]}
    assert {"__address__", "node", "instance"} <= targets


# --------------------------------------------------------------------- dashboard


def test_dashboard_panels_are_complete() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in dash["panels"]}
    for wanted in (
        "Repairs by kind and outcome",
        "Reload repair latency",
        "Versions across the fleet",
    ):
        assert wanted in titles
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
    names = {v["name"] for v in dash["templating"]["list"]}
    assert names == {"datasource", "node"}


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """Each query (Grafana's variables set) as a recording rule: promtool parses it."""
    require_tool("promtool")
    rules = [{"record": f"dashboard:query_{i}", "expr": e} for i, e in enumerate(dashboard_exprs())]
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules)} rules found" in r.stdout


def test_a_broken_query_fails_the_parse(tmp_path: Path) -> None:
    require_tool("promtool")
    path = tmp_path / "bad.rules.yml"
    bad = "sum by (kind (gpuguard_actions_total)"
    path.write_text(
        yaml.safe_dump({"groups": [{"name": "x", "rules": [{"record": "x:y", "expr": bad}]}]})
    )
    r = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode != 0


# ------------------------------------------------- names the real daemon serves


def documented_labels() -> Dict[str, Set[str]]:
    """docs/metrics.md's table: metric -> its label names."""
    out = {}
    for m in re.finditer(r"^\| `(gpuguard_\w+)` \| \w+ \| ([^|]*)\|", METRICS_MD.read_text(), re.M):
        out[m.group(1)] = set(re.findall(r"`(\w+)`", m.group(2)))
    return out


def exposition() -> Dict[str, Dict[str, Set[str]]]:
    """metric name (each sample's: _bucket, _total...) -> label name -> values seen,
    over every recorded scrape. A family the daemon declared (HELP, TYPE) without a
    series yet (a labelled counter before its first event) has its documented labels
    with no value seen."""
    out: Dict[str, Dict[str, Set[str]]] = {}
    docs = documented_labels()
    for path in sorted(FIXTURES.glob("*.prom")):
        text = path.read_text()
        for declared in re.findall(r"^# TYPE (\w+) ", text, re.M):
            if declared not in out and not any(
                f.name == declared or f.name + "_total" == declared
                for f in text_string_to_metric_families(text)
                if f.samples
            ):
                out[declared] = {k: set() for k in docs[declared]}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = out.setdefault(s.name, {})
                for k, v in s.labels.items():
                    labels.setdefault(k, set()).add(v)
    return out


SELECTOR = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
GROUPING = re.compile(r"\b(?:by|on|without|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def catalog_kinds() -> Set[str]:
    text = (REPO / "docs/gpuguard.catalog").read_text()
    return set(re.findall(r"^gpuguard kind: (\S+)$", text, re.M))


def test_every_metric_label_and_value_used_is_served() -> None:
    served = exposition()
    assert "gpuguard_node_condition_status" in served  # the recordings are there
    kinds = catalog_kinds()
    exprs = rule_exprs() + dashboard_exprs()
    all_labels = set(TARGET_LABELS) | {"le"}
    for labels in served.values():
        all_labels |= set(labels)
    for expr in exprs:
        for name in re.findall(r"\bgpuguard_[a-zA-Z0-9_]+", expr):
            assert name in served, f"{name} is not in the recorded scrapes: {expr}"
        for name, body in SELECTOR.findall(expr):
            known = served.get(name, {}) if name.startswith("gpuguard_") else {}
            other = OTHER_EXPORTERS.get(name)
            assert name.startswith("gpuguard_") or other is not None, (name, expr)
            for label, op, value in MATCHER.findall(body):
                if other is not None:
                    assert label in other | TARGET_LABELS, (name, label)
                    continue
                if label in TARGET_LABELS:
                    continue
                assert label in known, f"{name} has no label {label}: {expr}"
                if op != "=" and op != "!=":
                    if label == "kind":  # a regex of kinds: each one the catalog's
                        assert set(value.split("|")) <= kinds, value
                    continue
                if label == "outcome":
                    assert value in OUTCOMES, value
                elif label == "kind":
                    assert value in kinds, value
                else:
                    assert value in known[label], f"{name}{{{label}={value!r}}}: never served"
        for group in GROUPING.findall(expr):
            for label in filter(None, (x.strip() for x in group.split(","))):
                assert label in all_labels, f"by/on ({label}): no such label: {expr}"


def test_every_alert_has_its_runbook_section() -> None:
    doc = (REPO / "docs/alerts.md").read_text()
    sections = dict(re.findall(r"^### (\w+)\n(.*?)(?=^### |\Z)", doc, re.M | re.S))
    base = "https://github.com/gpuguard/gpuguard/blob/main/docs/alerts.md#"
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            name, notes = rule["alert"], rule["annotations"]
            assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
            assert notes["summary"] and notes["description"], name
            assert notes["runbook_url"] == base + name.lower(), name  # GitHub's anchor
            body = sections.get(name, "")
            for part in ("**Means**", "**Check**", "**Do**"):
                assert part in body, f"docs/alerts.md: {name} has no {part}"


def test_metrics_md_queries_parse(tmp_path: Path) -> None:
    """docs/metrics.md's queries, copied by hand into consoles: each one parses."""
    require_tool("promtool")
    block = METRICS_MD.read_text().split("```promql\n", 1)[1].split("```", 1)[0]
    queries, current = [], ""
    for line in block.splitlines():
        if line.startswith("#"):
            if current:
                queries.append(current)
            current = ""
        else:
            current += line + "\n"
    queries.append(current)
    rules = [{"record": f"docs:query_{i}", "expr": q} for i, q in enumerate(queries) if q.strip()]
    assert len(rules) >= 8
    path = tmp_path / "docs.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "docs", "rules": rules}]}))
    r = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
