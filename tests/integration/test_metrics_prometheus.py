"""Metrics end to end: the real daemon on a real systemd writes them, the repo's
gpuguard-metrics.socket serves them (its sandboxed service renders them at each
scrape), a real Prometheus scrapes the endpoint, a real node_exporter reads the
textfile, and promtool accepts both.

Everything runs inside the namespace's private network (loopback only), on ports the
kernel picks there; Prometheus and node_exporter are children of the namespace,
stopped by PID with it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import require_tool
from integration.gpuguard_ns import GPUGUARD, REPO, gpuguard_units, setup_node, status, wait_for
from integration.harness import systemd_ns as systemd_ns

pytestmark = pytest.mark.root

TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"
FETCH = (
    "import sys, urllib.request; "
    "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"
)
PORTS = (
    "import socket; s = [socket.socket() for _ in range(3)]; "
    "[x.bind(('127.0.0.1', 0)) for x in s]; print(*[x.getsockname()[1] for x in s])"
)


def metrics_units(port: int) -> dict[str, str]:
    return {
        "gpuguard-metrics.socket": (REPO / "units/gpuguard-metrics.socket").read_text(),
        "gpuguard-metrics.socket.d/50-test.conf": (
            f"[Socket]\nListenStream=\nListenStream=127.0.0.1:{port}\n"
        ),
        "gpuguard-metrics.service": (REPO / "units/gpuguard-metrics.service").read_text(),
        "gpuguard-metrics.service.d/50-checkout.conf": (
            f"[Service]\nExecStart=\nExecStart={GPUGUARD} metrics --serve\n"
            f"BindReadOnlyPaths={REPO}\n"
        ),
    }


def fetch(ns: Any, url: str) -> str:
    return str(ns.run(["python3", "-c", FETCH, url], check=True).stdout)


def query(ns: Any, prom: int, expr: str) -> list[dict[str, Any]]:
    from urllib.parse import quote

    doc = json.loads(fetch(ns, f"http://127.0.0.1:{prom}/api/v1/query?query={quote(expr)}"))
    assert doc["status"] == "success", doc
    return list(doc["data"]["result"])


def promtool(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )


def test_prometheus_scrapes_endpoint_and_node_exporter_textfile(systemd_ns, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    require_tool("prometheus", "prometheus-node-exporter", "promtool")
    ns = systemd_ns(units={**gpuguard_units(), **metrics_units(0)}, extra_mask=())
    metrics_port, node_port, prom_port = map(
        int, ns.run(["python3", "-c", PORTS], check=True).stdout.split()
    )
    ns.write_unit(
        "gpuguard-metrics.socket.d/50-test.conf",
        f"[Socket]\nListenStream=\nListenStream=127.0.0.1:{metrics_port}\n",
        reload=True,
    )
    setup_node(ns, stale=True, config=f"[Metrics]\nTextfileDirectory={TEXTFILE_DIR}\n")
    ns.path(TEXTFILE_DIR).mkdir(parents=True, exist_ok=True)
    ns.systemctl("start", "gpuguard.service")
    wait_for(lambda: status(ns).get("passes", 0) >= 1, what="first pass")
    ns.systemctl("start", "gpuguard-metrics.socket")

    # what the daemon exported: its values as JSON, rendered by `gpuguard metrics`, and
    # the textfile it rendered itself (TextfileDirectory= set); promtool-clean
    state = wait_for(lambda: ns.path("/run/gpuguard/metrics.json").read_text(), what="metrics")
    assert json.loads(state)["families"]["gpuguard_passes"][0]["value"] >= 1
    runtime = ns.run([str(GPUGUARD), "metrics"], check=True).stdout
    textfile = ns.path(f"{TEXTFILE_DIR}/gpuguard.prom").read_text()
    assert "gpuguard_passes_total" in runtime and "gpuguard_build_info{" in textfile
    assert "gpuguard_passes_created" in textfile  # prometheus_client's, not hand-made
    for text in (runtime, textfile):
        r = promtool(text)
        assert r.returncode == 0, r.stdout + r.stderr

    # the socket-activated endpoint, as a scraper sees it
    try:
        served = fetch(ns, f"http://127.0.0.1:{metrics_port}/metrics")
    except Exception as e:
        log = ns.run(["journalctl", "--no-pager", "-u", "gpuguard-metrics", "-n", "30"]).stdout
        raise AssertionError(f"{e}\n{log}") from None
    assert "gpuguard_pass_duration_seconds_bucket" in served
    r = promtool(served)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ns.unit_property("gpuguard-metrics.service", "ActiveState") == "active"

    ns.popen(
        [
            "prometheus-node-exporter",
            f"--web.listen-address=127.0.0.1:{node_port}",
            "--collector.disable-defaults",
            "--collector.textfile",
            f"--collector.textfile.directory={TEXTFILE_DIR}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    prom_dir = ns.path("/tmp/prometheus")
    prom_dir.mkdir()
    (prom_dir / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: gpuguard\n    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n"
        f"  - job_name: node\n    static_configs: [{{targets: ['127.0.0.1:{node_port}']}}]\n"
    )
    ns.popen(
        [
            "prometheus",
            "--config.file=/tmp/prometheus/prometheus.yml",
            "--storage.tsdb.path=/tmp/prometheus/data",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def both_jobs() -> Any:
        try:
            got = query(ns, prom_port, "gpuguard_build_info")
        except Exception:
            return None
        jobs = {r["metric"]["job"] for r in got}
        return got if jobs == {"gpuguard", "node"} else None

    got = wait_for(both_jobs, timeout=60, what="Prometheus scraped both gpuguard and node_exporter")
    assert all(r["value"][1] == "1" for r in got)
    up = {r["metric"]["job"]: r["value"][1] for r in query(ns, prom_port, "up")}
    assert up == {"gpuguard": "1", "node": "1"}
    passes = query(ns, prom_port, 'gpuguard_passes_total{job="gpuguard"}')
    assert float(passes[0]["value"][1]) >= 1
    done = [o["kind"] for o in status(ns)["first_pass"]["outcomes"] if o["status"] == "done"]
    assert done, "the stale checkpoint should have been repaired"
    counted = query(ns, prom_port, f'gpuguard_actions_total{{kind="{done[0]}",outcome="done"}}')
    assert {r["metric"]["job"] for r in counted} == {"gpuguard", "node"}
    gpus = query(ns, prom_port, 'gpuguard_gpus{job="gpuguard",layer="nvml"}')
    assert [float(r["value"][1]) for r in gpus] == [float(status(ns)["last_pass"]["gpus"])]
