"""The configuration sections about devices: [Devices], [DevicePlugin], [Runtime]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from gpuguard.config.keyspec import DEFAULT_ORIGIN as DEFAULT_ORIGIN
from gpuguard.config.keyspec import SEE_ALSO as SEE_ALSO
from gpuguard.config.keyspec import KeySpec as KeySpec
from gpuguard.config.keyspec import _key
from gpuguard.config.types import (
    AbsPath,
    Bool,
    Choice,
    CriEndpoint,
    Int,
    TimeSpan,
)


@dataclass(frozen=True)
class DevicesConfig:
    SECTION: ClassVar[str] = "Devices"

    create_nodes: bool = _key(
        "CreateNodes",
        Bool(),
        "yes",
        "Create missing /dev/nvidia* device nodes with the driver's major and minor numbers.",
    )
    create_char_links: bool = _key(
        "CreateCharLinks",
        Bool(),
        "yes",
        "Create missing /dev/char/MAJOR:MINOR links to NVIDIA device nodes, through "
        "which systemd resolves device access rules.",
    )
    nvidia_modprobe: str = _key(
        "NvidiaModprobe",
        AbsPath(),
        "/usr/bin/nvidia-modprobe",
        "The driver's helper that loads modules and creates the nodes it owns "
        "(nvidia-uvm, nvidia-caps); skipped when it is not installed.",
    )
    regrant: bool = _key(
        "Regrant",
        Bool(),
        "yes",
        "Grant device access again to running GPU containers that lost it, "
        "e.g. to a systemd daemon-reload.",
    )
    durable_grants: bool = _key(
        "DurableGrants",
        Bool(),
        "yes",
        "Make a GPU container's grant durable on its systemd scope (DeviceAllow=, "
        "written first as the scope's drop-in) so that the next daemon-reload does "
        "not revoke it again. no: on cgroup v1 gpuguard still writes a lost node back "
        "to devices.allow (until the next reload); on cgroup v2 a scope whose systemd "
        "program denies a node is only reported, since DeviceAllow= is the repair "
        "there (no bridge either); a runtime's own program in the scope is still "
        "repaired under V2Remedy=. A scope that admits every device (a privileged "
        "container's) never gets a DeviceAllow=, whatever this says.",
    )
    watch_interval: float = _key(
        "WatchInterval",
        TimeSpan(0.0),
        "200ms",
        "How often the daemon compares each GPU container's device cgroup with its last "
        "look, for a rewrite nothing announces (cgroup v1: a runtime's own write to "
        "devices.deny and devices.allow, e.g. runc's cgroupfs driver on an update); a "
        "container that lost a node it was given is repaired at once. Reads one small "
        "kernel file per GPU container each time; 0 turns the watch off (such a "
        "rewrite then waits for the next pass).",
    )
    v2_remedy: str = _key(
        "V2Remedy",
        Choice("report", "inplace", "restart-container"),
        "inplace",
        "On cgroup v2 without a systemd scope (cgroupfs driver, or runc's own device "
        "program): inplace: replace the container's device program with one admitting "
        "its previous rules plus exactly the lost nodes (verified by a probe, the old "
        "program kept on any failure); report: only report affected containers; "
        "restart-container: restart them so they get their devices back.",
    )


@dataclass(frozen=True)
class DevicePluginConfig:
    SECTION: ClassVar[str] = "DevicePlugin"

    restart: bool = _key(
        "Restart",
        Bool(),
        "yes",
        "Restart the NVIDIA device plugin when it needs it: its /dev lacks NVIDIA nodes "
        "the host has or holds them with stale numbers (F3), it did not register again "
        "after a kubelet restart (F4), or NVML fails in its context (NvmlProbe=yes). "
        "no: only report these.",
    )
    cool_down: float = _key(
        "CoolDown",
        TimeSpan(0.0),
        "5min",
        "The least time between two restarts of the device plugin, counted from "
        "when it last started. A restart declined for it is made when it ends "
        "(MaxRestartsPerHour still applies).",
    )
    max_restarts_per_hour: int = _key(
        "MaxRestartsPerHour",
        Int(0, 3600),
        "3",
        "Stop restarting the device plugin after this many restarts within an hour "
        "(0: never restart it).",
    )
    registration_grace: float = _key(
        "RegistrationGrace",
        TimeSpan(0.0),
        "2min",
        "How long a freshly started kubelet or device plugin may take to register "
        "before gpuguard acts.",
    )
    nvml_probe: bool = _key(
        "NvmlProbe",
        Bool(),
        "no",
        "Also check that NVML works inside the device plugin's container, which "
        "costs a process per pass.",
    )
    socket_dir: str = _key(
        "SocketDir",
        AbsPath(),
        "/var/lib/kubelet/device-plugins",
        "The directory of kubelet.sock and the device plugins' sockets.",
    )


@dataclass(frozen=True)
class RuntimeConfig:
    """The container runtime, used by two steps: the device plugin's restarts and the
    container access step's V2Remedy=restart-container."""

    SECTION: ClassVar[str] = "Runtime"

    crictl: str = _key(
        "Crictl",
        AbsPath(),
        "/usr/bin/crictl",
        "The crictl binary used to stop a container so that kubelet recreates it (the "
        "device plugin's, or a GPU container's with V2Remedy=restart-container).",
    )
    cri_endpoint: str = _key(
        "CriEndpoint",
        CriEndpoint(),
        "unix:///run/containerd/containerd.sock",
        "The container runtime's CRI endpoint, passed to crictl.",
    )
