"""What a scope's transient unit files say of its devices (devices/scopepolicy.py), and a
new scope whose cgroup admits every device while its unit says otherwise: pending, not
taken for a privileged container."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuguard.devices.scopepolicy import MAX_DROPINS, ScopeDevices, apply_unit_text, scope_devices
from gpuguard.host.paths import Root

UNIT = f"cri-containerd-{'c' * 64}.scope"
HEADER = '# This is a drop-in unit file extension, created via "systemctl set-property"\n'
# what runc 1.1's systemd driver has systemd 252 write (seen in the real-runc tests)
RUNC_POLICY = HEADER + "[Scope]\nDevicePolicy=strict\n"
RUNC_ALLOW = (
    HEADER + "[Scope]\nDeviceAllow=\nDeviceAllow=char-pts rwm\nDeviceAllow=/dev/char/1:3 rwm\n"
)
MAIN = "[Unit]\nDescription=libcontainer container\n\n[Scope]\nSlice=x.slice\nDelegate=yes\n"


def _files(root: Path, main: str, dropins: dict[str, str]) -> None:
    base = root / "run/systemd/transient"
    (base / f"{UNIT}.d").mkdir(parents=True)
    (base / UNIT).write_text(main)
    for name, text in dropins.items():
        (base / f"{UNIT}.d" / name).write_text(text)


@pytest.mark.parametrize(
    ("texts", "want"),
    [
        ([], ScopeDevices("auto", 0)),
        ([RUNC_POLICY], ScopeDevices("strict", 0)),
        # auto with entries: a closed list; /dev/char/1:3 allowed by number
        ([RUNC_ALLOW], ScopeDevices("auto", 2, frozenset({"1:3"}))),
        ([RUNC_ALLOW, "[Scope]\nDeviceAllow=\n"], ScopeDevices("auto", 0)),  # a reset
        (["[Scope]\nDevicePolicy=closed\n", "[Scope]\nDevicePolicy=\n"], ScopeDevices()),
        (["[Scope]\nDevicePolicy=bogus\n"], ScopeDevices()),  # systemd ignores it too
    ],
)
def test_settings_applied_in_order(texts: list[str], want: ScopeDevices) -> None:
    got = ScopeDevices()
    for t in texts:
        got = apply_unit_text(got, t)
    assert got == want
    assert got.admits_all == (want.policy == "auto" and want.entries == 0)


def test_runc_scope_read_from_its_files(tmp_path: Path) -> None:
    _files(tmp_path, MAIN, {"50-DevicePolicy.conf": RUNC_POLICY, "50-DeviceAllow.conf": RUNC_ALLOW})
    got = scope_devices(Root(tmp_path), UNIT)
    assert got == ScopeDevices("strict", 2, frozenset({"1:3"})) and not got.admits_all


def test_privileged_scope_admits_all(tmp_path: Path) -> None:
    _files(tmp_path, MAIN, {"50-DevicePolicy.conf": HEADER + "[Scope]\nDevicePolicy=auto\n"})
    got = scope_devices(Root(tmp_path), UNIT)
    assert got is not None and got.admits_all


def test_unreadable_files_say_nothing(tmp_path: Path) -> None:
    assert scope_devices(Root(tmp_path), UNIT) is None  # not a transient unit
    _files(tmp_path, MAIN, {})
    os.mkfifo(tmp_path / f"run/systemd/transient/{UNIT}.d/50-DevicePolicy.conf")
    assert scope_devices(Root(tmp_path), UNIT) is None  # a FIFO is never opened to block
    big = tmp_path / f"run/systemd/transient/{UNIT}.d/50-DevicePolicy.conf"
    big.unlink()
    big.write_text("DeviceAllow=/dev/char/1:3 rwm\n" * 20000)
    assert scope_devices(Root(tmp_path), UNIT) is None  # over the bound
    big.unlink()
    many = tmp_path / f"run/systemd/transient/{UNIT}.d"
    for i in range(MAX_DROPINS + 1):
        (many / f"{i:03d}-x.conf").write_text("[Scope]\nDevicePolicy=strict\n")
    assert scope_devices(Root(tmp_path), UNIT) is None  # more drop-ins than it reads
    (many / "000-x.conf").unlink()
    assert scope_devices(Root(tmp_path), UNIT) == ScopeDevices("strict")


def test_new_scope_whose_unit_confines_it_waits_for_systemd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cgroup's word alone would leave it alone for good (never narrow); its unit
    says strict, so the read waits for systemd to apply it. A privileged one's unit
    agrees with its cgroup: left alone at once."""
    from gpuguard.devices.containers import CgroupLayout
    from gpuguard.steps.container_access import newscope
    from unit.test_devices_entitlement import CTR_GPU0, _ent

    uid = "0dbd65af-6693-11eb-994b-246e9634b5c8"
    pod = f"kubepods-besteffort-pod{uid.replace('-', '_')}.slice"
    slice_dir = tmp_path / "sys/fs/cgroup/devices/kubepods.slice/kubepods-besteffort.slice"
    scope = slice_dir / pod / UNIT
    scope.mkdir(parents=True)
    (scope / "cgroup.procs").write_text("42\n")
    proc = tmp_path / "proc/42"
    (proc / "root/dev").mkdir(parents=True)
    (proc / "comm").write_text("sleep\n")
    (tmp_path / "proc/devices").write_text("Character devices:\n195 nvidia-frontend\n")
    (tmp_path / "dev").mkdir()
    monkeypatch.setattr(newscope, "read_entitlement", lambda *a: _ent(CTR_GPU0))
    _files(tmp_path, MAIN, {"50-DevicePolicy.conf": RUNC_POLICY})
    layout = CgroupLayout("/sys/fs/cgroup/devices", None)

    def read() -> newscope.NewScope:
        return newscope.read_new_scope(
            Root(tmp_path), UNIT, layout, (), newscope.PodDeviceIds("/nonexistent"),
            admits_all=lambda c: True,
        )  # fmt: skip

    got = read()
    assert got.view is None and not got.skip, got
    assert "its unit says DevicePolicy=strict" in got.pending
    assert got.container is not None  # waiting for systemd, not for the scope
    (tmp_path / f"run/systemd/transient/{UNIT}.d/50-DevicePolicy.conf").write_text(
        "[Scope]\nDevicePolicy=auto\n"
    )
    got = read()
    assert got.view is not None and got.view.unconfined == frozenset({"c" * 64})
