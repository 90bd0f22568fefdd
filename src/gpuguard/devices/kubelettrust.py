"""Which running kubelet gpuguard may act for: the one place that decides whether a
process named kubelet (or k3s's) is a kubelet an installer started.

A process's name is chosen by whoever starts it: any local user can run a program
called `kubelet`. gpuguard derives from such a process the unit an F1 repair stops and
starts (and the configuration doctor reads), so a process counts only if all hold:

- its cgroup is in a service of [Systemd] KubeletUnits= (a user cannot put a process
  into a system service's cgroup: cgroup.procs is root's);
- it runs as root (/proc/PID is owned by its effective uid);
- its executable is a regular file owned by root, writable by no one else, at a path
  a kubelet, k3s or RKE2 install uses (TRUSTED_EXES), in directories owned by root and
  writable by no one else; on the host, that path still names the very file the
  process runs (or the file was deleted by an upgrade and its directory is trusted).

Anything else is refused with the reason, for a finding: never an action.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import Callable, Optional, Sequence

from gpuguard.devices.kubeletproc import KubeletProcess, kubelet_processes
from gpuguard.devices.processes import proc_runs_as_root
from gpuguard.host.echo import cut
from gpuguard.host.paths import Root
from gpuguard.model import Finding

# Where kubelet, k3s and RKE2 installs put the binary that runs as kubelet (a `*`
# matches one path component). Packages (kubeadm, EKS, AKS, OpenShift): /usr/bin,
# /usr/local/bin; Flatcar: /opt/bin; GKE: /home/kubernetes/bin; RKE2 runs kubelet
# from its data directory; k3s re-executes the binary it unpacked into its own.
TRUSTED_EXES = (
    "/usr/bin/kubelet",
    "/usr/local/bin/kubelet",
    "/usr/sbin/kubelet",
    "/bin/kubelet",
    "/opt/bin/kubelet",
    "/home/kubernetes/bin/kubelet",
    "/var/lib/rancher/rke2/data/*/bin/kubelet",
    "/var/lib/rancher/k3s/data/*/bin/k3s",
    "/usr/local/bin/k3s",
    "/usr/bin/k3s",
)
ROOT_UID = 0  # the owner trusted (tests of fake roots that do not run as root set theirs)
_DELETED = " (deleted)"
FINDING_KIND = "kubelet-process-untrusted"


@dataclass(frozen=True)
class Refused:
    process: KubeletProcess
    why: str

    def finding(self, reconciler: str) -> Finding:
        return Finding(
            FINDING_KIND,
            reconciler,
            f"{cut(self.process.describe(), 200)} ignored: {cut(self.why, 300)}; gpuguard "
            "acts on no unit and reads no configuration because of it",
            {"PID": str(self.process.pid), "UNIT": cut(self.process.unit), "REASON": self.why},
        )


@dataclass(frozen=True)
class Kubelets:
    trusted: tuple[KubeletProcess, ...]
    refused: tuple[Refused, ...]

    @property
    def first(self) -> Optional[KubeletProcess]:
        return self.trusted[0] if self.trusted else None

    def findings(self, reconciler: str) -> list[Finding]:
        return [r.finding(reconciler) for r in self.refused]

    def describe_refused(self) -> str:
        shown = [f"{cut(r.process.describe(), 200)} ignored: {r.why}" for r in self.refused[:4]]
        more = len(self.refused) - len(shown)
        return "; ".join(shown + ([f"{more} more"] if more > 0 else []))


def exe_path_trusted(path: str) -> bool:
    parts = PurePosixPath(path).parts
    for pattern in TRUSTED_EXES:
        want = PurePosixPath(pattern).parts
        if len(want) == len(parts) and all(fnmatchcase(p, w) for p, w in zip(parts, want)):
            return True
    return False


def _owner_why(st: os.stat_result, what: str) -> str:
    if st.st_uid != ROOT_UID:
        return f"{what} is owned by uid {st.st_uid}, not root"
    if st.st_mode & 0o022:
        return f"{what} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def _view(root: Root, pid: int) -> Callable[[str], Path]:
    """Where to look at a path of the process's filesystem: on the host through
    /proc/PID/root (its own mount namespace: a kubelet in another one, or a daemon
    whose ProtectHome= hides /home, sees the very files); in a root prefix, in it."""
    if root.is_host:
        return lambda path: Path(f"/proc/{pid}/root{path}")
    return root.path


def _chain_why(view: Callable[[str], Path], path: str, top: bool) -> str:
    """Every directory above `path` owned by root, writable by no one else, and no
    symbolic link (the kernel's path of an executable has none); `top`: "/" too."""
    parents = list(PurePosixPath(path).parents)[::-1]
    for d in parents if top else parents[1:]:
        try:
            st = os.lstat(view(str(d)) if str(d) != "/" else f"{view('/')}/")
        except OSError as e:
            return f"cannot read {d}: {e.strerror}"
        if not stat.S_ISDIR(st.st_mode):
            return f"{d} is not a directory"
        why = _owner_why(st, f"directory {d}")
        if why:
            return why
    return ""


def exe_why(root: Root, pid: int) -> str:
    """ "" when the process's executable is trusted, else why not."""
    link = root.path(f"/proc/{pid}/exe")
    try:
        path = os.readlink(link)
    except OSError as e:
        return f"its executable cannot be read ({e.strerror})"
    deleted = path.endswith(_DELETED)
    path = path[: -len(_DELETED)] if deleted else path
    if not path.startswith("/") or os.path.normpath(path) != path or not exe_path_trusted(path):
        return f"its executable {path[:200]!r} is not where a kubelet install puts it"
    view = _view(root, pid)
    try:  # on the host, the file the process runs (whatever its path shows now)
        st = os.stat(link) if root.is_host else os.lstat(view(path))
    except OSError as e:
        return f"its executable {path} cannot be read ({e.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return f"its executable {path} is not a regular file"
    why = _owner_why(st, f"its executable {path}") or _chain_why(view, path, root.is_host)
    if why or not root.is_host or deleted:
        return why
    try:  # the path still names the file the process runs (not replaced since)
        now = os.lstat(view(path))
    except OSError as e:
        return f"its executable {path} cannot be read ({e.strerror})"
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        return f"it does not run the file at {path}"
    return ""


def process_why(root: Root, p: KubeletProcess, units: Sequence[str]) -> str:
    """ "" when `p` is a kubelet gpuguard may act for (the unit it is in, its flags)."""
    if not p.unit:
        return "it is in no systemd service"
    if p.unit not in units:
        return f"{p.unit} is not one of [Systemd] KubeletUnits= ({' '.join(units)})"
    try:
        owner = os.stat(root.path(f"/proc/{p.pid}")).st_uid
    except OSError as e:
        return f"/proc/{p.pid} cannot be read ({e.strerror})"
    if owner != ROOT_UID:
        return f"it runs as uid {owner}, not root"
    return exe_why(root, p.pid)


def runs_as_root(root: Root, pid: int) -> bool:
    """On the host, whether the process runs as root (what a local user starts under a
    plugin's or kubelet's name does not); in a root prefix always true."""
    return proc_runs_as_root(root, root.path(f"/proc/{pid}"))


def kubelets(root: Root, units: Sequence[str]) -> Kubelets:
    """The running kubelets gpuguard trusts, by pid, and those it refused with why."""
    trusted, refused = [], []
    for p in kubelet_processes(root):
        why = process_why(root, p, units)
        if why:
            refused.append(Refused(p, why))
        else:
            trusted.append(p)
    return Kubelets(tuple(trusted), tuple(refused))


def kubelet_unit(root: Root, candidates: Sequence[str]) -> tuple[str, str]:
    """(unit, why): the unit the trusted running kubelet is in, else the first
    candidate (`why` says which case it is). Only ever one of `candidates`."""
    found = kubelets(root, candidates)
    if found.first is not None:
        return found.first.unit, f"the running {found.first.describe()}"
    first = candidates[0] if candidates else "kubelet.service"
    return first, "no trusted kubelet process in a systemd service; the first of " + (
        "[Systemd] KubeletUnits="
    )
