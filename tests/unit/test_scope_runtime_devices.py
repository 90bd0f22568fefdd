"""The device numbers a scope's unit already allows (the runtime's DeviceAllow=, from a
CDI container's OCI spec), read from systemd's transient files: what lets the new-scope
fast path leave such a scope alone."""

from __future__ import annotations

from gpuguard.devices.scopepolicy import ScopeDevices, apply_unit_text


def test_char_numbers_allowed_read_write() -> None:
    text = (
        "[Scope]\nDevicePolicy=strict\nDeviceAllow=/dev/null rw\n"
        "DeviceAllow=/dev/char/195:0 rw\nDeviceAllow=/dev/char/195:255 rwm\n"
        "DeviceAllow=/dev/char/511:0\nDeviceAllow=/dev/char/195:1 r\n"
        "DeviceAllow=char-nvidia rw\nDeviceAllow=/dev/char/0195:07 rw\n"
    )
    d = apply_unit_text(ScopeDevices(), text)
    assert d.policy == "strict" and d.entries == 7
    # read-only and by-name entries are not a grant of the node by number
    assert d.numbers == {"195:0", "195:255", "511:0", "195:7"}


def test_an_empty_device_allow_resets_the_numbers() -> None:
    first = apply_unit_text(ScopeDevices(), "DeviceAllow=/dev/char/195:0 rw\n")
    assert first.numbers == {"195:0"}
    after = apply_unit_text(first, "DeviceAllow=\nDeviceAllow=/dev/char/195:1 rw\n")
    assert after.numbers == {"195:1"} and after.entries == 1


def test_hostile_values_are_no_numbers() -> None:
    d = apply_unit_text(
        ScopeDevices(),
        "DeviceAllow=/dev/char/195:99999999 rw\nDeviceAllow=/dev/char/a:b rw\n"
        "DeviceAllow=/dev/char/195:0/../1 rw\nDeviceAllow=/dev/char/\u0661:0 rw\n",
    )
    assert d.numbers == frozenset()
