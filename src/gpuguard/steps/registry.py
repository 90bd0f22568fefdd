"""Every step by name, the order of a pass and of `gpuguard check`, each reason once.

Sources mark steps by these names, the daemon runs them in STEP_ORDER, `gpuguard check`
in CHECK_ORDER. Adding a step is its package under steps/ and one line in STEPS.

Cheap to import (no step code is loaded until build_steps()): the udev and systemd
sources and `gpuguard check` import it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    from gpuguard.engine.passes import Step

CONTAINER_ACCESS = "container_access"
DEVICE_NODES = "device_nodes"
CHECKPOINT = "checkpoint"
DEVICE_PLUGIN = "device_plugin"
GPU_COUNT = "gpu_count"


@dataclass(frozen=True)
class StepSpec:
    """One step: its name, where its class lives ("module:Class", imported only when
    the daemon builds its steps) and why it sits where it does in the pass."""

    name: str
    load: str
    why: str

    def build(self) -> Step:
        module, _, attr = self.load.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        step: Step = factory()
        return step


# The order of the steps in every pass, the daemon's and `gpuguard check`'s alike.
STEPS: tuple[StepSpec, ...] = (
    StepSpec(CONTAINER_ACCESS, "gpuguard.steps.container_access:ContainerAccessStep",
             "first: after a daemon-reload every millisecond counts"),
    StepSpec(DEVICE_NODES, "gpuguard.steps.device_nodes:DeviceNodesStep",
             "a new /dev/char link asks for an immediate second container access run, "
             "so durable grants follow at once"),
    StepSpec(CHECKPOINT, "gpuguard.steps.checkpoint:CheckpointStep",
             "may restart kubelet, so after the urgent device repairs"),
    StepSpec(DEVICE_PLUGIN, "gpuguard.steps.device_plugin:DevicePluginStep",
             "judges the plugins once nodes and the checkpoint are repaired"),
    StepSpec(GPU_COUNT, "gpuguard.steps.gpu_count:GpuCountStep",
             "last, report only: it judges what the plugins' repairs left"),
)  # fmt: skip
STEP_ORDER: tuple[str, ...] = tuple(s.name for s in STEPS)
ALL_STEPS: frozenset[str] = frozenset(STEP_ORDER)

# `gpuguard check` runs the steps that repair a node in one go, in STEP_ORDER: the
# device steps, then the checkpoint. The device plugin step is the daemon's only (its
# restarts need a cool-down and a budget that outlive one run); the GPU count is in
# `gpuguard doctor`.
CHECK_ORDER: tuple[str, ...] = (CONTAINER_ACCESS, DEVICE_NODES, CHECKPOINT)


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
