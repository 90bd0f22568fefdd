"""The kernel's cgroup v1 ``devices`` controller, mimicked exactly (security/device_cgroup.c).

What the kernel keeps per cgroup is a *behaviour* plus an *exception list*:

- behaviour "allow" (``DEVCG_DEFAULT_ALLOW``): everything is allowed except the
  exceptions, which are deny rules;
- behaviour "deny" (``DEVCG_DEFAULT_DENY``): nothing is allowed except the exceptions,
  which are allow rules.

``devices.list`` shows ``a *:* rwm`` and NOTHING else in allow mode (the kernel hides
deny exceptions "to preserve compatibility": the file stays a whitelist), and the
exception list in deny mode, in insertion order. So a list read from the file is exact
in deny mode (what every container has) and blind to deny exceptions in allow mode.

Access is checked per open(2)/mknod(2): in deny mode ONE exception must match the type,
the major and minor (``*`` matches any) and contain ALL requested access bits
(``c 1:* r`` plus ``c 1:3 w`` do not allow ``rw`` on 1:3); in allow mode a deny
exception that overlaps in ANY requested bit denies.

Writes (``devices.allow`` / ``devices.deny``) are simulated by `apply_write`, so tests can
replay what runc did in seed 002 (``a`` to devices.deny, then the spec's allow lines).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Iterable, Optional

from gpuguard.host.numparse import clip

# Access bits, as DEVCG_ACC_* (mknod=1, read=2, write=4 in the kernel; only the
# rendering order "rwm" is visible, so the values themselves do not matter here).
ACC_MKNOD = 1
ACC_READ = 2
ACC_WRITE = 4
ACC_ALL = ACC_MKNOD | ACC_READ | ACC_WRITE

# Device types, as DEVCG_DEV_*: 'a' is both bits, so it matches blocks and chars.
DEV_BLOCK = 1
DEV_CHAR = 2
DEV_ALL = DEV_BLOCK | DEV_CHAR

_TYPE_BITS = {"a": DEV_ALL, "b": DEV_BLOCK, "c": DEV_CHAR}
_TYPE_CHAR = {DEV_ALL: "a", DEV_BLOCK: "b", DEV_CHAR: "c"}


def access_bits(access: str) -> int:
    """``"rw"`` -> bits. Raises ValueError on anything but r, w, m."""
    bits = 0
    for ch in access:
        if ch == "r":
            bits |= ACC_READ
        elif ch == "w":
            bits |= ACC_WRITE
        elif ch == "m":
            bits |= ACC_MKNOD
        else:
            raise ValueError(f"bad access character {ch!r} in {access!r}")
    return bits


def access_str(bits: int) -> str:
    """Bits -> ``"rwm"`` subset, in the kernel's order (set_access())."""
    return (
        ("r" if bits & ACC_READ else "")
        + ("w" if bits & ACC_WRITE else "")
        + ("m" if bits & ACC_MKNOD else "")
    )


@dataclass(frozen=True)
class DeviceRule:
    """One line of devices.list / devices.allow / devices.deny.

    ``major``/``minor`` None is the kernel's ``~0`` (rendered ``*``).
    """

    type: str  # "a" | "b" | "c"
    major: Optional[int]
    minor: Optional[int]
    access: int  # ACC_* bits

    def render(self) -> str:
        """The line as devices.list prints it, e.g. ``c 195:0 rw``."""
        maj = "*" if self.major is None else str(self.major)
        mnr = "*" if self.minor is None else str(self.minor)
        return f"{self.type} {maj}:{mnr} {access_str(self.access)}"

    @property
    def type_bits(self) -> int:
        return _TYPE_BITS[self.type]

    def same_target(self, other: DeviceRule) -> bool:
        """The kernel's merge/remove key: same type, major and minor, wildcards literal."""
        return (self.type, self.major, self.minor) == (other.type, other.major, other.minor)


ALLOW_ALL = DeviceRule("a", None, None, ACC_ALL)


