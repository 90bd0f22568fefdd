"""`gpuguard check` against fake roots: the kubelet coordination matrix without systemd.

No bus exists under these roots, so "kubelet running" can only be a process named
kubelet in ROOT/proc/<pid>/comm. Whatever the outcome, a refused or dry run must leave
every file of the root exactly as it was.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CHECKPOINTS, REPO, log_to_stderr
from gpuguard import cli, exitcodes
from gpuguard.checkpoint import marshal, parse, verify
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.host.inventory import parse_inventory
from gpuguard.steps.checkpoint.reconcile import DEFAULT_RESOURCES, analyse

CHECKPOINT = "var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
FIXTURE = CHECKPOINTS / "numa-blog-04.json"
KEPT = "GPU-77a702db-e37f-3a74-d46d-c5713f66058c"
MOVED = "GPU-c1e9f249-b37b-81c2-a8d9-ba5ca0294841"
INVENTORY = {
    "gpus": [
        {"uuid": u, "index": i, "minor": i, "pci_bus_id": f"00000000:{16 + i:02X}:00.0"}
        for i, u in enumerate(
            [
                KEPT,
                # pod B held c1e9f249 and 9b341c59: both replaced, so its entry goes
                # (an entry still holding a present GPU is never dropped without history)
                "GPU-0b341c59-f96b-ba85-c137-78c3652fea65",
                "GPU-5d3e2a10-7c4b-4f0e-9a61-2b8e4c1d7f93",
            ]
        )
    ]
}


@pytest.fixture(autouse=True)
def log_to_current_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    log_to_stderr(monkeypatch)


def tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else "dir"
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "node"
    ckpt = r / CHECKPOINT
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(FIXTURE.read_bytes())
    (r / "etc/gpuguard").mkdir(parents=True)
    (r / "etc/gpuguard/inventory.json").write_text(json.dumps(INVENTORY))
    (r / "proc/1").mkdir(parents=True)
    (r / "proc/1/comm").write_text("systemd\n")
    return r


def repaired_bytes() -> bytes:
    a = analyse(
        parse(FIXTURE.read_bytes(), source="f"),
        parse_inventory(INVENTORY, source="t"),
        DEFAULT_RESOURCES,
    )
    assert a.repaired is not None
    return marshal(a.repaired)


def check(root: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    argv = [
        "check",
        "--root",
        str(root),
        "--inventory",
        str(root / "etc/gpuguard/inventory.json"),
        "--log-json",
        *extra,
    ]
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def plain_lines(err: str) -> list[str]:
    """stderr lines that are not JSON log records (the one-line error, or a traceback)."""
    out = []
    for line in err.splitlines():
        try:
            json.loads(line)
        except ValueError:
            out.append(line)
    return out


def kubelet_process(root: Path, pid: int = 4242) -> None:
    (root / f"proc/{pid}").mkdir(parents=True)
    (root / f"proc/{pid}/comm").write_text("kubelet\n")


@pytest.mark.parametrize("only", [(), ("--only", "checkpoint")])
def test_kubelet_not_running_no_bus_repairs_directly(
    root: Path, capsys: pytest.CaptureFixture[str], only: tuple[str, ...]
) -> None:
    code, out, err = check(root, capsys, *only)
    assert code == exitcodes.OK, out + err
    data = (root / CHECKPOINT).read_bytes()
    assert data == repaired_bytes() and verify(parse(data, source="r"))
    assert MOVED not in data.decode() and KEPT in data.decode()
    assert "kubelet is not running: repair directly" in out
    assert "result:     repaired" in out
    (backup,) = (root / "var/lib/gpuguard/backups").iterdir()
    assert backup.read_bytes() == FIXTURE.read_bytes()
    kinds = [json.loads(line)["kind"] for line in err.splitlines() if line.startswith("{")]
    assert "checkpoint-stale-entry" in kinds and "checkpoint-repaired" in kinds
    # A second run finds nothing to do.
    code, out, _ = check(root, capsys, *only)
    assert code == exitcodes.OK and "nothing to do" in out


def test_json_report(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = check(root, capsys, "--only", "checkpoint", "--json")
    doc = json.loads(out)
    assert code == doc["exit_code"] == exitcodes.OK
    assert doc["result"] == "repaired" and doc["checkpoint"] == str(root / CHECKPOINT)
    assert [a["kind"] for a in doc["actions"]] == ["checkpoint-repaired"]
    assert [o["status"] for o in doc["outcomes"]] == ["done"]
    assert {f["kind"] for f in doc["findings"]} == {
        "checkpoint-stale-entry",
        "checkpoint-stale-registered",
        "checkpoint-remap-unavailable",  # no GPU identity history yet: dropped, not remapped
    }


def test_hook_mode_with_a_kubelet_process_refuses(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kubelet_process(root)
    before = tree(root)
    code, _, err = check(root, capsys, "--only", "checkpoint", "--kubelet-stopped")
    assert code == exitcodes.KUBELET
    result = json.loads((root / "run/gpuguard/kubelet-hook.result").read_text())
    assert result["outcome"] == "failed" and result["exit_code"] == exitcodes.KUBELET
    assert "4242" in result["detail"] and result["token"] == ""
    assert {k: v for k, v in tree(root).items() if not k.startswith("run")} == before
    (line,) = plain_lines(err)
    assert line.startswith("gpuguard: ") and "4242" in line and str(root / CHECKPOINT) in line


def test_hook_mode_without_kubelet_repairs(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = check(root, capsys, "--only", "checkpoint", "--kubelet-stopped")
    assert code == exitcodes.OK, out
    assert (root / CHECKPOINT).read_bytes() == repaired_bytes()
    assert "ExecStartPre= hook" in out


@pytest.mark.parametrize("extra", [(), ("--no-restart",)])
def test_kubelet_process_without_systemd_refuses(
    root: Path, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...]
) -> None:
    kubelet_process(root, 777)
    before = tree(root)
    code, _, err = check(root, capsys, "--only", "checkpoint", *extra)
    assert code == exitcodes.KUBELET
    assert tree(root) == before
    (line,) = plain_lines(err)
    assert "kubelet runs outside systemd" in line and "777" in line


def test_dry_run_modifies_nothing(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = tree(root)
    code, out, _ = check(root, capsys, "--only", "checkpoint", "--dry-run")
    assert code == exitcodes.FINDINGS
    assert tree(root) == before
    assert "dry run: nothing modified" in out and "would rewrite" in out


def test_policy_report_modifies_nothing(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = tree(root)
    code, out, _ = check(root, capsys, "--only", "checkpoint", "--policy", "report")
    after = tree(root)
    # only gpuguard's own state: the GPUs at its first look (no history yet)
    assert after.pop("var/lib/gpuguard/gpu-identity.json", None)
    assert code == exitcodes.FINDINGS and after == {**before, "var/lib/gpuguard": "dir"}
    assert "Policy=report" in out


def test_policy_delete(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = check(root, capsys, "--only", "checkpoint", "--policy", "delete")
    assert code == exitcodes.OK
    assert not (root / CHECKPOINT).exists()


def test_zero_gpus_refused(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / "etc/gpuguard/inventory.json").write_text('{"gpus": []}')
    before = tree(root)
    code, out, _ = check(root, capsys, "--only", "checkpoint")
    assert code == exitcodes.FINDINGS and tree(root) == before
    assert "not repaired" in out and "no GPU" in out


def test_missing_checkpoint_is_fine(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / CHECKPOINT).unlink()
    code, out, err = check(root, capsys, "--only", "checkpoint")
    assert code == exitcodes.OK
    assert "no checkpoint file" in out
    assert plain_lines(err) == []


@pytest.mark.parametrize(
    "content",
    [b"", b'{"Data":{"PodDeviceEntries":[', b"not json", b'{"Data":{},"Checksum":1}'],
    ids=["empty", "truncated", "garbage", "bad-checksum"],
)
def test_corrupt_checkpoint_one_line_exit_3(
    root: Path, capsys: pytest.CaptureFixture[str], content: bytes
) -> None:
    (root / CHECKPOINT).write_bytes(content)
    before = tree(root)
    code, _, err = check(root, capsys, "--only", "checkpoint")
    assert code == exitcodes.BAD_INPUT
    assert tree(root) == before
    (line,) = plain_lines(err)
    assert line.startswith(f"gpuguard: {root / CHECKPOINT}: ")
    assert "Traceback" not in err


def test_corrupt_checkpoint_as_a_process(root: Path) -> None:
    (root / CHECKPOINT).write_bytes(b"{")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuguard",
            "check",
            "--root",
            str(root),
            "--inventory",
            str(root / "etc/gpuguard/inventory.json"),
            "--log-json",
        ],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert p.returncode == exitcodes.BAD_INPUT
    assert "Traceback" not in p.stderr
    (line,) = plain_lines(p.stderr)
    assert str(root / CHECKPOINT) in line and "truncated" in line


def test_no_driver_and_no_inventory_exit_4(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = tree(root)
    code = cli.main(["check", "--root", str(root), "--log-json"])
    err = capsys.readouterr().err
    assert code == exitcodes.NO_DRIVER
    assert tree(root) == before
    (line,) = plain_lines(err)
    assert line.startswith("gpuguard: ") and "--inventory" in line


def test_bad_inventory_exit_3(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / "etc/gpuguard/inventory.json").write_text("{")
    code, _, err = check(root, capsys, "--only", "checkpoint")
    assert code == exitcodes.BAD_INPUT
    (line,) = plain_lines(err)
    assert "inventory.json" in line


def test_the_check_settings_come_from_kubelet_config_one_way() -> None:
    """`gpuguard check` and the daemon's checkpoint step build their settings with
    CheckSettings.from_config only: [Kubelet] decides, the caller overrides what it must."""
    import ast
    import dataclasses

    from gpuguard.config import KubeletConfig
    from gpuguard.steps.checkpoint.report import CheckSettings

    k = dataclasses.replace(KubeletConfig(), policy="report", unit="k.service", backup_keep=3)
    s = CheckSettings.from_config(
        k, apply=ChangeExecutor(dry_run=True), reason="why", bus_address=None
    )
    assert (s.policy, s.kubelet_unit, s.backup_keep, s.resources) == (
        "report", "k.service", 3, tuple(k.resources))  # fmt: skip
    assert (s.restart_kubelet, s.apply.dry_run, s.reason) == (k.restart_kubelet, True, "why")
    later = CheckSettings.from_config(
        k,
        apply=ChangeExecutor(dry_run=False),
        reason="",
        bus_address=None,
        policy="delete",
        may_restart=False,
    )
    assert (later.policy, later.restart_kubelet) == ("delete", False)
    builders = [
        str(p.relative_to(REPO))
        for p in sorted((REPO / "src/gpuguard").rglob("*.py"))
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "CheckSettings"
    ]
    assert builders == [], f"build CheckSettings with CheckSettings.from_config: {builders}"
