"""rules.py: the kernel's cgroup v1 devices semantics, as tables.

Every expectation here mirrors security/device_cgroup.c; the integration test
test_devices_cgroup_v1.py replays the same kind of writes on a real kernel.
"""

from __future__ import annotations

import pytest

from gpuguard.devices.rules import (
    ACC_ALL,
    RUNC_DEFAULT_RULES,
    DeviceRule,
    DeviceRules,
    WriteRejected,
    allow_line,
    allows,
    apply_write,
    looks_runc_written,
    parse_devices_list,
    parse_rule,
)

# Seed 004: devices.list of a GPU container whose plugin never saw /dev/nvidia-uvm.
SEED_004_LIST = """\
c 1:5 rwm
c 1:3 rwm
c 1:9 rwm
c 1:8 rwm
c 5:0 rwm
c 5:1 rwm
c 195:255 rw
c 195:1 rw
c *:* m
b *:* m
c 1:7 rwm
c 136:* rwm
c 5:2 rwm
c 10:200 rwm
"""


@pytest.mark.parametrize(
    ("line", "rendered"),
    [
        ("a *:* rwm", "a *:* rwm"),
        ("a", "a *:* rwm"),
        ("ajunk", "a *:* rwm"),  # the kernel looks at the first character only
        ("c 195:* rw", "c 195:* rw"),
        ("b 8:0 r", "b 8:0 r"),
        ("c *:* m", "c *:* m"),
        ("c 01:3 r", "c 1:3 r"),
        ("c 1:3 rwmr", "c 1:3 rwm"),  # past the third access character: ignored
        ("c 1:3 rr", "c 1:3 r"),
        ("c 1:3 mwr", "c 1:3 rwm"),  # rendered in the kernel's order
        ("c 4294967295:1 r", "c *:1 r"),  # ~0 written out is the wildcard
        ("  c 1:3 rw\n", "c 1:3 rw"),  # strstrip()
    ],
)
def test_parse_rule_accepts(line: str, rendered: str) -> None:
    assert parse_rule(line).render() == rendered


@pytest.mark.parametrize(
    "line",
    [
        "",
        "c 1:3",  # no access
        "c 1:3 ",  # stripped to the above
        "c 1:3 x",
        "c  1:3 r",  # two spaces
        "c 1:3  r",
        "c 1: r",
        "c :3 r",
        "x 1:3 r",
        "c 1-3 r",
        "c 4294967296:1 r",
        "c 123456789012:1 r",
        "c\u00a01:3 r" + "\u0661",  # non-ASCII digits are not digits to the kernel
    ],
)
def test_parse_rule_rejects(line: str) -> None:
    with pytest.raises(ValueError):
        parse_rule(line)


def test_list_allow_all_hides_exceptions() -> None:
    rules = parse_devices_list("a *:* rwm\n")
    assert rules == DeviceRules(default_allow=True)
    assert allows(rules, "c", 195, 0, "rw")
    assert allows(rules, "b", 8, 0, "rwm")


def test_empty_list_denies_everything() -> None:
    rules = parse_devices_list("")
    assert not rules.default_allow
    assert not allows(rules, "c", 1, 3, "r")


@pytest.mark.parametrize(
    ("type_", "major", "minor", "access", "expected"),
    [
        ("c", 195, 1, "rw", True),  # GPU1 in the spec
        ("c", 195, 255, "rw", True),  # nvidiactl
        ("c", 195, 255, "rwm", False),  # mknod not granted: a subset is needed
        ("c", 195, 0, "rw", False),  # another GPU
        ("c", 237, 0, "rw", False),  # seed 004: uvm absent
        ("c", 237, 0, "m", True),  # c *:* m
        ("b", 8, 0, "m", True),  # b *:* m
        ("b", 8, 0, "r", False),
        ("c", 136, 7, "rw", True),  # pts wildcard minor
        ("b", 136, 7, "r", False),  # type matters
        ("c", 1, 3, "rwm", True),
        ("c", 10, 200, "rw", True),
    ],
)
def test_seed_004_list(type_: str, major: int, minor: int, access: str, expected: bool) -> None:
    rules = parse_devices_list(SEED_004_LIST)
    assert allows(rules, type_, major, minor, access) is expected


