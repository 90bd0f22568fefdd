"""metrics.py and metrics_http.py: what a pass turns into, the files, the HTTP reply."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuguard import cli
from gpuguard.metrics import RUNTIME_FILE, TEXTFILE_NAME, Metrics, MetricsOutput
from gpuguard.metrics_http import CONTENT_TYPE, listen, make_server
from gpuguard.paths import Root


def outcome(kind: str, status: str) -> dict[str, Any]:
    return {
        "kind": kind,
        "status": status,
        "target": "t",
        "reason": "r",
        "detail": "",
        "reconciler": "x",
        "fields": {},
    }


DENIED = {
    "kind": "container-device-denied",
    "reconciler": "container_access",
    "summary": "s",
    "severity": "warning",
    "fields": {"CONTAINER_ID": "c1"},
}


def a_pass(number: int = 1) -> tuple[dict[str, Any], dict[str, Any]]:
    now = time.time()
    last = {
        "number": number,
        "ended": now,
        "duration_ms": 40.0,
        "findings": [DENIED, DENIED],
        "outcomes": [
            outcome("cgroup-v1-allow", "done"),
            outcome("restart-plugin", "declined"),
            outcome("restart-plugin", "done"),
        ],
    }
    steps = {
        "container_access": {
            "pass": number,
            "ended": now,
            "error": None,
            "findings": [DENIED],
            "outcomes": [outcome("cgroup-v1-allow", "done")],
            "gauges": {"gpu_containers": 4},
        },
        "gpu_count": {
            "pass": number,
            "ended": now,
            "error": None,
            "outcomes": [],
            "gauges": {"gpus_pci": 8, "gpus_nvml": 7, "gpus_kubelet": 7},
            "findings": [
                {
                    "kind": "gpu-count-mismatch",
                    "reconciler": "gpu_count",
                    "summary": "NVML sees 7 of the 8",
                    "fields": {},
                }
            ],
        },
    }
    return last, {"steps": steps}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_a_pass_becomes_counters_gauges_and_a_histogram() -> None:
    m = Metrics()
    last, status = a_pass()
    m.observe_pass(last, status)
    m.observe_pass(*a_pass(2))
    s = samples(m.exposition().decode())
    assert s[("gpuguard_passes_total", ())] == 2
    assert s[("gpuguard_pass_duration_seconds_count", ())] == 2
    assert s[("gpuguard_pass_duration_seconds_bucket", (("le", "0.05"),))] == 2
    assert s[("gpuguard_pass_duration_seconds_bucket", (("le", "0.025"),))] == 0
    key = (("kind", "container-device-denied"), ("step", "container_access"))
    assert s[("gpuguard_findings_total", key)] == 4
    assert s[("gpuguard_open_findings", key)] == 1
    assert s[("gpuguard_actions_total", (("kind", "cgroup-v1-allow"), ("outcome", "done")))] == 2
    assert s[("gpuguard_plugin_restarts_total", (("outcome", "declined"),))] == 2
    assert s[("gpuguard_plugin_restarts_total", (("outcome", "done"),))] == 2
    assert s[("gpuguard_gpu_containers", ())] == 4
    assert s[("gpuguard_gpu_containers_without_access", ())] == 1
    assert s[("gpuguard_gpus", (("layer", "pci"),))] == 8
    assert s[("gpuguard_node_condition", (("condition", "GPUCountMismatch"),))] == 1
    assert s[("gpuguard_node_condition", (("condition", "GPUDeviceAccessLost"),))] == 0
    # a step that has not run: its condition is unknown, so absent
    assert not any(
        k[0] == "gpuguard_node_condition" and ("condition", "GPUDevicePluginStale") in k[1]
        for k in s
    )
    assert s[("gpuguard_last_pass_timestamp_seconds", ())] == pytest.approx(last["ended"], abs=5)
    (build,) = [k for k in s if k[0] == "gpuguard_build_info"]
    assert dict(build[1])["version"]


def test_output_writes_both_files_and_reports_an_error_once(tmp_path: Path) -> None:
    (tmp_path / "run/gpuguard").mkdir(parents=True)
    out = MetricsOutput(Metrics())
    assert out.publish(*a_pass(), Root(tmp_path), "/textfile") == [
        f"cannot write metrics to {tmp_path}/textfile/{TEXTFILE_NAME}: No such file or directory"
    ]
    assert out.publish(*a_pass(2), Root(tmp_path), "/textfile") == []  # said once
    (tmp_path / "textfile").mkdir()
    assert out.publish(*a_pass(3), Root(tmp_path), "/textfile") == []
    runtime = (tmp_path / RUNTIME_FILE.lstrip("/")).read_bytes()
    assert runtime == (tmp_path / "textfile" / TEXTFILE_NAME).read_bytes()
    assert b"gpuguard_passes_total 3.0" in runtime
    assert [p.name for p in (tmp_path / "textfile").iterdir()] == [TEXTFILE_NAME]  # no temp left
    assert (tmp_path / "textfile" / TEXTFILE_NAME).stat().st_mode & 0o777 == 0o644


def test_http_serves_the_file_and_says_why_when_there_is_none(tmp_path: Path) -> None:
    path = tmp_path / "metrics.prom"
    server = make_server(listen("127.0.0.1:0"), path)
    port = server.server_address[1]
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert e.value.code == 503 and b"is gpuguard.service running" in e.value.read()
        path.write_bytes(b"gpuguard_passes_total 1.0\n")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert r.headers["Content-Type"] == CONTENT_TYPE
            assert r.read() == b"gpuguard_passes_total 1.0\n"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=5)
        assert e.value.code == 404
    finally:
        server.shutdown()
        server.server_close()


def test_cli_metrics_prints_the_file_or_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["metrics", "--root", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.prom" in err and "gpuguard.service" in err
    f = tmp_path / RUNTIME_FILE.lstrip("/")
    f.parent.mkdir(parents=True)
    f.write_text("gpuguard_passes_total 2.0\n")
    assert cli.main(["metrics", "--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "gpuguard_passes_total 2.0\n"
    assert cli.main(["metrics", "--serve", "--root", str(tmp_path)]) == 2
    assert "gpuguard-metrics.socket" in capsys.readouterr().err


def test_a_metrics_bug_is_logged_once_and_never_raised(tmp_path: Path) -> None:
    import io
    import json

    from gpuguard.log import EventLog

    class Broken(Metrics):
        def observe_pass(self, last_pass: Any, status: Any) -> None:
            raise KeyError("kind")

    out = io.StringIO()
    output = MetricsOutput(Broken())
    for n in (1, 2):
        output.after_pass(*a_pass(n), Root(tmp_path), None, EventLog(stream=out))
    entries = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["kind"] for e in entries] == ["metrics-failed"]
    assert "metrics disabled: KeyError" in entries[0]["msg"]
    assert output.broken
