"""Load a cgroup v2 device program with raw bpf(2), to play the legacy NVIDIA hook.

On a unified node the hook (and runc) admit a container's GPU with their own
BPF_PROG_TYPE_CGROUP_DEVICE program: attach a new one with BPF_F_ALLOW_MULTI, then
detach the programs already there (systemd's ``sd_devices``). The GPU is then admitted
behind systemd's back, until a daemon-reload makes systemd attach a fresh program from
the scope's ``DeviceAllow=`` list (every attached program must admit an open).

The program is built here instruction by instruction (no clang, no libbpf): one block
per allowed ``(type, major, minor)``; access bits are not checked (rwm), like runc's
rules for ``--device`` nodes.

The kernel tests' helpers live here too, built on the same raw calls rather than on the
code they test: attach any program's code to a cgroup, detach them all, the programs
attached and their names, and the kernel's verdict on opening fake nodes from inside.
"""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from gpuguard.devices.bpfread import prog_info
from gpuguard.devices.probe import (
    BPF_ATTR_SIZE,
    BPF_CGROUP_DEVICE,
    BPF_PROG_ATTACH,
    BPF_PROG_DETACH,
    BPF_PROG_LOAD,
    BPF_PROG_TYPE_CGROUP_DEVICE,
    bpf_syscall,
    probe_open,
    query_device_programs,
)

BPF_PROG_GET_FD_BY_ID = 13
BPF_F_ALLOW_MULTI = 2
DEVCG_CHAR = 2  # BPF_DEVCG_DEV_CHAR
DEVCG_BLOCK = 1

#: What every container gets (runc's default devices): null, zero, full, random,
#: urandom, tty, ptmx and the pts.
DEFAULT_RULES: Tuple[Tuple[str, int, Optional[int]], ...] = (
    ("c", 1, 3),
    ("c", 1, 5),
    ("c", 1, 7),
    ("c", 1, 8),
    ("c", 1, 9),
    ("c", 5, 0),
    ("c", 5, 2),
    ("c", 136, None),
)


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, dst | (src << 4), off, imm)


_LDX_W = 0x61  # BPF_LDX | BPF_MEM | BPF_W
_AND32_K = 0x54  # BPF_ALU | BPF_AND | BPF_K
_RSH32_K = 0x74  # BPF_ALU | BPF_RSH | BPF_K
_JNE_K = 0x55  # BPF_JMP | BPF_JNE | BPF_K
_MOV64_K = 0xB7  # BPF_ALU64 | BPF_MOV | BPF_K
_EXIT = 0x95  # BPF_JMP | BPF_EXIT


def program(rules: Iterable[Tuple[str, int, Optional[int]]]) -> bytes:
    """Instructions admitting exactly ``rules`` ((type "c"/"b", major, minor or None))."""
    # struct bpf_cgroup_dev_ctx { u32 access_type (access << 16 | type); u32 major, minor; }
    out = [
        _insn(_LDX_W, 2, 1, 0),
        _insn(_AND32_K, 2, imm=0xFFFF),
        _insn(_LDX_W, 4, 1, 4),
        _insn(_LDX_W, 5, 1, 8),
    ]
    for kind, major, minor in rules:
        typ = DEVCG_CHAR if kind == "c" else DEVCG_BLOCK
        if minor is None:
            out += [_insn(_JNE_K, 2, off=3, imm=typ), _insn(_JNE_K, 4, off=2, imm=major)]
        else:
            out += [
                _insn(_JNE_K, 2, off=4, imm=typ),
                _insn(_JNE_K, 4, off=3, imm=major),
                _insn(_JNE_K, 5, off=2, imm=minor),
            ]
        out += [_insn(_MOV64_K, 0, imm=1), _insn(_EXIT)]
    out += [_insn(_MOV64_K, 0, imm=0), _insn(_EXIT)]
    return b"".join(out)


def load(rules: Iterable[Tuple[str, int, Optional[int]]]) -> int:
    """BPF_PROG_LOAD of :func:`program`; returns the program fd (caller closes it)."""
    return load_code(program(rules))


def load_code(code: bytes, name: bytes = b"legacy_hook", *, log_level: int = 0) -> int:
    """BPF_PROG_LOAD of ``code``, named ``name`` (what bpftool shows); returns the fd."""
    insns = ctypes.create_string_buffer(code, len(code))
    license = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(65536 if log_level else 1)
    attr = ctypes.create_string_buffer(BPF_ATTR_SIZE)
    # prog_type, insn_cnt, insns, license, log_level, log_size, log_buf
    struct.pack_into(
        "<IIQQIIQ",
        attr,
        0,
        BPF_PROG_TYPE_CGROUP_DEVICE,
        len(code) // 8,
        ctypes.addressof(insns),
        ctypes.addressof(license),
        log_level,
        len(log) if log_level else 0,
        ctypes.addressof(log) if log_level else 0,
    )
    struct.pack_into("16s", attr, 48, name[:15])  # prog_name, NUL-terminated
    try:
        return bpf_syscall(BPF_PROG_LOAD, attr)
    except OSError as e:
        if not log_level:  # again, for the verifier's word
            return load_code(code, name, log_level=1)
        raise OSError(e.errno, f"BPF_PROG_LOAD: {e.strerror}: {log.value.decode()}") from None


