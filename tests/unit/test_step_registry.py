"""One registry of steps: adding a step is one line in a spec list, the daemon runs the
steps in the registry's order, and a name no step answers to is refused at once."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import pytest

from gpuguard.config import load_config
from gpuguard.devices.nodes import GpuLike
from gpuguard.engine.daemon import Daemon
from gpuguard.engine.passes import PassContext, Services, Work
from gpuguard.host.notify import Notifier
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.reporting.status_figures import FastPaths
from gpuguard.steps import registry
from gpuguard.steps.events import Event, EventKind
from gpuguard.steps.registry import STEP_ORDER, StepSpec, UnknownStepError, build_steps

RAN: list[str] = []


class Recorder:
    """A step that only notes that it ran; its name is the spec's."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def __call__(self, svc: Services, ctx: PassContext) -> None:
        RAN.append(self.name)


def _recorder(name: str) -> Any:
    return lambda: Recorder(name)


class DummyStep(Recorder):
    def __init__(self) -> None:
        super().__init__("dummy")


# The real steps' names and order, each replaced by a recorder, and one new step.
for _spec in registry.STEPS:
    globals()[f"Fake_{_spec.name}"] = _recorder(_spec.name)
SPECS = tuple(StepSpec(s.name, f"{__name__}:Fake_{s.name}", s.why) for s in registry.STEPS)
WITH_DUMMY = (*SPECS[:3], StepSpec("dummy", f"{__name__}:DummyStep", "after the checkpoint"))
WITH_DUMMY += SPECS[3:]


def daemon(tmp_path: Path, specs: tuple[StepSpec, ...]) -> Daemon:
    root = Root(tmp_path / "root")
    return Daemon(
        root=root,
        config=load_config(root),
        config_path=None,
        log=EventLog(stream=io.StringIO()),
        notifier=Notifier(""),
        inventory_path=tmp_path / "inventory.json",
        bus_address="unix:path=/nonexistent",
        steps=build_steps(specs),
        step_order=[s.name for s in specs],
    )


def run_pass(d: Daemon, names: frozenset[str]) -> None:
    now = time.monotonic()
    asyncio.run(d._run_pass(Work(names, ("test",), now, now)))


def test_a_new_step_is_one_line_and_runs_in_its_place(tmp_path: Path) -> None:
    RAN.clear()
    d = daemon(tmp_path, WITH_DUMMY)
    run_pass(d, frozenset(s.name for s in WITH_DUMMY))
    assert RAN == ["container_access", "device_nodes", "checkpoint", "dummy",
                   "device_plugin", "gpu_count", "readmit"]  # fmt: skip
    assert d.ledger.steps.keys() >= {"dummy"}
    RAN.clear()
    run_pass(d, frozenset({"gpu_count", "dummy"}))  # only the marked ones, still in order
    assert RAN == ["dummy", "gpu_count"]


def test_the_daemon_runs_steps_in_the_registry_order_whatever_the_mapping_order(
    tmp_path: Path,
) -> None:
    RAN.clear()
    root = Root(tmp_path / "root")
    steps = build_steps(SPECS)
    d = Daemon(root=root, config=load_config(root), config_path=None,
               log=EventLog(stream=io.StringIO()), notifier=Notifier(""),
               inventory_path=tmp_path / "i.json", bus_address="unix:path=/nonexistent",
               steps=dict(reversed(list(steps.items()))))  # fmt: skip
    run_pass(d, frozenset(STEP_ORDER))
    assert list(STEP_ORDER) == RAN


