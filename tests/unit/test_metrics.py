"""metrics_state.py, metrics.py and metrics_http.py: what a pass turns into, the files,
the HTTP reply."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import statusdoc
from conftest import REPO
from gpuguard import __commit__, cli, package_version
from gpuguard.host.paths import Root
from gpuguard.reporting.metrics import render, render_file
from gpuguard.reporting.metrics_file import SPEC
from gpuguard.reporting.metrics_http import CONTENT_TYPE, listen, make_server
from gpuguard.reporting.metrics_output import MetricsOutput
from gpuguard.reporting.metrics_state import (
    MISSING_LIBRARY,
    STATE_FILE,
    STATE_MAX,
    TEXTFILE_NAME,
    MetricsState,
    unimportable,
)
from gpuguard.reporting.status import PassRecord, Status


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


def a_pass(number: int = 1) -> tuple[PassRecord, Status]:
    last, steps = a_pass_doc(number)
    return typed(last, steps)


def typed(last: dict[str, Any], steps: dict[str, Any]) -> tuple[PassRecord, Status]:
    """The pass and status documents through the status file's own loader."""
    status = statusdoc.model({"last_pass": last, "steps": steps})
    assert status.last_pass is not None
    return status.last_pass, status


def a_pass_doc(number: int = 1) -> tuple[dict[str, Any], dict[str, Any]]:
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
    return last, steps


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_a_plan_repeated_by_every_pass_is_one_dry_run_action() -> None:
    """Observe mode plans the same change at every pass while the loss lasts: counted
    when the plan appears (and again once it went away and came back), not per pass."""
    m = MetricsState()

    def observe_pass(number: int, targets: list[str], ran: tuple[str, ...] = ("x",)) -> float:
        last, steps = a_pass_doc(number)
        last["reconcilers"] = list(ran)
        last["outcomes"] = [{**outcome("cgroup-v1-allow", "dry-run"), "target": t} for t in targets]
        m.observe_pass(*typed(last, steps))
        key = (("kind", "cgroup-v1-allow"), ("outcome", "dry-run"))
        return samples(render(m.to_values()).decode()).get(("gpuguard_actions_total", key), 0)

    assert observe_pass(1, ["c1"]) == 1
    assert observe_pass(2, ["c1"]) == 1  # the same plan again
    assert observe_pass(3, ["c1", "c2"]) == 2  # a new one
    assert observe_pass(4, [], ran=("other",)) == 2  # a pass without that step
    assert observe_pass(5, ["c1", "c2"]) == 2
    assert observe_pass(6, []) == 2  # repaired meanwhile (the step ran, planned nothing)
    assert observe_pass(7, ["c1"]) == 3  # lost again: a new event


def test_a_pass_becomes_counters_gauges_and_a_histogram() -> None:
    m = MetricsState()
    last, status = a_pass()
    m.observe_pass(last, status)
    m.observe_pass(*a_pass(2))
    s = samples(render(m.to_values()).decode())
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
    assert (
        s[
            (
                "gpuguard_node_condition_status",
                (("condition", "GPUCountMismatch"), ("status", "true")),
            )
        ]
        == 1
    )
    key = (("condition", "GPUDevicePluginStale"), ("status", "unknown"))
    assert s[("gpuguard_node_condition_status", key)] == 1
    key = (("condition", "GPUDeviceAccessLost"), ("status", "false"))
    assert s[("gpuguard_node_condition_status", key)] == 1
    assert s[("gpuguard_last_pass_timestamp_seconds", ())] == pytest.approx(last.ended, abs=5)
    (build,) = [k for k in s if k[0] == "gpuguard_build_info"]
    labels = dict(build[1])
    assert labels["version"] == package_version() and labels["commit"] == (__commit__ or "unknown")


