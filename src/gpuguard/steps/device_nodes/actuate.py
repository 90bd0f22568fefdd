"""Creates NVIDIA device nodes and /dev/char links.

On the real host, nvidia-modprobe is preferred for GPU/ctl/uvm nodes (it applies the
driver's configured mode and group); mknod is the fallback and the only way under a
test root. Links are made atomically (symlink to a temp name, rename over).
"""

from __future__ import annotations

import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from gpuguard.actuate.change import Change
from gpuguard.actuate.safewrite import UnsafeWriteError, check_real_dir, chmod_node
from gpuguard.host.commands import CommandError, run
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.model import Action, Outcome
from gpuguard.steps.device_nodes.reconcile import CreateCharLink, CreateDeviceNode


def modprobe_args(action: CreateDeviceNode) -> Optional[list[str]]:
    """nvidia-modprobe flags that create this node, or None when it has none."""
    if action.role == "gpu":
        return ["-c", str(action.minor)]
    if action.role == "ctl":
        return ["-c", "0"]  # any GPU minor creates nvidiactl too
    if action.role in ("uvm", "uvm-tools"):
        return ["-u", "-c", "0"]
    if action.role == "modeset":
        return ["-m"]
    return None


@dataclass(frozen=True)
class DeviceNodeActuator:
    root: Root
    log: EventLog
    nvidia_modprobe: str = "/usr/bin/nvidia-modprobe"

    def change(self, action: Action) -> Change[Outcome]:
        """Creating a node or a link, for the executor; each half journals its outcome
        (a dry-run's as every step's dry-run outcome is)."""
        return Change(action.kind, lambda: self.apply(action), lambda: self._describe(action))

    def _describe(self, action: Action) -> Outcome:
        outcome = Outcome(action, "dry-run", "would " + action.describe())
        self.log.outcome(outcome)
        return outcome

    def apply(self, action: Action) -> Outcome:
        """The making half of `change`."""
        try:
            if isinstance(action, CreateDeviceNode):
                outcome = self._node(action)
            elif isinstance(action, CreateCharLink):
                outcome = self._link(action)
            else:
                raise TypeError(f"not a device node action: {action!r}")
        except OSError as e:
            outcome = Outcome(action, "failed", f"{action.target}: {e.strerror}")
        except UnsafeWriteError as e:
            outcome = Outcome(action, "failed", e.message)
        self.log.outcome(outcome)
        return outcome

    def _matches(self, path: Path, a: CreateDeviceNode) -> bool:
        try:
            st = os.lstat(path)
        except OSError:
            return False
        return stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (
            a.major,
            a.minor,
        )

    def _node(self, a: CreateDeviceNode) -> Outcome:
        path = self.root.path(a.path)
        if self._matches(path, a):
            return Outcome(a, "skipped", "already there")
        args = modprobe_args(a)
        if self.root.is_host and args is not None and os.access(self.nvidia_modprobe, os.X_OK):
            try:
                res = run([self.nvidia_modprobe, *args], timeout=20)
            except CommandError as e:
                res = None
                self.log.warning(f"nvidia-modprobe failed ({e}); using mknod")
            if res is not None and self._matches(path, a):
                return Outcome(a, "done", "by nvidia-modprobe")
        check_real_dir(self.root, path.parent)  # nothing made through a link
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        try:
            os.mknod(path, stat.S_IFCHR | a.mode, os.makedev(a.major, a.minor))
        except FileExistsError:
            return Outcome(a, "skipped", "appeared meanwhile")
        chmod_node(path, a.mode, (a.major, a.minor))  # mknod's mode is filtered by the umask
        return Outcome(a, "done", "mknod")

    def _link(self, a: CreateCharLink) -> Outcome:
        link = self.root.path(a.link)
        check_real_dir(self.root, link.parent)  # /dev/char linked elsewhere: refused
        link.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        tmp = link.parent / f".gpuguard-{link.name}.{secrets.token_hex(3)}"
        os.symlink(a.points_to, tmp)
        try:
            os.rename(tmp, link)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        return Outcome(a, "done", "replaced" if a.replace else "created")
