"""Daemon steps: observe (in a worker thread), reconcile (pure), actuate, log.

Each step is an object built in main() and called once per pass whose work names it;
state that must outlive a pass (caches, rate limits) lives in the step object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuguard.passes import Step


def build_steps() -> dict[str, Step]:
    """Every step of the daemon, in passes.STEP_ORDER (imported here, not at the top:
    `gpuguard check` imports this package and must not pay for the plugin code)."""
    from gpuguard.check import CheckpointStep
    from gpuguard.passes import STEP_ORDER
    from gpuguard.plugins.step import DevicePluginStep
    from gpuguard.steps.container_access import ContainerAccessStep
    from gpuguard.steps.device_nodes import DeviceNodesStep
    from gpuguard.steps.gpu_count import GpuCountStep

    steps: dict[str, Step] = {
        "container_access": ContainerAccessStep(),
        "device_nodes": DeviceNodesStep(),
        "checkpoint": CheckpointStep(),
        "device_plugin": DevicePluginStep(),
        "gpu_count": GpuCountStep(),
    }
    return {name: steps[name] for name in STEP_ORDER}
