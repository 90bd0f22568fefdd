"""What wakes a step: the events sources translate outside signals into.

A source never names a step: it emits an `Event` of one of these kinds, and the
registry (steps/registry.py) declares, for each step, the kinds that wake it. Adding a
kind is one line here, its source, and the steps that want it in the registry (a test
fails for a kind no step wakes on).

Imports nothing of the package: the sources, the registry, the daemon and the passes
all use it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EventKind(enum.Enum):
    """One kind of outside signal (the value is how the registry's table prints it)."""

    START_UP = "start-up"  # the daemon's first pass (urgent: before READY=1)
    CONFIG_RELOADED = "config-reloaded"  # SIGHUP: a new configuration
    AUDIT = "audit"  # AuditInterval= passed: what no event announces
    SYSTEMD_RELOADED = "systemd-reloaded"  # a daemon-reload/reexec ended: cgroups rewritten
    SYSTEMD_REEXECUTED = "systemd-reexecuted"  # a reexec seen outside a Reloading pair
    BOOT_FINISHED = "boot-finished"  # systemd's StartupFinished
    BUS_RECONNECTED = "bus-reconnected"  # the system bus is back: what was missed meanwhile
    KUBELET_STARTED = "kubelet-started"  # a kubelet unit became active
    RUNTIME_STARTED = "runtime-started"  # a container runtime's unit became active
    # gpuguard-readmit.service's process ended: the re-admission bridge's streams with it, and
    # kubelet 1.26+ may have dropped the plugin that replaced its endpoint
    READMIT_STOPPED = "readmit-stopped"
    SCOPE_STARTED = "scope-started"  # a container scope's job ended (its unit: Event.unit)
    SCOPE_DEVICES_SET = "scope-devices-set"  # a scope's DevicePolicy=/DeviceAllow= set at runtime
    NVIDIA_MODULE = "nvidia-module"  # an NVIDIA driver module loaded, unloaded or changed
    NVIDIA_PCI = "nvidia-pci"  # an NVIDIA PCI function added, removed, (un)bound, reset
    UDEV_EVENTS_LOST = "udev-events-lost"  # the uevent socket overflowed
    DEVICE_LINKS_CREATED = "device-links-created"  # a step made /dev/char links
    # NVML became available or its GPU set changed (engine/inventory_reader.py): the
    # driver arrived, late on a GPU Operator node, or GPUs came back with new UUIDs
    INVENTORY_CHANGED = "inventory-changed"
    # WatchInterval= passed: the known GPU containers' device cgroups are due a look for
    # a rewrite nothing announces (steps/container_access/devwatch.py); never a pass
    DEVICE_WATCH = "device-watch"


@dataclass(frozen=True)
class Event:
    """One occurrence: its kind, why (journaled with the pass), and whether losses are
    likely (an urgent event shortens the quiet period: coalescer.py). `at` (monotonic)
    is when a reload's end arrived, `unit` the scope a SCOPE_STARTED names."""

    kind: EventKind
    why: str
    urgent: bool = False
    at: float = 0.0
    unit: str = ""
