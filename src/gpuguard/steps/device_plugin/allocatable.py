"""F4's second rule (pure): a plugin kubelet dropped after it registered.

kubelet 1.26+ takes the registration it handles last as a resource's endpoint and does
not close the replaced one's stream; when that stream ends (the re-admission bridge's,
at a stop or a crash of gpuguard-readmit while kubelet runs), kubelet's handler looks
the client up by resource name, disconnects the CURRENT plugin and marks every device
unhealthy. The plugin keeps serving its socket, created after kubelet's start, so the
socket-time rule (reconcile.py) sees nothing; the node advertises 0 GPUs until the
plugin registers again, which a restart makes it do.

So: once RegistrationGrace has passed since the latest kubelet start, when the node has
GPUs, kubelet's podresources API (podresources.py) reports no allocatable device of any
resource the node's plugins serve, and a plugin's socket is younger than kubelet but
older than RegistrationGrace (a plugin registering now is not judged), that plugin is
restarted (within the step's limits). "Any resource": a resource may be empty on
purpose while another of the same GPUs is not (nvidia.com/gpu beside MIG profiles).
kubelet counts only healthy devices, so a plugin that reports every GPU unhealthy looks
the same; NVIDIA's plugin keeps a device it marked unhealthy so until it restarts
(NVIDIA/k8s-device-plugin#234), so the restart (at most MaxRestartsPerHour) is the
remedy there too.
Where kubelet cannot be asked (before 1.21, no socket, the call not served, no answer)
that is said, as an info finding that is never "OK", and the socket-time rule alone
judges registration.
"""

from __future__ import annotations

from gpuguard.devices.plugins import PluginInfo
from gpuguard.model import Finding
from gpuguard.steps.device_plugin.observe import PluginObservation
from gpuguard.steps.registry import DEVICE_PLUGIN

K_NOT_ALLOCATABLE = "plugin-not-allocatable"
K_ALLOCATABLE_UNCHECKED = "plugin-allocatable-unchecked"


def allocatable_judged(obs: PluginObservation, grace: float) -> bool:
    """Whether the rule has anything to judge (the step asks kubelet only then):
    kubelet up for RegistrationGrace, GPUs on the node, a GPU plugin serving."""
    k = obs.kubelet_started
    if k is None or obs.now < k + grace or obs.gpus <= 0:
        return False
    return any(p.process is not None and p.resource for p in obs.plugins)


def not_allocatable(
    obs: PluginObservation, grace: float
) -> tuple[list[Finding], list[tuple[PluginInfo, str]]]:
    """(findings, [(plugin to restart, why)])."""
    a, k = obs.allocatable, obs.kubelet_started
    if a is None or k is None or not allocatable_judged(obs, grace):
        return [], []
    if a.unchecked:
        unchecked = Finding(
            K_ALLOCATABLE_UNCHECKED,
            DEVICE_PLUGIN,
            f"cannot ask kubelet which GPUs it can allocate ({a.unchecked}): a plugin kubelet "
            "dropped after it registered would go unseen; registration is judged by the "
            "plugin sockets' times only",
            {"PODRESOURCES_SOCKET": a.socket, "REASON": a.unchecked},
            "info",
        )
        return [unchecked], []
    served = [p for p in obs.plugins if p.process is not None and p.resource]
    if any(a.counts.get(p.resource, 0) for p in served):
        return [], []
    findings: list[Finding] = []
    restart: list[tuple[PluginInfo, str]] = []
    for p in served:
        if p.process is None or p.socket_ctime < k or obs.now < p.socket_ctime + grace:
            continue  # the socket-time rule says it, or it is registering now
        why = f"kubelet reports 0 allocatable {p.resource} of the node's {obs.gpus} GPUs"
        fields = {
            "PLUGIN": p.identity,
            "PLUGIN_SOCKET": p.socket,
            "PLUGIN_PID": str(p.process.pid),
            "RESOURCE": p.resource,
            "ALLOCATABLE": "0",
            "GPUS": str(obs.gpus),
            "PODRESOURCES_SOCKET": a.socket,
        }
        if p.process.container_id:
            fields["CONTAINER_ID"] = p.process.container_id
        if p.process.unit:
            fields["UNIT"] = p.process.unit
        findings.append(
            Finding(
                K_NOT_ALLOCATABLE,
                DEVICE_PLUGIN,
                f"{why} although device plugin {p.identity} ({p.process.describe()}) serves: "
                "kubelet dropped its registration (a replaced endpoint's stream ended); "
                "it must register again",
                fields,
                "error",
            )
        )
        restart.append((p, why))
    return findings, restart
