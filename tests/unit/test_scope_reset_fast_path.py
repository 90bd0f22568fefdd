"""A scope's DeviceAllow= reset at runtime (steps/container_access/resetscope.py): what
gpuguard granted and the scope lost is set again for that scope alone, at once; what
it cannot tell is left to the pass; never more than it had granted."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Optional

from gpuguard.config import load_config
from gpuguard.devices.containers import ContainerCgroup
from gpuguard.devices.entitlement import Entitlement, VisibleDevices
from gpuguard.devices.nodes import ROLE_GPU, DeviceNode
from gpuguard.devices.scopepolicy import ScopeDevices, apply_unit_text
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.model import Outcome
from gpuguard.steps.container_access.actions import UnitDeviceAllow
from gpuguard.steps.container_access.resetscope import ScopeResets, lost_grants

UNIT = f"cri-containerd-{'a' * 64}.scope"
GPU0 = DeviceNode("/dev/nvidia0", 195, 0, ROLE_GPU)


def test_lost_grants_are_the_granted_numbers_no_longer_listed_rw() -> None:
    listed = apply_unit_text(
        ScopeDevices(), "DeviceAllow=/dev/char/195:0 rw\nDeviceAllow=/dev/char/195:1 r\n"
    )
    assert lost_grants(listed, {"195:0", "195:1", "195:255"}) == ("195:1", "195:255")
    assert lost_grants(listed, {"195:0"}) == ()
    assert lost_grants(ScopeDevices("strict"), {"195:0"}) == ("195:0",)  # a reset to nothing


class Svc:
    """The Services surface the fast path uses."""

    def __init__(self, root: Path) -> None:
        self.root = Root(root)
        self.config = load_config(self.root)
        self.log = EventLog(level="error", stream=io.StringIO())
        self.systemd: Optional[object] = object()
        self.apply = ChangeExecutor()


def _pair() -> tuple[ContainerCgroup, Entitlement]:
    c = ContainerCgroup("p1", "c" * 64, "containerd", "systemd", None, None, UNIT, (1,))
    ent = Entitlement("p1", "c" * 64, (GPU0,), (GPU0,), (), (), VisibleDevices("list", ("0",)))
    return c, ent


def _transient(root: Path, text: str, dropin: bool = True) -> None:
    mine = root / "run/systemd/system" / f"{UNIT}.d" / "60-gpuguard-devices.conf"
    mine.parent.mkdir(parents=True, exist_ok=True)
    if dropin:
        mine.write_text("[Scope]\nDeviceAllow=/dev/char/195:0 rw\n")
    elif mine.exists():
        mine.unlink()
    d = root / "run/systemd/transient" / f"{UNIT}.d"
    d.mkdir(parents=True, exist_ok=True)
    (root / "run/systemd/transient" / UNIT).write_text("[Scope]\n")
    (d / "50-DeviceAllow.conf").write_text(text)


def _resets(durable: dict[str, set[str]], granted: list[UnitDeviceAllow]) -> ScopeResets:
    async def grant(a: UnitDeviceAllow, svc: object, sd: object) -> Outcome:
        granted.append(a)
        return Outcome(a, "done")

    return ScopeResets(durable, grant, lambda o: None, lambda: [_pair()], frozenset)


def test_a_reset_without_the_gpu_is_granted_again_for_that_scope(tmp_path: Path) -> None:
    _transient(tmp_path, "[Scope]\nDeviceAllow=\nDeviceAllow=/dev/char/1:3 rwm\n")
    granted: list[UnitDeviceAllow] = []
    again: list[str] = []
    resets = _resets({UNIT: {"195:0"}}, granted)

    async def go() -> bool:
        took = resets.on_devices_set(Svc(tmp_path), UNIT, again.append)  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        return took

    assert asyncio.run(go())
    assert [a.devices for a in granted] == [(("/dev/char/195:0", "rw"),)]
    assert granted[0].unit == UNIT and again  # the pass follows as the backstop
    assert resets.status()["repaired"] == 1


def test_left_to_the_pass_where_it_cannot_tell(tmp_path: Path) -> None:
    granted: list[UnitDeviceAllow] = []
    svc = Svc(tmp_path)
    # no transient file to read
    assert not _resets({UNIT: {"195:0"}}, granted).on_devices_set(svc, UNIT, print)  # type: ignore[arg-type]
    _transient(tmp_path, "[Scope]\nDeviceAllow=\nDeviceAllow=/dev/char/195:0 rw\n")
    # the grant is still listed (gpuguard's own write, or an update that kept it)
    assert not _resets({UNIT: {"195:0"}}, granted).on_devices_set(svc, UNIT, print)  # type: ignore[arg-type]
    _transient(tmp_path, "[Scope]\nDeviceAllow=\n")
    # gpuguard granted this scope nothing: the runtime's own list, the pass judges
    assert not _resets({}, granted).on_devices_set(svc, UNIT, print)  # type: ignore[arg-type]
    # a number it granted that the container is no longer entitled to: never again
    assert not _resets({UNIT: {"195:1"}}, granted).on_devices_set(svc, UNIT, print)  # type: ignore[arg-type]
    _transient(tmp_path, "[Scope]\nDeviceAllow=\n", dropin=False)
    # gpuguard's drop-in was taken away: on purpose, the pass judges
    assert not _resets({UNIT: {"195:0"}}, granted).on_devices_set(svc, UNIT, print)  # type: ignore[arg-type]
    svc.systemd = None  # the bus is down
    assert not _resets({UNIT: {"195:0"}}, granted).on_devices_set(svc, UNIT, print)  # type: ignore[arg-type]
    assert granted == []
