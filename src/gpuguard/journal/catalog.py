"""Every kind of journal entry gpuguard writes, with its fixed MESSAGE_ID and catalog text.

MESSAGE_IDs are derived from the kind name with uuid5 under gpuguard's namespace, so
they never change while the name stays. docs/gpuguard.catalog is generated from this
table (`gpuguard catalog > docs/gpuguard.catalog`; a test keeps it in sync) and is
installed to /usr/lib/systemd/catalog/ so `journalctl -x` explains each entry.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from gpuguard.journal.catalog_checkpoint import CHECKPOINT_KINDS
from gpuguard.journal.catalog_ops import OPS_KINDS
from gpuguard.journal.catalog_readmit import READMIT_KINDS

NAMESPACE = bytes.fromhex("5b0f3c2e8d7a4c1e9f556a1d2b3c4e5f")


def message_id(kind: str) -> str:
    """`uuid.uuid5(NAMESPACE, kind).hex` (RFC 4122 §4.3: SHA-1, version 5, variant 10),
    computed here: `uuid` and the `platform` module it loads are 0.2 MB of the daemon."""
    digest = bytearray(hashlib.sha1(NAMESPACE + kind.encode()).digest()[:16])
    digest[6] = (digest[6] & 0x0F) | 0x50
    digest[8] = (digest[8] & 0x3F) | 0x80
    return digest.hex()


@dataclass(frozen=True)
class KindDoc:
    subject: str
    text: str


KINDS: dict[str, KindDoc] = {
    # generic levels, for entries that are not findings or actions
    "debug": KindDoc("gpuguard debug message", "Diagnostic detail."),
    "info": KindDoc("gpuguard message", "Informational."),
    "warning": KindDoc("gpuguard warning", "Something unexpected that gpuguard worked around."),
    "error": KindDoc(
        "gpuguard error", "An error gpuguard could not work around; see the message above."
    ),
    # checkpoint (F1): catalog_checkpoint.py
    **{k: KindDoc(*v) for k, v in CHECKPOINT_KINDS.items()},
    # operating gpuguard itself (the off switch, observe-only): catalog_ops.py
    **{k: KindDoc(*v) for k, v in OPS_KINDS.items()},
    # the re-admission bridge (kubelet 1.26+ after a reboot): catalog_readmit.py
    **{k: KindDoc(*v) for k, v in READMIT_KINDS.items()},
    # device nodes and /dev/char links (F2, F3)
    "device-node-created": KindDoc(
        "gpuguard created an NVIDIA device node",
        "The driver registered the device (/proc/devices) but its node was missing, for example "
        "/dev/nvidia-uvm, which the driver creates lazily. Without it a device plugin that starts "
        "now would hand containers a set of devices without it (F3).",
    ),
    "device-node-missing": KindDoc(
        "An NVIDIA device node is missing",
        "The driver registered the device but its node does not exist, and CreateNodes=no.",
    ),
    "device-node-mismatch": KindDoc(
        "An NVIDIA device node has other numbers than the driver registered",
        "Left as it is: check what created it (a stale node from an older driver?).",
    ),
    "char-link-created": KindDoc(
        "gpuguard created a /dev/char link for an NVIDIA node",
        "runc writes a DeviceAllow= entry for a device, and systemd resolves one, only through "
        "/dev/char/MAJ:MIN, which udev does not create for NVIDIA nodes. Without it a "
        "daemon-reload wipes the GPU from containers (F2).",
    ),
    "char-link-missing": KindDoc(
        "A /dev/char link for an NVIDIA node is missing",
        "CreateCharLinks=no: grants of this node cannot be made durable.",
    ),
    # container device access (F2)
    "container-device-denied": KindDoc(
        "A GPU container's cgroup denies a device it was given",
        "Inside the container nvidia-smi says 'Failed to initialize NVML: Unknown Error' and CUDA "
        "returns error 30. Usual causes: systemctl daemon-reload/daemon-reexec re-applied the "
        "container's scope without the device (systemd cgroup driver), or the kubelet CPU "
        "manager's runc update rewrote the device cgroup. This time: @DEVICE@ (@DEVICE_NUMBERS@) "
        "is denied; likely cause: @CAUSE@. gpuguard re-grants exactly the nodes the container has "
        "in its own /dev. The container is on cgroup @CGROUP_LAYOUT@ and its devices are admitted "
        "by @DEVICE_MECHANISM@: v1-rule (its devices.list: re-granted at once, then on its scope), "
        "scope-device-allow (v2: the program systemd builds from its scope's DeviceAllow=, where "
        "gpuguard adds the node), own-program (v2 without a scope: the runtime's own BPF program, "
        "which gpuguard replaces with its rules plus the lost nodes, see v2-program-replace, or "
        "with V2Remedy=report only reports, see v2-report-only).",
    ),
    "container-device-missing": KindDoc(
        "A GPU container has no @DEVICE@ in its /dev",
        "The host has @DEVICE@ but the container's /dev does not: @CAUSE@. Typically "
        "/dev/nvidia-uvm: the device plugin started before the node existed and gave the container "
        "its GPUs without it (F3). A cgroup grant cannot add a node to a container's /dev: once "
        "the device plugin sees the node (gpuguard restarts it), recreate the container (delete "
        "its pod). Device plugins' own containers are not reported here: see "
        "plugin-missing-device. Reported when it appears and when it clears (condition-cleared), "
        "not on every pass.",
    ),
    "container-device-stale": KindDoc(
        "A GPU container's @DEVICE@ has stale device numbers",
        "The container's @DEVICE@ is @CONTAINER_DEVICE_NUMBERS@, the host's is now "
        "@DEVICE_NUMBERS@: @CAUSE@ (the nvidia-uvm major is assigned when the module loads). The "
        "node is present but leads nowhere, so CUDA fails in the container. gpuguard never grants "
        "it the new numbers; recreate the container (delete its pod). Reported when it appears and "
        "when it clears, not on every pass.",
    ),
    "container-device-conflict": KindDoc(
        "A container holds a GPU its records do not give it",
        "The node is in the container's /dev but neither NVIDIA_VISIBLE_DEVICES nor the kubelet "
        "checkpoint names that GPU. gpuguard never grants it.",
    ),
    "container-unreadable": KindDoc(
        "A container's cgroup or process files cannot be read",
        "Its cgroup.procs, devices.list, environ or command line is not what the kernel writes (a "
        "malformed line, a FIFO or link where a file should be, too big). gpuguard neither judges "
        "nor grants this container anything; every other container is still audited and repaired. "
        "The message above names the file: check what wrote it, or recreate the container.",
    ),
    "gpu-process-unattributed": KindDoc(
        "Processes with GPU nodes open in a kubepods cgroup gpuguard cannot place",
        "The cgroup @CGROUP@ is in the kubepods tree but is no container gpuguard knows (a "
        "runtime or cgroup layout whose names it does not recognise, or a process placed in a "
        "pod or QoS cgroup itself), and its processes (@PIDS@) hold @DEVICE@ open. gpuguard "
        "cannot tell what they were given, so it neither judges nor repairs their access, and "
        "the node is not reported healthy while they run. Find what made the cgroup "
        "(`systemd-cgls @CGROUP@`, the runtime's configuration) and report it with the path. "
        "Reported when it appears, changes and clears.",
    ),
    "container-program-unexpected": KindDoc(
        "A container's cgroup v2 has several device programs: no in-place repair",
        "The container (cgroup v2, no systemd scope) lost GPU nodes, but more than one device "
        "program is attached to its cgroup (@BPF_PROGRAMS@): gpuguard replaces only the single "
        "program runc or systemd attaches, since it cannot tell which of several denies, and "
        "replacing one could never be judged safe. Nothing was changed and nothing else was "
        "granted. Restart the container (V2Remedy=restart-container does it through the CRI), or "
        "find the tool that attached the other programs (`bpftool cgroup show @CGROUP@`). Reported "
        "when it appears and when it clears.",
    ),
    "container-repair-backoff": KindDoc(
        "gpuguard holds back a failed in-place repair of a container's device program",
        "Replacing the container's cgroup v2 device program failed @FAILURES@ time(s) with the "
        "same programs attached (@BPF_PROGRAMS@); the last reason is in the message (no "
        "CAP_SYS_ADMIN/CAP_BPF, BPF_PROG_QUERY refused, a frozen cgroup, a program of unknown "
        "shape). The old program stays, nothing else was granted. gpuguard tries again when the "
        "cgroup's programs change, or after a back-off that doubles from 1 min up to 1 h; restart "
        "the container to end it sooner. Reported when it appears, changes and clears.",
    ),
    "cgroup-v1-allow": KindDoc(
        "gpuguard re-granted GPU devices in a container's cgroup",
        "A direct write to the container's devices.allow restored the nodes it was given (the fast "
        "path, microseconds). A durable grant follows where systemd manages the container's scope.",
    ),
    "unit-device-allow": KindDoc(
        "gpuguard made a container's GPU grant durable",
        "A runtime DeviceAllow=/dev/char/MAJ:MIN on the container's systemd scope: later "
        "daemon-reloads and reexecs re-apply the grant instead of wiping it.",
    ),
    "unit-dropin-remove": KindDoc(
        "gpuguard removed the GPU drop-in of a container scope that is gone",
        "With each durable grant gpuguard writes the same DeviceAllow= lines as a drop-in of the "
        "scope (/run/systemd/system/SCOPE.d/60-gpuguard-devices.conf), so the grant survives a "
        "daemon-reload even before systemd has answered. systemd never removes that file; "
        "gpuguard does once the container's cgroup is gone.",
    ),
    "v2-report-only": KindDoc(
        "GPU access lost on cgroup v2 without a systemd scope",
        "The device policy is runc's BPF program, which gpuguard does not rewrite with "
        "V2Remedy=report. Recreate the container, or set V2Remedy=inplace (the default) or "
        "V2Remedy=restart-container.",
    ),
    "v2-program-replace": KindDoc(
        "gpuguard added lost GPU nodes to a container's cgroup v2 device program",
        "V2Remedy=inplace: the container's BPF device program was replaced by one admitting its "
        "previous rules plus exactly the entitled nodes it had lost (attached before the old one "
        "was detached, verified by a probe). On failure the old program stays and the entry says "
        "why.",
    ),
    "v2-bridge-attach": KindDoc(
        "gpuguard bridged a container's lost GPU nodes until systemd applies its grant",
        "cgroup v2, systemd scope: systemd's device program (sd_devices) denied nodes the "
        "container was given. gpuguard replaced it in place by a bridge (gpuguard_bridge: "
        "systemd's rules plus exactly those nodes, attached before systemd's was detached, "
        "verified): access is back within milliseconds. The scope's DeviceAllow= follows "
        "(unit-device-allow), then the bridge is detached (v2-bridge-detach). All attached "
        "programs must admit an open, so a bridge never grants more than the container had plus "
        "its entitlement. On failure nothing changed and DeviceAllow= alone repairs it.",
    ),
    "v2-bridge-detach": KindDoc(
        "gpuguard detached its bridge from a container's cgroup",
        "systemd's own program is attached again next to gpuguard's bridge (after the DeviceAllow= "
        "gpuguard set, or a reload for a bridge left from before), so the bridge was detached: "
        "systemd's program and the runtime's admit the devices, as before the loss. If systemd's "
        "program still denies a node, the entry says so and the next pass reports and repairs it.",
    ),
    "restart-container": KindDoc(
        "gpuguard stopped a container to restore its GPU access",
        "V2Remedy=restart-container: kubelet recreates it with a fresh device policy.",
    ),
    # daemon (issue: event-driven daemon)
    "daemon-started": KindDoc("gpuguard daemon started", "The daemon finished its first pass."),
    "daemon-stopping": KindDoc("gpuguard daemon stopping", "SIGTERM received; finishing the pass."),
    "pass-backoff": KindDoc(
        "gpuguard holds back its next pass: its repairs changed nothing",
        "@PASSES@ pass(es) in a row changed something (or tried to) and then, brought at once "
        "by what the pass before did, found exactly what that pass found: their repairs did not "
        "take. A pass's own changes can wake "
        "the next one (a DeviceAllow= it sets is a scope change), so without this the daemon "
        "would repair the same thing in a loop. The next pass waits @WAIT_S@ s, twice as long "
        "after each such pass up to 5 min; a daemon-reload, a reexec or a reconnection still "
        "brings one at once, as does the audit. The findings of the passes before say what "
        "does not take; the streak ends with the first pass that finds something else.",
    ),
    "pass-complete": KindDoc(
        "gpuguard pass complete",
        "A coalesced reconciliation pass ran: @FINDINGS@ finding(s), @ACTIONS@ action(s). The "
        "entries before it say what was found and done; `gpuguard status` shows the last pass.",
    ),
    "reconciler-crashed": KindDoc(
        "gpuguard's @GPUGUARD_RECONCILER@ step raised an exception",
        "A bug or an unexpected host state. The other steps and the daemon went on. `journalctl -o "
        "verbose` shows the traceback in the entry's TRACEBACK field; please report it.",
    ),
    "metrics-failed": KindDoc(
        "gpuguard stopped updating its Prometheus metrics",
        "Updating or exporting the metrics raised an exception (a bug: the entry's TRACEBACK field "
        "has the details, please report it). The repairs go on; the metrics files keep their last "
        "content until the daemon restarts.",
    ),
    "config-reloaded": KindDoc(
        "Configuration reloaded", "SIGHUP: the new configuration is in use."
    ),
    "config-rejected": KindDoc(
        "New configuration rejected",
        "SIGHUP found an error in the configuration; the previous configuration stays in use. Fix "
        "the file and line the message names, check it with `gpuguard config`, and reload again. "
        "Every key: gpuguard.conf(5).",
    ),
    "config-invalid": KindDoc(
        "gpuguard cannot start: its configuration is invalid",
        "The daemon found an error in the file and line named in the message above and exited with "
        "status 2. gpuguard.service does not restart on this status (RestartPreventExitStatus=), "
        "so the unit stays failed until the file is fixed: check it with `gpuguard config`, then "
        "`systemctl restart gpuguard`.",
    ),
    "dbus-lost": KindDoc(
        "Lost the system bus",
        "The D-Bus connection to systemd dropped (dbus restart?). gpuguard reconnects with "
        "back-off and runs a full pass after reconnecting.",
    ),
    "dbus-connected": KindDoc("Connected to the system bus", "Subscribed to systemd's signals."),
    "inventory-unavailable": KindDoc(
        "No GPU inventory: @GPUGUARD_PROBLEM@",
        "gpuguard cannot learn the GPUs (no NVIDIA driver or libnvidia-ml, NVML not answering, or "
        "an unreadable --inventory/[Inventory] File=). Passes go on without GPU identities: the "
        "checkpoint is not judged, container access still is. Reported once when it starts and "
        "again only if the reason changes; inventory-available says when it is back.",
    ),
    "inventory-available": KindDoc(
        "GPU inventory available again",
        "gpuguard can read the GPUs again; before, @GPUGUARD_PROBLEM@.",
    ),
    "nvml-library": KindDoc(
        "NVML: @GPUGUARD_NVML_LIBRARY@",
        "The NVML library gpuguard loads to learn the GPUs, and where it was found: the host's "
        "loader path, the GPU Operator's driver root /run/nvidia/driver, or [Inventory] "
        "DriverRoot=. Journaled when the daemon first uses it and when it changes.",
    ),
    "condition-cleared": KindDoc(
        "A condition gpuguard reported no longer holds",
        "A @GPUGUARD_CLEARED_KIND@ condition reported earlier for @GPUGUARD_SUBJECT@ is gone "
        "(repaired, or the container or plugin went away). Such conditions are journaled when they "
        "appear, change and clear, not on every pass.",
    ),
    "hook-run": KindDoc("Operator hook ran", "An executable in /etc/gpuguard/hooks.d ran."),
    "hook-refused": KindDoc(
        "Operator hook refused",
        "Hooks must be regular executables owned by root and not writable by group or others. Fix "
        "the ownership or mode of the file the message names.",
    ),
    "hook-failed": KindDoc("Operator hook failed", "A hook exited non-zero or timed out."),
    # device plugin (F3, F4)
    "plugin-missing-device": KindDoc(
        "The GPU device plugin does not see an NVIDIA device node the host has",
        "The NVIDIA device plugin hands containers /dev/nvidiactl, /dev/nvidia-uvm, "
        "/dev/nvidia-uvm-tools and /dev/nvidia-modeset only if it finds them in its own /dev, "
        "which is fixed when it starts. It started before the node existed (uvm is created "
        "lazily), so the GPU containers it sets up lack the node and CUDA fails with 'unknown "
        "error'. A node can also be present with stale numbers (the module was reloaded after the "
        "plugin started). This time: @PLUGIN@ does not see @MISSING@. gpuguard restarts the "
        "plugin, within Restart=, CoolDown= and MaxRestartsPerHour= ([DevicePlugin] in "
        "gpuguard.conf(5)); plugin-restarted or plugin-restart-declined follows. Reported when it "
        "appears and when it clears, not on every pass.",
    ),
    "plugin-not-registered": KindDoc(
        "A GPU device plugin did not register again after kubelet started",
        "Kubelet removes the plugin sockets when it starts; a plugin must serve a new socket and "
        "register, or the node advertises no GPUs (allocatable nvidia.com/gpu is 0). "
        "RegistrationGrace passed without that. gpuguard restarts the plugin when its process is "
        "known; otherwise check the plugin's pod.",
    ),
    "plugin-not-serving": KindDoc(
        "A device plugin socket has no listening process",
        "The plugin exited and left its socket behind. Kubelet or the container runtime should "
        "start it again; if this persists, check the plugin pod's logs.",
    ),
    "plugin-nvml-failed": KindDoc(
        "NVML cannot initialise in a GPU device plugin's context",
        "With NvmlProbe=yes gpuguard loads libnvidia-ml.so.1 from the plugin's own filesystem, "
        "inside its device cgroup, and calls nvmlInit: it failed, or the library cannot be loaded "
        "there. This time: @NVML_ERROR@ (after an init failure the plugin logs 'Failed to "
        "initialize NVML: ' and the same). Typical causes: a device node the plugin's cgroup "
        "denies, a driver upgraded under a running plugin, libraries not injected into its "
        "container. gpuguard restarts the plugin, within Restart=, CoolDown= and "
        "MaxRestartsPerHour= (gpuguard.conf(5)).",
    ),
    "plugin-nvml-unchecked": KindDoc(
        "gpuguard could not check NVML in a GPU device plugin's context",
        "The NVML probe (NvmlProbe=yes) could not run at its @NVML_STAGE@ stage (one of cgroup, "
        "namespace, timeout, error), so there is no verdict on the plugin and nothing is done. "
        "namespace: entering the plugin's mount namespace needs CAP_SYS_ADMIN and CAP_SYS_CHROOT "
        "in gpuguard.service's CapabilityBoundingSet= and mnt allowed by its RestrictNamespaces=.",
    ),
    "plugin-not-allocatable": KindDoc(
        "kubelet dropped a registered GPU device plugin: 0 allocatable GPUs",
        "kubelet's podresources API reports no allocatable @RESOURCE@ although the node has "
        "@GPUS@ GPUs and the plugin serves a socket made after kubelet started. kubelet 1.26+ "
        "does this when a replaced endpoint's stream ends (gpuguard-readmit stopped while "
        "kubelet runs): it disconnects the current plugin and marks every device unhealthy until "
        "the plugin registers again. gpuguard restarts the plugin, within Restart=, CoolDown= "
        "and MaxRestartsPerHour= (gpuguard.conf(5)).",
    ),
    "plugin-allocatable-unchecked": KindDoc(
        "gpuguard cannot ask kubelet which GPUs it can allocate",
        "kubelet's podresources API (GetAllocatableResources, kubelet 1.21+) did not answer: "
        "@REASON@. A plugin kubelet dropped after it registered goes unseen; registration is "
        "judged by the plugin sockets' times only.",
    ),
    "gpu-count-mismatch": KindDoc(
        "The node has fewer (or more) GPUs at one layer than at the one below",
        "gpuguard counts NVIDIA GPUs on the PCI bus, GPUs NVML sees and devices kubelet registered "
        "(RegisteredDevices in its checkpoint). The layer that lost them here is @GPUGUARD_LAYER@ "
        "(counts: @GPU_COUNTS@). Layers: driver (a GPU fell off the bus or failed to initialise: "
        "check dmesg for Xid errors and nvidia-smi), device-plugin (it did not register them all, "
        "F4: restart the device plugin pod), kubelet (stale registrations of GPUs that are gone, "
        "F1). gpuguard reports it; the repair belongs to that layer.",
    ),
    "container-missing-uvm": KindDoc(
        "A GPU container has no /dev/nvidia-uvm",
        "It was set up by a device plugin that did not see /dev/nvidia-uvm. Granting access in its "
        "cgroup cannot add a node to its /dev: delete its pod so it is recreated (after the plugin "
        "was restarted).",
    ),
    "restart-plugin": KindDoc(
        "gpuguard plans to restart a GPU device plugin",
        "The action behind plugin-restarted and plugin-restart-declined entries; hooks and "
        "--dry-run show it with the plugin and the reason.",
    ),
    "plugin-restarted": KindDoc(
        "gpuguard restarted a GPU device plugin",
        "Through the container runtime (crictl stop / ctr task kill, so kubelet recreates the "
        "container), systemd (a host service) or, as a last resort, SIGTERM. This time: @PLUGIN@ "
        "through @METHOD@, because of @CAUSE@. A plugin-recovered or plugin-restart-failed entry "
        "follows.",
    ),
    "plugin-restart-declined": KindDoc(
        "gpuguard did not restart a GPU device plugin that needs it",
        "Why not, this time: @REASON@. One of: disabled (Restart=no or MaxRestartsPerHour=0), "
        "cool-down (it started less than CoolDown ago), budget (MaxRestartsPerHour reached), "
        "back-off (earlier attempts failed), pending (an earlier restart is being verified) or "
        "dry-run. Budgets persist in /var/lib/gpuguard/plugin-restarts.json.",
    ),
    "plugin-recovered": KindDoc(
        "A restarted GPU device plugin is back and healthy",
        "A new plugin process serves the socket and its /dev has every NVIDIA node the host has. "
        "Containers set up before still lack the nodes (see container-missing-uvm).",
    ),
    "plugin-restart-failed": KindDoc(
        "Restarting a GPU device plugin did not help",
        "The restart command failed, no new plugin came up in time, or the new plugin still lacks "
        "a node. gpuguard backs off exponentially and stops at MaxRestartsPerHour. Check the "
        "plugin pod (kubectl describe) and how its /dev is populated.",
    ),
}


def render_catalog() -> str:
    """The journal message catalog (see journalctl(1) --update-catalog)."""
    out = ["# gpuguard journal message catalog; generated by `gpuguard catalog`.", ""]
    for kind in sorted(KINDS):
        doc = KINDS[kind]
        out += [
            f"-- {message_id(kind)}",
            f"Subject: {doc.subject}",
            "Defined-By: gpuguard",
            "Support: man:gpuguard(8)",
            "",
            doc.text,
            "",
            f"gpuguard kind: {kind}",
            "",
        ]
    return "\n".join(out)
