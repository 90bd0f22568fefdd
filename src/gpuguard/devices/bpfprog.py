"""cgroup v2 device programs as rules: parse runc's/systemd's shape, build a program.

A BPF_PROG_TYPE_CGROUP_DEVICE program as runc (libcontainer/cgroups/devices) and
systemd (bpf-devices.c) generate it is a prologue loading the context into registers
(r2 = type, r3 = access, r4 = major, r5 = minor) followed by blocks, each a run of
"jump to the next block unless ..." tests and ``r0 = verdict; exit``. The first block
whose tests all pass decides; a block without tests is the default verdict. systemd
ends its blocks with a jump to one shared verdict instead: a rule ``goto accept``, the
default ``r0 = 0; goto exit``, and the program ``accept: r0 = 1; exit: exit``.

`parse` accepts exactly that shape and raises `UnknownProgramShape` for anything else:
an unexpected program is a finding, never a guess. Two variants of the access test are
read as the kernel runs them: runc before 1.0 (1.0.0-rc93, Debian 11) skips a block when
the request shares no bit with its mask (``if (access & mask) == 0 goto next``, so "m"
also matches "rwm"), later runc, crun and systemd when the request is not within it;
crun writes a block with mask 0 first (it never matches an open, whose access is never
empty). `build` writes the same shape, so a
parsed program rebuilt admits what it admitted. `grant_nodes` puts allow blocks for the
given char nodes (read and write, no mknod) in front of the previous rules: the result
admits the previous program's set plus exactly those nodes. Pure code: no syscalls.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

# struct bpf_cgroup_dev_ctx { u32 access_type (access << 16 | type); u32 major, minor; }
DEVCG_BLOCK = 1
DEVCG_CHAR = 2
ACC_MKNOD = 1
ACC_READ = 2
ACC_WRITE = 4
ACC_RW = ACC_READ | ACC_WRITE
ACC_ALL = ACC_MKNOD | ACC_READ | ACC_WRITE

_LDX_W = 0x61  # r_dst = *(u32 *)(r_src + off)
_AND32_K = 0x54
_RSH32_K = 0x74
_MOV32_X = 0xBC
_MOV32_K = 0xB4
_MOV64_K = 0xB7
_JNE_K = 0x55
_JNE_X = 0x5D
_JEQ_K = 0x15  # runc before 1.0: ``if (access & mask) == 0 goto next``
_JA = 0x05  # goto pc + 1 + off (systemd: a matching rule jumps to its shared verdict)
_EXIT = 0x95

_KINDS = {DEVCG_BLOCK: "b", DEVCG_CHAR: "c"}


class UnknownProgramShape(ValueError):
    """The program is not of the shape runc or systemd generate."""


@dataclass(frozen=True)
class DevRule:
    """One block: None in a field means the block does not test it."""

    allow: bool
    kind: Optional[str] = None  # "c" or "b"
    major: Optional[int] = None
    minor: Optional[int] = None
    access: Optional[int] = None  # ACC_* mask; the request must lie within it
    # runc before 1.0: the request need only share a bit with the mask
    access_any: bool = False

    def matches(self, kind: str, major: int, minor: int, access: int) -> bool:
        return (
            (self.kind is None or self.kind == kind)
            and (self.major is None or self.major == major)
            and (self.minor is None or self.minor == minor)
            and (self.access is None or self._access_matches(access))
        )

    def _access_matches(self, access: int) -> bool:
        assert self.access is not None
        if self.access_any:
            return access & self.access != 0
        return access & self.access == access

    @property
    def matches_all(self) -> bool:
        """Every request matches (no type, number or access limit)."""
        full = self.access is None or (self.access == ACC_ALL and not self.access_any)
        return (self.kind, self.major, self.minor) == (None, None, None) and full


@dataclass(frozen=True)
class DeviceProgram:
    rules: Tuple[DevRule, ...]  # the first matching rule decides
    default_allow: bool

    def admits(self, kind: str, major: int, minor: int, access: int) -> bool:
        for r in self.rules:
            if r.matches(kind, major, minor, access):
                return r.allow
        return self.default_allow

    @property
    def admits_all(self) -> bool:
        """Every device, every access: what a privileged container's program says (crun
        ends it with an allow-all block). A deny rule before the first rule that matches
        everything may refuse something: then False."""
        for r in self.rules:
            if not r.allow:
                return False
            if r.matches_all:
                return True
        return self.default_allow

    def describe(self) -> str:
        def one(r: DevRule) -> str:
            acc = "" if r.access is None else " " + (_acc_text(r.access) or "-")
            acc += " (any)" if r.access_any else ""
            num = f"{'*' if r.major is None else r.major}:{'*' if r.minor is None else r.minor}"
            return f"{'allow' if r.allow else 'deny'} {r.kind or 'a'} {num}{acc}"

        rest = "allow" if self.default_allow else "deny"
        return "; ".join([*(one(r) for r in self.rules), f"else {rest}"])


def _acc_text(mask: int) -> str:
    return "".join(
        c for bit, c in ((ACC_READ, "r"), (ACC_WRITE, "w"), (ACC_MKNOD, "m")) if mask & bit
    )


def grant_nodes(prog: DeviceProgram, nodes: Iterable[Tuple[int, int]]) -> DeviceProgram:
    """``prog`` plus read/write on each char node ``(major, minor)`` (deduplicated)."""
    new = tuple(DevRule(True, "c", ma, mi, ACC_RW) for ma, mi in sorted(set(nodes)))
    return DeviceProgram(new + prog.rules, prog.default_allow)


# --- decoding


@dataclass(frozen=True)
class _Insn:
    code: int
    dst: int
    src: int
    off: int
    imm: int


def _decode(code: bytes) -> List[_Insn]:
    if not code or len(code) % 8:
        raise UnknownProgramShape(f"{len(code)} bytes is not a whole number of instructions")
    out = []
    for i in range(0, len(code), 8):
        op, regs, off, imm = struct.unpack_from("<BBhi", code, i)
        out.append(_Insn(op, regs & 0xF, regs >> 4, off, imm))
    return out


def _prologue(insns: List[_Insn]) -> Tuple[Dict[int, str], int]:
    """Registers loaded from the context and what they hold; index of the first block."""
    regs: Dict[int, str] = {}
    pc = 0
    while pc < len(insns) and insns[pc].code == _LDX_W and insns[pc].src == 1:
        i = insns[pc]
        nxt = insns[pc + 1] if pc + 1 < len(insns) else None
        if i.off == 0 and nxt and nxt.dst == i.dst and (nxt.code, nxt.imm) == (_AND32_K, 0xFFFF):
            regs[i.dst], pc = "type", pc + 2
        elif i.off == 0 and nxt and nxt.dst == i.dst and (nxt.code, nxt.imm) == (_RSH32_K, 16):
            regs[i.dst], pc = "access", pc + 2
        elif i.off in (4, 8):
            regs[i.dst], pc = ("major" if i.off == 4 else "minor"), pc + 1
        else:
            raise UnknownProgramShape(f"instruction {pc}: unexpected load of the context")
    if 1 in regs or 0 in regs or len(set(regs.values())) != len(regs):
        raise UnknownProgramShape("unexpected register use in the prologue")
    return regs, pc


def _tail(insns: List[_Insn]) -> List[_Insn]:
    """systemd's shared verdict at the end, ``r0 = 1; exit``, or nothing (runc)."""
    if len(insns) >= 4 and insns[-3].code == _JA and insns[-3].off == 1:
        last = insns[-2:]
        if last[0].code in (_MOV64_K, _MOV32_K) and last[0].dst == 0 and last[1].code == _EXIT:
            return last
    return []


