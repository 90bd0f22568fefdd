"""`gpuguard check` remaps through the GPU identity history it records itself.

A fake node with the real numa-blog-04 checkpoint (3 GPUs, 2 pods). The first check
finds it healthy and records the GPUs; then the GPUs come back with new UUIDs in the
same slots. The dry-run prints the remap, the real run makes exactly that remap
(journaled per entry), records the evidence and the new GPUs, and the next check is
healthy. The kubelet pre-start hook does the same; a bad history costs one journal
line and today's drop, never a crash.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from conftest import CHECKPOINTS, log_to_stderr
from gpuguard import cli, exitcodes
from gpuguard.checkpoint import dropped, history, parse, verify
from gpuguard.engine.snapshot import HostSnapshot
from gpuguard.host.paths import Root

CHECKPOINT = "var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
HISTORY = "var/lib/gpuguard/gpu-identity.json"
RECORD = "var/lib/gpuguard/checkpoint-dropped.json"
OLD = [
    "GPU-77a702db-e37f-3a74-d46d-c5713f66058c",
    "GPU-c1e9f249-b37b-81c2-a8d9-ba5ca0294841",
    "GPU-9b341c59-f96b-ba85-c137-78c3652fea65",
]
NEW = ["GPU-0" + u[5:] for u in OLD]


def inventory(uuids: list[str]) -> dict[str, Any]:
    return {
        "gpus": [
            {"uuid": u, "index": i, "minor": i, "pci_bus_id": f"00000000:{0x82 + i:02X}:00.0"}
            for i, u in enumerate(uuids)
        ]
    }


@pytest.fixture(autouse=True)
def _log(monkeypatch: pytest.MonkeyPatch) -> None:
    log_to_stderr(monkeypatch)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_root(tmp_path / "node")


def make_root(r: Path) -> Path:
    (r / CHECKPOINT).parent.mkdir(parents=True)
    (r / CHECKPOINT).write_bytes((CHECKPOINTS / "numa-blog-04.json").read_bytes())
    (r / "etc/gpuguard").mkdir(parents=True)
    (r / "proc/1").mkdir(parents=True)
    (r / "proc/1/comm").write_text("systemd\n")
    for i in range(3):
        d = r / f"sys/bus/pci/devices/0000:{0x82 + i:02x}:00.0"
        d.mkdir(parents=True)
        (d / "numa_node").write_text("1\n")
    set_gpus(r, OLD)
    return r


def set_gpus(root: Path, uuids: list[str]) -> None:
    (root / "etc/gpuguard/inventory.json").write_text(json.dumps(inventory(uuids)))


def check_argv(root: Path) -> list[str]:
    inv = str(root / "etc/gpuguard/inventory.json")
    return ["check", "--root", str(root), "--inventory", inv, "--only", "checkpoint",
            "--log-json", "--json"]  # fmt: skip


def check(
    root: Path, capsys: pytest.CaptureFixture[str], *extra: str
) -> tuple[int, Any, list[Any]]:
    code = cli.main([*check_argv(root), *extra])
    out = capsys.readouterr()
    return code, json.loads(out.out), [json.loads(x) for x in out.err.splitlines() if x]


def kinds(journal: list[Any], kind: str) -> list[Any]:
    return [e for e in journal if e["kind"] == kind]


def test_recorded_on_a_healthy_check_then_remapped_exactly_as_the_dry_run_said(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, doc, journal = check(root, capsys)
    assert code == exitcodes.OK and doc["actions"] == []
    h, _ = history.read(root / HISTORY)
    assert h is not None and [g.uuid for g in h.generations[-1].gpus] == OLD
    assert h.generations[-1].gpus[0].numa_node == 1 and kinds(journal, "gpu-history-recorded")
    assert check(root, capsys)[2] == []  # unchanged: nothing written, nothing said

    set_gpus(root, NEW)  # the reboot: same slots, new UUIDs
    before = (root / CHECKPOINT).read_bytes()
    code, dry, _ = check(root, capsys, "--dry-run")
    assert code == exitcodes.FINDINGS and (root / CHECKPOINT).read_bytes() == before
    h_after_dry, _ = history.read(root / HISTORY)
    assert h_after_dry == h  # a dry run records nothing
    (planned,) = dry["actions"]
    assert [(r["old_device_ids"], r["new_device_ids"]) for r in planned["remaps"]] == [
        ([OLD[0]], [NEW[0]]),
        ([OLD[1], OLD[2]], [NEW[1], NEW[2]]),
    ]
    assert planned["drops"] == []

    code, real, journal = check(root, capsys)
    assert code == exitcodes.OK, real["result"]
    (done,) = real["outcomes"]
    assert done["status"] == "done"
    assert {k: done[k] for k in ("remaps", "drops", "registered_remaps", "target")} == {
        k: planned[k] for k in ("remaps", "drops", "registered_remaps", "target")
    }
    cp = parse((root / CHECKPOINT).read_bytes(), source="after")
    assert verify(cp)
    assert [e.all_device_ids() for e in cp.entries or ()] == [(NEW[0],), (NEW[1], NEW[2])]
    remapped = kinds(journal, "checkpoint-entry-remapped")
    assert [(e["POD_UID"], e["OLD_DEVICE_IDS"], e["NEW_DEVICE_IDS"]) for e in remapped] == [
        ("513cb897-0262-4868-826f-aa943ee45a38", OLD[0], NEW[0]),
        ("94283d1b-ce5a-4797-bff8-0cf0c7143b2b", f"{OLD[1]},{OLD[2]}", f"{NEW[1]},{NEW[2]}"),
    ]
    assert all(e["CONTAINER_NAME"] == "app" for e in remapped)
    assert list((root / "var/lib/gpuguard/backups").iterdir())
    h2, _ = history.read(root / HISTORY)
    assert h2 is not None and len(h2.generations) == 2
    assert [g.uuid for g in h2.generations[-1].gpus] == NEW

    # evidence: the containers of the remapped pods are judged by what the entries said
    records = dropped.read(root / RECORD)
    assert [r.remapped_to for r in records] == [(NEW[0],), (NEW[1], NEW[2])]
    ids = HostSnapshot(Root(root), "/" + CHECKPOINT).pod_device_ids
    assert ids["513cb897-0262-4868-826f-aa943ee45a38"] == frozenset({OLD[0]})

    code, doc, _ = check(root, capsys)
    assert code == exitcodes.OK and doc["actions"] == []


def test_the_kubelet_pre_start_hook_remaps_and_records(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert check(root, capsys, "--kubelet-stopped")[0] == exitcodes.OK
    set_gpus(root, NEW)
    code, doc, journal = check(root, capsys, "--kubelet-stopped")
    assert code == exitcodes.OK, doc["result"]
    assert len(kinds(journal, "checkpoint-entry-remapped")) == 2
    result = json.loads((root / "run/gpuguard/kubelet-hook.result").read_text())
    assert result["outcome"] == "repaired"
    h, _ = history.read(root / HISTORY)
    assert h is not None and [g.uuid for g in h.generations[-1].gpus] == NEW


def test_one_gpu_gone_for_good_its_pod_is_dropped_and_says_so(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    check(root, capsys)
    inv = inventory([NEW[0], NEW[2]])
    inv["gpus"][1]["pci_bus_id"] = "00000000:84:00.0"  # GPU 2 still in its slot
    (root / "etc/gpuguard/inventory.json").write_text(json.dumps(inv))
    code, _doc, journal = check(root, capsys)
    assert code == exitcodes.OK
    (drop,) = kinds(journal, "checkpoint-entry-dropped")
    assert drop["POD_UID"] == "94283d1b-ce5a-4797-bff8-0cf0c7143b2b"
    assert OLD[1] in drop["DROP_REASON"] and "gone" in drop["DROP_REASON"]
    (remap,) = kinds(journal, "checkpoint-entry-remapped")
    assert remap["NEW_DEVICE_IDS"] == NEW[0]
    record = [r for r in dropped.read(root / RECORD) if not r.remapped_to]
    assert record[0].device_ids == (OLD[1], OLD[2])


@pytest.mark.parametrize(
    "bad",
    [b"{", b'{"version": 9, "generations": []}', "fifo", "link", b"[" * 100_000],
)
def test_a_bad_history_is_one_line_and_todays_drop_then_replaced(
    root: Path, capsys: pytest.CaptureFixture[str], bad: Any
) -> None:
    path = root / HISTORY
    path.parent.mkdir(parents=True)
    if bad == "fifo":
        os.mkfifo(path)
    elif bad == "link":
        path.symlink_to("/dev/zero")
    else:
        path.write_bytes(bad)
    set_gpus(root, NEW)
    code, _doc, journal = check(root, capsys)
    assert code == exitcodes.OK
    (line,) = kinds(journal, "gpu-history-unusable")
    assert str(path) in line["msg"]
    assert len(kinds(journal, "checkpoint-entry-dropped")) == 2
    assert not kinds(journal, "checkpoint-entry-remapped")
    h, problem = history.read(path)
    assert problem == "" and h is not None  # replaced by a good one, the GPUs of now