def test_output_writes_the_state_and_the_textfile_and_reports_an_error_once(
    tmp_path: Path,
) -> None:
    (tmp_path / "run/gpuguard").mkdir(parents=True)
    out = MetricsOutput(MetricsState())
    assert out.publish(*a_pass(), Root(tmp_path), "/textfile") == [
        f"cannot write metrics to {tmp_path}/textfile/{TEXTFILE_NAME}: No such file or directory"
    ]
    assert out.publish(*a_pass(2), Root(tmp_path), "/textfile") == []  # said once
    (tmp_path / "textfile").mkdir()
    assert out.publish(*a_pass(3), Root(tmp_path), "/textfile") == []
    state = tmp_path / STATE_FILE.lstrip("/")
    textfile = tmp_path / "textfile" / TEXTFILE_NAME
    doc = json.loads(state.read_bytes())
    assert doc["format"] == 1 and doc["families"]["gpuguard_passes"][0]["value"] == 3.0
    assert textfile.read_bytes() == render_file(state)  # what gpuguard metrics serves, too
    assert b"gpuguard_passes_total 3.0" in textfile.read_bytes()
    assert [p.name for p in (tmp_path / "textfile").iterdir()] == [TEXTFILE_NAME]  # no temp left
    assert [p.name for p in state.parent.iterdir()] == ["metrics.json"]
    for f in (state, textfile):
        assert f.stat().st_mode & 0o777 == 0o644


def test_without_the_library_the_state_is_still_written_and_the_textfile_missing_said_once(
    tmp_path: Path,
) -> None:
    (tmp_path / "run/gpuguard").mkdir(parents=True)
    (tmp_path / "textfile").mkdir()
    tries = []

    def missing() -> Any:
        tries.append(1)
        raise ModuleNotFoundError("No module named 'prometheus_client'", name="prometheus_client")

    out = MetricsOutput(MetricsState(), renderer=missing)
    want = f"cannot write metrics to {tmp_path}/textfile/{TEXTFILE_NAME}: {MISSING_LIBRARY}"
    assert out.publish(*a_pass(), Root(tmp_path), "/textfile") == [want]
    assert out.publish(*a_pass(2), Root(tmp_path), "/textfile") == []
    assert not (tmp_path / "textfile" / TEXTFILE_NAME).exists()
    doc = json.loads((tmp_path / STATE_FILE.lstrip("/")).read_bytes())
    assert doc["families"]["gpuguard_passes"][0]["value"] == 2.0
    # without a textfile nothing needs the library, and nothing is said
    assert out.publish(*a_pass(3), Root(tmp_path), None) == []
    assert len(tries) == 2


def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


def _serving(path: Path, render: Any) -> Any:
    server = make_server(listen("127.0.0.1:0"), path, render)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_http_renders_the_state_and_says_why_when_it_cannot(tmp_path: Path) -> None:
    path = tmp_path / "metrics.json"
    server = _serving(path, render_file)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        code, _, body = _get(f"{url}/metrics")
        assert code == 503 and body.count(b"\n") == 1
        assert str(path).encode() in body and b"is gpuguard.service running" in body
        state = MetricsState()
        state.observe_pass(*a_pass())
        path.write_bytes(SPEC.encode(state.to_values()))
        code, ctype, body = _get(f"{url}/metrics")
        assert (code, ctype) == (200, CONTENT_TYPE)
        assert body == render(state.to_values())
        assert b"gpuguard_passes_total 1.0" in body
        path.write_text('{"format": 1, "fam')  # corrupt
        code, _, body = _get(f"{url}/metrics")
        assert code == 503 and body.count(b"\n") == 1 and b"not a gpuguard metrics state" in body
        with open(path, "r+b") as f:  # oversized
            f.truncate(STATE_MAX + 1)
        code, _, body = _get(f"{url}/metrics")
        assert code == 503 and body.count(b"\n") == 1 and b"limit" in body
        code, _, _ = _get(f"{url}/other")
        assert code == 404
    finally:
        server.shutdown()
        server.server_close()


def test_http_without_the_library_answers_503_with_the_reason(tmp_path: Path) -> None:
    server = _serving(tmp_path / "metrics.json", None)
    try:
        code, _, body = _get(f"http://127.0.0.1:{server.server_address[1]}/metrics")
        assert (code, body) == (503, f"no metrics: {MISSING_LIBRARY}\n".encode())
    finally:
        server.shutdown()
        server.server_close()


