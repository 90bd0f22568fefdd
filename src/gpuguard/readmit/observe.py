"""What the bridge reads from the host: which kubelet runs here and whether it needs
the bridge, which checkpointed pods still have processes, which device plugin sockets
exist (the device IDs the node has: readmit/node.py)."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from gpuguard.errors import GpuguardError
from gpuguard.host import commands, pathtrust
from gpuguard.host.echo import cut
from gpuguard.host.paths import STATE_DIR, Root
from gpuguard.host.statefile import StateFile, load
from gpuguard.readmit.alive import alive_pods as own_containers_alive

#: the first kubelet whose device manager rejects a re-admitted pod before a plugin has
#: reported its devices healthy (devicesToAllocate's "no healthy devices present")
NEEDS_BRIDGE = (1, 26)
#: executables whose ``--version`` names the kubelet they run: kubelet, or k3s and
#: RKE2, which run kubelet inside their own binary
KUBELET_NAMES = re.compile(r"kubelet|k3s|rke2")
#: "Kubernetes v1.34.9", "k3s version v1.28.5+k3s1 (...)": a version with its "v"
VERSION = re.compile(r"\bv(\d+)\.(\d+)\.\d+")
CACHE_FILE = f"{STATE_DIR}/kubelet-version.json"
CGROUP_TOPS = ("/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified", "/sys/fs/cgroup")


@dataclass(frozen=True)
class KubeletVersion:
    """The version a kubelet executable reports, for one identity of that file."""

    path: str
    identity: str  # device, inode, size, mtime: another binary at the path is asked again
    version: str  # "1.34" ("" when it could not be told)
    text: str  # its --version line, bounded

    @property
    def needs_bridge(self) -> Optional[bool]:
        """True from 1.26, False before; None when the version is unknown."""
        m = re.fullmatch(r"(\d+)\.(\d+)", self.version)
        if not m:
            return None
        return (int(m[1]), int(m[2])) >= NEEDS_BRIDGE


CACHE: StateFile[KubeletVersion] = StateFile(
    path=CACHE_FILE,
    what="kubelet version cache",
    version=1,
    parse=lambda o: KubeletVersion(
        o.text("path", max_len=4096),
        o.text("identity", max_len=200),
        o.text("kubelet", max_len=32),
        o.text("text", max_len=200),
    ),
    render=lambda v: {
        "path": v.path,
        "identity": v.identity,
        "kubelet": v.version,
        "text": v.text,
    },
)


def unit_executable(units: Sequence[str]) -> Optional[tuple[str, str]]:
    """The first of ``units`` that systemd has loaded and its executable, as its
    ExecStart= names it (``{ path=/usr/bin/kubelet ; argv[]=... }``)."""
    for unit in units:
        try:
            res = commands.run(["systemctl", "show", "--property=ExecStart", "--value", unit])
        except GpuguardError:
            return None
        m = re.search(r"path=(/\S+)", res.stdout)
        if res.returncode == 0 and m:
            return unit, m[1]
    return None


def file_key(path: Path) -> tuple[int, int, int]:
    """A file's identity (inode, mtime, size); zeros when absent."""
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0, 0)
    return st.st_ino, st.st_mtime_ns, st.st_size


def identity(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


VERSION_TIMEOUT = 5.0  # seconds for ``--version``: kubelet answers in tens of ms
VERSION_BYTES = 4096  # of its output read: the version is its first line


def kubelet_version(root: Root, path: str, cached: Optional[KubeletVersion]) -> KubeletVersion:
    """What ``path --version`` says, asked only of a root-owned executable that no one
    else may write (nor any directory on its way: host/pathtrust.py), with no setuid
    or setgid bit and no file capability, whose name is kubelet's (or k3s's, RKE2's);
    ``cached`` when it is the same file as then. It runs as nobody, without new
    privileges, an empty environment, a timeout and its output bounded
    (host/commands.py: run_as_nobody), exec'd through a descriptor of the file checked."""
    try:
        found = pathtrust.resolve(root.path("/"), path)
    except pathtrust.Untrusted as e:
        return KubeletVersion(path, "", "", f"{path}: not asked: {e}"[:200])
    if found is None:
        return KubeletVersion(path, "", "", f"{path}: No such file or directory")
    st = found.st
    ident = identity(st)
    if cached is not None and (cached.path, cached.identity) == (path, ident):
        return cached
    if not KUBELET_NAMES.search(Path(path).name):
        return KubeletVersion(path, ident, "", f"{path}: not kubelet, k3s or rke2")
    why = _executable_problem(st)
    if why:
        return KubeletVersion(path, ident, "", f"{path}: {why}")
    try:
        fd = os.open(found.real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        return KubeletVersion(path, ident, "", f"{path}: {e.strerror}")
    try:
        now = os.fstat(fd)
        why = "replaced while it was checked" if identity(now) != ident else _caps(fd)
        if why:
            return KubeletVersion(path, ident, "", f"{path}: {why}")
        _rc, out = commands.run_as_nobody(
            fd, ["--version"], timeout=VERSION_TIMEOUT, max_bytes=VERSION_BYTES
        )
    except commands.CommandError as e:
        return KubeletVersion(path, ident, "", f"{path} --version: {e}"[:200])
    finally:
        os.close(fd)
    line = out.strip().splitlines()[:1]
    text = cut(line[0], 200) if line else ""
    m = VERSION.search(text)
    return KubeletVersion(path, ident, f"{m[1]}.{m[2]}" if m else "", text)


def _executable_problem(st: os.stat_result) -> str:
    if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        return "not a root-owned file only root writes"
    if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
        return "setuid or setgid: not run"
    return ""


def _caps(fd: int) -> str:
    """Why not, when the file carries capabilities (security.capability)."""
    try:
        os.getxattr(fd, "security.capability")
    except OSError:
        return ""  # none (ENODATA), or no xattrs on this filesystem
    return "has file capabilities: not run"


def read_cached(root: Root) -> Optional[KubeletVersion]:
    return load(root.path(CACHE_FILE), CACHE).value


def alive_pods(root: Root) -> frozenset[str]:
    """Pod UIDs with a process in one of their own containers, never their sandbox
    alone (readmit/alive.py), in the kubepods tree (either cgroup driver, cgroup v1's
    named systemd hierarchy or v2)."""
    return own_containers_alive(root, CGROUP_TOPS)


def other_sockets(plugins_dir: Path) -> tuple[str, ...]:
    """The sockets in kubelet's device-plugins directory besides kubelet's own: a
    device plugin is serving (kubelet removes every socket there when it starts)."""
    try:
        with os.scandir(plugins_dir) as it:
            return tuple(
                sorted(
                    e.name
                    for e in it
                    if e.name != "kubelet.sock"
                    and stat.S_ISSOCK(e.stat(follow_symlinks=False).st_mode)
                )
            )
    except OSError:
        return ()
