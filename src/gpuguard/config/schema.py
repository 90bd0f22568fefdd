"""The configuration's schema: one frozen dataclass per section, each key's name, value
type, default and doc in its field metadata; `KEYS` and the per-section table derive
from it (the parser, `gpuguard config`, the man page and the shipped file read them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Dict, List, Mapping, Tuple

from gpuguard.config.keyspec import DEFAULT_ORIGIN as DEFAULT_ORIGIN
from gpuguard.config.keyspec import SEE_ALSO as SEE_ALSO
from gpuguard.config.keyspec import KeySpec as KeySpec
from gpuguard.config.keyspec import _key, _KeyMeta
from gpuguard.config.types import (
    AbsPath,
    Bool,
    Choice,
    CriEndpoint,
    Int,
    ResourcePattern,
    ServiceUnit,
    SpaceList,
    TimeSpan,
)


@dataclass(frozen=True)
class DaemonConfig:
    SECTION: ClassVar[str] = "Daemon"

    audit_interval: float = _key(
        "AuditInterval",
        TimeSpan(1.0),
        "5min",
        "Run a full audit pass this often even when no event arrived, "
        "to catch changes that no signal reports.",
    )
    quiet_period: float = _key(
        "QuietPeriod",
        TimeSpan(0.0),
        "150ms",
        "Wait this long after the last event before a pass, so a burst of events causes one pass.",
    )
    max_delay: float = _key(
        "MaxDelay",
        TimeSpan(0.0),
        "2s",
        "Run a pass at most this long after the first event of a burst, even if "
        "events keep arriving. Must not be shorter than QuietPeriod.",
    )
    reload_quiet_period: float = _key(
        "ReloadQuietPeriod",
        TimeSpan(0.0),
        "5ms",
        "The shorter quiet period used once systemd reports the end of a "
        "daemon-reload or daemon-reexec (its burst of signals is over, and running "
        "GPU containers may just have lost their devices), and after a uevent that "
        "adds or binds a GPU or an NVIDIA module (something became usable).",
    )
    private_socket: str | None = _key(
        "PrivateSocket",
        AbsPath(optional=True),
        "/run/systemd/private",
        "Read systemd's Reloading signal from its private socket (root only; the one "
        "systemctl uses), where the end of a daemon-reload arrives before systemctl "
        "returns, tens of ms before the bus delivers it; the bus stays in use for "
        "everything else, and for reloads while this connection is down. Empty: the "
        "bus only.",
    )
    mode: str = _key(
        "Mode",
        Choice("repair", "observe"),
        "repair",
        "repair: find and repair. observe: find, report, export metrics and node "
        "conditions and journal the plan, and change nothing anywhere: no checkpoint "
        "rewrite, no kubelet or device plugin restart, no cgroup write, device program, "
        "unit property or drop-in, in the daemon, kubelet's pre-start hook and `gpuguard "
        "check` alike: the canary stage of a rollout. Operator hooks still run, "
        "with GPUGUARD_DRY_RUN=1. A probe still runs where a cgroup v2 program cannot be "
        "read: a short-lived process joins the container's cgroup and opens the node, "
        "which changes no access.",
    )
    dry_run: bool = _key(
        "DryRun",
        Bool(),
        "no",
        "yes: the same as Mode=observe (kept for configurations that set it).",
    )
    hook_timeout: float = _key(
        "HookTimeout",
        TimeSpan(0.001),
        "10s",
        "Kill an operator hook in /etc/gpuguard/hooks.d, with its whole process "
        "group, when it runs longer than this.",
    )
    log_level: str = _key(
        "LogLevel",
        Choice("debug", "info", "warning", "error"),
        "info",
        "The least severe messages that are logged to the journal.",
    )

    @property
    def observe(self) -> bool:
        """Mode=observe (or DryRun=yes): find and report, change nothing."""
        return self.mode == "observe" or self.dry_run


@dataclass(frozen=True)
class KubeletConfig:
    SECTION: ClassVar[str] = "Kubelet"

    unit: str | None = _key(
        "Unit",
        ServiceUnit(optional=True),
        "",
        "The kubelet's systemd unit, restarted (or stopped and started) around a "
        "checkpoint repair. Empty: the unit the running kubelet is in (its process's "
        "cgroup), else the first of [Systemd] KubeletUnits= that is loaded.",
    )
    checkpoint_path: str = _key(
        "CheckpointPath",
        AbsPath(),
        "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint",
        "The kubelet device manager's checkpoint that gpuguard checks and repairs.",
    )
    policy: str = _key(
        "Policy",
        Choice("rewrite", "delete", "report"),
        "rewrite",
        "What to do with stale GPU entries in the checkpoint: rewrite it without "
        "them, delete the whole file (kubelet rebuilds it), or only report them.",
    )
    resources: Tuple[str, ...] = _key(
        "Resources",
        SpaceList(ResourcePattern()),
        "nvidia.com/gpu nvidia.com/gpu.shared nvidia.com/mig-*",
        "Extended resources (glob patterns) whose checkpoint entries gpuguard "
        "manages; entries of other resources are never touched.",
    )
    backup_dir: str = _key(
        "BackupDir",
        AbsPath(),
        "/var/lib/gpuguard/backups",
        "Where a copy of the checkpoint is saved before each change.",
    )
    backup_keep: int = _key(
        "BackupKeep",
        Int(1, 10000),
        "20",
        "How many of the most recent checkpoint backups to keep; older ones are deleted.",
    )
    restart_kubelet: bool = _key(
        "RestartKubelet",
        Bool(),
        "yes",
        "Restart the kubelet around a checkpoint repair so it reloads the file; "
        "no: only a stopped kubelet's checkpoint is repaired.",
    )


@dataclass(frozen=True)
class SystemdConfig:
    SECTION: ClassVar[str] = "Systemd"

    runtime_units: Tuple[str, ...] = _key(
        "RuntimeUnits",
        SpaceList(ServiceUnit()),
        "containerd.service crio.service docker.service",
        "Container runtime units whose (re)starts trigger a pass; units that do "
        "not exist are ignored.",
    )
    kubelet_units: Tuple[str, ...] = _key(
        "KubeletUnits",
        SpaceList(ServiceUnit()),
        "kubelet.service k3s.service k3s-agent.service rke2-agent.service rke2-server.service",
        "The units that may run kubelet (kubeadm and most distributions: kubelet.service; "
        "k3s and RKE2 run it inside their own unit): their starts and stops trigger a "
        "pass, and [Kubelet] Unit= is chosen from them. Units that do not exist are "
        "ignored. The package installs kubelet's pre-start hook as a drop-in for each of "
        "these five; another unit needs one too (see gpuguard(8)).",
    )
    max_in_flight: int = _key(
        "MaxInFlight",
        Int(1, 4096),
        "64",
        "The most D-Bus calls gpuguard has in flight at once, e.g. while it reads "
        "unit properties during a scan.",
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


# Keys that moved to another section: still read where they were, with a warning.
MOVED_KEYS: Mapping[Tuple[str, str], str] = MappingProxyType(
    {("DevicePlugin", "Crictl"): "Runtime", ("DevicePlugin", "CriEndpoint"): "Runtime"}
)


@dataclass(frozen=True)
class InventoryConfig:
    SECTION: ClassVar[str] = "Inventory"

    file: str | None = _key(
        "File",
        AbsPath(optional=True),
        "",
        "A JSON GPU inventory to use instead of asking NVML (for simulations and "
        "tests); empty: ask NVML.",
    )
    allow_kubelet_restart: bool = _key(
        "AllowKubeletRestart",
        Bool(),
        "no",
        "With File= set (a simulation), still restart or stop a running kubelet for a "
        "checkpoint repair. no: the daemon reports the plan and leaves a running kubelet "
        "alone, as `gpuguard check --inventory` does without --allow-kubelet-restart.",
    )


@dataclass(frozen=True)
class MetricsConfig:
    SECTION: ClassVar[str] = "Metrics"

    textfile_directory: str | None = _key(
        "TextfileDirectory",
        AbsPath(optional=True),
        "",
        "Write gpuguard.prom (Prometheus metrics) here after every pass, atomically, for "
        "node_exporter's textfile collector (its default directory is "
        "/var/lib/prometheus/node-exporter, which gpuguard.service may write); empty: off. "
        "The daemon then renders the file itself, with python3-prometheus-client, which "
        "costs it about 6.5 MB of resident memory.",
    )


def _empty_origins() -> Mapping[Tuple[str, str], str]:
    return MappingProxyType({})


@dataclass(frozen=True)
class Config:
    """The effective configuration. `Config()` is all defaults.

    `origins` maps (section, key) to "file:line" for keys set in a file; it is left out
    of comparisons so a config equals its rendered-and-reloaded self.
    """

    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    kubelet: KubeletConfig = field(default_factory=KubeletConfig)
    systemd: SystemdConfig = field(default_factory=SystemdConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    device_plugin: DevicePluginConfig = field(default_factory=DevicePluginConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    inventory: InventoryConfig = field(default_factory=InventoryConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    origins: Mapping[Tuple[str, str], str] = field(
        default_factory=_empty_origins, compare=False, repr=False
    )
    # "file:line: what to change" for each deprecated assignment read (MOVED_KEYS).
    warnings: Tuple[str, ...] = field(default=(), compare=False, repr=False)

    def origin(self, section: str, key: str) -> str:
        """Where a key's value came from: "default" or "file:line"."""
        return self.origins.get((section, key), DEFAULT_ORIGIN)

    def value(self, section: str, key: str) -> Any:
        spec = _BY_SECTION[section][key]
        return getattr(getattr(self, _SECTION_ATTR[section]), spec.attr)

    def render(self) -> str:
        """The effective configuration in gpuguard.conf syntax, each key's origin above it."""
        out = [
            "# gpuguard's effective configuration. The comment above each key says",
            "# where its value came from: the default, or the file and line that set it.",
        ]
        for section, specs in _BY_SECTION.items():
            out += ["", f"[{section}]"]
            for spec in specs.values():
                out.append(f"# {self.origin(section, spec.key)}")
                out.append(f"{spec.key}={spec.type.format(self.value(section, spec.key))}")
        return "\n".join(out) + "\n"


