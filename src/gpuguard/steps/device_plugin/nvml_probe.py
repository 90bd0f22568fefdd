"""Can NVML initialise in a device plugin's context? (``[DevicePlugin] NvmlProbe=yes``)

A device plugin whose NVML fails ("Failed to initialize NVML: Unknown Error") serves
nothing useful even though its /dev looks complete: the library it loads is not the
running driver's, a device node it needs is denied by its device cgroup, the driver
was reloaded under it. The probe asks NVML itself, from where the plugin stands:

1. a forked child writes its pid into the plugin's ``cgroup.procs`` (the v1 devices
   directory and/or the v2 directory: devices/cgroupchild.py, the fork, join and report
   skeleton the device probe shares), so the device cgroup that applies to the plugin
   (v1 rules, or BPF programs of the directory and its ancestors) applies to it;
2. it enters the plugin's mount namespace: ``setns(open("/proc/PID/ns/mnt"),
   CLONE_NEWNS)`` through ctypes (``os.setns`` is Python >= 3.12 only), then
   ``chdir("/")`` (nothing to do when it is already ours); from now on every path,
   ``/dev/nvidiactl`` and the library included, is the plugin's;
3. it lowers its capabilities to the plugin's (CapEff/CapPrm of /proc/PID/status, never
   more than it has) and sets no_new_privs, so that the library cannot do more than
   in the plugin (see below);
4. it loads ``libnvidia-ml.so.1`` with ctypes from the plugin's filesystem: first the
   very file the plugin has mapped (/proc/PID/maps, when it keeps NVML loaded), then
   the name in each directory of the plugin's ``LD_LIBRARY_PATH`` and in the usual
   library directories (Debian multiarch, /usr/lib64, /usr/local/nvidia/lib64 ...),
   then the bare name (our dynamic loader's own search, inside the plugin's
   filesystem). Its dependencies (libc, libm, libdl, libpthread, librt) are the ones
   our process has loaded (they are loaded before step 2), never the plugin's;
5. it calls ``nvmlInit_v2`` (``nvmlInit`` for old libraries), takes the text of a
   failure from ``nvmlErrorString``, calls ``nvmlShutdown`` after a success, reports
   over a pipe and ``_exit``\\ s. The parent reads with a timeout and kills and reaps a
   child that does not answer (a hung driver, a frozen cgroup).

Why a child: setns(CLONE_NEWNS) changes the mount namespace of the calling process,
which must not be the daemon (its own files, its PrivateMounts= view); and the kernel
refuses it (EINVAL) in a multi-threaded process, which the daemon is (asyncio worker
threads). A freshly forked child has exactly one thread. The child of a multi-threaded
parent may find a lock (the dynamic loader's) held forever: the timeout covers that.
Call :func:`probe_nvml` from a worker thread; it blocks up to ``timeout``.

Privileges: writing another cgroup's ``cgroup.procs`` (root, CAP_DAC_OVERRIDE on
hierarchies it does not own); setns into a mount namespace needs CAP_SYS_ADMIN and
CAP_SYS_CHROOT, and the unit's ``RestrictNamespaces=`` must allow ``mnt`` (its
seccomp filter answers EPERM otherwise); lowering capabilities needs nothing. When
setns fails the result says so (stage ``namespace``) and is inconclusive: no verdict
on the plugin. Remaining exposure: the library comes from the plugin's image and runs
as uid 0 in the host's PID, network and IPC namespaces, outside the plugin's seccomp
and LSM profiles, though with no more capabilities than the plugin has.

:class:`NvmlResult` ``stage``: ``ok``; ``init`` (nvmlInit failed: ``code`` is its
return, ``detail`` its text, e.g. "Unknown Error"); ``load`` (the library cannot be
loaded in the plugin's filesystem: the NVIDIA device plugin needs it); inconclusive:
``cgroup``, ``namespace``, ``timeout``, ``error``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from gpuguard.devices import cgroupchild
from gpuguard.devices.cgroupchild import process_cgroup_dirs, run_in_cgroups
from gpuguard.host.libc import c_library
from gpuguard.host.paths import Root
from gpuguard.host.safeio import proc_bytes, proc_text

if TYPE_CHECKING:
    from gpuguard.steps.device_plugin.observe import PluginObservation

NVML_LIBRARY = "libnvidia-ml.so.1"
NVML_SUCCESS = 0
CLONE_NEWNS = 0x00020000
PR_SET_NO_NEW_PRIVS = 38
_CAP_VERSION_3 = 0x20080522
CAP_SYS_CHROOT = 18
CAP_SYS_ADMIN = 21

# Where driver libraries live in images (and where the toolkit injects them).
_ARCH = f"{os.uname().machine}-linux-gnu"
LIBRARY_DIRS = (
    f"/usr/lib/{_ARCH}",
    f"/lib/{_ARCH}",
    "/usr/lib64",
    "/lib64",
    "/usr/lib",
    "/lib",
    "/usr/local/nvidia/lib64",
    "/usr/local/nvidia/lib",
)
# Loaded from the host before entering the plugin's namespace, so that NVML's
# dependencies are never resolved in the plugin's filesystem (another glibc).
_HOST_DEPENDENCIES = ("libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1")

CONCLUSIVE = frozenset({"ok", "init", "load"})


@dataclass(frozen=True)
class NvmlResult:
    ok: bool
    code: Optional[int]  # nvmlInit's return code; None when NVML was not reached
    detail: str  # NVML's error text for stage "init"; a sentence otherwise
    stage: str = "init"  # ok | init | load | cgroup | namespace | timeout | error
    library: str = ""  # the file loaded, as a path in the plugin's filesystem

    @property
    def conclusive(self) -> bool:
        """A verdict on the plugin (False: the probe itself could not run)."""
        return self.stage in CONCLUSIVE

    @property
    def failed(self) -> bool:
        return self.conclusive and not self.ok


# -- what the parent reads about the plugin -------------------------------------------

# The plugin's v1 devices directory and v2 directory (those that exist).
plugin_cgroup_dirs = process_cgroup_dirs


def library_candidates(root: Root, pid: int) -> list[str]:
    """Paths (in the plugin's filesystem) to try, best first; the bare name is last."""
    out: list[str] = []
    try:
        for line in proc_text(root.path(f"/proc/{pid}/maps")).splitlines():
            f = line.split(None, 5)
            if (
                len(f) == 6
                and f[5].startswith("/")
                and not f[5].endswith(" (deleted)")
                and os.path.basename(f[5]).startswith("libnvidia-ml.so")
                and f[5] not in out
            ):
                out.append(f[5])
    except OSError:
        pass
    dirs: list[str] = []
    try:
        env = proc_bytes(root.path(f"/proc/{pid}/environ")).split(b"\0")
        for var in env:
            if var.startswith(b"LD_LIBRARY_PATH="):
                dirs += [d for d in os.fsdecode(var[16:]).split(":") if d.startswith("/")]
    except OSError:
        pass
    for d in [*dirs, *LIBRARY_DIRS]:
        p = f"{d.rstrip('/')}/{NVML_LIBRARY}"
        if p not in out:
            out.append(p)
    return out


def _caps(root: Root, pid: str) -> Optional[tuple[int, int]]:
    """(CapEff, CapPrm) of a process; None when unreadable."""
    eff = prm = None
    try:
        for line in proc_text(root.path(f"/proc/{pid}/status")).splitlines():
            if line.startswith("CapEff:"):
                eff = int(line.split()[1], 16)
            elif line.startswith("CapPrm:"):
                prm = int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        return None
    return (eff, prm) if eff is not None and prm is not None else None


def _namespace_hint() -> str:
    own = _caps(Root(), "self")
    missing = [
        name
        for bit, name in ((CAP_SYS_CHROOT, "CAP_SYS_CHROOT"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
        if own is not None and not own[0] >> bit & 1
    ]
    if missing:
        return f"gpuguard.service needs {' and '.join(missing)} for NvmlProbe=yes"
    return (
        "gpuguard.service needs CAP_SYS_CHROOT and CAP_SYS_ADMIN, and RestrictNamespaces= "
        "must allow mnt, for NvmlProbe=yes"
    )


# -- the child ------------------------------------------------------------------------


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _lower_caps(libc: ctypes.CDLL, eff: int, prm: int) -> None:
    """Keep only the capabilities the plugin has (and we have); no_new_privs, so an
    exec by the library (nvidia-modprobe) cannot get them back as root would."""
    hdr = _CapHeader(_CAP_VERSION_3, 0)
    data = (_CapData * 2)()
    if libc.capget(ctypes.byref(hdr), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    for i in range(2):
        data[i].effective &= (eff >> (32 * i)) & 0xFFFFFFFF
        data[i].permitted &= (prm >> (32 * i)) & 0xFFFFFFFF
        data[i].inheritable = 0
        data[i].effective &= data[i].permitted
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.capset(ctypes.byref(hdr), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def _nvml(candidates: Sequence[str]) -> dict[str, object]:
    lib: Optional[ctypes.CDLL] = None
    path = ""
    errors: list[str] = []
    for cand in [*candidates, NVML_LIBRARY]:
        if cand != NVML_LIBRARY and not os.path.exists(cand):
            continue
        try:
            lib = ctypes.CDLL(cand)
            path = cand
            break
        except OSError as e:
            errors.append(str(e))
    if lib is None:
        why = "; ".join(errors[-2:]) or "not found"
        return {
            "stage": "load",
            "detail": f"cannot load {NVML_LIBRARY} in the plugin's filesystem ({why}): "
            "the NVIDIA device plugin cannot use NVML",
        }
    init = getattr(lib, "nvmlInit_v2", None) or getattr(lib, "nvmlInit", None)
    if init is None:
        return {"stage": "load", "library": path, "detail": f"{path} has no nvmlInit"}
    init.restype = ctypes.c_int
    code = int(init())
    if code != NVML_SUCCESS:
        text = f"NVML error {code}"
        es = getattr(lib, "nvmlErrorString", None)
        if es is not None:
            es.restype, es.argtypes = ctypes.c_char_p, [ctypes.c_int]
            raw = es(code)
            if raw:
                text = raw.decode(errors="replace")
        return {"stage": "init", "code": code, "library": path, "detail": text}
    shutdown = getattr(lib, "nvmlShutdown", None)
    if shutdown is not None:
        shutdown()
    return {"stage": "ok", "code": code, "library": path, "detail": "nvmlInit succeeded"}


def _child_work(
    ns_path: bytes,
    caps: Optional[tuple[int, int]],
    candidates: Sequence[str],
    hint: str,
) -> dict[str, object]:  # pragma: no cover - forked child, already in the plugin's cgroups
    libc = c_library()
    for dep in _HOST_DEPENDENCIES:
        with contextlib.suppress(OSError):
            ctypes.CDLL(dep)
    try:
        fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        return {"stage": "namespace", "detail": f"cannot open {os.fsdecode(ns_path)}: {e.strerror}"}
    try:
        st, own = os.fstat(fd), os.stat("/proc/self/ns/mnt")
        if (st.st_dev, st.st_ino) != (own.st_dev, own.st_ino) and libc.setns(fd, CLONE_NEWNS):
            err = ctypes.get_errno()
            return {
                "stage": "namespace",
                "detail": f"cannot enter the plugin's mount namespace: {os.strerror(err)} "
                f"(errno {err}); {hint}",
            }
    finally:
        os.close(fd)
    os.chdir("/")
    if caps is not None:
        _lower_caps(libc, *caps)
    return _nvml(candidates)


# -- the parent -----------------------------------------------------------------------


def probe_nvml(
    pid: int,
    cgroup_dirs: Sequence[Path],
    *,
    timeout: float = 10.0,
    root: Optional[Root] = None,
) -> NvmlResult:
    """Initialise NVML from a child in ``pid``'s cgroups and mount namespace.

    ``cgroup_dirs``: host paths (under the root) of the plugin's v1 devices and/or v2
    directory (:func:`plugin_cgroup_dirs`); empty: the child stays in ours. Nothing is
    left behind: the child exits (or is killed) and is reaped before this returns."""
    rt = root or Root()
    ns_path = os.fsencode(rt.path(f"/proc/{pid}/ns/mnt"))
    candidates = library_candidates(rt, pid)
    caps = _caps(rt, str(pid))
    hint = _namespace_hint()

    def work() -> bytes:  # in the child, once it joined the cgroups
        return json.dumps(_child_work(ns_path, caps, candidates, hint)).encode()

    r = run_in_cgroups(cgroup_dirs, work, timeout=timeout)
    if r.status == cgroupchild.TIMEOUT:
        return NvmlResult(False, None, f"the NVML probe timed out after {timeout:g}s", "timeout")
    if r.status == cgroupchild.JOIN:
        why = os.strerror(r.errno) if r.errno else "unexpected error"
        return NvmlResult(False, None, f"cannot join the plugin's cgroup {r.text}: {why}", "cgroup")
    if r.status == cgroupchild.ERROR:
        return NvmlResult(False, None, f"probe failed: {r.text}", "error")
    try:
        msg = json.loads(r.data)
    except ValueError:
        return NvmlResult(False, None, "the NVML probe sent an unreadable report", "error")
    stage = str(msg.get("stage", "error"))
    code = msg.get("code")
    return NvmlResult(
        ok=stage == "ok",
        code=code if isinstance(code, int) else None,
        detail=str(msg.get("detail", "")),
        stage=stage,
        library=str(msg.get("library", "")),
    )


def probe_plugins(root: Root, obs: PluginObservation, *, timeout: float) -> dict[str, NvmlResult]:
    """NVML in each served plugin's context (a container or a host service), by
    identity: one probe per process, however many sockets it serves."""
    if not obs.host_nodes:  # no driver: NVML fails everywhere, nothing to judge
        return {}
    by_pid: dict[int, NvmlResult] = {}
    out: dict[str, NvmlResult] = {}
    for p in obs.plugins:
        proc = p.process
        if proc is None or proc.kind not in ("container", "service"):
            continue
        if proc.pid not in by_pid:
            dirs = plugin_cgroup_dirs(root, proc.pid)
            by_pid[proc.pid] = probe_nvml(proc.pid, dirs, timeout=timeout, root=root)
        out[p.identity] = by_pid[proc.pid]
    return out