def test_an_unknown_step_is_refused_at_construction(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    with pytest.raises(UnknownStepError, match=r"Daemon\(steps=...\): unknown step\(s\) dummy"):
        Daemon(root=root, config=load_config(root), config_path=None,
               log=EventLog(stream=io.StringIO()), notifier=Notifier(""),
               inventory_path=None, bus_address="unix:path=/nonexistent",
               steps=build_steps(WITH_DUMMY))  # fmt: skip


def test_an_unknown_step_is_refused_when_marked(tmp_path: Path) -> None:
    d = daemon(tmp_path, SPECS)
    with pytest.raises(UnknownStepError, match=r"mark \(udev: x\): unknown step\(s\) nvml"):
        d.mark(frozenset({"nvml", "checkpoint"}), "udev: x", False)
    assert d.coalescer._pending == set()  # refused whole: nothing half-marked
    d.mark(frozenset({"checkpoint"}), "udev: y", False)  # a known one is taken
    assert d.coalescer._pending == {"checkpoint"}


def test_a_name_given_twice_is_refused() -> None:
    with pytest.raises(UnknownStepError, match="named twice"):
        build_steps(SPECS + SPECS[:1])


def test_every_event_kind_wakes_a_declared_step() -> None:
    for kind in EventKind:
        woken = registry.woken_by(kind)
        assert woken, f"{kind} wakes no step: declare it in a StepSpec's wakes"
        assert woken <= registry.ALL_STEPS


def _kinds_named_in(paths: list[Path]) -> set[str]:
    """Every EventKind.X an emitter names (sources, and steps that announce)."""
    import ast

    found = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "EventKind"
            ):
                found.add(node.attr)
    return found


def test_every_event_a_source_or_step_emits_is_declared_and_wakes_a_step() -> None:
    src = Path(registry.__file__).resolve().parents[1]
    emitters = [*sorted((src / "sources").glob("*.py")), *sorted((src / "steps").rglob("*.py"))]
    emitters += [src / "engine/daemon.py", src / "engine/inventory_reader.py"]
    named = _kinds_named_in([p for p in emitters if p.name not in ("events.py", "registry.py")])
    assert {"SYSTEMD_RELOADED", "SCOPE_STARTED", "NVIDIA_MODULE", "AUDIT"} <= named
    assert "INVENTORY_CHANGED" in named
    for name in named:
        assert registry.woken_by(EventKind[name]), name


def test_each_event_wakes_the_steps_it_always_did() -> None:
    """The table sources used to hold, now the registry's declarations."""
    every = frozenset(STEP_ORDER)
    assert registry.woken_by(EventKind.SYSTEMD_RELOADED) == every
    for kind in registry.EVERY_CHANGE:
        assert registry.woken_by(kind) == every, kind
    # the driver's module loading wakes the checkpoint too: a late driver (a GPU
    # Operator node's) is when GPUs back with new UUIDs can first be judged
    assert registry.woken_by(EventKind.NVIDIA_MODULE) == every
    assert registry.woken_by(EventKind.INVENTORY_CHANGED) == {
        "device_nodes", "checkpoint", "device_plugin", "gpu_count"}  # fmt: skip
    assert registry.woken_by(EventKind.RUNTIME_STARTED) == {"container_access", "device_plugin"}
    assert registry.woken_by(EventKind.READMIT_STOPPED) == {"device_plugin"}
    assert registry.woken_by(EventKind.KUBELET_STARTED) == {
        "checkpoint", "container_access", "device_plugin", "readmit"}  # fmt: skip
    for kind in (EventKind.SCOPE_STARTED, EventKind.SCOPE_DEVICES_SET,
                 EventKind.DEVICE_LINKS_CREATED):  # fmt: skip
        assert registry.woken_by(kind) == {"container_access"}, kind