def test_cli_metrics_prints_the_rendered_state_or_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["metrics", "--root", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.json" in err and "gpuguard.service" in err
    f = tmp_path / STATE_FILE.lstrip("/")
    f.parent.mkdir(parents=True)
    state = MetricsState()
    state.observe_pass(*a_pass())
    f.write_bytes(SPEC.encode(state.to_values()))
    assert cli.main(["metrics", "--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out == render(state.to_values()).decode()
    f.write_text("[]")
    assert cli.main(["metrics", "--root", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not an object" in err and "Traceback" not in err
    assert cli.main(["metrics", "--serve", "--root", str(tmp_path)]) == 2
    assert "gpuguard-metrics.socket" in capsys.readouterr().err


def test_a_metrics_bug_is_logged_once_and_never_raised(tmp_path: Path) -> None:
    import io

    from gpuguard.journal.log import EventLog

    class Broken(MetricsState):
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


MISSING = """
import sys
sys.modules["prometheus_client"] = None  # as on a host without python3-prometheus-client
from pathlib import Path
from gpuguard.cli import main
from gpuguard.reporting.metrics_output import MetricsOutput
from gpuguard.reporting.metrics_state import MetricsState
from gpuguard.host.paths import Root
sys.path.insert(0, sys.argv[2])
import statusdoc
status = statusdoc.model({"last_pass": {"number": 1}})
root = Path(sys.argv[1])
errors = MetricsOutput(MetricsState()).publish(status.last_pass, status, Root(root), "/textfile")
print(*errors, sep="\\n")
sys.exit(main(["metrics", "--root", str(root)]))
"""


def test_without_the_library_gpuguard_metrics_says_so_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "run/gpuguard").mkdir(parents=True)
    (tmp_path / "textfile").mkdir()
    p = subprocess.run(
        [sys.executable, "-c", MISSING, str(tmp_path), str(REPO / "tests")],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert p.returncode == 2, p.stderr
    assert p.stderr == f"gpuguard: {MISSING_LIBRARY}\n"
    textfile = tmp_path / "textfile" / TEXTFILE_NAME
    assert p.stdout == f"cannot write metrics to {textfile}: {MISSING_LIBRARY}\n"
    assert (tmp_path / STATE_FILE.lstrip("/")).exists() and not textfile.exists()


MISSING_DEPENDENCY = """
import sys
sys.path.insert(0, sys.argv[3])  # a prometheus_client that imports `decorator`, as Debian's
sys.modules["decorator"] = None  # as on a host without python3-decorator
from pathlib import Path
from gpuguard.cli import main
from gpuguard.reporting.metrics_output import MetricsOutput
from gpuguard.reporting.metrics_state import MetricsState
from gpuguard.host.paths import Root
sys.path.insert(0, sys.argv[2])
import statusdoc
status = statusdoc.model({"last_pass": {"number": 1}})
root = Path(sys.argv[1])
errors = MetricsOutput(MetricsState()).publish(status.last_pass, status, Root(root), "/textfile")
print(*errors, sep="\\n")
sys.exit(main(["metrics", "--root", str(root)]))
"""


def test_a_module_the_library_needs_is_named_in_one_line_not_a_crash(tmp_path: Path) -> None:
    """Debian's python3-prometheus-client imports python3-decorator's `decorator`; without
    it `gpuguard metrics` exited 70 with a traceback."""
    lib = tmp_path / "lib" / "prometheus_client"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("import decorator\n")
    (tmp_path / "run/gpuguard").mkdir(parents=True)
    (tmp_path / "textfile").mkdir()
    p = subprocess.run(
        [sys.executable, "-c", MISSING_DEPENDENCY, str(tmp_path), str(REPO / "tests"),
         str(tmp_path / "lib")],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"},
        check=False,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert "'decorator'" in p.stderr and "python3-decorator" in p.stderr, p.stderr
    textfile = tmp_path / "textfile" / TEXTFILE_NAME
    assert (
        p.stdout.startswith(f"cannot write metrics to {textfile}: ") and "'decorator'" in p.stdout
    )
    assert (tmp_path / STATE_FILE.lstrip("/")).exists() and not textfile.exists()


def test_an_import_error_of_gpuguard_itself_stays_a_bug() -> None:
    assert unimportable(ImportError("x", name="gpuguard.reporting.metrics")) is None
    assert unimportable(ModuleNotFoundError("x", name="prometheus_client")) == MISSING_LIBRARY
    assert "'decorator'" in (unimportable(ModuleNotFoundError("x", name="decorator")) or "")
