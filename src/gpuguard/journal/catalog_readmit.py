"""Catalog entries of the re-admission bridge (readmit/, gpuguard-readmit.service), as
(subject, text); catalog.KINDS holds them with the rest."""

from __future__ import annotations

_WHY = (
    "kubelet 1.26 and later re-admit their pods at start-up before any device plugin "
    "has reported a healthy device, and reject for good every GPU pod whose container "
    "is not running (UnexpectedAdmissionError, 'no healthy devices present'): after a "
    "reboot, every GPU pod. The bridge reports healthy, for that moment only, the "
    "devices the checkpoint's pods hold and the node has; the real plugin serves every "
    "new pod once it registers. gpuguard(8) explains it (readmit)."
)

READMIT_KINDS: dict[str, tuple[str, str]] = {
    "readmit-offered": (
        "gpuguard reported the GPUs of the checkpoint's pods healthy for their re-admission",
        "kubelet started with GPU pods whose containers are not running; gpuguard's "
        "re-admission bridge registered the GPU resource and reported healthy exactly the "
        "devices those pods hold that are on this node, so kubelet re-admits the pods on "
        "their own GPUs without an allocation. The devices were judged on @EVIDENCE@ "
        "(NVML; or, before the driver loads, the PCI bus and gpuguard's GPU history: a "
        "GPU whose slot still holds an NVIDIA GPU). Waiting pods with a device not offered, "
        "and why: @REFUSED@ (a MIG device recreated with a new UUID, an empty "
        "slot). " + _WHY,
    ),
    "readmit-skip": (
        "gpuguard's re-admission bridge offered nothing at this kubelet start",
        "The message says why: no pod of kubelet's checkpoint holds a GPU, every GPU "
        "pod is running (a kubelet restart: kubelet keeps running containers), a device "
        "plugin was serving already, none of the held devices is on the node, or gpuguard "
        "is off. Where the checkpoint was judged, the entry's fields say on what evidence "
        "and which waiting pods were not offered, and why (a MIG device recreated with a new UUID, "
        "a slot that is empty or holds another device). " + _WHY,
    ),
    "readmit-observe": (
        "gpuguard (observe-only) would report the checkpoint's GPUs healthy",
        "Mode=observe: the re-admission bridge journals what it would report and "
        "registers nothing; after a reboot kubelet 1.26+ may then reject the GPU pods. " + _WHY,
    ),
    "readmit-failed": (
        "gpuguard's re-admission bridge could not register with kubelet",
        "The registration call on kubelet.sock failed (the message has gRPC's status "
        "code and kubelet's details); "
        "kubelet may reject GPU pods that were running before it started. " + _WHY,
    ),
    "readmit-off": (
        "gpuguard's re-admission bridge is off on this node",
        "The kubelet of this node does not need it (before 1.26 kubelet reuses a "
        "checkpointed allocation without a plugin), its version could not be told, "
        "python3-grpcio is not installed, the unit's environment turns it off, or "
        "gpuguard is off. The message says which; gpuguard(8) (readmit) says how to turn "
        "it on whatever the version (a drop-in of gpuguard-readmit.service). Where kubelet "
        "is 1.26+ or its version is unknown it is a warning with the fix: GPU pods are "
        "exposed at kubelet's next start (the daemon's finding readmit-bridge-off).",
    ),
    "readmit-bridge-off": (
        "gpuguard's re-admission bridge is off where kubelet needs it",
        "gpuguard-readmit.service stays off (@CAUSE@: @DETAIL@) on a node whose kubelet "
        "is 1.26 or later, or whose version could not be told: at kubelet's next start "
        "(after a reboot, every GPU pod) kubelet rejects each GPU pod whose container is "
        "not running. A finding of the daemon's readmit step, from the bridge's state "
        "file: the NPD condition GPUPodsRejected, gpuguard status, gpuguard_open_findings. "
        "Fix: @FIX@. " + _WHY,
    ),
    "readmit-streams-ended": (
        "gpuguard's re-admission bridge ended while kubelet runs",
        "The bridge's process stopped (a stop or restart of gpuguard-readmit.service: "
        "@HOW@ is stop) or an earlier one ended (killed, crashed, OOM: gone) after it "
        "registered @RESOURCES@ in this kubelet run. kubelet keeps the "
        "stream of the bridge's endpoint after the real plugin replaced it; when that "
        "stream ends, kubelet disconnects the real plugin and marks every device "
        "unhealthy: new GPU pods are rejected until the plugin registers again. "
        "gpuguard's daemon restarts the plugin at once (plugin-not-allocatable, then "
        "plugin-restarted), within MaxRestartsPerHour=. Avoid stopping the bridge while "
        "kubelet runs: its new version loads at the next boot. " + _WHY,
    ),
    "readmit-config-error": (
        "gpuguard's re-admission bridge cannot read its configuration again",
        "The bridge reads gpuguard's configuration again every minute and at each "
        "kubelet start; it could not (the message names the file and the error), so it "
        "keeps the last configuration it read and goes on: it never exits while kubelet "
        "holds its streams. Said once per distinct error and in its state file. Fix the "
        "file (`gpuguard config --check`); readmit-config-ok follows.",
    ),
    "readmit-config-ok": (
        "gpuguard's re-admission bridge reads its configuration again",
        "After readmit-config-error the configuration reads again and is in use.",
    ),
    "readmit-raced": (
        "a device plugin registered at the same moment as gpuguard's re-admission bridge",
        "kubelet handles the registration that comes last as the resource's endpoint. "
        "The bridge registers only while no device plugin socket exists, but a plugin "
        "already waiting for kubelet (a host service started with it) may register "
        "within the same milliseconds. If the plugin's registration came first, kubelet "
        "now asks the bridge, which allocates nothing, for new pods' devices, and sees "
        "only the held devices as healthy: new GPU pods fail admission until the plugin "
        "registers again. Restart the plugin (its pod, or its unit). Pods that ran "
        "before are not affected. " + _WHY,
    ),
    "readmit-rejected": (
        "kubelet rejected a GPU pod at its start",
        "kubelet's device manager refused to admit the pod the message names "
        "(UnexpectedAdmissionError: no healthy devices present, previously allocated "
        "devices no longer healthy, or none available). A static or bare pod stays "
        "Failed for good; a controller's pod is replaced on any free GPU. gpuguard's "
        "re-admission bridge reads kubelet's own records (its journal entries, or "
        "[Kubelet] LogFile=) for two minutes after each kubelet start and names once "
        "each pod the checkpoint held GPUs for at that start, and each pod rejected "
        "within 5 s of it (bound to the node while it was down): with gpuguard off or "
        "observing, a GPU gone for good, or a bridge that could not register, these are "
        'the pods lost. The message says "at its start" only for a rejection within '
        "5 s of kubelet's start, else how long after it, and what became of the pod "
        "as the API server's pods of this node tell it then (@FATE@: lost for a bare or "
        "static pod, waiting while its controller @OWNER@ has not replaced it, replaced "
        "with @REPLACEMENT@); readmit-pod-fate follows when that changes. " + _WHY,
    ),
    "readmit-pod-fate": (
        "what became of a GPU pod kubelet rejected",
        "After readmit-rejected, gpuguard's re-admission bridge reads the API server's "
        "pods of this node (with kubelet's kubeconfig) every 5 s for up to 10 minutes "
        "and says each new fate of the rejected pod once: replaced (a pod with the same "
        "controller ownerReference on this node, created after the rejection, the "
        "newest Running one: here @REPLACEMENT@ @REPLACEMENT_UID@), lost (a bare or static "
        "pod, or no replacement on this node within 10 minutes: a warning), running "
        "(it runs again) or deleted. The daemon's gpu-pod-rejected finding clears when "
        "the pod runs again, is deleted, or is replaced and its replacement runs.",
    ),
    "readmit-unread": (
        "gpuguard's re-admission bridge cannot read kubelet's rejections at this start",
        "The bridge reads the rejections only from kubelet's own records: the kubelet "
        "unit's journal entries of its main process from that process's start "
        "(journald's _SYSTEMD_UNIT, _PID and _BOOT_ID), or [Kubelet] LogFile= where "
        "kubelet logs to a file (RKE2), and names only pods the checkpoint held GPUs for "
        "at kubelet's start. The message says what kept it from reading: the journal or "
        "the file unreadable (or not root's file that only root may write), journalctl "
        "failing, no kubelet process in the unit (is [Systemd] KubeletUnits= right?), "
        "kubelet's checkpoint unreadable. The state file keeps it (problem) and the "
        "daemon's readmit verdict is unknown for this kubelet run: GPU pods kubelet "
        "rejected may not be named. " + _WHY,
    ),
    "readmit-log-reader": (
        "gpuguard's re-admission bridge reads kubelet's journal through journalctl",
        "python3-systemd is not installed, so the bridge runs journalctl -o json, matched "
        "on the same trusted fields, instead of reading the journal in-process. It works "
        "the same; install python3-systemd (a dependency of the package) to spare the "
        "process. Said once per bridge process. " + _WHY,
    ),
    "gpu-pod-rejected": (
        "a GPU pod kubelet rejected at its start has not run since",
        "kubelet's device manager refused pod @POD@ (@POD_UID@) at its start (@REASON@: "
        "@KUBELET_MESSAGE@) and the pod has not run since: a finding of the daemon's "
        "readmit step, from what the re-admission bridge read in kubelet's journal. It is the "
        "NPD condition GPUPodsRejected and gpuguard_readmit_rejected_pods, and clears "
        "(condition-cleared) when a container of the pod runs again or the pod is "
        "deleted (its pod directory gone). A static or bare pod stays Failed: delete "
        "it, or restart kubelet once its GPU is back. " + _WHY,
    ),
    "readmit-stream": (
        "kubelet asked gpuguard's re-admission bridge for its devices",
        "kubelet opened the bridge's ListAndWatch stream after its registration; the "
        "bridge answered once and keeps the stream open for kubelet's whole run. " + _WHY,
    ),
    "readmit-api-unread": (
        "gpuguard's re-admission bridge could not read this node's pods from the API server",
        "The bridge reads the pods the API server has bound to this node ([Kubelet] "
        "Kubeconfig=, kubelet's credentials) so that it never offers the GPU of a pod "
        "deleted while the node was down. It could not (@PROBLEM@: the server not "
        "reachable at boot, the credentials refused, the kubeconfig unreadable), so it "
        "offered every checkpointed GPU pod's devices, as for a kubelet without an API "
        "server: withholding them would make kubelet reject every static and bare GPU "
        "pod for good. A deleted pod's GPU may then be free to kubelet until the bridge "
        "withdraws its devices (readmit-withdrawn, 30 s after kubelet's start at most); "
        "a new pod placed on it meanwhile fails admission. " + _WHY,
    ),
    "readmit-withdrawn": (
        "gpuguard's re-admission bridge reported its devices unhealthy",
        "Once the pods it offered for were re-admitted (kubelet's podresources List "
        "shows their devices), or 30 s after kubelet's start, the bridge sent its one "
        "last ListAndWatch answer: the @RESOURCE@ devices it had reported healthy "
        "(@DEVICES@), now unhealthy, so that the Node's allocatable counts no device the "
        "bridge cannot allocate (it allocates none) and the scheduler places no new pod "
        "on it. kubelet keeps the re-admitted pods running; allocatable is 0 until the "
        "device plugin registers and reports the node's GPUs. Pods not re-admitted by "
        "then (@PENDING@) are rejected as without the bridge. It is sent only while no "
        "device plugin socket exists: after a plugin registered, kubelet would apply it "
        "to the plugin's devices. " + _WHY,
    ),
    "readmit-handed-over": (
        "a device plugin took over from gpuguard's re-admission bridge",
        "A device plugin's socket (@PLUGINS@) appeared in kubelet's device-plugins "
        "directory: the plugin has registered or is about to, and serves @RESOURCES@ and "
        "every new pod from now on. The bridge sends nothing more on its stream in this "
        "kubelet run (kubelet would apply it to the plugin's devices) and keeps the "
        "stream open. " + _WHY,
    ),
    "readmit-allocate": (
        "kubelet asked gpuguard's re-admission bridge to allocate a device",
        "A new pod needed @RESOURCE@ while the bridge was the registered endpoint and "
        "kubelet chose devices (@DEVICES@) the bridge had reported healthy; the bridge "
        "allocates no device and answered FAILED_PRECONDITION, so kubelet failed the "
        "pod's admission (a controller makes another). This should not happen: the "
        "bridge reports only devices held by pods it expects back and withdraws them once "
        "those are re-admitted. The pod the device was held for may be gone (deleted "
        "while the API server could not be read: readmit-api-unread). " + _WHY,
    ),
}