def test_one_exception_must_cover_all_bits() -> None:
    rules = parse_devices_list("c 1:* r\nc 1:3 w\n")
    assert allows(rules, "c", 1, 3, "r")
    assert allows(rules, "c", 1, 3, "w")
    assert not allows(rules, "c", 1, 3, "rw")


def test_a_exception_matches_both_types() -> None:
    rules = DeviceRules(False, (DeviceRule("a", 8, None, ACC_ALL),))
    assert allows(rules, "b", 8, 1, "rw")
    assert allows(rules, "c", 8, 1, "rw")


def test_allow_mode_deny_exception_partial_overlap() -> None:
    rules = apply_write(DeviceRules(True), "devices.deny", "c 195:* w")
    assert not allows(rules, "c", 195, 0, "rw")  # overlaps in w
    assert allows(rules, "c", 195, 0, "r")
    assert allows(rules, "c", 196, 0, "rw")
    assert rules.render_list() == "a *:* rwm\n"  # the kernel hides it


def test_seed_002_cpu_manager_rewrite() -> None:
    """runc update: deny everything, then allow only the spec's devices; the legacy
    hook's direct grant of the GPU is gone, the list starts over in write order."""
    state = DeviceRules(True)
    state = apply_write(state, "devices.deny", "a")
    for r in RUNC_DEFAULT_RULES:
        state = apply_write(state, "devices.allow", r.render())
    state = apply_write(state, "devices.allow", "c 195:0 rw")  # the hook, behind runc's back
    state = apply_write(state, "devices.allow", "c 195:255 rw")
    assert allows(state, "c", 195, 0, "rw")
    # CPU manager's periodic runc update with older runc:
    state = apply_write(state, "devices.deny", "a *:* rwm")
    assert state.exceptions == ()
    for r in RUNC_DEFAULT_RULES:
        state = apply_write(state, "devices.allow", r.render())
    assert not allows(state, "c", 195, 0, "rw")
    assert not allows(state, "c", 195, 255, "rw")
    assert looks_runc_written(state)
    assert looks_runc_written(parse_devices_list(state.render_list()))


def test_writes_merge_and_remove_by_literal_target() -> None:
    s = apply_write(DeviceRules(True), "devices.deny", "a")
    s = apply_write(s, "devices.allow", "c 195:* r")
    s = apply_write(s, "devices.allow", "c 195:0 w")
    s = apply_write(s, "devices.allow", "c 195:* w")  # merges into the first
    assert s.render_list() == "c 195:* rw\nc 195:0 w\n"
    s = apply_write(s, "devices.deny", "c 195:0 rw")  # does not touch 195:*
    assert s.render_list() == "c 195:* rw\n"
    s = apply_write(s, "devices.deny", "c 195:* r")
    assert s.render_list() == "c 195:* w\n"
    s = apply_write(s, "devices.deny", "c 195:* rwm")
    assert s.render_list() == ""


def test_write_rejections() -> None:
    deny_all = DeviceRules(False)
    with pytest.raises(WriteRejected) as e:
        apply_write(deny_all, "devices.allow", "c 1:3", parent=None)
    assert e.value.errno_name == "EINVAL"
    with pytest.raises(WriteRejected) as e:
        apply_write(deny_all, "devices.allow", "c 195:0 rw", parent=parse_devices_list("c 1:3 rw"))
    assert e.value.errno_name == "EPERM"
    with pytest.raises(WriteRejected) as e:
        apply_write(DeviceRules(True), "devices.deny", "a", has_children=True)
    assert e.value.errno_name == "EINVAL"
    with pytest.raises(WriteRejected) as e:
        apply_write(deny_all, "devices.allow", "a", parent=deny_all)
    assert e.value.errno_name == "EPERM"


def test_parent_allows_subset() -> None:
    parent = parse_devices_list("c 195:* rw\n")
    child = apply_write(DeviceRules(False), "devices.allow", "c 195:3 r", parent=parent)
    assert child.render_list() == "c 195:3 r\n"


def test_allow_line_and_runc_recognition() -> None:
    assert allow_line("c", 195, 0) == "c 195:0 rw"
    assert allow_line("b", 8, 0, "r") == "b 8:0 r"
    with pytest.raises(ValueError):
        allow_line("a", 1, 1)
    assert looks_runc_written(parse_devices_list(SEED_004_LIST))
    assert not looks_runc_written(parse_devices_list("a *:* rwm"))
    assert not looks_runc_written(parse_devices_list("c 195:0 rw"))
