"""The device watch (steps/container_access/devwatch.py): a known GPU container's device
cgroup rewritten behind systemd's back is seen at the next tick and repaired for that
container alone, after systemd's apply has settled; nothing else is granted, nothing
is done in observe mode, and what it remembers is bounded by the live containers."""

from __future__ import annotations

import asyncio
import io
import os
from pathlib import Path
from typing import Any, Optional, Sequence

from gpuguard.config import load_config
from gpuguard.devices.containers import ContainerCgroup
from gpuguard.devices.entitlement import Entitlement, VisibleDevices
from gpuguard.devices.nodes import ROLE_GPU, DeviceNode
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.model import Action, Finding, Outcome
from gpuguard.steps.container_access.cgroupv1 import CgroupV1
from gpuguard.steps.container_access.devwatch import DeviceWatch
from gpuguard.steps.container_access.view import AccessView, Pair, Readings

GPU0 = DeviceNode("/dev/nvidia0", 195, 0, ROLE_GPU)
GPU1 = DeviceNode("/dev/nvidia1", 195, 1, ROLE_GPU)


class Svc:
    def __init__(self, root: Path, *, dry_run: bool = False) -> None:
        self.root = Root(root)
        self.config = load_config(self.root)
        self.stream = io.StringIO()
        self.log = EventLog(level="debug", stream=self.stream)
        self.systemd: Optional[object] = object()
        self.apply = ChangeExecutor(dry_run=dry_run)


def _pair(n: int, *nodes: DeviceNode) -> Pair:
    cid = str(n) * 64
    c = ContainerCgroup(f"p{n}", cid, "containerd", "systemd", None, None, f"ctr-{n}.scope", (n,))
    ent = Entitlement(f"p{n}", cid, nodes, nodes, (), (), VisibleDevices("list", ()))
    return c, ent


class FakeLayout:
    """A layout whose fingerprint and verdicts a test sets; records its grants."""

    def __init__(self) -> None:
        self.fp: dict[str, Optional[bytes]] = {}
        self.denied: dict[str, set[str]] = {}
        self.granted: list[tuple[str, tuple[str, ...]]] = []

    def fingerprint(self, root: Root, c: ContainerCgroup) -> Optional[bytes]:
        return self.fp.get(c.container_id)

    def reread(self, root: Root, pairs: Sequence[Pair]) -> Readings:
        r = Readings()
        for c, ent in pairs:
            for n in ent.nodes:
                r.access[(c.container_id, n.numbers)] = n.numbers not in self.denied.get(
                    c.container_id, set()
                )
        return r

    def plan_regrant(self, c: ContainerCgroup, denied: Sequence[DeviceNode], remedy: str) -> Any:
        return ((c.container_id, tuple(n.numbers for n in denied)),)

    async def grant(self, actions: Any, view: AccessView, svc: Any) -> list[Outcome]:
        out = []
        for cid, numbers in actions:
            self.granted.append((cid, numbers))
            self.denied[cid] -= set(numbers)
            out.append(Outcome(Action("container-access", "test", cid), "done"))
        return out


class Harness:
    def __init__(self, tmp: Path, pairs: list[Pair], **kw: Any) -> None:
        self.layout = FakeLayout()
        self.pairs = pairs
        self.settled: list[str] = []
        self.reported: list[int] = []
        self.carried: list[int] = []
        self.again: list[str] = []
        self.svc = Svc(tmp, **kw)

        async def settle(sd: object, unit: str) -> None:
            self.settled.append(unit)

        def report(view: AccessView, outcomes: Sequence[Outcome], svc: Any) -> list[Finding]:
            self.reported.append(len(outcomes))
            return []

        def carry(outcomes: Sequence[Outcome], findings: Sequence[Finding]) -> None:
            self.carried.append(len(outcomes))

        self.watch = DeviceWatch(
            lambda: [(self.layout, self.pairs)],  # type: ignore[list-item]
            lambda: settle,
            report,
            carry,
        )

    def tick(self) -> None:
        async def go() -> None:
            self.watch.on_tick(self.svc, self.again.append)  # type: ignore[arg-type]
            for _ in range(20):  # the judging task, its thread hops
                await asyncio.sleep(0.005)

        asyncio.run(go())


