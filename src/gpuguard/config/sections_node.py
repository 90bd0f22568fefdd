"""The configuration sections about the node's services: [Daemon], [Kubelet], [Systemd]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Tuple

from gpuguard.config.keyspec import DEFAULT_ORIGIN as DEFAULT_ORIGIN
from gpuguard.config.keyspec import SEE_ALSO as SEE_ALSO
from gpuguard.config.keyspec import KeySpec as KeySpec
from gpuguard.config.keyspec import _key
from gpuguard.config.types import (
    AbsPath,
    Bool,
    Choice,
    Int,
    NodeName,
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
        "conditions and journal the plan, and change nothing on the node: no checkpoint "
        "rewrite, no kubelet or device plugin restart, no cgroup write, device program, "
        "unit property or drop-in, in the daemon, kubelet's pre-start hook and `gpuguard "
        "check` alike: the canary stage of a rollout. gpuguard's own state is still "
        "written: the GPU identity history (/var/lib/gpuguard/gpu-identity.json), the "
        "hook's memo (/var/lib/gpuguard/kubelet-hook.memo.json) and result "
        "(/run/gpuguard/kubelet-hook.result), the status and metrics files in "
        "/run/gpuguard. Operator hooks still run, "
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
        "checkpoint repair. Empty: the unit a trusted running kubelet is in (one of "
        "[Systemd] KubeletUnits=, run by root from a root-owned kubelet, k3s or RKE2 "
        "executable: see gpuguard(8)), else the first of [Systemd] KubeletUnits= that is "
        "loaded.",
    )
    checkpoint_path: str = _key(
        "CheckpointPath",
        AbsPath(),
        "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint",
        "The kubelet device manager's checkpoint that gpuguard checks and repairs.",
    )
    log_file: str | None = _key(
        "LogFile",
        AbsPath(optional=True),
        "",
        "The file kubelet writes its log to, where it logs to a file rather than the "
        "journal (RKE2: /var/lib/rancher/rke2/agent/logs/kubelet.log; kubelet's "
        "--log-file): the re-admission bridge reads kubelet's rejections of GPU pods "
        "there, from its size at each kubelet start, only while it is root's and only "
        "root may write it. Empty: the journal of the kubelet unit, its main process's "
        "entries from that process's start.",
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
        "no: the same as RestartPolicy=never (kept for configurations that set it).",
    )
    restart_policy: str = _key(
        "RestartPolicy",
        Choice("for-pods", "for-pods-no-agent", "never"),
        "for-pods",
        "When the daemon restarts a running kubelet's unit so that its pre-start hook "
        "repairs the checkpoint. for-pods: only when a pod kubelet still has (its "
        "directory under /var/lib/kubelet/pods, or its cgroup) holds a remapped entry, "
        "so the restart brings it back (kubelet 1.20-1.26 replays the stale entry and "
        "its containers crash-loop; a GPU driver that came up after kubelet), never "
        "for what was stale when the daemon started (an install, an upgrade, its own "
        "restart): kubelet's next start repairs that. At "
        "most once per 10 minutes, journaled (kubelet-restart) with the pods it is for. "
        "Under k3s or RKE2 the unit is the whole agent (k3s-agent.service, "
        "rke2-agent.service ...), and the whole agent restarts. for-pods-no-agent: the "
        "same, but never a k3s or RKE2 unit. never: a running kubelet is never restarted "
        "or stopped, by the daemon or `gpuguard check`; kubelet's next start repairs "
        "the file.",
    )
    kubeconfig: str | None = _key(
        "Kubeconfig",
        AbsPath(optional=True),
        "/etc/kubernetes/kubelet.conf",
        "kubelet's kubeconfig, with which the re-admission bridge (gpuguard-readmit) "
        "reads, at a node's boot, the pods the API server has bound to this node "
        "(read only: one list every 5 s, 2 s at most each, only while a GPU pod of "
        "kubelet's checkpoint has no process): the GPU of a pod deleted while the node "
        "was down is then never offered. Its server, certificate authority (or "
        "insecure-skip-tls-verify), client certificate and key or token are those of "
        "its current context; it must be owned by root and written by no one else. A "
        "file "
        "that does not exist, or empty: a kubelet without an API server (standalone, "
        "static pods only). k3s and RKE2: "
        "/var/lib/rancher/k3s/agent/kubelet.kubeconfig, "
        "/var/lib/rancher/rke2/agent/kubelet.kubeconfig.",
    )
    node_name: str | None = _key(
        "NodeName",
        NodeName(),
        "",
        "This node's name in the API server, for the re-admission bridge's list of its "
        "pods. Empty: the user the API server says the kubeconfig's credentials are "
        "(system:node:NAME, API servers 1.28 and later), else the host name in "
        "lowercase, as kubelet without --hostname-override.",
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
