"""Read the cgroup v2 device programs that bind a cgroup, and judge an open by them.

The kernel runs every program in a cgroup's *effective* set (its own and each
ancestor's, BPF_F_ALLOW_MULTI) on each device open; all must admit it. Loaded programs
are immutable and their ids are not reused while they exist, so a program is read and
parsed once (`ProgramCache`) and a cgroup's verdicts follow from the ids BPF_PROG_QUERY
returns: two syscalls per container and no fork, where a probe open costs a process.

Only programs of runc's/systemd's shape are judged (devices/bpfprog.parse); a program
that cannot be read (no CAP_SYS_ADMIN) or is of another shape yields None, and the
caller asks the kernel instead (devices/probe.py). Both the in-process verdict and the
probe are held to the kernel's own answer by tests/integration/test_bpf_verdicts.py.
"""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from gpuguard.devices.bpfprog import ACC_RW, DeviceProgram, UnknownProgramShape, parse
from gpuguard.devices.probe import (
    BPF_PROG_TYPE_CGROUP_DEVICE,
    BpfAttr,
    bpf_syscall,
    query_device_programs,
)
from gpuguard.host.numparse import parse_decimal
from gpuguard.host.paths import Root
from gpuguard.host.safeio import UnsafeFileError, read_kernel_text

BRIDGE_NAME = "gpuguard_bridge"  # gpuguard's bridges (steps/container_access/bridge.py)
SYSTEMD_NAME = "sd_devices"  # the program systemd builds from a unit's DeviceAllow=
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
_INFO_SIZE = 80  # bpf_prog_info up to its name (offset 64, 16 bytes)
_Info = ctypes.c_char * _INFO_SIZE
# systemd's and runc's programs are a few hundred bytes: one call with a buffer this
# large reads most whole, a larger one takes a second call with the size the kernel gave
_INSNS_GUESS = 4096


class ProgramUnreadable(Exception):
    """The kernel would not show a program's instructions; the message says why."""

    def __init__(self, message: str, name: str = "") -> None:
        super().__init__(message)
        self.name = name  # the program's name, when the kernel gave it


def fd_by_id(prog_id: int) -> int:
    """BPF_PROG_GET_FD_BY_ID; the caller closes the fd."""
    attr = BpfAttr()
    struct.pack_into("<I", attr, 0, prog_id)
    return bpf_syscall(BPF_PROG_GET_FD_BY_ID, attr)


def prog_info(prog_fd: int, insns: int = 0, size: int = 0) -> Tuple[int, int, str]:
    """(id, xlated length, name) of a device program; fills ``insns`` (an address) when
    given. The name is the one it was loaded with (systemd's: ``sd_devices``)."""
    info = _Info()
    struct.pack_into("<I", info, 20, size)  # xlated_prog_len
    struct.pack_into("<Q", info, 32, insns)  # xlated_prog_insns
    attr = BpfAttr()
    struct.pack_into("<IIQ", attr, 0, prog_fd, _INFO_SIZE, ctypes.addressof(info))
    bpf_syscall(BPF_OBJ_GET_INFO_BY_FD, attr)
    (prog_type, prog_id) = struct.unpack_from("<II", info, 0)
    if prog_type != BPF_PROG_TYPE_CGROUP_DEVICE:
        raise ProgramUnreadable(f"program {prog_id} is of type {prog_type}, not a device program")
    (length,) = struct.unpack_from("<I", info, 20)
    name = info.raw[64:80].split(b"\0", 1)[0].decode("ascii", "replace")
    return prog_id, length, name


def read_named(prog_fd: int) -> Tuple[str, bytes]:
    """A loaded program's name and the kernel's xlated instructions (one call, two for
    a program over 4 KiB)."""
    hidden = "the kernel hides the program's instructions (needs CAP_SYS_ADMIN)"
    buf = ctypes.create_string_buffer(_INSNS_GUESS)
    _, length, name = prog_info(prog_fd, ctypes.addressof(buf), _INSNS_GUESS)
    if length > _INSNS_GUESS:
        buf = ctypes.create_string_buffer(length)
        _, length, name = prog_info(prog_fd, ctypes.addressof(buf), length)
    # without CAP_SYS_ADMIN the kernel says 0 bytes, or the length and copies nothing
    code = buf.raw[:length]
    if length == 0 or not any(code):
        raise ProgramUnreadable(hidden, name)
    return name, code


def read_program(prog_fd: int) -> bytes:
    """The kernel's xlated instructions of a loaded program."""
    return read_named(prog_fd)[1]


def read_rules(
    prog_fd: int, parse_code: Callable[[bytes], Optional[DeviceProgram]] = parse
) -> Tuple[str, Optional[DeviceProgram]]:
    """A loaded program's name and rules; the rules None when the kernel hides the
    instructions or they are not of runc's/systemd's shape (OSError: not readable)."""
    try:
        name, code = read_named(prog_fd)
    except ProgramUnreadable as e:
        return e.name, None
    try:
        return name, parse_code(code)
    except UnknownProgramShape:
        return name, None


BPF_F_QUERY_EFFECTIVE = 1
BPF_PROG_LINK = "anon_inode:bpf-prog"
MAX_PID1_FDS = 1 << 16  # fds of PID 1 looked at, at most