@dataclass(frozen=True)
class DeviceRules:
    """A cgroup's devices state: behaviour plus exceptions (see the module doc)."""

    default_allow: bool
    exceptions: tuple[DeviceRule, ...] = ()

    def render_list(self) -> str:
        """What ``cat devices.list`` prints for this state (devcgroup_seq_show())."""
        if self.default_allow:
            return ALLOW_ALL.render() + "\n"
        return "".join(r.render() + "\n" for r in self.exceptions)


ROOT_RULES = DeviceRules(default_allow=True)


_SPACE = " \t\n\v\f\r"  # the kernel's isspace() on ASCII
_MAJMIN_DIGITS = 11  # MAJMINLEN - 1: the kernel copies at most this many digits


def _parse_num(text: str, pos: int, what: str, line: str) -> tuple[Optional[int], int]:
    """Read ``*`` or a u32 at ``pos``; ``~0`` written out is the wildcard, as in the kernel."""
    if pos < len(text) and text[pos] == "*":
        return None, pos + 1
    end = pos
    while end < len(text) and text[end] in "0123456789" and end - pos < _MAJMIN_DIGITS:
        end += 1
    if end == pos:
        raise ValueError(f"bad {what} in device rule {clip(line)}")
    value = int(text[pos:end])
    if value > 0xFFFFFFFF:
        raise ValueError(f"{what} out of range in device rule {clip(line)}")
    return (None if value == 0xFFFFFFFF else value), end


def parse_rule(line: str) -> DeviceRule:
    """Parse ``c 195:* rw`` / ``b 8:0 r`` / ``a *:* rwm`` / ``a`` like the kernel.

    devcgroup_update_access() on the strstrip()ed buffer: ``a`` followed by anything is
    "all"; otherwise type, ONE space, major, ``:``, minor, ONE space, 1-3 of r/w/m
    (characters past the third are ignored; an empty access is refused). Raises
    ValueError for what the kernel rejects with EINVAL. Checked against a real kernel
    by tests/integration/test_devices_cgroup_v1.py.
    """
    text = line.strip()
    if not text:
        raise ValueError("empty device rule")
    if text[0] == "a":
        return ALLOW_ALL
    if text[0] not in ("b", "c") or len(text) < 2 or text[1] not in _SPACE:
        raise ValueError(f"bad device rule {clip(line)}")
    major, pos = _parse_num(text, 2, "major", line)
    if pos >= len(text) or text[pos] != ":":
        raise ValueError(f"bad major:minor in device rule {clip(line)}")
    minor, pos = _parse_num(text, pos + 1, "minor", line)
    if pos >= len(text) or text[pos] not in _SPACE:
        raise ValueError(f"missing access in device rule {clip(line)}")
    acc = text[pos + 1 : pos + 4]
    if "\n" in acc:
        acc = acc[: acc.index("\n")]
    try:
        bits = access_bits(acc)
    except ValueError:
        raise ValueError(f"bad access in device rule {clip(line)}") from None
    if not bits:
        raise ValueError(f"empty access in device rule {clip(line)}")
    return DeviceRule(text[0], major, minor, bits)


def parse_devices_list(text: str) -> DeviceRules:
    """Parse the content of devices.list.

    Any ``a`` line means allow mode (the kernel never lists an ``a`` exception in deny
    mode: writing ``a`` switches the behaviour instead of adding one). An empty file is
    deny mode with no exceptions: a cgroup that may open nothing.
    """
    rules = [parse_rule(ln) for ln in text.splitlines() if ln.strip()]
    if any(r.type == "a" for r in rules):
        return DeviceRules(default_allow=True)
    return DeviceRules(default_allow=False, exceptions=tuple(rules))


# After a daemon-reload most containers' lists are byte-identical: each distinct text
# parsed once (the rules are frozen, so they are shared; lru_cache is safe from the
# pass's thread and the loop's reload fast path alike).
parsed_devices_list = functools.lru_cache(maxsize=256)(parse_devices_list)


