"""NVIDIA's legacy runtime hook (nvidia-container-runtime-hook), played for tests.

runc runs it as a prestart hook (containerd's ``base_runtime_spec`` carries it: see
harness/kubelet.py), in the runtime's namespaces, after the container's mounts are set
up and before it pivots into its root; the container's state (id, pid, bundle) comes on
stdin. Like the real hook it reads ``NVIDIA_VISIBLE_DEVICES`` from the container's
config (what the device plugin's Allocate answer put there), looks each ID up in the
node's GPUs (here gpuguard's inventory file, where the real hook asks NVML), and:

* fails the container's start for an ID the node does not have, with the real hook's
  words: ``device error: GPU-...: unknown device`` (so kubelet retries it, and a pod
  whose checkpointed allocation names old UUIDs stays in CrashLoopBackOff);
* otherwise gives the container each GPU's node and ``nvidiactl`` behind runc's back:
  the node made in the container's own /dev (a tmpfs of its mount namespace, reached
  through ``/proc/PID/root``; never a host /dev), and ``c 195:N rw`` written to the
  devices cgroup the container's process is in (v1; read from /proc/PID/cgroup, as
  libnvidia-container finds it).

Unlike the real hook it does not give ``nvidia-uvm``: in these tests that node comes
only from the device plugin's device specs, as it did on seed 004's node once a
runtime update had wiped the hook's grants (F3).

Stdlib only: runc runs it with the system python3.
Usage: nvidia_hook.py INVENTORY_JSON [LOG_FILE]
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
from typing import Dict, List, Tuple

GPU_MAJOR = 195
CTL_MINOR = 255


def _env(config: Dict[str, object]) -> Dict[str, str]:
    process = config.get("process")
    env = process.get("env", []) if isinstance(process, dict) else []
    return dict(e.split("=", 1) for e in env if isinstance(e, str) and "=" in e)


def select(value: str, gpus: List[Dict[str, object]]) -> List[Tuple[str, int]]:
    """(name, minor) per requested GPU; SystemExit with the hook's error for a bad ID."""
    if value in ("", "void", "none"):
        return []
    if value == "all":
        return [(f"nvidia{g['minor']}", int(str(g["minor"]))) for g in gpus]
    out = []
    for ident in value.split(","):
        found = [g for g in gpus if ident.strip() in (g["uuid"], str(g["index"]))]
        if not found:
            raise SystemExit(f"device error: {ident.strip()}: unknown device")
        out.append((f"nvidia{found[0]['minor']}", int(str(found[0]["minor"]))))
    return out


def devices_cgroup(pid: int) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _hid, ctrls, path = line.rstrip("\n").split(":", 2)
            if "devices" in ctrls.split(","):
                return f"/sys/fs/cgroup/devices{path}"
    raise SystemExit("nvidia hook: no v1 devices cgroup (this double plays the v1 hook only)")


def main(argv: List[str]) -> int:
    state = json.load(sys.stdin)
    pid, bundle = int(state["pid"]), str(state["bundle"])
    with open(os.path.join(bundle, "config.json")) as f:
        config = json.load(f)
    value = _env(config).get("NVIDIA_VISIBLE_DEVICES")
    if value is None:
        return 0
    with open(argv[1]) as f:
        gpus = json.load(f)["gpus"]
    nodes = select(value, gpus)
    if not nodes:
        return 0
    nodes.append(("nvidiactl", CTL_MINOR))
    root = config["root"]["path"]
    rootfs = root if os.path.isabs(root) else os.path.join(bundle, root)
    cgroup = devices_cgroup(pid)
    for name, minor in nodes:
        node = f"/proc/{pid}/root{rootfs}/dev/{name}"
        with contextlib.suppress(FileExistsError):  # given by the plugin's specs too
            os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(GPU_MAJOR, minor))
        with open(os.path.join(cgroup, "devices.allow"), "w") as f:
            f.write(f"c {GPU_MAJOR}:{minor} rw")
    if len(argv) > 2:
        with open(argv[2], "a") as f:
            f.write(json.dumps({"id": state["id"], "value": value, "cgroup": cgroup}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
