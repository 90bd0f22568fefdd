"""The processes behind the device plugins: who a pid is (its start, comm and cgroup:
a container, a host service or a bare process), whether it is still the same process,
and the init of the container it runs in. Read from /proc under the root."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

from gpuguard.devices.cgroupnames import (
    CGROUPFS_CONTAINER,
    CGROUPFS_POD,
    RUNTIME,
    SYSTEMD_CONTAINER,
    parse_proc_cgroup,
    systemd_pod_uid,
)
from gpuguard.host.numparse import parse_decimal
from gpuguard.host.paths import Root
from gpuguard.host.safeio import UnsafeFileError, proc_text, read_bytes


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    start: float  # wall-clock seconds
    comm: str
    kind: str  # "container" | "service" | "process"
    container_id: str = ""
    runtime: str = ""  # containerd | cri-o | docker | unknown
    pod_uid: str = ""
    unit: str = ""  # the systemd service of a host-service plugin
    cgroup: str = ""
    # seconds since boot (/proc/PID/stat's start, CLOCK_BOOTTIME), where read in this
    # daemon's life: never written to a state file (a pid and a start since boot may
    # come again in another boot), so one read back has None and the wall clock's start
    boot_start: Optional[float] = field(default=None, compare=False)

    def describe(self) -> str:
        if self.kind == "container":
            return f"container {self.container_id[:13]} (pid {self.pid})"
        if self.kind == "service":
            return f"{self.unit} (pid {self.pid})"
        return f"process {self.comm} (pid {self.pid})"

    def to_json(self) -> dict[str, object]:
        return {
            "pid": self.pid,
            "start": self.start,
            "comm": self.comm,
            "kind": self.kind,
            "container_id": self.container_id,
            "runtime": self.runtime,
            "pod_uid": self.pod_uid,
            "unit": self.unit,
            "cgroup": self.cgroup,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, object]) -> ProcessInfo:
        def s(key: str) -> str:
            v = d.get(key, "")
            return v if isinstance(v, str) else ""

        pid, start = d.get("pid", 0), d.get("start", 0.0)
        return cls(
            pid=int(pid) if isinstance(pid, (int, float)) else 0,
            start=float(start) if isinstance(start, (int, float)) else 0.0,
            comm=s("comm"),
            kind=s("kind") or "process",
            container_id=s("container_id"),
            runtime=s("runtime"),
            pod_uid=s("pod_uid"),
            unit=s("unit"),
            cgroup=s("cgroup"),
        )


# -- /proc readers -------------------------------------------------------------------


def boot_time(root: Root) -> float:
    """When this boot began (btime of /proc/stat, Unix seconds); 0 when unknown."""
    try:
        for line in proc_text(root.path("/proc/stat")).splitlines():
            if line.startswith("btime "):
                value = parse_decimal(line.split()[1])
                return float(value) if value is not None else 0.0
    except (OSError, IndexError):
        pass
    return 0.0


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def start_ticks(root: Root, pid: int) -> Optional[int]:
    """The start of ``pid`` in clock ticks since boot (None: gone). Field 22 of
    /proc/<pid>/stat, after the command's closing parenthesis."""
    try:
        text = proc_text(root.path(f"/proc/{pid}/stat"))
    except OSError:
        return None
    rest = text[text.rfind(")") + 2 :].split()
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return None


def process_start(root: Root, pid: int, btime: Optional[float] = None) -> Optional[float]:
    """Wall-clock start of ``pid`` (None: gone): btime + its start since boot."""
    ticks = start_ticks(root, pid)
    if ticks is None:
        return None
    return (boot_time(root) if btime is None else btime) + ticks / _CLK_TCK


def _comm(root: Root, pid: int) -> str:
    try:
        return proc_text(root.path(f"/proc/{pid}/comm")).strip()
    except OSError:
        return ""


def classify_cgroup(path: str) -> tuple[str, str, str, str, str]:
    """(kind, container_id, runtime, pod_uid, unit) for a cgroup path.

    Matches with devices.cgroupnames' kubepods patterns, wherever the kubepods tree sits
    (kubelet's --cgroup-root); a ``*.service`` component outside a pod is a host
    service (``system.slice/nvidia-device-plugin.service``)."""
    parts = [p for p in path.split("/") if p]
    pod = ""
    for i, part in enumerate(parts):
        m = SYSTEMD_CONTAINER.fullmatch(part)
        if m:
            if i > 0:
                pod = systemd_pod_uid(parts[i - 1]) or ""
            return ("container", m.group(2), RUNTIME[m.group(1)], pod, "")
        pm2 = CGROUPFS_POD.fullmatch(part)
        if pm2 and i + 1 < len(parts):
            cm = CGROUPFS_CONTAINER.fullmatch(parts[i + 1])
            if cm:
                rt = RUNTIME[cm.group(1)] if cm.group(1) else "unknown"
                return ("container", cm.group(2), rt, pm2.group(1), "")
    for part in reversed(parts):
        if part.endswith(".service"):
            return ("service", "", "", "", part)
    return ("process", "", "", "", "")