# Config's attribute and class for each section, in file order.
_SECTIONS: Dict[str, Tuple[str, type]] = {
    cls.SECTION: (attr, cls)
    for attr, cls in (
        ("daemon", DaemonConfig),
        ("kubelet", KubeletConfig),
        ("systemd", SystemdConfig),
        ("devices", DevicesConfig),
        ("device_plugin", DevicePluginConfig),
        ("runtime", RuntimeConfig),
        ("inventory", InventoryConfig),
        ("metrics", MetricsConfig),
    )
}
_SECTION_ATTR = {section: attr for section, (attr, _) in _SECTIONS.items()}


def _build_table() -> Tuple[KeySpec, ...]:
    specs: List[KeySpec] = []
    for section, (_, cls) in _SECTIONS.items():
        for f in dataclasses.fields(cls):
            meta: _KeyMeta = f.metadata["gpuguard"]
            spec = KeySpec(
                section, meta.key, f.name, meta.type, meta.default_text, f.default, meta.doc
            )
            specs.append(spec)
    return tuple(specs)


KEYS = _build_table()
_BY_SECTION: Dict[str, Dict[str, KeySpec]] = {}
for _spec in KEYS:
    _BY_SECTION.setdefault(_spec.section, {})[_spec.key] = _spec
del _spec


# ------------------------------------------------------------------------------ parsing