def test_a_rewrite_is_repaired_for_that_container_alone(tmp_path: Path) -> None:
    a, b = _pair(1, GPU0, GPU1), _pair(2, GPU0)
    h = Harness(tmp_path, [a, b])
    h.layout.fp = {a[0].container_id: b"x", b[0].container_id: b"y"}
    h.tick()  # the first look only remembers
    assert h.settled == [] and h.layout.granted == []
    # a runtime rewrote container 1's list: GPU1 denied, GPU0 kept
    h.layout.fp[a[0].container_id] = b"x2"
    h.layout.denied[a[0].container_id] = {"195:1"}
    h.tick()
    assert h.settled == ["ctr-1.scope"]  # systemd's apply waited for first
    assert h.layout.granted == [(a[0].container_id, ("195:1",))]  # only what it lost
    assert h.carried == [1] and h.reported == [1] and h.again  # journaled, pass follows
    st = h.watch.status()
    assert st["repaired"] == 1 and st["changes"] == 1 and st["watched"] == 2
    assert "repair_ms" in st


def test_a_change_that_left_every_node_admitted_is_no_loss(tmp_path: Path) -> None:
    a = _pair(1, GPU0)
    h = Harness(tmp_path, [a])
    h.layout.fp = {a[0].container_id: b"x"}
    h.tick()
    h.layout.fp[a[0].container_id] = b"x reordered by systemd's apply"
    h.tick()
    assert h.settled == ["ctr-1.scope"]  # judged after the apply settled
    assert h.layout.granted == [] and h.again == [] and h.carried == []
    h.tick()  # no change since: nothing judged again
    assert h.settled == ["ctr-1.scope"]


def test_observe_mode_and_regrant_no_write_nothing_the_pass_reports(tmp_path: Path) -> None:
    a = _pair(1, GPU0)
    for kw in ({"dry_run": True},):
        h = Harness(tmp_path, [a], **kw)
        h.layout.fp = {a[0].container_id: b"x"}
        h.tick()
        h.layout.fp[a[0].container_id] = b"y"
        h.layout.denied[a[0].container_id] = {"195:0"}
        h.tick()
        assert h.layout.granted == [] and h.carried == []
        assert h.again  # the pass judges and reports it, once


def test_only_live_containers_are_remembered(tmp_path: Path) -> None:
    pairs = [_pair(i, GPU0) for i in range(1, 6)]
    h = Harness(tmp_path, pairs)
    h.layout.fp = {c.container_id: b"x" for c, _ in pairs}
    h.tick()
    assert h.watch.status()["watched"] == 5
    h.pairs = pairs[:2]  # three containers gone at the last pass
    h.tick()
    assert h.watch.status()["watched"] == 2 and len(h.watch._last) == 2


def test_a_bug_is_journaled_once_not_at_every_tick(tmp_path: Path) -> None:
    a = _pair(1, GPU0)
    h = Harness(tmp_path, [a])

    def broken(root: Root, c: ContainerCgroup) -> Optional[bytes]:
        raise RuntimeError("boom")

    h.layout.fingerprint = broken  # type: ignore[method-assign]
    for _ in range(5):
        h.tick()
    assert h.svc.stream.getvalue().count("device watch raised RuntimeError") == 1


def test_v1_fingerprint_is_the_devices_list_and_refuses_a_fifo(tmp_path: Path) -> None:
    d = tmp_path / "sys/fs/cgroup/devices/kubepods/ctr"
    d.mkdir(parents=True)
    (d / "devices.list").write_text("c 195:0 rw\n")
    c = ContainerCgroup("p", "c" * 64, "containerd", "cgroupfs", d, None, None, (1,))
    v1 = CgroupV1(lambda *a: None, {})  # type: ignore[arg-type, return-value]
    root = Root(tmp_path)
    assert v1.fingerprint(root, c) == b"c 195:0 rw\n"
    (d / "devices.list").unlink()
    assert v1.fingerprint(root, c) is None  # gone: the pass judges
    os.mkfifo(d / "devices.list")
    assert v1.fingerprint(root, c) is None  # never read without bound
