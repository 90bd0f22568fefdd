"""Crash-safe file changes and the checkpoint actuator, against a temporary root."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import pytest

from gpuguard.actuate import files
from gpuguard.actuate.files import (
    TEMP_PREFIX,
    atomic_replace,
    backup,
    prune_backups,
    remove_stale_temps,
)
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.journal.log import EventLog
from gpuguard.steps.checkpoint.actuate import CheckpointActuator
from gpuguard.steps.checkpoint.reconcile import DeleteCheckpoint, RewriteCheckpoint, sha256

OLD = b'{"Data":{"PodDeviceEntries":[],"RegisteredDevices":{}},"Checksum":1}'
NEW = b'{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{}},"Checksum":2}'
BACKUP_NAME = re.compile(r"^kubelet_internal_checkpoint\.\d{8}T\d{6}\.\d{6}Z\.[0-9a-f]{4}\.bak$")


def tree(root: Path) -> dict[str, tuple[str, int, int, int]]:
    """Every file under `root`: sha256, mode, uid, gid (what 'touched nothing' means)."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        out[str(p.relative_to(root))] = (digest, st.st_mode, st.st_uid, st.st_gid)
    return out


@pytest.fixture
def node(tmp_path: Path) -> Path:
    d = tmp_path / "var/lib/kubelet/device-plugins"
    d.mkdir(parents=True)
    (d / "kubelet_internal_checkpoint").write_bytes(OLD)
    (d / "kubelet.sock").write_bytes(b"")  # a neighbour that must stay
    return d / "kubelet_internal_checkpoint"


def actuator(tmp_path: Path, **kw: Any) -> tuple[CheckpointActuator, io.StringIO]:
    out = io.StringIO()
    log = EventLog(stream=out, level="debug")
    return CheckpointActuator(tmp_path / "backups", kw.pop("keep", 3), log, **kw), out


def rewrite(path: Path, expected: bytes = OLD, content: bytes = NEW) -> RewriteCheckpoint:
    return RewriteCheckpoint(
        "checkpoint",
        "1 pod entries and 0 registered IDs name devices this host no longer has",
        str(path),
        path=path,
        content=content,
        expected_sha256=sha256(expected),
        dropped_entries=1,
    )


def test_atomic_replace_keeps_mode_and_owner_and_leaves_no_temp(node: Path) -> None:
    os.chmod(node, 0o640)
    if os.geteuid() == 0:
        os.chown(node, 1234, 5678)
    st = node.stat()
    atomic_replace(node, NEW, mode=stat.S_IMODE(st.st_mode), uid=st.st_uid, gid=st.st_gid)
    after = node.stat()
    assert node.read_bytes() == NEW
    assert stat.S_IMODE(after.st_mode) == 0o640
    assert (after.st_uid, after.st_gid) == (st.st_uid, st.st_gid)
    assert after.st_ino != st.st_ino  # a new inode renamed over, never written in place
    assert sorted(p.name for p in node.parent.iterdir()) == [
        "kubelet.sock",
        "kubelet_internal_checkpoint",
    ]


