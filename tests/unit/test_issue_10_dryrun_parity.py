"""Issue 10, dry-run parity: a real run never grants what its dry-run declined.

The scenario from the report, on a fake root: pod P's checkpoint entry names GPU A plus
a stale ID; its container's /dev holds GPU B, which both NVIDIA_VISIBLE_DEVICES (A) and
the checkpoint contradict. The dry-run reports the conflict and "will not grant" B. The
real run repairs the checkpoint (its stale registered ID; P's entry, which still holds
A, is left as it is rather than dropped with A) and must still not grant B: not in the
same run, not in a second run, not in a daemon pass after the repair.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import log_to_stderr
from gpuguard import cli, exitcodes
from gpuguard.checkpoint import Checkpoint, PodDevicesEntry, marshal, parse
from gpuguard.checkpoint.spew import checksum
from gpuguard.config import load_config
from gpuguard.devices import nodes
from gpuguard.devices.rules import RUNC_DEFAULT_RULES
from gpuguard.engine.passes import Work
from gpuguard.host.notify import Notifier
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.steps.registry import STEP_ORDER
from unit.test_devices_support import fake_stat, make_node

# devices.list follows the writes as the kernel's would (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("v1_kernel")

CHECKPOINT = "var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
GPU_A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
GPU_B = "GPU-bbbbbbbb-1111-2222-3333-444444444444"
STALE = "GPU-dddddddd-0000-0000-0000-000000000000"  # a GPU this host no longer has
POD = "0dbd65af-6693-11eb-994b-246e9634b5c8"
CID = "c" * 64
PID = 4242
CGROUP = f"sys/fs/cgroup/devices/kubepods/burstable/pod{POD}/{CID}"
PROC_DEVICES = "Character devices:\n  1 mem\n195 nvidia\n510 nvidia-uvm\n\nBlock devices:\n"
HOST_NODES = {
    "nvidia0": (195, 0),
    "nvidia1": (195, 1),
    "nvidiactl": (195, 255),
    "nvidia-uvm": (510, 0),
    "nvidia-uvm-tools": (510, 1),
}
GPU_B_RULE = "c 195:1 rw"


@pytest.fixture(autouse=True)
def fake_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nodes, "_stat", fake_stat)
    log_to_stderr(monkeypatch)


def _checkpoint() -> bytes:
    entry = PodDevicesEntry(POD, "cuda", "nvidia.com/gpu", ((-1, (GPU_A, STALE)),), b"\n\x00")
    cp = Checkpoint("v2", (entry,), (("nvidia.com/gpu", (GPU_A, GPU_B, STALE)),), 0)
    cp = Checkpoint(cp.format, cp.entries, cp.registered, checksum(cp))
    return marshal(cp)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "node"
    (r / CHECKPOINT).parent.mkdir(parents=True)
    (r / CHECKPOINT).write_bytes(_checkpoint())
    (r / "etc/gpuguard").mkdir(parents=True)
    inventory = {
        "gpus": [
            {"uuid": GPU_A, "index": 0, "minor": 0, "pci_bus_id": "00000000:10:00.0"},
            {"uuid": GPU_B, "index": 1, "minor": 1, "pci_bus_id": "00000000:11:00.0"},
        ]
    }
    (r / "etc/gpuguard/inventory.json").write_text(json.dumps(inventory))
    (r / "proc/1").mkdir(parents=True)
    (r / "proc/1/comm").write_text("systemd\n")
    (r / "proc/devices").write_text(PROC_DEVICES)
    for name, (major, minor) in HOST_NODES.items():
        make_node(r / "dev" / name, major, minor)
    # The container: its /dev holds GPU B (and the control nodes), its environment says A.
    ctr_root = r / "ctr-rootfs"
    for name in ("nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        make_node(ctr_root / "dev" / name, *HOST_NODES[name])
    (r / f"proc/{PID}").mkdir(parents=True)
    (r / f"proc/{PID}/root").symlink_to(ctr_root)
    (r / f"proc/{PID}/environ").write_bytes(f"NVIDIA_VISIBLE_DEVICES={GPU_A}\0".encode())
    (r / f"proc/{PID}/cmdline").write_bytes(b"sleep\0300\0")
    (r / "sys/fs/cgroup/devices").mkdir(parents=True)
    (r / "sys/fs/cgroup/devices/devices.list").write_text("a *:* rwm\n")
    cg = r / CGROUP
    cg.mkdir(parents=True)
    (cg / "cgroup.procs").write_text(f"{PID}\n")
    # runc's list after a daemon-reload wiped the hook's grants: every GPU node denied
    (cg / "devices.list").write_text("".join(x.render() + "\n" for x in RUNC_DEFAULT_RULES))
    (cg / "devices.allow").write_text("")
    return r


def _check(root: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, Any]:
    inv = str(root / "etc/gpuguard/inventory.json")
    argv = ["check", "--root", str(root), "--inventory", inv, "--log-json", "--json", *extra]
    code = cli.main(argv)
    return code, json.loads(capsys.readouterr().out)


def _decisions(doc: Any) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """The container-access findings and actions, without the run's status words."""
    return _access(doc["devices"]["findings"], doc["devices"]["outcomes"])