def _prog_fd(prog_id: int) -> int:
    attr = ctypes.create_string_buffer(BPF_ATTR_SIZE)
    struct.pack_into("<I", attr, 0, prog_id)
    return bpf_syscall(BPF_PROG_GET_FD_BY_ID, attr)


def _attach(cmd: int, cgroup_fd: int, prog_fd: int, flags: int) -> None:
    attr = ctypes.create_string_buffer(BPF_ATTR_SIZE)
    # target_fd, attach_bpf_fd, attach_type, attach_flags
    struct.pack_into("<IIII", attr, 0, cgroup_fd, prog_fd, BPF_CGROUP_DEVICE, flags)
    bpf_syscall(cmd, attr)


def replace_programs(
    cgroup_dir: Path, rules: Sequence[Tuple[str, int, Optional[int]]]
) -> Tuple[int, ...]:
    """Attach a program admitting ``rules`` (ALLOW_MULTI), then detach the programs that
    were there, as the legacy hook and runc do; returns the detached program ids."""
    before = query_device_programs(cgroup_dir)
    cg = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = load(rules)
        try:
            _attach(BPF_PROG_ATTACH, cg, fd, BPF_F_ALLOW_MULTI)
        finally:
            os.close(fd)
        detached: List[int] = []
        for prog_id in before:
            try:  # systemd may have swapped its own program meanwhile: that one is gone
                old = _prog_fd(prog_id)
            except FileNotFoundError:
                continue
            try:
                _attach(BPF_PROG_DETACH, cg, old, 0)
                detached.append(prog_id)
            except FileNotFoundError:
                pass
            finally:
                os.close(old)
    finally:
        os.close(cg)
    return tuple(detached)


def attach(
    cgroup_dir: Path, code: bytes, name: bytes = b"runc_like", *, flags: int = BPF_F_ALLOW_MULTI
) -> int:
    """Attach ``code`` to the cgroup (ALLOW_MULTI, as runc does); returns the id of the
    one program that is new there."""
    before = set(query_device_programs(cgroup_dir))
    fd = load_code(code, name)
    cg = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _attach(BPF_PROG_ATTACH, cg, fd, flags)
    finally:
        os.close(cg)
        os.close(fd)
    (new,) = set(query_device_programs(cgroup_dir)) - before
    return new


def detach_one(cgroup_dir: Path, prog_id: int) -> None:
    """Detach one program from the cgroup (as systemd does once its next is attached)."""
    fd = _prog_fd(prog_id)
    cg = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _attach(BPF_PROG_DETACH, cg, fd, 0)
    finally:
        os.close(fd)
        os.close(cg)


def detach_all(cgroup_dir: Path) -> None:
    """Detach every device program attached to the cgroup itself (not its ancestors')."""
    for prog_id in query_device_programs(cgroup_dir):
        detach_one(cgroup_dir, prog_id)


def programs(cgroup_dir: Path) -> Dict[int, str]:
    """The programs attached to the cgroup: id -> name."""
    out = {}
    for prog_id in query_device_programs(cgroup_dir):
        fd = _prog_fd(prog_id)
        try:
            out[prog_id] = prog_info(fd)[2]
        finally:
            os.close(fd)
    return out


def names(cgroup_dir: Path) -> List[str]:
    """The names of the programs attached to the cgroup, sorted."""
    return sorted(programs(cgroup_dir).values())


def verdicts(
    cgroup_dir: Path, nodes: Dict[Tuple[int, int], Path]
) -> Dict[Tuple[int, int], Optional[bool]]:
    """The kernel's verdict on opening each node from inside the cgroup (a forked child
    joins it): True = admitted (ENXIO: no driver behind the fake node), False = EPERM."""
    return {n: probe_open(p, [cgroup_dir], timeout=5).verdict for n, p in nodes.items()}


#: if (type == char) allow else deny, written with JEQ: not runc's or systemd's shape
OTHER_SHAPE = b"".join(
    [
        _insn(_LDX_W, 2, 1, 0),
        _insn(_AND32_K, 2, imm=0xFFFF),
        _insn(0x15, 2, off=2, imm=DEVCG_CHAR),  # BPF_JMP | BPF_JEQ | BPF_K
        _insn(_MOV64_K, 0, imm=0),
        _insn(_EXIT),
        _insn(_MOV64_K, 0, imm=1),
        _insn(_EXIT),
    ]
)
