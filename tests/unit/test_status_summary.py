"""gpuguard status: the one-screen summary (node verdict, last pass, repairs in the last
hour) before the per-container table."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

import statusdoc
from gpuguard import cli
from gpuguard.host.statefile import SchemaError
from gpuguard.reporting.container_row import Access, ContainerRow
from gpuguard.reporting.summary import render, summarize
from unit.doctor_support import status_file
from unit.test_npd import finding, steps


def row(access: Access) -> ContainerRow:
    """A GPU container read now, judged `access`."""
    return ContainerRow("p", "c" * 64, None, "cgroupfs", "v1", "v1-rule", access)


def change(kind: str, age: float, status: str = "done") -> dict[str, object]:
    return {"time": time.time() - age, "step": "s", "kind": kind, "status": status, "target": "t"}


def test_summary_counts_repairs_of_the_last_hour_only(tmp_path: Path) -> None:
    doc: dict[str, object] = {"steps": steps()}
    doc["recent_changes"] = [
        change("cgroup-v1-allow", 60),
        change("cgroup-v1-allow", 120),
        change("unit-device-allow", 30),
        change("plugin-restarted", 4000),
        change("restart-plugin", 10, status="declined"),
    ]
    summary = summarize(statusdoc.model(doc), "", [])
    s = summary.to_json()
    assert s["verdict"] == "ok" and s["repairs_last_hour"] == 3
    assert s["repairs_by_kind"] == {"cgroup-v1-allow": 2, "unit-device-allow": 1}
    text = "\n".join(render(summary))
    assert "repairs:    3 in the last hour (2 cgroup-v1-allow, 1 unit-device-allow)" in text
    assert text.startswith("node:       OK")


def test_problem_and_unknown_verdicts() -> None:
    now = time.time()
    doc = {
        "pid": 1,
        "steps": steps(gpu_count={"findings": [finding("gpu-count-mismatch", "lost 1")]}),
        "last_pass": {
            "number": 7,
            "ended": now - 3,
            "reasons": ["periodic audit"],
            "findings": [finding("gpu-count-mismatch")],
        },
    }
    summary = summarize(statusdoc.model(doc), "", [], now=now)
    s = summary.to_json()
    assert s["verdict"] == "problem" and s["problems"] == ["GPUCountMismatch: lost 1"]
    assert "last pass:  3s ago (pass 7: periodic audit), 1 finding(s)" in render(summary)
    s = summarize(None, "no /run/gpuguard/status.json: gpuguard daemon not running", []).to_json()
    assert s["verdict"] == "unknown" and s["last_pass"] is None
    s = summarize(None, "no status", [row(access="denied")]).to_json()
    assert s["verdict"] == "problem"  # what the table sees now counts without the daemon


def test_cli_status_prints_the_summary_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status_file(tmp_path, steps=steps())
    assert cli.main(["status", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "node:       OK"
    assert out[1].startswith("last pass:  ") and out[2].startswith("repairs:    0 in the last hour")
    assert any(line.startswith("containers: not read now") for line in out[3:])
    assert cli.main(["status", "--root", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"]["verdict"] == "ok" and doc["containers"] == []


def test_the_last_reload_repair_is_summarised() -> None:
    doc: dict[str, Any] = {
        "pid": 1,
        "steps": steps(),
        "fast_paths": {
            "reload": {"signal": 100.0, "restored": 100.0554, "containers": 200, "checked": 200}
        },
        "reload_signal": {
            "last_via": "private-socket",
            "private_socket": True,
            "reloads": 1,
            "received": {},
        },
    }
    summary = summarize(statusdoc.model(doc), "", [])
    s = summary.to_json()
    want = {
        "observe": False,
        "containers": 200,
        "checked": 200,
        "repair_ms": 55.4,
        "via": "private-socket",
    }
    assert s["last_reload"] == want
    assert (
        "last reload: 200 of 200 known GPU container(s) re-granted on the signal, the last "
        "55.4 ms after it (signal via private-socket)"
    ) in render(summary)
    doc["fast_paths"] = {"reload": {"signal": 1.0, "restored": None, "containers": 0, "checked": 3}}
    assert "last reload: none of 3 known GPU container(s) had lost a device" in "\n".join(
        render(summarize(statusdoc.model(doc), "", []))
    )
    doc["fast_paths"] = {"reload": {"signal": 1.0, "restored": None, "containers": 2, "checked": 3}}
    assert "2 re-grant(s) tried on the signal, none read back done" in "\n".join(
        render(summarize(statusdoc.model(doc), "", []))
    )
    doc["mode"] = "observe"  # plans only: nothing was tried
    text = "\n".join(render(summarize(statusdoc.model(doc), "", [])))
    assert "re-grant(s) tried" not in text and "re-granted" not in text
    assert "last reload: observe mode: 2 of 3 known GPU container(s) had lost a device; " in text
    assert "planned, not tried" in text
    del doc["mode"]
    doc["fast_paths"] = {}
    assert summarize(statusdoc.model(doc), "", []).to_json()["last_reload"] is None
    for broken in ({"reload": "x"}, {"reload": {"signal": "soon"}}, "x"):
        doc["fast_paths"] = broken
        with pytest.raises(SchemaError):  # the loader refuses the file: status unknown
            statusdoc.model(doc)


def test_the_containers_line_never_counts_what_it_could_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No NVIDIA driver in /proc/devices: nothing judged, which is no "0 with GPUs";
    a container the daemon's latest results name and this read did not list is said."""
    cid = "c" * 64
    named = finding("container-access-lost", "pod p: lost /dev/nvidia0")
    named["fields"] = {"CONTAINER_ID": cid}
    status_file(tmp_path, steps=steps(container_access={"findings": [named]}))
    cli.main(["status", "--root", str(tmp_path)])
    out = capsys.readouterr().out
    assert "containers: not read now (no NVIDIA driver in /proc/devices)" in out
    assert "0 with GPUs" not in out
    (tmp_path / "proc").mkdir(exist_ok=True)
    (tmp_path / "proc/devices").write_text("Character devices:\n195 nvidia-frontend\n")
    cli.main(["status", "--root", str(tmp_path)])
    out = capsys.readouterr().out
    assert (
        "containers: 0 with GPUs; the daemon's latest results name 1 more (cccccccccccc), "
        "not read now as GPU containers"
    ) in out
