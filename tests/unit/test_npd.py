"""gpuguard npd: node-problem-detector conditions from the status file, and the shipped
monitor configuration checked against NPD's schema."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gpuguard import cli
from gpuguard.engine import passes
from gpuguard.host.paths import Root
from gpuguard.reporting.npd import (
    CONDITIONS,
    DEFAULT_MAX_LENGTH,
    OK,
    PROBLEM,
    STATUS_FILE,
    UNKNOWN,
    answer,
    monitor_config,
    one_line,
)
from unit.doctor_support import DAEMON_PID, status_file, write
from unit.npd_schema import SCHEMA, npd_semantic_errors

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "share/node-problem-detector/gpuguard-monitor.json"
SCRIPT = REPO / "hooks/npd-condition"
INSTALLED_SCRIPT = "/usr/libexec/gpuguard/npd-condition"

STEP_OF = {c.name: c.steps[0] for c in CONDITIONS}
KIND_OF = {
    "device-access": "container-device-denied",
    "checkpoint": "checkpoint-stale-entry",
    "device-plugin": "plugin-not-registered",
    "gpu-count": "gpu-count-mismatch",
    "gpu-pods": "gpu-pod-rejected",
}


def finding(kind: str, summary: str = "something is wrong") -> dict[str, Any]:
    return {"kind": kind, "reconciler": "x", "summary": summary, "severity": "error", "fields": {}}


def outcome(status: str) -> dict[str, Any]:
    return {"kind": "some-action", "target": "t", "status": status, "reason": "r", "detail": ""}


def steps(**overrides: dict[str, Any]) -> dict[str, Any]:
    now = time.time()
    out: dict[str, Any] = {
        s: {"pass": 3, "ended": now - 5, "error": None, "findings": [], "outcomes": []}
        for s in STEP_OF.values()
    }
    out["gpu_count"]["gauges"] = {"gpus_pci": 2, "gpus_nvml": 2, "gpus_kubelet": 2}
    for name, st in overrides.items():
        out[name].update(st)
    return out


@pytest.mark.parametrize("name", sorted(STEP_OF))
def test_each_condition_ok_problem_repaired(tmp_path: Path, name: str) -> None:
    step = STEP_OF[name]
    status_file(tmp_path, steps=steps())
    code, msg = answer(Root(tmp_path), name)
    assert code == OK and msg
    status_file(tmp_path, steps=steps(**{step: {"findings": [finding(KIND_OF[name], "lost it")]}}))
    assert answer(Root(tmp_path), name) == (PROBLEM, "lost it")
    # another condition's finding in the same step does not count
    other = "plugin-nvml-unchecked" if name != "device-access" else "char-link-missing"
    status_file(tmp_path, steps=steps(**{step: {"findings": [finding(other)]}}))
    assert answer(Root(tmp_path), name)[0] == OK
    # repaired in the same pass: every outcome done or already so
    repaired = {
        "findings": [finding(KIND_OF[name])],
        "outcomes": [outcome("done"), outcome("skipped")],
    }
    status_file(tmp_path, steps=steps(**{step: repaired}))
    assert answer(Root(tmp_path), name)[0] == OK
    declined = {
        "findings": [finding(KIND_OF[name], "a"), finding(KIND_OF[name])],
        "outcomes": [outcome("done"), outcome("declined")],
    }
    status_file(tmp_path, steps=steps(**{step: declined}))
    assert answer(Root(tmp_path), name) == (PROBLEM, "a (+1 more)")


@pytest.mark.parametrize(
    "setup, reason",
    [
        (lambda r: None, "no /run/gpuguard/status.json: gpuguard daemon not running"),
        (lambda r: write(r, STATUS_FILE, '{"pid": 4242, "steps": {"che'), "not JSON"),
        (lambda r: write(r, STATUS_FILE, '"just a string"'), "not a gpuguard status file"),
        (lambda r: (r / "run/gpuguard/status.json").mkdir(parents=True), "is a directory"),
        (
            lambda r: (status_file(r, steps=steps()), os.rmdir(r / f"proc/{DAEMON_PID}")),
            "pid 4242) is gone",
        ),
        (
            lambda r: status_file(r, steps=steps(gpu_count={"unknown": ["no GPU inventory"]})),
            "no GPU inventory",
        ),
        (lambda r: status_file(r, steps={}), "no gpu_count check has run yet"),
        (
            lambda r: status_file(r, steps=steps(gpu_count={"error": "ValueError: boom"})),
            "gpu_count check failed: ValueError: boom",
        ),
        (
            lambda r: status_file(r, steps=steps(gpu_count={"ended": time.time() - 9000})),
            "older than 7200s",
        ),
    ],
)
def test_unknown_with_the_reason(tmp_path: Path, setup: Any, reason: str) -> None:
    setup(tmp_path)
    code, msg = answer(Root(tmp_path), "gpu-count")
    assert code == UNKNOWN
    assert reason in msg


def test_cli_exit_codes_and_one_bounded_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    long = "container 0123456789ab of pod 7f0c lost /dev/nvidia0 (195:0) after daemon-reload; " * 4
    status_file(
        tmp_path,
        steps=steps(
            container_access={
                "findings": [finding("container-device-denied", long + "\nsecond line \u00e9")]
            }
        ),
    )
    code = cli.main(["npd", "device-access", "--root", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == PROBLEM
    assert out.count("\n") == 1 and len(out.rstrip("\n").encode()) <= DEFAULT_MAX_LENGTH
    assert out.startswith("container 0123456789ab") and out.rstrip().endswith("...")
    assert cli.main(["npd", "gpu-count", "--root", str(tmp_path)]) == OK
    assert cli.main(["npd", "gpu-count", "--root", str(tmp_path / "nowhere")]) == UNKNOWN
    assert "not running" in capsys.readouterr().out
    assert cli.main(["npd", "gpu-count", "--root", str(tmp_path), "--max-length", "20"]) == OK
    assert len(capsys.readouterr().out.rstrip("\n")) == 20


def test_one_line_is_ascii_and_bounded() -> None:
    assert one_line("a\nb\tc  d", 80) == "a b c d"
    assert one_line("\u00e9" * 100, 10) == "???????..."
    assert one_line("x" * 80, 80) == "x" * 80


def test_status_file_path_matches_the_daemons() -> None:
    assert STATUS_FILE == passes.STATUS_FILE


def test_shipped_config_is_generated_and_valid_for_npd() -> None:
    shipped = json.loads(SHIPPED.read_text())
    assert shipped == monitor_config(INSTALLED_SCRIPT)
    jsonschema.validate(shipped, SCHEMA)
    assert npd_semantic_errors(shipped) == []
    assert [r["args"] for r in shipped["rules"]] == [[c.name] for c in CONDITIONS]
    for c in shipped["conditions"] + shipped["rules"]:
        assert re.fullmatch(r"[A-Z][A-Za-z0-9]+", c["reason"]), c["reason"]  # CamelCase


def test_schema_rejects_what_npd_rejects() -> None:
    cfg = monitor_config(INSTALLED_SCRIPT)
    bad_plugin = {**cfg, "plugin": "other"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad_plugin, SCHEMA)
    bad_type = {**cfg, "rules": [{**cfg["rules"][0], "type": "perm"}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad_type, SCHEMA)
    typo = {**cfg, "pluginConfig": {**cfg["pluginConfig"], "max_output_lenght": 80}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(typo, SCHEMA)
    orphan = {**cfg, "conditions": cfg["conditions"][1:]}
    assert npd_semantic_errors(orphan)
    slow = {**cfg, "rules": [{**cfg["rules"][0], "timeout": "10s"}]}
    assert npd_semantic_errors(slow)


def test_plugin_script_runs_gpuguard_npd_or_says_unknown() -> None:
    text = SCRIPT.read_text()
    assert os.access(SCRIPT, os.X_OK)
    assert 'exec /usr/bin/gpuguard npd "$@"' in text
    assert "exit 2" in text


@pytest.mark.parametrize("kind", ["container-unreadable", "gpu-process-unattributed"])
def test_a_container_gpuguard_cannot_audit_is_never_ok(tmp_path: Path, kind: str) -> None:
    """A scope whose processes gpuguard cannot place, or GPU processes in a kubepods
    cgroup that is no container it knows (issue 25: crun's containers went unseen while
    the node said OK): the device-access condition is a problem, with the path."""
    cg = "/sys/fs/cgroup/kubepods.slice/x.scope"
    status_file(tmp_path, steps=steps(container_access={"findings": [finding(kind, cg)]}))
    assert answer(Root(tmp_path), "device-access") == (PROBLEM, cg)


def test_the_parser_offers_exactly_the_conditions() -> None:
    """The parser takes the names from reporting/npd_names.py, so that building it loads
    no condition: they must be npd.CONDITIONS' own, in their order."""
    from gpuguard.reporting import npd, npd_names

    assert tuple(c.name for c in npd.CONDITIONS) == npd_names.NAMES
    assert (npd.DEFAULT_MAX_AGE, npd.DEFAULT_MAX_LENGTH) == (7200.0, 80)
