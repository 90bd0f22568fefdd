"""Every step by name, the events that wake it, the order of a pass and of `gpuguard
check`, each reason once; and the contract a step fulfils.

Sources emit events (steps/events.py); the registry says which steps each kind wakes
(`WAKES`), the daemon runs the woken steps in STEP_ORDER, `gpuguard check` in
CHECK_ORDER. Adding a step is its package under steps/ and one line in STEPS: its name,
its class, why it sits where it does, and the events that wake it.

Cheap to import (no step code is loaded until build_steps()): the sources, the daemon
and `gpuguard check` import it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    AbstractSet,
    Callable,
    Iterable,
    Mapping,
    Optional,
    Protocol,
    Sequence,
    runtime_checkable,
)

from gpuguard.steps.events import EventKind as E

if TYPE_CHECKING:
    from gpuguard.devices.nodes import GpuLike
    from gpuguard.engine.passes import PassContext, Services
    from gpuguard.reporting.status_figures import FastPaths

CONTAINER_ACCESS = "container_access"
DEVICE_NODES = "device_nodes"
CHECKPOINT = "checkpoint"
DEVICE_PLUGIN = "device_plugin"
GPU_COUNT = "gpu_count"
READMIT = "readmit"


class Step(Protocol):
    """A step: observes the host (in a worker thread), runs its pure reconciler, hands
    the actions to actuators, and adds its findings and outcomes to the pass (`ctx`).
    State that must outlive a pass (caches, rate limits) lives in the step object."""

    async def __call__(self, svc: Services, ctx: PassContext) -> None: ...


@runtime_checkable
class ReloadFastPath(Protocol):
    """A step with work that must not wait for the pass a reload's end marks: run inline
    on the loop the moment systemd's reload ends (SYSTEMD_RELOADED), before that pass.
    Returns when the last access it restored was back (monotonic; None: none), for the
    repair-time histogram. `fast_status` is what its fast paths last did, for the status
    file."""

    def on_reload(self, svc: Services, signal: float) -> Optional[float]: ...

    def fast_status(self) -> FastPaths: ...


@runtime_checkable
class ScopeFastPath(Protocol):
    """A step that handles a new container scope (SCOPE_STARTED) on its own instead of
    being marked: it calls `again(why)` to ask for its full pass once it is done."""

    def on_new_scope(
        self, svc: Services, unit: str, gpus: Sequence[GpuLike], again: Callable[[str], None]
    ) -> None: ...


@runtime_checkable
class ScopeDevicesFastPath(Protocol):
    """A step that may repair one scope whose device properties were set at runtime
    (SCOPE_DEVICES_SET naming its unit) before any pass: True when it took the event
    (it calls `again(why)` for its pass when done), False to be marked as usual."""

    def on_scope_devices(self, svc: Services, unit: str, again: Callable[[str], None]) -> bool: ...


@runtime_checkable
class DeviceWatchFastPath(Protocol):
    """A step that looks, every WatchInterval=, for what no event announces and repairs
    it on its own (DEVICE_WATCH): it calls `again(why)` for its pass when it acted;
    the tick itself never marks a pass."""

    def on_device_watch(self, svc: Services, again: Callable[[str], None]) -> None: ...


@runtime_checkable
class ResetRepairTimes(Protocol):
    """A step whose fast paths repair device access reset at runtime: the seconds each
    repair took (from seeing the reset to the grant in place) since the last call, for
    the metrics' histogram."""

    def take_reset_seconds(self) -> Sequence[float]: ...


# What may change anything on the node: every step looks.
EVERY_CHANGE: frozenset[E] = frozenset({
    E.START_UP, E.CONFIG_RELOADED, E.AUDIT, E.SYSTEMD_RELOADED, E.SYSTEMD_REEXECUTED,
    E.BOOT_FINISHED, E.BUS_RECONNECTED, E.NVIDIA_PCI, E.UDEV_EVENTS_LOST,
})  # fmt: skip


@dataclass(frozen=True)
class StepSpec:
    """One step: its name, where its class lives ("module:Class", imported only when
    the daemon builds its steps), why it sits where it does in the pass, and the events
    that wake it."""

    name: str
    load: str
    why: str
    wakes: frozenset[E] = EVERY_CHANGE

    def build(self) -> Step:
        module, _, attr = self.load.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        step: Step = factory()
        return step


