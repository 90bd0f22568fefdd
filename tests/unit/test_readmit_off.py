"""A bridge that cannot run says so: ``gpuguard readmit`` writes its state (decision
"off" with the cause) even when it stays off; the daemon's readmit step makes that a
finding (status, metrics, the NPD condition) and ``gpuguard doctor`` says exposed
with the fix, on a kubelet 1.26+ node or one whose kubelet's version is unknown."""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuguard import cli
from gpuguard.doctor.model import EXPOSED, OK, UNKNOWN
from gpuguard.doctor.readmit import BridgeFacts, check_bridge, read_bridge
from gpuguard.host.paths import Root
from gpuguard.host.statefile import load
from gpuguard.readmit import observe, offstate
from gpuguard.readmit.observe import KubeletVersion
from gpuguard.readmit.state import SPEC, STATE_FILE, ReadmitState
from gpuguard.reporting.npd import BY_NAME, PROBLEM, evaluate
from gpuguard.steps.readmit.exposure import K_BRIDGE_OFF, judge_exposure
from unit.doctor_support import bridge_state


def run_bridge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, version: Optional[str]
) -> ReadmitState:
    monkeypatch.setenv("GPUGUARD_READMIT", mode)
    found = ("kubelet.service", "/usr/bin/kubelet") if version is not None else None
    monkeypatch.setattr(observe, "unit_executable", lambda units: found)
    kv = KubeletVersion("/usr/bin/kubelet", "1:2:3:4", version or "", f"Kubernetes v{version}.1")
    monkeypatch.setattr(observe, "kubelet_version", lambda root, path, cached: kv)
    (tmp_path / "etc/gpuguard").mkdir(parents=True, exist_ok=True)
    (tmp_path / "etc/gpuguard/gpuguard.conf").write_text("")
    assert cli.main(["--root", str(tmp_path), "readmit"]) == 0
    got = load(Root(tmp_path).path(STATE_FILE), SPEC).value
    assert got is not None, "no state file written"
    return got


@pytest.mark.parametrize(
    ("mode", "version", "cause", "exposed"),
    [
        ("off", "1.34", offstate.ENV_OFF, True),
        ("auto", "", offstate.UNKNOWN_VERSION, True),  # a unit whose version is not told
        ("auto", None, offstate.NO_KUBELET, None),  # no kubelet unit, none ever seen
        ("auto", "1.25", offstate.OLD_KUBELET, False),
        ("off", "1.25", offstate.ENV_OFF, False),
    ],
)
def test_the_bridge_writes_its_state_when_it_stays_off(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    version: Optional[str],
    cause: str,
    exposed: Optional[bool],
) -> None:
    """``exposed`` None: no kubelet here, so nothing to find; doctor cannot judge."""
    s = run_bridge(tmp_path, monkeypatch, mode, version)
    assert (s.decision, s.off_cause) == ("off", cause)
    findings, _unknown = judge_exposure(s, False, "")
    assert bool(findings) is bool(exposed)
    verdict = check_bridge(read_bridge(Root(tmp_path))).verdict
    assert verdict == (EXPOSED if exposed else OK if exposed is False else UNKNOWN)


def test_without_grpcio_the_bridge_says_exposed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = builtins.__import__

    def no_grpc(name: str, *a: Any, **kw: Any) -> Any:
        if name == "grpc" or name.startswith("grpc."):
            raise ImportError("No module named 'grpc'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_grpc)
    s = run_bridge(tmp_path, monkeypatch, "auto", "1.34")
    assert (s.decision, s.off_cause, s.kubelet_version) == ("off", offstate.NO_GRPCIO, "1.34")
    c = check_bridge(read_bridge(Root(tmp_path)))
    assert c.verdict == EXPOSED and "install python3-grpcio" in c.fix


def test_status_and_the_npd_condition_are_never_ok_with_the_bridge_off() -> None:
    import statusdoc
    from unit.test_npd import steps

    off = ReadmitState("", 0.0, "off", "GPUGUARD_READMIT=off", off_cause="env-off",
                       kubelet_version="1.34")  # fmt: skip
    found, _u = judge_exposure(off, False, "")
    assert [f.kind for f in found] == [K_BRIDGE_OFF]
    assert "GPUGUARD_READMIT=off" in found[0].fields["FIX"]
    doc = {"steps": steps(readmit={"findings": [f.to_json() for f in found]})}
    status = statusdoc.model(doc)
    code, msg = evaluate(BY_NAME["gpu-pods"], status.steps, status.steps["readmit"].ended, 600)
    assert code == PROBLEM and msg.startswith("the re-admission bridge is off on kubelet 1.26+")
    from gpuguard.reporting.summary import summarize

    assert summarize(status, "", []).to_json()["verdict"] == "problem"


def test_no_state_this_boot_for_a_kubelet_that_needs_it_is_not_ok(tmp_path: Path) -> None:
    assert judge_exposure(None, True, "1.34")[1]  # the daemon: unknown, with the fix
    assert judge_exposure(None, True, "1.25") == ((), ())
    assert check_bridge(BridgeFacts(None, "", "1.34")).verdict == EXPOSED
    assert check_bridge(BridgeFacts(None, "", "")).verdict == UNKNOWN
    assert check_bridge(BridgeFacts(None, "", "1.25")).verdict == OK


def test_a_running_bridge_is_ok(tmp_path: Path) -> None:
    bridge_state(tmp_path, "offered", "2 of 2 GPU pods have no running process")
    assert check_bridge(read_bridge(Root(tmp_path))).verdict == OK