def systemd_held(root: Root) -> frozenset[int]:
    """The ids of the BPF programs PID 1 (systemd) holds open: systemd keeps each unit's
    installed device program by its fd, so these are its programs, on every version
    (before 249 it loads them unnamed, like runc 1.0-rc93). Empty when PID 1's fds
    cannot be read (no CAP_SYS_PTRACE)."""
    fd_dir = root.path("/proc/1/fd")
    out: set[int] = set()
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return frozenset()
    for fd in fds[:MAX_PID1_FDS]:
        try:
            if os.readlink(fd_dir / fd) != BPF_PROG_LINK:
                continue
            text = read_kernel_text(root.path(f"/proc/1/fdinfo/{fd}"), what="fdinfo")
        except (OSError, UnsafeFileError):
            continue
        for line in (text or "").splitlines():
            key, _, value = line.partition(":")
            if key == "prog_id":
                prog_id = parse_decimal(value.strip(), hi=2**32 - 1)
                if prog_id is not None:
                    out.add(prog_id)
    return frozenset(out)


def effective_programs(cgroup_dir: Path, fd: Optional[int] = None) -> Tuple[int, ...]:
    """Ids of every device program the kernel runs for an open from ``cgroup_dir``
    (``fd``: the directory, already open)."""
    return query_device_programs(cgroup_dir, query_flags=BPF_F_QUERY_EFFECTIVE, fd=fd)


class ProgramCache:
    """Parsed device programs by id: each read once while it stays attached somewhere."""

    def __init__(self) -> None:
        self._parsed: Dict[int, Optional[DeviceProgram]] = {}
        self._names: Dict[int, str] = {}  # by id, for gpuguard's own bridges (bridge.py)
        self._seen: set[int] = set()
        # by instructions too: after a daemon-reload systemd loads a new program per
        # scope, mostly byte-identical (same DeviceAllow= lists), so most skip the parse
        self._by_code: Dict[bytes, Optional[DeviceProgram]] = {}
        # (id, major, minor) -> whether the program admits a read/write open of that
        # char node: a reload's sweep asks each scope's programs twice (look, verify)
        self._admits: Dict[Tuple[int, int, int], bool] = {}

    def get(self, prog_id: int) -> Optional[DeviceProgram]:
        """The program's rules; None when it cannot be read or has another shape."""
        self._seen.add(prog_id)
        if prog_id in self._parsed:
            return self._parsed[prog_id]
        prog: Optional[DeviceProgram] = None
        try:
            fd = fd_by_id(prog_id)
        except OSError:
            fd = -1  # gone or not permitted: unknown (a gone one is not cached below)
        if fd >= 0:
            try:
                self._names[prog_id], prog = read_rules(fd, self._parse)
            except OSError:
                prog = None
            finally:
                os.close(fd)
            self._parsed[prog_id] = prog
        return prog

    def _parse(self, code: bytes) -> Optional[DeviceProgram]:
        if code not in self._by_code:
            try:
                self._by_code[code] = parse(code)
            except UnknownProgramShape:
                self._by_code[code] = None
        return self._by_code[code]

    def admits_rw(self, prog_id: int, prog: DeviceProgram, node: Tuple[int, int]) -> bool:
        """``prog`` (the program `get` returned for ``prog_id``) admits a read/write
        open of the char node; remembered while the program is cached."""
        key = (prog_id, *node)
        v = self._admits.get(key)
        if v is None:
            v = self._admits[key] = prog.admits("c", node[0], node[1], ACC_RW)
        return v

    def name(self, prog_id: int) -> str:
        """The name of a program read by `get` ("" when unknown)."""
        return self._names.get(prog_id, "")

    def forget_unseen(self) -> None:
        """Drop programs not asked for since the last call (detached, usually freed)."""
        gone = set(self._parsed) - self._seen
        for prog_id in gone:
            del self._parsed[prog_id]
            self._names.pop(prog_id, None)
        if gone:
            self._admits = {k: v for k, v in self._admits.items() if k[0] not in gone}
        self._seen = set()
        if len(self._by_code) > 4 * len(self._parsed) + 64:  # bounded: start afresh
            self._by_code = {}


def judge(
    cache: ProgramCache,
    cgroup_dir: Path,
    nodes: Sequence[Tuple[int, int]],
    ids_out: Optional[List[int]] = None,
    fd: Optional[int] = None,
) -> Optional[Dict[Tuple[int, int], bool]]:
    """Would a read/write open of each char node from ``cgroup_dir`` pass its device
    programs? None when the programs cannot be listed, read or parsed (ask a probe).
    ``ids_out`` receives the effective programs' ids; ``fd``: the directory, open."""
    try:
        ids = effective_programs(cgroup_dir, fd)
    except OSError:
        return None
    if ids_out is not None:
        ids_out.extend(ids)
    progs = [(i, cache.get(i)) for i in ids]
    known = [(i, p) for i, p in progs if p is not None]
    if len(known) != len(progs):
        return None
    return {n: all(cache.admits_rw(i, p, n) for i, p in known) for n in nodes}