# The order of the steps in every pass, the daemon's and `gpuguard check`'s alike.
STEPS: tuple[StepSpec, ...] = (
    StepSpec(CONTAINER_ACCESS, "gpuguard.steps.container_access:ContainerAccessStep",
             "first: after a daemon-reload every millisecond counts",
             EVERY_CHANGE | {E.NVIDIA_MODULE, E.RUNTIME_STARTED, E.KUBELET_STARTED,
                             E.SCOPE_STARTED, E.SCOPE_DEVICES_SET, E.DEVICE_LINKS_CREATED,
                             E.DEVICE_WATCH}),
    StepSpec(DEVICE_NODES, "gpuguard.steps.device_nodes:DeviceNodesStep",
             "a new /dev/char link asks for an immediate second container access run, "
             "so durable grants follow at once",
             EVERY_CHANGE | {E.NVIDIA_MODULE, E.INVENTORY_CHANGED}),
    StepSpec(CHECKPOINT, "gpuguard.steps.checkpoint:CheckpointStep",
             "may restart kubelet, so after the urgent device repairs; the driver "
             "arriving (a module load, NVML appearing) is when a late driver's new UUIDs "
             "can first be judged",
             EVERY_CHANGE | {E.KUBELET_STARTED, E.NVIDIA_MODULE, E.INVENTORY_CHANGED}),
    StepSpec(DEVICE_PLUGIN, "gpuguard.steps.device_plugin:DevicePluginStep",
             "judges the plugins once nodes and the checkpoint are repaired",
             EVERY_CHANGE | {E.NVIDIA_MODULE, E.RUNTIME_STARTED, E.KUBELET_STARTED,
                             E.INVENTORY_CHANGED, E.READMIT_STOPPED}),
    StepSpec(GPU_COUNT, "gpuguard.steps.gpu_count:GpuCountStep",
             "last, report only: it judges what the plugins' repairs left",
             EVERY_CHANGE | {E.NVIDIA_MODULE, E.INVENTORY_CHANGED}),
    StepSpec(READMIT, "gpuguard.steps.readmit:ReadmitStep",
             "report only, after every repair: the GPU pods kubelet rejected at its "
             "start, from the re-admission bridge's state",
             EVERY_CHANGE | {E.NVIDIA_MODULE, E.KUBELET_STARTED}),
)  # fmt: skip
STEP_ORDER: tuple[str, ...] = tuple(s.name for s in STEPS)
ALL_STEPS: frozenset[str] = frozenset(STEP_ORDER)

# `gpuguard check` runs the steps that repair a node in one go, in STEP_ORDER: the
# device steps, then the checkpoint. The device plugin step is the daemon's only (its
# restarts need a cool-down and a budget that outlive one run); the GPU count is in
# `gpuguard doctor`.
CHECK_ORDER: tuple[str, ...] = (CONTAINER_ACCESS, DEVICE_NODES, CHECKPOINT)

Wakes = Mapping[E, frozenset[str]]


def wakes_of(specs: Sequence[StepSpec] = STEPS) -> Wakes:
    """Each event kind -> the steps of `specs` it wakes (kinds that wake none absent)."""
    table: dict[E, set[str]] = {}
    for s in specs:
        for kind in s.wakes:
            table.setdefault(kind, set()).add(s.name)
    return {kind: frozenset(names) for kind, names in table.items()}


WAKES: Wakes = wakes_of()


def woken_by(kind: E, among: AbstractSet[str] = ALL_STEPS, wakes: Wakes = WAKES) -> frozenset[str]:
    """The steps (of `among`) an event of `kind` wakes."""
    return wakes.get(kind, frozenset()) & among


class UnknownStepError(ValueError):
    """A name no step answers to: a bug in the caller, never the operator's doing."""


def check_names(names: Iterable[str], known: Iterable[str], where: str) -> None:
    """Raise UnknownStepError naming `where` and the known steps for any unknown name."""
    known_set = frozenset(known)
    unknown = sorted(set(names) - known_set)
    if unknown:
        raise UnknownStepError(
            f"{where}: unknown step(s) {', '.join(unknown)} "
            f"(known: {', '.join(sorted(known_set)) or 'none'}); "
            "a step is named in gpuguard.steps.registry.STEPS"
        )


def build_steps(specs: Sequence[StepSpec] = STEPS) -> dict[str, Step]:
    """Every step of `specs`, in their order (the daemon runs them so)."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise UnknownStepError(f"steps named twice in {names}")
    return {s.name: s.build() for s in specs}
