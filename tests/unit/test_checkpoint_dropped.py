"""Dropped checkpoint entries kept as evidence: the record file, the actuator that writes
it before the checkpoint changes, and the snapshot every step of a pass decides from."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import pytest

from gpuguard.checkpoint import Checkpoint, PodDevicesEntry, dropped, marshal
from gpuguard.checkpoint.spew import checksum
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.engine.snapshot import HostSnapshot
from gpuguard.errors import BadInputError
from gpuguard.host.paths import DROPPED_ENTRIES_FILE, Root
from gpuguard.journal.log import EventLog
from gpuguard.steps.checkpoint.actuate import CheckpointActuator
from gpuguard.steps.checkpoint.reconcile import DeleteCheckpoint, RewriteCheckpoint, sha256

CKPT = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
A = PodDevicesEntry("pod-a", "main", "nvidia.com/gpu", ((0, ("GPU-1", "GPU-old")),), None)
B = PodDevicesEntry("pod-b", "main", "nvidia.com/gpu", ((0, ("GPU-2",)),), None)


def _cp(*entries: PodDevicesEntry) -> bytes:
    cp = Checkpoint("any" if not entries else entries[0].shape or "v2", entries, (), 0)
    return marshal(Checkpoint(cp.format, cp.entries, cp.registered, checksum(cp)))


def _rec(pod: str, ids: tuple[str, ...], when: str = "t") -> dropped.DroppedEntry:
    return dropped.DroppedEntry(pod, "main", "nvidia.com/gpu", ids, when)


def test_records_round_trip_and_merge_keeps_the_newest_once() -> None:
    old = (_rec("p1", ("x",), "1"), _rec("p2", ("y",), "1"))
    merged = dropped.merge(old, (_rec("p1", ("x",), "2"), _rec("p3", ("z",), "2")), keep=3)
    assert [(r.pod_uid, r.dropped_at) for r in merged] == [("p2", "1"), ("p1", "2"), ("p3", "2")]
    assert dropped.merge(merged, (_rec("p4", ("w",)),), keep=2)[0].pod_uid == "p3"
    assert dropped.parse(dropped.render(merged), "f") == merged


def test_a_record_stands_in_for_a_dropped_pod_and_never_widens_a_live_one() -> None:
    records = [_rec("pod-a", ("GPU-1", "GPU-old")), _rec("pod-b", ("Z",))]
    ids = dropped.pod_device_ids([B], records)
    assert ids == {"pod-a": {"GPU-1", "GPU-old"}, "pod-b": {"GPU-2"}}
    assert dropped.recorded_device_ids(records) == {"pod-a": {"GPU-1", "GPU-old"}, "pod-b": {"Z"}}


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"[]",
        b'{"version": 2, "dropped": []}',
        b'{"version": 1, "dropped": [1]}',
        b'{"version": 1, "dropped": [{"pod_uid": "p", "device_ids": "x"}]}',
        b"\xff\xfe",
        b"[" * 100000,
    ],
    ids=["empty", "truncated", "list", "version", "item", "ids", "binary", "deep"],
)
def test_bad_record_file_is_one_sentence_with_the_path(raw: bytes) -> None:
    with pytest.raises(BadInputError) as e:
        dropped.parse(raw, "/s/checkpoint-dropped.json")
    assert e.value.message.startswith("/s/checkpoint-dropped.json: unreadable")
    assert "move it aside" in e.value.message and len(e.value.message) < 400


def test_read_never_follows_links_or_blocks_on_a_fifo(tmp_path: Path) -> None:
    assert dropped.read(tmp_path / "absent.json") == ()
    (tmp_path / "real.json").write_bytes(dropped.render((_rec("p", ("x",)),)))
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    os.mkfifo(tmp_path / "fifo.json")
    for name, why in (("link.json", "symbolic link"), ("fifo.json", "not a regular file")):
        result: list[BaseException] = []

        def run(n: str = name, result: list[BaseException] = result) -> None:
            try:
                dropped.read(tmp_path / n)
            except BaseException as e:  # handed to the main thread
                result.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(5)
        assert not t.is_alive(), f"{name}: read blocked"
        (err,) = result
        assert isinstance(err, BadInputError) and why in err.message


# --- the actuator records before it writes, and fails closed ------------------------


def _setup(tmp_path: Path, *entries: PodDevicesEntry) -> tuple[Path, bytes, Path]:
    path = tmp_path / CKPT.lstrip("/")
    path.parent.mkdir(parents=True)
    raw = _cp(*entries)
    path.write_bytes(raw)
    return path, raw, Root(tmp_path).path(DROPPED_ENTRIES_FILE)


def _actuator(tmp_path: Path, rec: Path) -> CheckpointActuator:
    log = EventLog(stream=io.StringIO(), level="debug")
    return CheckpointActuator(tmp_path / "backups", 3, log, dropped_file=rec)


def test_rewrite_records_the_entries_it_drops(tmp_path: Path) -> None:
    path, raw, rec = _setup(tmp_path, A, B)
    action = RewriteCheckpoint(
        "checkpoint",
        "r",
        str(path),
        path=path,
        content=_cp(B),
        expected_sha256=sha256(raw),
        dropped=(A,),
    )
    dry = ChangeExecutor(dry_run=True).run(_actuator(tmp_path, rec).change(action))
    assert dry.status == "dry-run"
    assert not rec.exists()
    assert _actuator(tmp_path, rec).apply(action).status == "done"
    (r,) = dropped.read(rec)
    assert (r.pod_uid, r.container_name, r.device_ids) == ("pod-a", "main", ("GPU-1", "GPU-old"))
    assert (rec.stat().st_mode & 0o777) == 0o600
    snap = HostSnapshot(Root(tmp_path), CKPT)
    assert snap.pod_device_ids == {"pod-a": {"GPU-1", "GPU-old"}, "pod-b": {"GPU-2"}}


def test_delete_records_every_entry(tmp_path: Path) -> None:
    path, raw, rec = _setup(tmp_path, A)
    action = DeleteCheckpoint(
        "checkpoint", "r", str(path), path=path, expected_sha256=sha256(raw), dropped=(A,)
    )
    assert _actuator(tmp_path, rec).apply(action).status == "done"
    assert not path.exists()
    assert HostSnapshot(Root(tmp_path), CKPT).pod_device_ids == {"pod-a": {"GPU-1", "GPU-old"}}


def test_a_record_file_it_cannot_read_leaves_the_checkpoint_alone(tmp_path: Path) -> None:
    path, raw, rec = _setup(tmp_path, A, B)
    rec.parent.mkdir(parents=True, exist_ok=True)
    rec.write_bytes(b"{garbage")
    action = RewriteCheckpoint(
        "checkpoint",
        "r",
        str(path),
        path=path,
        content=_cp(B),
        expected_sha256=sha256(raw),
        dropped=(A,),
    )
    out = _actuator(tmp_path, rec).apply(action)
    assert out.status == "failed"
    assert str(path) in out.detail and str(rec) in out.detail and "move it aside" in out.detail
    assert path.read_bytes() == raw and rec.read_bytes() == b"{garbage"
    # The backup comes first (an unsafe backup directory must stop the repair before
    # anything is written); here it only holds the untouched original.
    assert [b.read_bytes() for b in (tmp_path / "backups").iterdir()] == [raw]
    # The snapshot still uses the checkpoint, and says why the records are not used.
    snap = HostSnapshot(Root(tmp_path), CKPT)
    assert snap.pod_device_ids == {"pod-a": {"GPU-1", "GPU-old"}, "pod-b": {"GPU-2"}}
    assert str(rec) in snap.dropped_entries[1]


def test_the_snapshot_reads_the_checkpoint_once(tmp_path: Path) -> None:
    path, raw, _ = _setup(tmp_path, A, B)
    snap = HostSnapshot(Root(tmp_path), CKPT)
    first = snap.checkpoint()
    assert first is not None and first.raw == raw
    path.write_bytes(_cp(B))  # a step repaired it since
    assert snap.checkpoint() is first
    assert set(snap.pod_device_ids) == {"pod-a", "pod-b"}
    assert set(HostSnapshot(Root(tmp_path), CKPT).pod_device_ids) == {"pod-b"}


def test_the_snapshot_repeats_a_read_error_and_gives_no_evidence(tmp_path: Path) -> None:
    path, _, _ = _setup(tmp_path, A)
    path.write_bytes(b"{")
    snap = HostSnapshot(Root(tmp_path), CKPT)
    for _ in range(2):
        with pytest.raises(BadInputError, match=str(path)):
            snap.checkpoint()
    assert snap.pod_device_ids == {}
    path.unlink()
    assert HostSnapshot(Root(tmp_path), CKPT).checkpoint() is None