def _verdict(insns: List[_Insn], pc: int, tail: List[_Insn]) -> Tuple[int, int]:
    """(verdict, next pc) of the block end at ``pc``: ``r0 = v; exit`` (runc), or
    systemd's ``goto accept`` / ``r0 = v; goto exit`` into the shared tail."""
    end = len(insns) - len(tail)  # index of the tail's ``r0 = 1``
    i = insns[pc] if pc < len(insns) else None
    nxt = insns[pc + 1] if pc + 1 < len(insns) else None
    verdict: Optional[int] = None
    if i is not None and i.code == _JA and tail and pc + 1 + i.off == end:
        verdict, pc = tail[0].imm, pc + 1
    elif (
        i is not None
        and nxt is not None
        and i.code in (_MOV64_K, _MOV32_K)
        and i.dst == 0
        and (nxt.code == _EXIT or (nxt.code == _JA and tail and pc + 2 + nxt.off == end + 1))
    ):
        verdict, pc = i.imm, pc + 2
    if verdict is None:
        raise UnknownProgramShape(f"instruction {pc}: a block must end with r0 = verdict; exit")
    if verdict not in (0, 1):
        raise UnknownProgramShape(f"instruction {pc}: verdict {verdict} is neither 0 nor 1")
    return verdict, pc


