"""The command line: checkpoint inspect/canonical, --version, config; one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Tuple

import pytest

from conftest import CHECKPOINTS, REPO
from gpuguard import exitcodes, package_version, version_line
from gpuguard.checkpoint import parse
from gpuguard.checkpoint.spew import checksum

REAL = CHECKPOINTS
FIXTURES = sorted(REAL.glob("*.json"))
GONE = "GPU-c1e9f249-b37b-81c2-a8d9-ba5ca0294841"
INVENTORY = {
    "gpus": [
        {"uuid": u, "index": i, "minor": i, "pci_bus_id": f"00000000:{16 + i:02X}:00.0"}
        for i, u in enumerate(
            [
                "GPU-77a702db-e37f-3a74-d46d-c5713f66058c",
                "GPU-9b341c59-f96b-ba85-c137-78c3652fea65",
                "GPU-5d3e2a10-7c4b-4f0e-9a61-2b8e4c1d7f93",
            ]
        )
    ]
}


def gpuguard(*args: str, root: Path) -> subprocess.CompletedProcess[bytes]:
    """The CLI as a process (real stdout bytes, real stderr), under an empty root."""
    return subprocess.run(
        [sys.executable, "-m", "gpuguard", "--root", str(root), *args],
        capture_output=True,
        env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    (r / "inventory.json").write_text(json.dumps(INVENTORY))
    return r


def one_line_error(p: subprocess.CompletedProcess[bytes]) -> str:
    err = p.stderr.decode()
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("gpuguard: ")
    return lines[0]


def test_inspect_json_fields(root: Path) -> None:
    path = REAL / "numa-blog-04.json"
    p = gpuguard(
        "checkpoint",
        "inspect",
        "--json",
        "--inventory",
        str(root / "inventory.json"),
        str(path),
        root=root,
    )
    assert p.returncode == exitcodes.OK, p.stderr
    doc = json.loads(p.stdout)
    cp = parse(path.read_bytes(), source="f")
    assert doc["file"] == str(path)
    assert doc["format"] == "v2"
    assert doc["checksum_stored"] == doc["checksum_computed"] == cp.checksum == 2442330366
    assert doc["valid"] is True and doc["error"] is None
    assert doc["registered_devices"] == {
        "nvidia.com/gpu": list(cp.registered_dict()["nvidia.com/gpu"] or ())
    }
    assert len(doc["entries"]) == 2
    e = doc["entries"][1]
    assert set(e) == {
        "pod_uid",
        "container_name",
        "resource_name",
        "device_ids",
        "alloc_resp_bytes",
    }
    assert e["device_ids"] == {"1": [GONE, "GPU-9b341c59-f96b-ba85-c137-78c3652fea65"]}
    assert cp.entries is not None and cp.entries[1].alloc_resp is not None
    assert e["alloc_resp_bytes"] == len(cp.entries[1].alloc_resp) == 355
    assert doc["inventory"] == str(root / "inventory.json")
    kinds = sorted(f["kind"] for f in doc["stale"])
    # judged as check judges it: no GPU identity history under the root yet, so pod B,
    # which still holds a present GPU, is left as it is, and the missing history is said
    assert kinds == [
        "checkpoint-entry-kept",
        "checkpoint-remap-unavailable",
        "checkpoint-stale-registered",
    ]
    assert all(GONE in f["summary"] for f in doc["stale"] if "remap" not in f["kind"])


def test_inspect_without_driver_still_inspects(root: Path) -> None:
    p = gpuguard("checkpoint", "inspect", "--json", str(REAL / "numa-blog-01.json"), root=root)
    assert p.returncode == exitcodes.OK
    doc = json.loads(p.stdout)
    assert doc["valid"] is True and doc["stale"] is None and doc["inventory"] is None
    assert doc["inventory_error"]


def test_inspect_human(root: Path) -> None:
    p = gpuguard(
        "checkpoint",
        "inspect",
        "--inventory",
        str(root / "inventory.json"),
        str(REAL / "numa-blog-04.json"),
        root=root,
    )
    assert p.returncode == exitcodes.OK
    out = p.stdout.decode()
    assert "format:     v2" in out
    assert "checksum:   stored 2442330366, computed 2442330366 (valid)" in out
    assert "entries:    2" in out and f"numa 1: {GONE}" in out
    assert "stale:      (inventory:" in out and "no longer has" in out


def test_inspect_null_entries_and_tegra(root: Path) -> None:
    p = gpuguard(
        "checkpoint",
        "inspect",
        "--json",
        "--inventory",
        str(root / "inventory.json"),
        str(REAL / "alibaba-ack-gpuops.json"),
        root=root,
    )
    doc = json.loads(p.stdout)
    assert doc["format"] == "any" and doc["entries"] == [] and doc["valid"]
    p = gpuguard(
        "checkpoint",
        "inspect",
        "--json",
        "--inventory",
        str(root / "inventory.json"),
        str(REAL / "gpu-lab-tegra.json"),
        root=root,
    )
    doc = json.loads(p.stdout)
    assert doc["entries"][0]["device_ids"] == {"-1": ["tegra"]}
    assert [f["kind"] for f in doc["stale"]] == ["checkpoint-unknown-id"]


def test_inspect_checksum_mismatch(root: Path, tmp_path: Path) -> None:
    raw = (REAL / "numa-blog-04.json").read_bytes().replace(b"2442330366", b"1")
    bad = tmp_path / "bad.json"
    bad.write_bytes(raw)
    p = gpuguard("checkpoint", "inspect", "--json", str(bad), root=root)
    assert p.returncode == exitcodes.BAD_INPUT
    doc = json.loads(p.stdout)
    assert doc["valid"] is False and doc["checksum_stored"] == 1
    assert doc["checksum_computed"] == 2442330366
    assert "checksum mismatch" in doc["error"] and str(bad) in doc["error"]
    p = gpuguard("checkpoint", "inspect", str(bad), root=root)
    assert p.returncode == exitcodes.BAD_INPUT and b"INVALID: " in p.stdout


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name)
def test_canonical_equals_each_real_fixture(root: Path, path: Path) -> None:
    p = gpuguard("checkpoint", "canonical", str(path), root=root)
    assert p.returncode == exitcodes.OK and p.stderr == b""
    assert p.stdout == path.read_bytes()


def test_canonical_reformats_and_rechecksums(root: Path, tmp_path: Path) -> None:
    doc = json.loads((REAL / "numa-blog-04.json").read_bytes())
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps(doc, indent=4))
    p = gpuguard("checkpoint", "canonical", str(pretty), root=root)
    assert p.stdout == (REAL / "numa-blog-04.json").read_bytes()
    doc["Checksum"] = 7
    pretty.write_text(json.dumps(doc))
    p = gpuguard("checkpoint", "canonical", str(pretty), root=root)
    assert p.returncode == exitcodes.OK and b"warning" in p.stderr
    cp = parse(p.stdout, source="out")
    assert cp.checksum == checksum(cp) == 2442330366


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, "does not exist"),
        (b"", "is empty"),
        (b'{"Data":{"PodDeviceEntries":[{"PodUID":"x"', "truncated"),
        (b"<html>", "not valid JSON"),
        (b'{"Data":{"PodDeviceEntries":[]}}', "no Checksum"),
        (b'{"Data":{"PodDeviceEntries":{}},"Checksum":1}', "not a list"),
        ("dir", "directory"),
    ],
)
@pytest.mark.parametrize("command", ["inspect", "canonical"])
def test_bad_inputs_one_line_exit_3(
    root: Path, tmp_path: Path, content: object, words: str, command: str
) -> None:
    path = tmp_path / "ckpt"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    p = gpuguard("checkpoint", command, str(path), root=root)
    assert p.returncode == exitcodes.BAD_INPUT
    line = one_line_error(p)
    assert str(path) in line and words in line
    if command == "canonical":
        assert p.stdout == b""


def test_version(root: Path) -> None:
    p = gpuguard("--version", root=root)
    assert p.returncode == 0
    assert p.stdout.decode().strip() == version_line()
    assert version_line().startswith(f"gpuguard {package_version()} (commit ")


def test_config_defaults_and_file(root: Path) -> None:
    p = gpuguard("config", root=root)
    assert p.returncode == exitcodes.OK, p.stderr
    out = p.stdout.decode()
    assert "[Kubelet]" in out and "Policy=rewrite" in out and "BackupKeep=20" in out
    conf = root / "etc/gpuguard/gpuguard.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text("[Kubelet]\nPolicy=report\nBackupKeep=5\n")
    out = gpuguard("config", root=root).stdout.decode()
    assert "Policy=report" in out and "BackupKeep=5" in out


def test_config_error_is_one_line_exit_2(root: Path) -> None:
    conf = root / "etc/gpuguard/gpuguard.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text("[Kubelet]\nBackupKeep=many\n")
    p = gpuguard("config", root=root)
    assert p.returncode == exitcodes.USAGE
    line = one_line_error(p)
    assert "gpuguard.conf" in line and "BackupKeep" in line


def test_config_check_strict_for_ci(root: Path) -> None:
    conf = root / "etc/gpuguard/gpuguard.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text("[Daemon]\nAuditIntervall=5min\n")
    p = gpuguard("config", "--check", root=root)
    assert p.returncode == exitcodes.OK and p.stdout == b""
    assert one_line_error(p).startswith(
        f"gpuguard: warning: {conf}:2: unknown key 'AuditIntervall' in [Daemon]; did you mean "
        "'AuditInterval'?"
    )
    p = gpuguard("config", "--check", "--strict", root=root)
    assert p.returncode == exitcodes.USAGE
    assert one_line_error(p).startswith(f"gpuguard: {conf}:2: unknown key 'AuditIntervall'")


@pytest.mark.parametrize(
    "argv", [("status",), ("doctor",), ("check", "--dry-run", "--only", "checkpoint")]
)
def test_debugging_commands_run_on_a_broken_dropin(root: Path, argv: Tuple[str, ...]) -> None:
    """They name the broken file in one line and run without it; `config` still refuses."""
    bad = root / "etc/gpuguard/gpuguard.conf.d/50-bad.conf"
    bad.parent.mkdir(parents=True)
    bad.write_text("[Kubelet]\nBackupKeep=many\n")
    inv = ("--inventory", str(root / "inventory.json"))
    p = gpuguard(*argv, *(inv if argv[0] != "status" else ()), root=root)
    err = p.stderr.decode()
    assert "Traceback" not in err
    warned = [line for line in err.splitlines() if str(bad) in line]
    assert len(warned) == 1 and warned[0].startswith(f"gpuguard: warning: {bad}:2: "), err
    assert warned[0].endswith(f"this command ignores {bad} and reads the rest")
    assert p.returncode != exitcodes.USAGE, err
    assert gpuguard("config", "--check", root=root).returncode == exitcodes.USAGE


def test_usage_error_exit_2(root: Path) -> None:
    p = gpuguard("check", "--policy", "shred", root=root)
    assert p.returncode == exitcodes.USAGE and b"Traceback" not in p.stderr
