"""The journal catalog's entries for the kubelet checkpoint (F1): (subject, text) by kind.

Merged into catalog.KINDS, which gives each its MESSAGE_ID; kept apart only for size.
"""

from __future__ import annotations

_CHECKPOINT_WHY = (
    "The kubelet device-manager checkpoint "
    "(/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint) names devices "
    "by ID. After a reboot or an instance replacement GPUs can come back with new "
    "UUIDs; kubelet then fails re-admitted pods with UnexpectedAdmissionError."
)

CHECKPOINT_KINDS: dict[str, tuple[str, str]] = {
    "checkpoint-stale-registered": (
        "Checkpoint registers a device this host no longer has",
        _CHECKPOINT_WHY + " A stale RegisteredDevices ID is mostly harmless; gpuguard "
        "drops it when it repairs the file.",
    ),
    "checkpoint-stale-entry": (
        "Checkpoint allocates a device this host no longer has to a pod",
        _CHECKPOINT_WHY + " gpuguard drops this pod entry (only this one) while kubelet is "
        "stopped, so kubelet re-allocates the pod's devices at its next admission.",
    ),
    "checkpoint-unknown-id": (
        "Checkpoint holds a device ID gpuguard does not understand",
        "The ID is neither a GPU or MIG UUID, a legacy MIG-GPU id, a replica, nor an index. "
        "gpuguard leaves its resource untouched.",
    ),
    "checkpoint-corrupt": (
        "Kubelet checkpoint cannot be used",
        "The file is not valid JSON, has a bad checksum or bad base64. Kubelet will discard it and "
        "start with no device allocations. gpuguard does not modify it; restore a backup from "
        "/var/lib/gpuguard/backups or let kubelet rebuild it.",
    ),
    "checkpoint-refused": (
        "gpuguard declined to repair the checkpoint",
        "A safety rule stopped the repair (for example NVML reports no GPU at all, which more "
        "likely means a driver problem than GPUs that all changed), or the repair needs a "
        "kubelet restart that gpuguard does not make (a simulated inventory, [Kubelet] "
        "RestartPolicy=, a checkpoint that was stale when gpuguard started): kubelet's next "
        "start repairs it through its pre-start hook. Nothing was modified. Check "
        "`nvidia-smi` and the message above for the reason.",
    ),
    "checkpoint-repaired": (
        "Kubelet checkpoint repaired",
        "gpuguard rewrote the checkpoint without the stale IDs and pod entries, with a checksum "
        "kubelet accepts. The previous file is saved as @BACKUP@. The pod entries it dropped are "
        "recorded in /var/lib/gpuguard/checkpoint-dropped.json, so their pods' running containers "
        "keep being judged by what the entries said.",
    ),
    "checkpoint-entry-remap": (
        "Checkpoint allocates to a pod GPUs that came back under new IDs",
        _CHECKPOINT_WHY + " The GPU identity history (/var/lib/gpuguard/gpu-identity.json) "
        "pairs each old GPU one to one with the GPU now in its place (same UUID, else same PCI "
        "bus id, else same index when that is unambiguous). gpuguard rewrites this pod entry "
        "while kubelet is stopped: its device IDs (@OLD_DEVICE_IDS@ become @NEW_DEVICE_IDS@), "
        "their NUMA node and the saved allocation response, so the pod runs again on the GPU "
        "of the same slot.",
    ),
    "checkpoint-allocresp-ambiguous": (
        "A pod entry's saved device plugin answer is read differently by kubelet",
        "The checkpoint entry's AllocResp (the device plugin's ContainerAllocateResponse, which "
        "kubelet replays when it restarts the container) holds bytes that kubelet's decoder and "
        "the protobuf specification read differently: a field number past 2^29-1 (kubelet "
        "keeps its low 32 bits, so it can be an environment variable kubelet sees and other "
        "readers do not), a group, or a varint past 64 bits. No device plugin writes these; "
        "check the plugin that allocated it. gpuguard never rewrites such an entry.",
    ),
    "checkpoint-entry-kept": (
        "Stale pod entry left in the checkpoint: it still holds a GPU this host has",
        _CHECKPOINT_WHY + " This entry names a GPU this node no longer has next to one it "
        "still has, and no GPU identity history says which GPU the stale one became. "
        "gpuguard leaves the entry as it is rather than drop it: dropping it would free the "
        "present GPU in kubelet's accounting while the pod's container may still use it, and "
        "kubelet refuses an entry with fewer devices than the pod requested. Kubelet then "
        "fails the pod's re-admission (or its container cannot start) until the pod is "
        "deleted; delete the pod (the entry names it) to let it be scheduled anew.",
    ),
    "checkpoint-entry-remapped": (
        "Pod entry remapped to the GPUs now in its GPUs' places",
        "gpuguard rewrote the checkpoint entry of pod @POD_UID@ container @CONTAINER_NAME@ "
        "(@RESOURCE@): @OLD_DEVICE_IDS@ -> @NEW_DEVICE_IDS@, with its NUMA node and allocation "
        "response (NVIDIA_VISIBLE_DEVICES, device paths, annotations, CDI names) to match. "
        "Kubelet reuses the entry when it re-admits the pod, so the pod keeps the GPU of the "
        "same slot and nothing is allocated twice. The previous file is in the backups.",
    ),
    "checkpoint-entry-dropped": (
        "Pod entry dropped from the checkpoint",
        "gpuguard removed the checkpoint entry of pod @POD_UID@ container @CONTAINER_NAME@ "
        "(@RESOURCE@, @OLD_DEVICE_IDS@) because it could not be remapped: @DROP_REASON@. "
        "Kubelet allocates the pod's devices afresh at its next admission, and fails a pod it "
        "admits before the device plugin has registered (UnexpectedAdmissionError): such a "
        "pod must be recreated.",
    ),
    "checkpoint-remap-unavailable": (
        "Stale checkpoint entries are dropped, not remapped",
        "gpuguard remaps a stale pod entry to the GPU now in its GPU's place only with a GPU "
        "identity history that knows the old GPUs: @REASON@. The stale entries are dropped "
        "as before this history existed. The history is recorded at every check once the "
        "checkpoint matches the GPUs, so the next change of GPUs can be remapped.",
    ),
    "gpu-history-unusable": (
        "The GPU identity history cannot be used",
        "@HISTORY@ is not a file gpuguard wrote (a link, a FIFO, too big, malformed or of "
        "another version); see the message. gpuguard ignores it (no remap is possible from "
        "it) and replaces it with the GPUs present at the next check that finds the "
        "checkpoint matching them.",
    ),
    "gpu-history-recorded": (
        "GPUs recorded in the identity history",
        "The checkpoint matches this host's GPUs, which differ from the newest generation "
        "recorded in @HISTORY@ (or none was recorded): gpuguard recorded them (UUID, PCI bus "
        "id, index, minor, NUMA node, MIG devices) as the newest generation, keeping the "
        "previous ones, so that a later change of GPUs can be remapped.",
    ),
    "checkpoint-deleted": (
        "Kubelet checkpoint deleted (policy delete)",
        "With Policy=delete gpuguard removes the whole checkpoint, as Alibaba's gpuops does; "
        "kubelet rebuilds it and forgets every allocation. The old file is saved as @BACKUP@; its "
        "pod entries are recorded in /var/lib/gpuguard/checkpoint-dropped.json.",
    ),
    "kubelet-restart": (
        "gpuguard restarted kubelet to repair its checkpoint",
        "Kubelet overwrites the checkpoint from memory, so the file can only be repaired while "
        "kubelet is stopped. gpuguard restarted kubelet's unit so that its ExecStartPre= hook "
        "(kubelet.service.d/10-gpuguard.conf) repairs the file before kubelet reads it. The "
        "daemon does so only as [Kubelet] RestartPolicy= allows: for the pods the message "
        "names, which the restart brings back, never for a checkpoint that was stale when "
        "gpuguard started. When the unit is a k3s or RKE2 agent, the whole agent restarted "
        "(the message says so). The repair is then verified; when it cannot be, "
        "checkpoint-repair-unverified follows.",
    ),
    "kubelet-stop": (
        "gpuguard stopped kubelet to repair its checkpoint",
        "The kubelet drop-in is not installed, so gpuguard stopped kubelet, repairs the file while "
        "it is stopped (checkpoint-repaired) and starts kubelet again (kubelet-start). Install the "
        "drop-in to make this a plain restart.",
    ),
    "kubelet-start": (
        "gpuguard started kubelet again after repairing its checkpoint",
        "The end of a stop, repair, start (kubelet-stop): gpuguard starts kubelet whether the "
        "repair succeeded or not, so a node is never left without kubelet.",
    ),
    "kubelet-process-untrusted": (
        "A process named kubelet that gpuguard does not act for",
        "A process named kubelet (or k3s-agent, k3s-server), pid @PID@, is not one gpuguard "
        "trusts to say where kubelet runs: @REASON@. gpuguard acts only for a kubelet in one "
        "of [Systemd] KubeletUnits=, running as root, from a root-owned executable at a path "
        "a kubelet, k3s or RKE2 install uses (see gpuguard(8)); it stops, starts or restarts "
        "no unit and reads no configuration because of this process. A local user can "
        "name a program kubelet: find out who started it. A kubelet installed elsewhere "
        "is named with [Kubelet] Unit=.",
    ),
    "kubelet-coordination-failed": (
        "gpuguard could not coordinate with kubelet",
        "Kubelet runs but could not be stopped or restarted through systemd (not a systemd unit, "
        "or the job failed). The checkpoint was not modified.",
    ),
    "unit-job-failed": (
        "A systemd job gpuguard queued did not succeed",
        "gpuguard asked systemd to restart, stop or start @UNIT@ (for the reason in the message: "
        "kubelet around a checkpoint repair, or a device plugin run as a host service) and the job "
        "ended otherwise than 'done', or systemd refused it: @JOB_RESULT@. The unit may now be "
        "stopped: see `systemctl status` and `journalctl -u` for it. What it means for the repair "
        "follows in gpuguard's next entry (kubelet-coordination-failed, "
        "checkpoint-repair-unverified or plugin-restart-failed).",
    ),
    "checkpoint-repair-unverified": (
        "A checkpoint repair during a kubelet restart could not be verified",
        "gpuguard restarted kubelet so that its ExecStartPre= hook would repair the checkpoint, "
        "but the hook left no result for that restart, reported that it did not repair the file, "
        "or the file still names stale devices after the restart. The message above says which. "
        "The repair is counted as failed (exit code 5). See `journalctl -u kubelet` for the hook's "
        "own entries, fix the cause (driver, configuration), then run `gpuguard check` again.",
    ),
    "kubelet-hook-skipped": (
        "kubelet's pre-start hook had nothing to do",
        "The hook found nothing it can or should check (no NVIDIA driver or NVML, or no checkpoint "
        "file yet) and exited 0 so kubelet's status shows no failing ExecStartPre=. Logged once "
        "per state and boot; nothing was modified.",
    ),
}