def _match_exception(
    exceptions: Iterable[DeviceRule],
    type_bits: int,
    major: Optional[int],
    minor: Optional[int],
    access: int,
) -> bool:
    """match_exception(): one exception covers the type, numbers and ALL access bits."""
    for ex in exceptions:
        if (type_bits & DEV_BLOCK) and not (ex.type_bits & DEV_BLOCK):
            continue
        if (type_bits & DEV_CHAR) and not (ex.type_bits & DEV_CHAR):
            continue
        if ex.major is not None and ex.major != major:
            continue
        if ex.minor is not None and ex.minor != minor:
            continue
        if access & ~ex.access:
            continue
        return True
    return False


def _match_exception_partial(
    exceptions: Iterable[DeviceRule],
    type_bits: int,
    major: Optional[int],
    minor: Optional[int],
    access: int,
) -> bool:
    """match_exception_partial(): an exception overlapping the range in ANY access bit."""
    for ex in exceptions:
        if (type_bits & DEV_BLOCK) and not (ex.type_bits & DEV_BLOCK):
            continue
        if (type_bits & DEV_CHAR) and not (ex.type_bits & DEV_CHAR):
            continue
        if ex.major is not None and major is not None and ex.major != major:
            continue
        if ex.minor is not None and minor is not None and ex.minor != minor:
            continue
        if not (access & ex.access):
            continue
        return True
    return False


def allows(
    rules: DeviceRules,
    type: str,
    major: Optional[int],
    minor: Optional[int],
    access: str | int,
) -> bool:
    """Would the kernel let a task in this cgroup do ``access`` on the device?

    ``type`` is ``"c"`` or ``"b"``; ``access`` ``"rw"`` for an O_RDWR open, ``"m"`` for
    mknod. Same decision as devcgroup_legacy_check_permission(). With a list read from
    devices.list in allow mode the (invisible) deny exceptions are unknown: the answer
    is then "allowed", which is what the file claims.
    """
    bits = access_bits(access) if isinstance(access, str) else access
    tbits = _TYPE_BITS[type]
    if rules.default_allow:
        return not _match_exception_partial(rules.exceptions, tbits, major, minor, bits)
    return _match_exception(rules.exceptions, tbits, major, minor, bits)


def _exception_add(exceptions: tuple[DeviceRule, ...], ex: DeviceRule) -> tuple[DeviceRule, ...]:
    """dev_exception_add(): OR the access into an exception with the same literal
    type/major/minor, else append (so devices.list keeps insertion order)."""
    out = []
    merged = False
    for walk in exceptions:
        if walk.same_target(ex):
            walk = replace(walk, access=walk.access | ex.access)
            merged = True
        out.append(walk)
    if not merged:
        out.append(ex)
    return tuple(out)


def _exception_rm(exceptions: tuple[DeviceRule, ...], ex: DeviceRule) -> tuple[DeviceRule, ...]:
    """dev_exception_rm(): clear the bits in exceptions with the SAME literal
    type/major/minor (``deny c 195:0`` does not touch ``c 195:* rw``), drop empty ones."""
    out = []
    for walk in exceptions:
        if walk.same_target(ex):
            walk = replace(walk, access=walk.access & ~ex.access)
            if not walk.access:
                continue
        out.append(walk)
    return tuple(out)


class WriteRejected(ValueError):
    """The kernel would fail this write: ``errno_name`` is "EINVAL" or "EPERM"."""

    def __init__(self, errno_name: str, message: str) -> None:
        super().__init__(message)
        self.errno_name = errno_name


def _parent_has_perm(parent: Optional[DeviceRules], ex: DeviceRule) -> bool:
    """verify_new_ex() against the parent: a child may only allow what its parent allows."""
    if parent is None:
        return True  # the root cgroup allows everything
    if parent.default_allow:
        return not _match_exception_partial(
            parent.exceptions, ex.type_bits, ex.major, ex.minor, ex.access
        )
    return _match_exception(parent.exceptions, ex.type_bits, ex.major, ex.minor, ex.access)


