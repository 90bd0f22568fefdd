"""A fake node root for the doctor and node-condition tests (no tests here).

`healthy_node` builds a root on which every doctor check is ok; tests then break one
thing each. Device nodes are fake (see test_devices_support.fake_stat)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

import statusdoc
from gpuguard.checkpoint import Checkpoint, marshal
from gpuguard.host.inventory import Gpu, Inventory
from gpuguard.host.paths import KUBELET_CHECKPOINT
from unit.test_devices_support import make_node

UUIDS = ("GPU-11111111-1111-1111-1111-111111111111", "GPU-22222222-2222-2222-2222-222222222222")
INVENTORY = Inventory(
    tuple(Gpu(u, i, i, f"00000000:1{i}:00.0") for i, u in enumerate(UUIDS)), source="test"
)
DAEMON_PID = 4242
PLUGIN_PID = 777


def write(root: Path, path: str, text: str) -> Path:
    p = root / path.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def write_checkpoint(root: Path, registered: Sequence[str]) -> None:
    cp = Checkpoint("v2", (), (("nvidia.com/gpu", tuple(registered)),), 0)
    p = root / KUBELET_CHECKPOINT.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(marshal(cp))


def pci_gpu(root: Path, address: str, klass: str = "0x030200", vendor: str = "0x10de") -> None:
    d = root / "sys/bus/pci/devices" / address
    d.mkdir(parents=True)
    (d / "vendor").write_text(vendor + "\n")
    (d / "class").write_text(klass + "\n")
    (d / "device").write_text("0x2330\n")


def plugin_process(root: Path, argv: Sequence[str], env: Sequence[str]) -> None:
    d = root / f"proc/{PLUGIN_PID}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "comm").write_text("nvidia-device-p\n")
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (d / "environ").write_bytes(b"\0".join(e.encode() for e in env) + b"\0")


def status_file(
    root: Path,
    *,
    age: float = 10.0,
    findings: Sequence[dict[str, object]] = (),
    steps: dict[str, object] | None = None,
) -> Path:
    (root / f"proc/{DAEMON_PID}").mkdir(parents=True, exist_ok=True)
    now = time.time()
    last = {
        "number": 3,
        "reasons": ["periodic audit"],
        "ended": now - age,
        "started": now - age,
        "duration_ms": 12.5,
        "findings": list(findings),
        "outcomes": [],
        "gpus": 2,
    }
    doc: dict[str, object] = {
        "pid": DAEMON_PID,
        "started": now - 3600,
        "passes": 3,
        "last_pass": last,
        "first_pass": last,
    }
    if steps is not None:
        doc["steps"] = steps
    p = root / "run/gpuguard/status.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(statusdoc.encode(doc))
    return p


def healthy_node(root: Path) -> Path:
    write(root, "/sys/fs/cgroup/cgroup.controllers", "cpu memory pids\n")
    write(
        root,
        "/var/lib/kubelet/config.yaml",
        "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n"
        "cgroupDriver: systemd\ncpuManagerPolicy: static\n"
        "evictionHard:\n  memory.available: 100Mi\n",
    )
    write(
        root,
        "/etc/nvidia-container-runtime/config.toml",
        "#accept-nvidia-visible-devices-as-volume-mounts = false\n"
        '[nvidia-container-runtime]\ndebug = "/var/log/nvidia-container-runtime.log"\n'
        'log-level = "info"\nmode = "cdi"\nruntimes = ["runc", "crun"]\n'
        '[nvidia-container-runtime.modes.cdi]\ndefault-kind = "nvidia.com/gpu"\n',
    )
    write(
        root,
        "/etc/containerd/config.toml",
        'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n'
        '  default_runtime_name = "nvidia"\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
        '  runtime_type = "io.containerd.runc.v2"\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\n'
        '  BinaryName = "/usr/bin/nvidia-container-runtime"\n  SystemdCgroup = true\n',
    )
    plugin_process(
        root,
        ["nvidia-device-plugin"],
        ["PATH=/usr/bin", "PASS_DEVICE_SPECS=true", "DEVICE_LIST_STRATEGY=envvar"],
    )
    write(root, "/proc/devices", "Character devices:\n195 nvidia\n195 nvidiactl\n510 nvidia-uvm\n")
    write(root, "/proc/modules", "nvidia_uvm 1 0 - Live 0x0\nnvidia 1 0 - Live 0x0\n")
    nodes = [
        ("nvidia0", 195, 0),
        ("nvidia1", 195, 1),
        ("nvidiactl", 195, 255),
        ("nvidia-uvm", 510, 0),
        ("nvidia-uvm-tools", 510, 1),
    ]
    for name, major, minor in nodes:
        make_node(root / "dev" / name, major, minor)
        link = root / f"dev/char/{major}:{minor}"
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(f"../{name}", link)
    runc = write(root, "/usr/bin/runc", "#!/bin/sh\n")
    runc.chmod(0o755)
    write(root, "/usr/lib/x86_64-linux-gnu/systemd/libsystemd-shared-252.so", "")
    write(root, "/usr/lib/systemd/system/kubelet.service.d/10-gpuguard.conf", "[Service]\n")
    status_file(root)
    pci_gpu(root, "0000:10:00.0")
    pci_gpu(root, "0000:11:00.0")
    pci_gpu(root, "0000:12:00.0", klass="0x068000")  # an NVSwitch: not a GPU
    pci_gpu(root, "0000:00:02.0", klass="0x030000", vendor="0x8086")  # another vendor's VGA
    write_checkpoint(root, UUIDS)
    bridge_state(root, "waiting", "waiting for kubelet's start")
    return root


def bridge_state(
    root: Path, decision: str, detail: str, cause: str = "", kubelet: str = "1.34"
) -> None:
    """What gpuguard-readmit.service writes (readmit/state.py), on or off."""
    from gpuguard.readmit.state import SPEC, STATE_FILE, ReadmitState

    state = ReadmitState("", 0.0, decision, detail, off_cause=cause, kubelet_version=kubelet)
    p = root / STATE_FILE.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(SPEC.encode(state))
