"""One registry of steps: adding a step is one line in a spec list, the daemon runs the
steps in the registry's order, and a name no step answers to is refused at once."""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path
from typing import Any

import pytest

from gpuguard.config import load_config
from gpuguard.engine.daemon import Daemon
from gpuguard.engine.passes import PassContext, Services, Work
from gpuguard.host.notify import Notifier
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.sources import systemd as systemd_source
from gpuguard.sources import udev as udev_source
from gpuguard.steps import registry
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
                   "device_plugin", "gpu_count"]  # fmt: skip
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


def test_sources_mark_only_registered_steps() -> None:
    marked = {
        *systemd_source.ALL,
        *systemd_source.ON_RUNTIME_START,
        *systemd_source.ON_KUBELET_START,
        *systemd_source.ON_SCOPE_NEW,
        *udev_source.ALL_RECONCILERS,
        *udev_source.MODULE_RECONCILERS,
    }
    assert marked <= registry.ALL_STEPS
    assert systemd_source.ALL == udev_source.ALL_RECONCILERS == frozenset(STEP_ORDER)


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
