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
        "their own GPUs without an allocation. " + _WHY,
    ),
    "readmit-skip": (
        "gpuguard's re-admission bridge offered nothing at this kubelet start",
        "The message says why: no pod of kubelet's checkpoint holds a GPU, every GPU "
        "pod is running (a kubelet restart: kubelet keeps running containers), a device "
        "plugin was serving already, or gpuguard is off. " + _WHY,
    ),
    "readmit-observe": (
        "gpuguard (observe-only) would report the checkpoint's GPUs healthy",
        "Mode=observe: the re-admission bridge journals what it would report and "
        "registers nothing; after a reboot kubelet 1.26+ may then reject the GPU pods. " + _WHY,
    ),
    "readmit-failed": (
        "gpuguard's re-admission bridge could not register with kubelet",
        "The registration call on kubelet.sock failed (the message has gRPC's error); "
        "kubelet may reject GPU pods that were running before it started. " + _WHY,
    ),
    "readmit-off": (
        "gpuguard's re-admission bridge is off on this node",
        "The kubelet of this node does not need it (before 1.26 kubelet reuses a "
        "checkpointed allocation without a plugin), its version could not be told, "
        "python3-grpcio is not installed, the unit's environment turns it off, or "
        "gpuguard is off. The message says which; gpuguard(8) (readmit) says how to turn "
        "it on whatever the version (a drop-in of gpuguard-readmit.service).",
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
        "re-admission bridge reads kubelet's journal for two minutes after each kubelet "
        "start and names each such pod once: with gpuguard off or observing, a GPU gone "
        "for good, or a bridge that could not register, these are the pods lost. " + _WHY,
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
}