def _access(findings: Any, outcomes: Any) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    mine = [f for f in findings if f["reconciler"] == "container_access"]
    done = [o for o in outcomes if o["reconciler"] == "container_access"]
    return (
        sorted((f["kind"], f["fields"].get("DEVICE_NUMBERS", "")) for f in mine),
        sorted((o["kind"], o["target"], o["fields"].get("DEVICE_NUMBERS", "")) for o in done),
    )


def _granted(root: Path) -> str:
    return (root / CGROUP / "devices.allow").read_text()


def _wiped_again(root: Path) -> None:
    """The container's rules re-applied without its GPU nodes once more (a reload)."""
    (root / CGROUP / "devices.list").write_text(
        "".join(x.render() + "\n" for x in RUNC_DEFAULT_RULES)
    )
    (root / CGROUP / "devices.allow").write_text("")


def test_issue_10_dry_run_parity_the_real_run_grants_nothing_the_dry_run_declined(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, dry = _check(root, capsys, "--dry-run")
    assert code == exitcodes.FINDINGS
    dry_findings, dry_actions = _decisions(dry)
    assert ("container-device-conflict", "195:1") in dry_findings
    assert dry_actions and all("195:1" not in a[2] for a in dry_actions)
    assert {o["status"] for o in dry["devices"]["outcomes"]} == {"dry-run"}
    assert dry["result"] == "dry run: nothing modified"
    assert _granted(root) == ""

    code, real = _check(root, capsys)
    assert real["result"] == "repaired"  # the stale registered ID, in this very run
    assert [
        e.pod_uid for e in parse((root / CHECKPOINT).read_bytes(), source="t").entries or ()
    ] == [POD]  # still holding A: never dropped with it
    assert _decisions(real) == (dry_findings, dry_actions)
    assert {o["status"] for o in real["devices"]["outcomes"]} == {"done"}
    assert GPU_B_RULE not in _granted(root)
    assert "c 195:255 rw" in _granted(root)  # what it was given is re-granted

    # A second run: the checkpoint is already repaired, the conflict must stay one.
    _wiped_again(root)
    code, again = _check(root, capsys)
    assert "left as they are" in again["result"]
    assert _decisions(again) == (dry_findings, dry_actions)
    assert GPU_B_RULE not in _granted(root)


def test_issue_10_dry_run_parity_a_daemon_pass_after_the_repair_grants_nothing_declined(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, dry = _check(root, capsys, "--dry-run")
    dry_findings, dry_actions = _decisions(dry)
    _, real = _check(root, capsys)
    assert real["result"] == "repaired" and GPU_B_RULE not in _granted(root)
    _wiped_again(root)

    from gpuguard.engine.daemon import Daemon
    from gpuguard.steps import build_steps

    steps = build_steps()
    assert tuple(steps) == STEP_ORDER
    rt = Root(root)
    daemon = Daemon(
        root=rt,
        config=load_config(rt),
        config_path=None,
        log=EventLog(level="info", stream=sys.stderr),
        notifier=Notifier(),
        inventory_path=root / "etc/gpuguard/inventory.json",
        bus_address="unix:path=/nonexistent",
        steps=steps,
    )
    now = time.monotonic()
    asyncio.run(daemon._run_pass(Work(frozenset(STEP_ORDER), ("start-up",), now, now)))
    last = daemon.last_pass
    assert last is not None
    findings, actions = _access(
        [f.to_json() for f in last.findings], [o.to_json() for o in last.outcomes]
    )
    assert (findings, actions) == (dry_findings, dry_actions)
    assert GPU_B_RULE not in _granted(root)


def test_check_runs_the_steps_in_the_daemons_order(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inv = str(root / "etc/gpuguard/inventory.json")
    assert cli.main(["check", "--root", str(root), "--inventory", inv, "--log-json"]) == 0
    kinds = [json.loads(x)["kind"] for x in capsys.readouterr().err.splitlines() if x[:1] == "{"]
    order = [
        kinds.index(k) for k in ("cgroup-v1-allow", "char-link-created", "checkpoint-repaired")
    ]
    assert order == sorted(order), kinds
    assert STEP_ORDER.index("container_access") < STEP_ORDER.index("device_nodes")
    assert STEP_ORDER.index("device_nodes") < STEP_ORDER.index("checkpoint")


def test_a_corrupt_checkpoint_stops_the_run_before_any_step_acts(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 3 means "nothing was modified": the device steps, which now run before the
    checkpoint step, must not act first."""
    (root / CHECKPOINT).write_bytes(b'{"Data":{"PodDeviceEntries":[')
    before = {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    inv = str(root / "etc/gpuguard/inventory.json")
    assert cli.main(["check", "--root", str(root), "--inventory", inv]) == exitcodes.BAD_INPUT
    assert {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    assert not (root / "dev/char").exists()
    assert str(root / CHECKPOINT) in capsys.readouterr().err


def _history_where_the_stale_gpu_was_in_gpu_bs_slot(root: Path) -> None:
    """The GPUs recorded before: A, and in B's PCI slot the GPU whose ID is now stale."""
    from gpuguard.checkpoint import history
    from gpuguard.host.inventory import Gpu

    old = (Gpu(GPU_A, 0, 0, "00000000:10:00.0"), Gpu(STALE, 1, 1, "00000000:11:00.0"))
    gen = history.generation_of(old, {}, when=1.0, boot_id="", source="nvml")
    path = root / "var/lib/gpuguard/gpu-identity.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(history.render(history.History((gen,))))


def test_a_remap_judges_the_running_container_as_the_dry_run_did(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """P's entry [A, stale] is remapped to [A, B] (B now sits in the stale GPU's slot).
    The container that ran before (its /dev holds B, its environment says A) was not given
    B by anything the checkpoint said then: the dry-run declines B, and so do the real run,
    a second run after the remap and a daemon pass, though the checkpoint now names B."""
    _history_where_the_stale_gpu_was_in_gpu_bs_slot(root)
    code, dry = _check(root, capsys, "--dry-run")
    assert code == exitcodes.FINDINGS
    (planned,) = dry["actions"]
    assert [r["new_device_ids"] for r in planned["remaps"]] == [[GPU_A, GPU_B]]
    dry_findings, dry_actions = _decisions(dry)
    assert ("container-device-conflict", "195:1") in dry_findings

    code, real = _check(root, capsys)
    assert real["result"] == "repaired"
    (entry,) = parse((root / CHECKPOINT).read_bytes(), source="t").entries or ()
    assert entry.all_device_ids() == (GPU_A, GPU_B)  # remapped, not dropped
    assert _decisions(real) == (dry_findings, dry_actions)
    assert GPU_B_RULE not in _granted(root)

    _wiped_again(root)
    code, again = _check(root, capsys)
    assert again["result"].startswith("checkpoint matches")
    assert _decisions(again) == (dry_findings, dry_actions)
    assert GPU_B_RULE not in _granted(root)
