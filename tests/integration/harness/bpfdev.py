"""Load a cgroup v2 device program with raw bpf(2), to play the legacy NVIDIA hook.

On a unified node the hook (and runc) admit a container's GPU with their own
BPF_PROG_TYPE_CGROUP_DEVICE program: attach a new one with BPF_F_ALLOW_MULTI, then
detach the programs already there (systemd's ``sd_devices``). The GPU is then admitted
behind systemd's back, until a daemon-reload makes systemd attach a fresh program from
the scope's ``DeviceAllow=`` list (every attached program must admit an open).

The program is built here instruction by instruction (no clang, no libbpf): one block
per allowed ``(type, major, minor)``; access bits are not checked (rwm), like runc's
rules for ``--device`` nodes.
"""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

from gpuguard.devices.probe import (
    BPF_ATTR_SIZE,
    BPF_CGROUP_DEVICE,
    BPF_PROG_ATTACH,
    BPF_PROG_DETACH,
    BPF_PROG_LOAD,
    BPF_PROG_TYPE_CGROUP_DEVICE,
    bpf_syscall,
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
    code = program(rules)
    insns = ctypes.create_string_buffer(code, len(code))
    license = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(65536)
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
        1,
        len(log),
        ctypes.addressof(log),
    )
    attr[48:59] = b"legacy_hook"  # prog_name: what bpftool shows
    try:
        return bpf_syscall(BPF_PROG_LOAD, attr)
    except OSError as e:
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
