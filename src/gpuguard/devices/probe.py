"""Ask the kernel itself whether a cgroup may open a device node.

Why a probe and not an interpretation of the cgroup v2 policy: on v2 the policy is a
BPF_PROG_TYPE_CGROUP_DEVICE program (runc or systemd generate them, possibly several
attached with BPF_F_ALLOW_MULTI, on the container's cgroup and its ancestors). Reading
it back means fetching the instructions (BPF_OBJ_GET_INFO_BY_ID, needs CAP_SYS_ADMIN and
gives the *translated* program) and emulating eBPF; any generator change breaks that.
Opening the node from a process inside the cgroup runs exactly the checks the
container's own open() runs: BPF programs of every ancestor, then (hybrid hosts) the
v1 devices controller. The denial (EPERM) happens in inode_permission() before the
driver's open handler, so a denied probe never touches the device; an allowed probe
does reach the driver (ENXIO/ENODEV on a node without driver, success on a real GPU, in
which case the fd is closed at once).

`query_device_programs` lists the attached program ids (BPF_PROG_QUERY) for reports.

The probe runs in a child placed in the target cgroup(s) (devices/cgroupchild.py: v1
the devices directory only, so no other controller sees it; v2 the container's
directory), which opens the node with O_RDWR|O_NONBLOCK|O_NOCTTY and reports the errno.
A child that hangs (a frozen cgroup) is killed. Call it from a worker thread of the
daemon; the child only makes raw syscalls before _exit.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from gpuguard.devices import cgroupchild
from gpuguard.devices.cgroupchild import run_in_cgroups
from gpuguard.host.libc import function

OPEN_FLAGS = os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

# Errnos meaning "the cgroup let the open through and something else answered".
_ALLOWED_ERRNOS = frozenset({0, errno.ENXIO, errno.ENODEV, errno.EBUSY, errno.EIO})


@dataclass(frozen=True)
class ProbeResult:
    node: str
    errno: int  # 0: opened
    verdict: Optional[bool]  # True allowed, False denied, None unknown
    detail: str = ""


def interpret_errno(err: int) -> Optional[bool]:
    """EPERM is the device cgroup's answer (v1 and BPF alike); ENXIO/ENODEV/success
    mean the open got past it. ENOENT/EACCES/others say nothing about the cgroup."""
    if err == errno.EPERM:
        return False
    if err in _ALLOWED_ERRNOS:
        return True
    return None


def _open_errnos(nodes: Sequence[bytes]) -> bytes:
    """In the child: the errno of opening each of ``nodes`` (0: opened, closed at once)."""
    out = b""
    for node in nodes:
        err = 0
        try:
            os.close(os.open(node, OPEN_FLAGS))
        except OSError as e:
            err = e.errno or 0
        out += struct.pack("<i", err)
    return out


def probe_open(node: Path, cgroup_dirs: Sequence[Path], *, timeout: float = 5.0) -> ProbeResult:
    """Open ``node`` from a child placed in every directory of ``cgroup_dirs``.

    Pass the container's v1 devices directory and/or its v2 directory (host paths under
    the root). Nothing is left behind: the child exits and leaves the cgroup with it."""
    return probe_open_all([node], cgroup_dirs, timeout=timeout)[0]


def probe_open_all(
    nodes: Sequence[Path], cgroup_dirs: Sequence[Path], *, timeout: float = 5.0
) -> list[ProbeResult]:
    """`probe_open` of each of ``nodes`` from one child: one fork per cgroup, not per node."""
    paths = [os.fsencode(n) for n in nodes]
    r = run_in_cgroups(cgroup_dirs, lambda: _open_errnos(paths), timeout=timeout)
    if r.status == cgroupchild.TIMEOUT:
        return [ProbeResult(str(n), -1, None, f"probe timed out after {timeout}s") for n in nodes]
    if r.status == cgroupchild.JOIN:
        why = os.strerror(r.errno) if r.errno else "unexpected error"
        return [
            ProbeResult(str(n), r.errno, None, f"could not join the cgroup: {why}") for n in nodes
        ]
    if r.status != cgroupchild.DONE or len(r.data) != 4 * len(nodes):
        return [ProbeResult(str(n), -1, None, f"probe failed: {r.text}") for n in nodes]
    out = []
    for i, n in enumerate(nodes):
        (err,) = struct.unpack_from("<i", r.data, 4 * i)
        verdict = interpret_errno(err)
        out.append(ProbeResult(str(n), err, verdict, os.strerror(err) if err else "opened"))
    return out


# --- bpf(2) through ctypes: enough for BPF_PROG_QUERY (and for tests to load a program)

BPF_PROG_LOAD = 5
BPF_PROG_ATTACH = 8
BPF_PROG_DETACH = 9
BPF_PROG_QUERY = 16
BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6  # attach type
BPF_ATTR_SIZE = 128  # large enough for the commands used here; the rest stays zero

_BPF_NR = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351}


@functools.lru_cache(maxsize=1)
def _syscall() -> Callable[..., int]:
    """syscall(2), looked up once: a lookup per call cost more than the bpf(2) calls."""
    fn = function("syscall", restype=ctypes.c_long)
    if fn is None:
        raise OSError(errno.ENOSYS, "the C library has no syscall(2)")
    return fn


@functools.lru_cache(maxsize=1)
def _bpf_nr() -> Optional[ctypes.c_long]:
    nr = _BPF_NR.get(os.uname().machine)  # asked once: a reload's sweep makes thousands
    return None if nr is None else ctypes.c_long(nr)


BpfAttr = ctypes.c_char * BPF_ATTR_SIZE  # a zeroed union bpf_attr: `BpfAttr()`
_ATTR_LEN = ctypes.c_uint(BPF_ATTR_SIZE)
_QUERY = struct.Struct("<IIIIQI")  # target_fd, attach_type, query_flags, attach_flags,
# prog_ids (u64 pointer), prog_cnt


def bpf_syscall(cmd: int, attr: ctypes.Array[ctypes.c_char]) -> int:
    """Raw bpf(2). Returns the result; raises OSError with the errno on failure."""
    nr = _bpf_nr()
    if nr is None:
        raise OSError(errno.ENOSYS, f"bpf(2) number unknown on {os.uname().machine}")
    size = _ATTR_LEN if len(attr) == BPF_ATTR_SIZE else ctypes.c_uint(len(attr))
    ret = int(_syscall()(nr, ctypes.c_int(cmd), ctypes.byref(attr), size))
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return ret


def open_cgroup(cgroup_dir: Path) -> int:
    """An fd of a cgroup2 directory, for BPF_PROG_QUERY/ATTACH (the caller closes it)."""
    return os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def query_device_programs(
    cgroup_dir: Path, max_progs: int = 64, *, query_flags: int = 0, fd: Optional[int] = None
) -> tuple[int, ...]:
    """Ids of the BPF device programs attached to a cgroup2 directory (not ancestors;
    with BPF_F_QUERY_EFFECTIVE, every program the kernel runs for it, ancestors' too).
    `fd`: the directory already open (`open_cgroup`), e.g. for a look, a swap and its
    verification of one cgroup in a row."""
    ids = (ctypes.c_uint32 * max_progs)()
    own = fd is None
    if fd is None:
        fd = open_cgroup(cgroup_dir)
    try:
        attr = BpfAttr()
        _QUERY.pack_into(
            attr, 0, fd, BPF_CGROUP_DEVICE, query_flags, 0, ctypes.addressof(ids), max_progs
        )
        bpf_syscall(BPF_PROG_QUERY, attr)
        (count,) = struct.unpack_from("<I", attr, 24)
    finally:
        if own:
            os.close(fd)
    return tuple(ids[: min(count, max_progs)])
