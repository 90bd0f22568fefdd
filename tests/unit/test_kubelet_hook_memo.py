"""kubelet's pre-start hook on an unchanged healthy node: the memo of the last verified
healthy state lets it skip the full check, and anything changed takes the full path."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import CHECKPOINTS, log_to_stderr
from gpuguard import cli, exitcodes
from gpuguard.host.inventory import parse_inventory
from gpuguard.host.paths import Root
from gpuguard.steps.checkpoint import kubelet_hook as kh
from gpuguard.steps.checkpoint import memo

CHECKPOINT = "var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
KEPT = "GPU-77a702db-e37f-3a74-d46d-c5713f66058c"
# pod B held c1e9f249 and 9b341c59: both replaced (a present one would keep it)
GONE = ["GPU-0b341c59-f96b-ba85-c137-78c3652fea65", "GPU-5d3e2a10-7c4b-4f0e-9a61-2b8e4c1d7f93"]
INVENTORY = {
    "gpus": [
        {"uuid": u, "index": i, "minor": i, "pci_bus_id": f"00000000:{16 + i:02X}:00.0"}
        for i, u in enumerate([KEPT, *GONE])
    ]
}


@pytest.fixture(autouse=True)
def log_to_current_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    log_to_stderr(monkeypatch)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "node"
    (r / CHECKPOINT).parent.mkdir(parents=True)
    (r / CHECKPOINT).write_bytes(FIXTURE.read_bytes())
    (r / "etc/gpuguard").mkdir(parents=True)
    (r / "proc/1").mkdir(parents=True)
    (r / "proc/1/comm").write_text("systemd\n")
    return r


def record(root: Path) -> dict[str, object]:
    return dict(json.loads((root / "run/gpuguard/kubelet-hook.result").read_text()))


FAST = "unchanged since last verified"
FIXTURE = CHECKPOINTS / "numa-blog-04.json"


def run(
    root: Path, capsys: pytest.CaptureFixture[str], inventory: object = None
) -> tuple[int, str]:
    inv = root / "etc/gpuguard/inventory.json"
    inv.write_text(json.dumps(inventory or INVENTORY))
    argv = ["check", "--only", "checkpoint", "--kubelet-stopped", "--root", str(root)]
    code = cli.main([*argv, "--inventory", str(inv)])
    return code, capsys.readouterr().out


@pytest.fixture
def verified(root: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A node whose checkpoint was repaired, then verified healthy by a full check."""
    assert run(root, capsys)[0] == exitcodes.OK  # repairs the fixture (stale GPUs)
    assert not (root / memo.MEMO.lstrip("/")).exists()  # a repair is not remembered
    code, out = run(root, capsys)
    assert code == exitcodes.OK and FAST not in out and "nothing to do" in out
    assert (root / memo.MEMO.lstrip("/")).exists()
    return root


def test_unchanged_takes_the_fast_path_and_still_records(
    verified: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kh.write_request(Root(verified), "70c0")
    code, out = run(verified, capsys)
    assert code == exitcodes.OK and FAST in out
    rec = record(verified)
    assert rec["outcome"] == kh.HEALTHY and rec["token"] == "70c0"
    assert rec["before_sha256"] == rec["after_sha256"] == kh.file_sha256(verified / CHECKPOINT)


def test_a_changed_byte_with_the_same_mtime_is_fully_verified(
    verified: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = verified / CHECKPOINT
    st = path.stat()
    raw = bytearray(path.read_bytes())
    raw[raw.index(b'"Checksum":') + 12] ^= 1  # same size, same mtime, other content
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    code, out = run(verified, capsys)
    assert code == exitcodes.BAD_INPUT and FAST not in out
    assert record(verified)["outcome"] == kh.FAILED


def test_a_changed_inventory_is_fully_verified_and_repaired(
    verified: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = (verified / CHECKPOINT).read_bytes()
    fewer = {"gpus": [g for g in INVENTORY["gpus"] if g["uuid"] != KEPT]}  # pod A's GPU gone
    code, out = run(verified, capsys, fewer)
    assert code == exitcodes.OK and FAST not in out
    assert record(verified)["outcome"] == kh.REPAIRED
    assert (verified / CHECKPOINT).read_bytes() != before


def test_the_same_gpus_renumbered_are_another_inventory(verified: Path) -> None:
    inv = parse_inventory(INVENTORY, source="test")
    swapped = {"gpus": [dict(g, minor=9 - g["minor"]) for g in INVENTORY["gpus"]]}
    other = parse_inventory(swapped, source="test")
    assert memo.inventory_identity(inv) != memo.inventory_identity(other)
    reordered = parse_inventory({"gpus": INVENTORY["gpus"][::-1]}, source="other")
    assert memo.inventory_identity(inv) == memo.inventory_identity(reordered)


def test_a_stale_checkpoint_put_back_is_repaired(
    verified: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (verified / CHECKPOINT).write_bytes(FIXTURE.read_bytes())
    code, out = run(verified, capsys)
    assert code == exitcodes.OK and FAST not in out
    assert record(verified)["outcome"] == kh.REPAIRED


@pytest.mark.parametrize("damage", ["garbage", "other-key", "symlink", "directory"])
def test_a_corrupt_or_unsafe_memo_means_the_full_path(
    verified: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    path = verified / memo.MEMO.lstrip("/")
    doc = json.loads(path.read_text())
    path.unlink()
    if damage == "garbage":
        path.write_bytes(b"\x00{not json")
    elif damage == "other-key":
        path.write_text(json.dumps({**doc, "checkpoint_sha256": "0" * 64}))
    elif damage == "symlink":
        (verified / "elsewhere.json").write_text(json.dumps(doc))
        path.symlink_to(verified / "elsewhere.json")
    else:
        path.mkdir()
    code, out = run(verified, capsys)
    assert code == exitcodes.OK and FAST not in out and "nothing to do" in out
    assert record(verified)["outcome"] == kh.HEALTHY