def read_cgroup(root: Root, pid: int) -> str:
    """The process's cgroup: the first of v1 devices, cgroup2 (``0::``) and name=systemd
    that names a container, else a service, else the first present.

    On a unified node the runtime places a container only in cgroup2; a kernel that
    also has v1 hierarchies still lists them, the devices one at its root (``/``), so
    taking the devices line first made a containerised plugin a bare process there."""
    try:
        text = proc_text(root.path(f"/proc/{pid}/cgroup"))
    except OSError:
        return ""
    by = parse_proc_cgroup(text)
    paths = [by[k] for k in ("devices", "", "name=systemd") if by.get(k)]
    for kind in ("container", "service"):
        for path in paths:
            if classify_cgroup(path)[0] == kind:
                return path
    return paths[0] if paths else ""


def process_info(root: Root, pid: int, btime: Optional[float] = None) -> Optional[ProcessInfo]:
    ticks = start_ticks(root, pid)
    if ticks is None:
        return None
    start = (boot_time(root) if btime is None else btime) + ticks / _CLK_TCK
    cg = read_cgroup(root, pid)
    kind, cid, runtime, pod, unit = classify_cgroup(cg)
    comm = _comm(root, pid)
    return ProcessInfo(pid, start, comm, kind, cid, runtime, pod, unit, cg, ticks / _CLK_TCK)


def still_running(root: Root, proc: ProcessInfo, btime: Optional[float] = None) -> bool:
    """Same pid and same start time: the very process, not a recycled pid."""
    now = process_info(root, proc.pid, btime)
    return now is not None and same_process(now, proc)


def same_process(a: ProcessInfo, b: ProcessInfo) -> bool:
    """The same pid and start: since boot where both were read so (a step of the wall
    clock between the two reads moves their wall-clock starts, not these), else on the
    wall clock within half a second (btime is whole seconds)."""
    if a.pid != b.pid:
        return False
    if a.boot_start is not None and b.boot_start is not None:
        return abs(a.boot_start - b.boot_start) < 0.5 / _CLK_TCK
    return abs(a.start - b.start) < 0.5


def _pids(root: Root) -> list[int]:
    try:
        pids = (parse_decimal(n, lo=1, hi=2**22) for n in os.listdir(root.path("/proc")))
        return sorted(p for p in pids if p is not None)
    except OSError:
        return []


def container_init_pid(root: Root, pid: int) -> Optional[int]:
    """The init (pid 1 of its pid namespace) of the container ``pid`` runs in."""

    def nspid(p: int) -> list[str]:
        try:
            for line in proc_text(root.path(f"/proc/{p}/status")).splitlines():
                if line.startswith("NSpid:"):
                    return line.split()[1:]
        except OSError:
            pass
        return []

    own = nspid(pid)
    if own and own[-1] == "1":
        return pid
    try:
        ns = os.readlink(root.path(f"/proc/{pid}/ns/pid"))
    except OSError:
        return None
    for p in _pids(root):
        try:
            if os.readlink(root.path(f"/proc/{p}/ns/pid")) != ns:
                continue
        except OSError:
            continue
        v = nspid(p)
        if v and v[-1] == "1":
            return p
    return None


# kubelet's own process, and k3s's, which runs kubelet inside it (devices/kubeletproc.py)
KUBELET_COMMS = ("kubelet", "k3s-agent", "k3s-server")


def proc_runs_as_root(root: Root, proc_dir: Path) -> bool:
    """On the host, /proc/PID is owned by the process's effective uid: a process a
    local user named kubelet is no kubelet (the checkpoint is root's), and must not
    make gpuguard wait for it. In a root prefix: the files say nothing of that."""
    if not root.is_host:
        return True
    try:
        return os.stat(proc_dir).st_uid == 0
    except OSError:
        return False


def kubelet_pids(root: Root) -> tuple[int, ...]:
    """Every process under the root's /proc that runs kubelet (KUBELET_COMMS) as root
    (on the host)."""
    proc = root.path("/proc")
    pids = []
    try:
        names = os.listdir(proc)
    except OSError:
        return ()
    for name in names:
        pid = parse_decimal(name, lo=1, hi=2**22)
        if pid is None:
            continue
        try:
            comm, _st = read_bytes(proc / name / "comm", what="comm", max_bytes=4096)
        except UnsafeFileError:  # the process exited while we looked, or not a comm file
            continue
        name_ok = comm.strip().decode(errors="replace") in KUBELET_COMMS
        if name_ok and proc_runs_as_root(root, proc / name):
            pids.append(pid)
    return tuple(sorted(pids))


MAX_FDS = 4096  # a process's fds looked at, at most
NVIDIA_PREFIX = "/dev/nvidia"


def open_nvidia_nodes(root: Root, pid: int) -> tuple[str, ...]:
    """The NVIDIA device nodes the process holds open (its /proc/PID/fd links, as its
    own mount namespace names them: /dev/nvidia0, /dev/nvidiactl, /dev/nvidia-uvm ...),
    sorted; () when it is gone or its fds cannot be read."""
    fd_dir = root.path(f"/proc/{pid}/fd")
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return ()
    found = set()
    for fd in fds[:MAX_FDS]:
        try:
            link = os.readlink(fd_dir / fd)
        except OSError:
            continue
        if link.startswith(NVIDIA_PREFIX):
            found.add(link)
    return tuple(sorted(found))