def parse(code: bytes) -> DeviceProgram:
    """The rules of a runc/systemd-shaped program (raw or the kernel's xlated insns)."""
    insns = _decode(code)
    regs, pc = _prologue(insns)
    tail = _tail(insns)
    rules: List[DevRule] = []
    while True:
        start = pc
        jumps: List[int] = []  # absolute targets of this block's tests
        f: Dict[str, int] = {}
        while pc < len(insns) and insns[pc].code not in (_MOV64_K, _MOV32_K, _JA):
            i = insns[pc]
            if i.code == _JNE_K and regs.get(i.dst) in ("type", "major", "minor"):
                what = regs[i.dst]
                if what in f:
                    raise UnknownProgramShape(f"instruction {pc}: {what} tested twice")
                f[what] = i.imm
                jumps.append(pc + 1 + i.off)
                pc += 1
            elif (
                i.code == _MOV32_X
                and (i.dst, regs.get(i.src)) == (1, "access")
                and pc + 2 < len(insns)
                and (insns[pc + 1].code, insns[pc + 1].dst) == (_AND32_K, 1)
                and "access" not in f
                and _access_test(insns[pc + 2], i.src) is not None
            ):
                f["access"] = insns[pc + 1].imm
                f["any"] = int(_access_test(insns[pc + 2], i.src) == "any")
                jumps.append(pc + 3 + insns[pc + 2].off)
                pc += 3
            else:
                raise UnknownProgramShape(f"instruction {pc}: code {i.code:#04x} not expected")
        verdict, pc = _verdict(insns, pc, tail)
        if any(t != pc for t in jumps):
            raise UnknownProgramShape(f"block at {start}: a test does not jump to the next block")
        if not f:  # no test: the default, which must end the program (bar systemd's tail)
            if insns[pc:] != tail:
                raise UnknownProgramShape(f"instruction {pc}: code after the default verdict")
            return DeviceProgram(tuple(rules), verdict == 1)
        kind = f.get("type")
        if kind is not None and kind not in _KINDS:
            raise UnknownProgramShape(f"block at {start}: device type {kind} unknown")
        if "access" in f and not 0 <= f["access"] < 8:
            raise UnknownProgramShape(f"block at {start}: access mask {f['access']} unknown")
        rules.append(
            DevRule(
                verdict == 1,
                None if kind is None else _KINDS[kind],
                f.get("major"),
                f.get("minor"),
                f.get("access"),
                bool(f.get("any")),
            )
        )


def _access_test(i: _Insn, access_reg: int) -> Optional[str]:
    """The jump that ends an access test: "within" (``r1 != access``), "any" (runc
    before 1.0: ``r1 == 0``), None: not an access test."""
    if i.code == _JNE_X and (i.dst, i.src) == (1, access_reg):
        return "within"
    if i.code == _JEQ_K and (i.dst, i.imm) == (1, 0):
        return "any"
    return None


# --- encoding


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, dst | (src << 4), off, imm)


_PROLOGUE = b"".join(
    [
        _insn(_LDX_W, 2, 1, 0),
        _insn(_AND32_K, 2, imm=0xFFFF),
        _insn(_LDX_W, 3, 1, 0),
        _insn(_RSH32_K, 3, imm=16),
        _insn(_LDX_W, 4, 1, 4),
        _insn(_LDX_W, 5, 1, 8),
    ]
)


def _block(r: DevRule) -> bytes:
    # each test: (instructions before its jump, jump code, dst, src, imm)
    tests: List[Tuple[List[bytes], int, int, int, int]] = []
    if r.kind is not None:
        tests.append(([], _JNE_K, 2, 0, DEVCG_CHAR if r.kind == "c" else DEVCG_BLOCK))
    if r.access is not None:
        pre = [_insn(_MOV32_X, 1, 3), _insn(_AND32_K, 1, imm=r.access)]
        tests.append((pre, _JEQ_K, 1, 0, 0) if r.access_any else (pre, _JNE_X, 1, 3, 0))
    if r.major is not None:
        tests.append(([], _JNE_K, 4, 0, r.major))
    if r.minor is not None:
        tests.append(([], _JNE_K, 5, 0, r.minor))
    n = sum(len(t[0]) + 1 for t in tests) + 2
    out: List[bytes] = []
    for pre, code, dst, src, imm in tests:
        out += pre
        out.append(_insn(code, dst, src, n - len(out) - 1, imm))  # to the next block
    out += [_insn(_MOV64_K, 0, imm=int(r.allow)), _insn(_EXIT)]
    return b"".join(out)


@functools.lru_cache(maxsize=64)
def build(prog: DeviceProgram) -> bytes:
    """Instructions of ``prog`` in runc's/systemd's shape (``parse(build(p)) == p``).
    Cached: after a reload most scopes are bridged with the same program."""
    if any((r.kind, r.major, r.minor, r.access) == (None,) * 4 for r in prog.rules):
        raise ValueError("a rule that tests nothing can only be the default verdict")
    return (
        _PROLOGUE
        + b"".join(_block(r) for r in prog.rules)
        + _insn(_MOV64_K, 0, imm=int(prog.default_allow))
        + _insn(_EXIT)
    )