def apply_write(
    rules: DeviceRules,
    file: str,
    line: str,
    *,
    parent: Optional[DeviceRules] = None,
    has_children: bool = False,
) -> DeviceRules:
    """The state after writing ``line`` to ``devices.allow`` / ``devices.deny``.

    Mirrors devcgroup_update_access() for a cgroup whose parent is ``parent`` (None: the
    root, which allows everything). Raises WriteRejected where the kernel returns an
    error (then the state is unchanged). Propagation to children is not modelled.
    """
    if file not in ("devices.allow", "devices.deny"):
        raise ValueError(f"not a devices control file: {file}")
    try:
        ex = parse_rule(line)
    except ValueError as e:
        raise WriteRejected("EINVAL", str(e)) from None
    if ex.type == "a":
        # Whole-behaviour change; the kernel refuses it while children exist.
        if has_children:
            raise WriteRejected("EINVAL", "cannot change behaviour of a cgroup with children")
        if file == "devices.deny":
            return DeviceRules(default_allow=False)
        if parent is not None and not parent.default_allow:
            raise WriteRejected("EPERM", "parent does not allow all devices")
        # The child copies the parent's (deny) exceptions when it goes back to allow.
        inherited = parent.exceptions if parent is not None else ()
        return DeviceRules(default_allow=True, exceptions=inherited)
    if file == "devices.allow":
        if rules.default_allow:
            # Allowing in allow mode removes a matching deny exception, silently.
            return replace(rules, exceptions=_exception_rm(rules.exceptions, ex))
        if not _parent_has_perm(parent, ex):
            raise WriteRejected("EPERM", f"parent does not allow {ex.render()}")
        return replace(rules, exceptions=_exception_add(rules.exceptions, ex))
    if rules.default_allow:
        return replace(rules, exceptions=_exception_add(rules.exceptions, ex))
    return replace(rules, exceptions=_exception_rm(rules.exceptions, ex))


def allow_line(type: str, major: int, minor: int, access: str = "rw") -> str:
    """The line to write to devices.allow for one node, e.g. ``c 195:0 rw``."""
    return _allow_line(type, major, minor, access)


# A reload's re-grant writes the same few lines for hundreds of containers.
@functools.lru_cache(maxsize=1024)
def _allow_line(type: str, major: int, minor: int, access: str) -> str:
    if type not in ("b", "c"):
        raise ValueError(f"device type must be 'b' or 'c', not {type!r}")
    return DeviceRule(type, major, minor, access_bits(access)).render()


# runc's default allow list for every container (libcontainer/specconv AllowedDevices):
# the mknod wildcards, null, zero, full, random, urandom, tty, console, ptmx, pts, tun.
# A devices.list made of these plus the spec's devices is what runc (re)writes.
RUNC_DEFAULT_RULES: tuple[DeviceRule, ...] = tuple(
    parse_rule(x)
    for x in (
        "c *:* m",
        "b *:* m",
        "c 1:3 rwm",
        "c 1:8 rwm",
        "c 1:7 rwm",
        "c 5:0 rwm",
        "c 1:5 rwm",
        "c 1:9 rwm",
        "c 5:1 rwm",
        "c 136:* rwm",
        "c 5:2 rwm",
        "c 10:200 rwm",
    )
)


# The defaults every runc version writes (tun, 10:200, was dropped from the list in
# later runc releases, so it is not required for recognising a runc-written list).
_RUNC_CORE = tuple(r for r in RUNC_DEFAULT_RULES if r.render() != "c 10:200 rwm")


def looks_runc_written(rules: DeviceRules) -> bool:
    """Deny mode with runc's defaults present: the list runc writes on create/update."""
    if rules.default_allow:
        return False
    return all(
        _match_exception(rules.exceptions, d.type_bits, d.major, d.minor, d.access)
        for d in _RUNC_CORE
    )