def test_sources_import_no_step_name() -> None:
    """A source emits events; which steps they wake is the registry's to say."""
    import ast

    src = Path(registry.__file__).resolve().parents[1]
    for path in sorted((src / "sources").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "gpuguard.steps.registry", path.name


class FastStep(Recorder):
    """A step with both fast paths, noting each call."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.calls: list[str] = []

    def on_reload(self, svc: Services, signal: float) -> Optional[float]:
        self.calls.append(f"reload {signal}")
        return signal + 0.5

    def fast_status(self) -> FastPaths:
        return FastPaths(new_scopes={"calls": len(self.calls)})

    def on_new_scope(
        self, svc: Services, unit: str, gpus: Sequence[GpuLike], again: Callable[[str], None]
    ) -> None:
        self.calls.append(f"scope {unit}")
        again(f"done with {unit}")


def test_the_daemon_runs_the_fast_paths_its_steps_declare_then_marks(tmp_path: Path) -> None:
    d = daemon(tmp_path, SPECS)
    fast = FastStep("container_access")
    assert isinstance(fast, registry.ReloadFastPath) and isinstance(fast, registry.ScopeFastPath)
    d.steps["container_access"] = fast
    d.runner.steps["container_access"] = fast
    marks: list[tuple[frozenset[str], bool]] = []
    d.coalescer.mark = lambda names, why, urgent: marks.append((names, urgent))  # type: ignore[method-assign]
    d.on_event(Event(EventKind.SYSTEMD_RELOADED, "systemd: reload", True, at=7.0))
    assert fast.calls == ["reload 7.0"] and marks == [(frozenset(STEP_ORDER), True)]
    marks.clear()
    # A new scope: the step with the fast path takes it and asks for its pass itself.
    d.on_event(Event(EventKind.SCOPE_STARTED, "systemd: new scope s", unit="s.scope"))
    assert fast.calls[-1] == "scope s.scope"
    assert marks == [(frozenset({"container_access"}), False)]
    d._write_status()  # the fast paths' figures go to the status file
    doc = json.loads(d.root.path("/run/gpuguard/status.json").read_text())
    assert doc["fast_paths"] == {"new_scopes": {"calls": 2}, "scope_resets": {}, "device_watch": {}}


def test_the_container_access_step_declares_both_fast_paths_by_their_protocols() -> None:
    from gpuguard.steps.container_access import ContainerAccessStep

    step = ContainerAccessStep()
    assert isinstance(step, registry.ReloadFastPath) and isinstance(step, registry.ScopeFastPath)
    assert isinstance(step, registry.ScopeDevicesFastPath)
    assert not isinstance(Recorder("x"), registry.ReloadFastPath)


def test_a_woken_step_without_a_fast_path_is_marked_at_once(tmp_path: Path) -> None:
    d = daemon(tmp_path, SPECS)
    marks: list[frozenset[str]] = []
    d.coalescer.mark = lambda names, why, urgent: marks.append(names)  # type: ignore[method-assign]
    d.on_event(Event(EventKind.SCOPE_STARTED, "systemd: new scope s", unit="s.scope"))
    assert marks == [frozenset({"container_access"})]


def test_check_runs_the_daemon_order_with_the_checkpoint_last() -> None:
    assert tuple(n for n in STEP_ORDER if n in registry.CHECK_ORDER) == registry.CHECK_ORDER
    assert registry.CHECK_ORDER[-1] == registry.CHECKPOINT


def test_every_step_gives_its_reason() -> None:
    assert all(len(s.why) > 10 for s in registry.STEPS)
    assert tuple(build_steps()) == STEP_ORDER


def test_sources_and_the_daemon_spell_no_step_name_themselves() -> None:
    """Step names are written once, in the registry; sources import them."""
    import ast

    src = Path(registry.__file__).resolve().parents[1]
    files = [
        *sorted((src / "sources").glob("*.py")),
        src / "engine/daemon.py",
        src / "engine/oneshot.py",
    ]
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in registry.ALL_STEPS:
                found.append(f"{path.name}:{node.lineno}: {node.value!r}")
    assert found == []


class ResetStep(Recorder):
    """A step with the scope-devices fast path: it takes `takes` and nothing else."""

    def __init__(self, name: str, takes: str) -> None:
        super().__init__(name)
        self.takes = takes
        self.seen: list[str] = []

    def on_scope_devices(self, svc: Services, unit: str, again: Callable[[str], None]) -> bool:
        self.seen.append(unit)
        return unit == self.takes


def test_a_scope_devices_event_is_marked_unless_the_fast_path_takes_it(tmp_path: Path) -> None:
    d = daemon(tmp_path, SPECS)
    step = ResetStep("container_access", takes="lost.scope")
    assert isinstance(step, registry.ScopeDevicesFastPath)
    d.steps["container_access"] = step
    marks: list[frozenset[str]] = []
    d.coalescer.mark = lambda names, why, urgent: marks.append(names)  # type: ignore[method-assign]
    d.on_event(Event(EventKind.SCOPE_DEVICES_SET, "systemd: lost.scope", unit="lost.scope"))
    assert marks == []  # taken: the step asks for its pass itself
    d.on_event(Event(EventKind.SCOPE_DEVICES_SET, "systemd: kept.scope", unit="kept.scope"))
    d.on_event(Event(EventKind.SCOPE_DEVICES_SET, "inotify queue overflowed"))  # no unit
    assert step.seen == ["lost.scope", "kept.scope"]
    assert marks == [frozenset({"container_access"})] * 2
