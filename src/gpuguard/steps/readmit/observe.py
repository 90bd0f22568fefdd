"""What the readmit step reads: the bridge's state file, and for the pods it names as
rejected, whether each has a running process and a pod directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from gpuguard.devices.kubeletstart import KubeletStartWatch
from gpuguard.host.paths import Root
from gpuguard.host.statefile import load
from gpuguard.readmit.observe import alive_pods
from gpuguard.readmit.state import SPEC, STATE_FILE
from gpuguard.steps.readmit.reconcile import ReadmitView


def pods_dir(checkpoint_path: str) -> str:
    """kubelet's pods directory, beside device-plugins/ in its root directory."""
    return str(Path(checkpoint_path).parent.parent / "pods")


def observe(
    root: Root, checkpoint_path: str, watch: Optional[KubeletStartWatch] = None
) -> ReadmitView:
    """``watch``: kubelet.sock's, kept across passes (devices/kubeletstart.py)."""
    got = load(root.path(STATE_FILE), SPEC)
    s = got.value
    if watch is None:
        watch = KubeletStartWatch(root, root.path(checkpoint_path).parent / "kubelet.sock")
    run = watch.look()
    sock = run.wall() if run is not None else None
    if s is None or not s.rejected:
        why = "" if got.absent else got.why
        return ReadmitView(s, why, frozenset(), frozenset(), kubelet_sock=sock)
    uids = {p.pod_uid for p in s.rejected}
    pods = root.path(pods_dir(checkpoint_path))
    present = frozenset(u for u in uids if os.path.isdir(pods / u))
    alive = alive_pods(root) & (uids | {p.replacement_uid for p in s.rejected})
    seen = os.path.isdir(pods)  # absent or unreadable: no pod is taken as gone
    why = "" if seen else f"{pods}: not a directory"
    return ReadmitView(s, why, alive, present, seen, sock)