def test_atomic_replace_fsyncs_file_then_directory(
    node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        calls.append("fsync " + os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def rename(a: Any, b: Any) -> None:
        calls.append(f"rename {Path(a).name} -> {Path(b).name}")
        real_rename(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    atomic_replace(node, NEW, mode=0o600, uid=None, gid=None)
    assert len(calls) == 3
    assert calls[0].startswith("fsync " + str(node.parent / TEMP_PREFIX))  # data first
    assert calls[1].startswith("rename " + TEMP_PREFIX) and calls[1].endswith(node.name)
    assert calls[2] == f"fsync {node.parent}"  # then the rename itself


def test_failed_write_removes_its_temp_and_keeps_the_old_file(
    node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="No space"):
        atomic_replace(node, NEW, mode=0o600, uid=None, gid=None)
    assert node.read_bytes() == OLD
    assert not list(node.parent.glob(TEMP_PREFIX + "*"))


def test_backup_naming_and_retention(tmp_path: Path, node: Path) -> None:
    bdir = tmp_path / "backups"
    made = [backup(f"v{i}".encode(), node, bdir, keep=3) for i in range(5)]
    assert all(BACKUP_NAME.match(p.name) for p in made)
    assert stat.S_IMODE(bdir.stat().st_mode) == 0o700
    left = sorted(bdir.iterdir())
    assert len(left) == 3
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in left)
    # Other files' backups are never pruned.
    (bdir / "other.20200101T000000Z.0000.bak").write_bytes(b"x")
    assert prune_backups(bdir, node.name, keep=1) and len(list(bdir.iterdir())) == 2
    assert (bdir / "other.20200101T000000Z.0000.bak").exists()


def test_backup_keeps_the_newest_by_timestamp(tmp_path: Path, node: Path) -> None:
    bdir = tmp_path / "backups"
    bdir.mkdir()
    for stamp in ("20240101T000000Z", "20230101T000000Z", "20250101T000000Z"):
        (bdir / f"{node.name}.{stamp}.abcd.bak").write_bytes(stamp.encode())
    new = backup(b"now", node, bdir, keep=2)
    assert sorted(p.name for p in bdir.iterdir()) == sorted(
        [f"{node.name}.20250101T000000Z.abcd.bak", new.name]
    )


def test_remove_stale_temps_only_ours(node: Path) -> None:
    d = node.parent
    ours = [d / f"{TEMP_PREFIX}{node.name}.dead", d / f"{TEMP_PREFIX}{node.name}.beef"]
    others = [d / f"{TEMP_PREFIX}other.dead", d / ".kubelet-tmp", d / f"{node.name}.dead"]
    for p in ours + others:
        p.write_bytes(b"half")
    assert sorted(remove_stale_temps(d, node.name)) == sorted(ours)
    assert all(p.exists() for p in others)
    assert remove_stale_temps(d / "missing", node.name) == []


def test_actuator_rewrites_with_backup_and_cleans_temps(tmp_path: Path, node: Path) -> None:
    stale_temp = node.parent / f"{TEMP_PREFIX}{node.name}.1234abcd"
    stale_temp.write_bytes(b"half written by a crashed run")
    os.chmod(node, 0o644)
    act, out = actuator(tmp_path)
    outcome = act.apply(rewrite(node))
    assert outcome.status == "done", outcome.detail
    assert node.read_bytes() == NEW and stat.S_IMODE(node.stat().st_mode) == 0o644
    assert not stale_temp.exists()
    (saved,) = (tmp_path / "backups").iterdir()
    assert saved.read_bytes() == OLD and BACKUP_NAME.match(saved.name)
    event = json.loads(out.getvalue().splitlines()[-1])
    assert event["kind"] == "checkpoint-repaired" and event["BACKUP"] == str(saved)
    assert event["DROPPED_ENTRIES"] == "1" and event["CHECKPOINT"] == str(node)


def test_actuator_delete(tmp_path: Path, node: Path) -> None:
    act, _ = actuator(tmp_path)
    action = DeleteCheckpoint(
        "checkpoint", "stale", str(node), path=node, expected_sha256=sha256(OLD)
    )
    assert act.apply(action).status == "done"
    assert not node.exists()
    (saved,) = (tmp_path / "backups").iterdir()
    assert saved.read_bytes() == OLD


def test_backup_retention_through_the_actuator(tmp_path: Path, node: Path) -> None:
    act, _ = actuator(tmp_path, keep=2)
    content = OLD
    for i in range(4):
        new = NEW.replace(b"2}", f"{i + 10}}}".encode())
        assert act.apply(rewrite(node, content, new)).status == "done"
        content = new
    assert len(list((tmp_path / "backups").iterdir())) == 2


@pytest.mark.parametrize("kind", ["rewrite", "delete"])
def test_actuator_refuses_a_file_changed_since_analysis(
    tmp_path: Path, node: Path, kind: str
) -> None:
    node.write_bytes(OLD + b" ")  # kubelet wrote it after we analysed
    before = tree(tmp_path)
    act, out = actuator(tmp_path)
    action: Any = (
        rewrite(node)
        if kind == "rewrite"
        else DeleteCheckpoint("checkpoint", "x", str(node), path=node, expected_sha256=sha256(OLD))
    )
    outcome = act.apply(action)
    assert outcome.status == "failed" and "changed since it was analysed" in outcome.detail
    assert tree(tmp_path) == before
    assert json.loads(out.getvalue().splitlines()[-1])["level"] == "error"


def test_actuator_refuses_a_missing_or_odd_file(tmp_path: Path, node: Path) -> None:
    act, _ = actuator(tmp_path)
    node.unlink()
    assert act.apply(rewrite(node)).status == "failed"
    os.mkfifo(node)
    before = tree(tmp_path)
    outcome = act.apply(rewrite(node))
    assert outcome.status == "failed" and "regular file" in outcome.detail
    assert tree(tmp_path) == before
    node.unlink()
    node.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_bytes(OLD)
    before = tree(tmp_path)
    assert act.apply(rewrite(node)).status == "failed"  # O_NOFOLLOW
    assert tree(tmp_path) == before


def test_dry_run_touches_nothing(tmp_path: Path, node: Path) -> None:
    (node.parent / f"{TEMP_PREFIX}{node.name}.old").write_bytes(b"left by a crash")
    before = tree(tmp_path)
    act, out = actuator(tmp_path)
    for action in (
        rewrite(node),
        DeleteCheckpoint("checkpoint", "x", str(node), path=node, expected_sha256=sha256(OLD)),
    ):
        outcome = ChangeExecutor(dry_run=True).run(act.change(action))
        assert outcome.status == "dry-run" and outcome.detail.startswith("would ")
    assert tree(tmp_path) == before
    assert not (tmp_path / "backups").exists()
    assert out.getvalue() == ""


def test_actuator_rejects_other_actions(tmp_path: Path) -> None:
    from gpuguard.model import Action

    act, _ = actuator(tmp_path)
    with pytest.raises(TypeError):
        act.apply(Action("x", "y", "z"))


def test_write_new_is_atomic_and_private(tmp_path: Path) -> None:
    p = tmp_path / "state.json"
    files.write_new(p, b"{}")
    assert p.read_bytes() == b"{}" and stat.S_IMODE(p.stat().st_mode) == 0o600
    assert [x.name for x in tmp_path.iterdir()] == ["state.json"]


def test_newest_backup_survives_pruning_within_one_second(
    tmp_path: Path, node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    suffixes = iter(["ffff", "0000"])
    real = files._token  # temp files draw from it too; pin only the suffix
    monkeypatch.setattr(files, "_token", lambda n: next(suffixes) if n == 2 else real(n))
    # both in the same microsecond: only the random suffix tells them apart
    monkeypatch.setattr(files.time, "time_ns", lambda: 1_700_000_000 * 10**9)
    bdir = tmp_path / "backups"
    backup(b"older", node, bdir, keep=1)
    newest = backup(b"newest", node, bdir, keep=1)
    assert newest.exists()
