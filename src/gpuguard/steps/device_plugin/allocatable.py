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
When the bridge's streams ended in this kubelet run (bridge_end.py: the bridge's
process ended after it registered) the rule does not wait: not for RegistrationGrace
since kubelet's start, nor for the plugin's socket to be older than it. A plugin
whose socket was made before that end had registered and is the one kubelet dropped
then: it is restarted at once, within MaxRestartsPerHour (the cool-down from its start
does not apply: it is not starting, it was dropped). It happens once per kubelet run:
a new bridge process never registers with a kubelet already running, and the
restarted plugin's socket is newer than that end.
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


def dropped_at_bridge_end(obs: PluginObservation, p: PluginInfo) -> bool:
    """Whether ``p`` registered before the bridge's streams ended in this kubelet run
    (kubelet dropped it then, if its devices are not allocatable)."""
    ended = obs.bridge_ended
    return ended is not None and p.process is not None and p.socket_ctime < ended


def allocatable_judged(obs: PluginObservation, grace: float) -> bool:
    """Whether the rule has anything to judge (the step asks kubelet only then):
    kubelet up for RegistrationGrace (or the bridge's streams ended), GPUs on the
    node, a GPU plugin serving."""
    k = obs.kubelet_started
    if k is None or obs.gpus <= 0:
        return False
    if obs.now < k + grace and obs.bridge_ended is None:
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
        dropped = dropped_at_bridge_end(obs, p)
        if p.process is None or p.socket_ctime < k:
            continue  # the socket-time rule says it
        if obs.now < p.socket_ctime + grace and not dropped:
            continue  # it is registering now
        why = f"kubelet reports 0 allocatable {p.resource} of the node's {obs.gpus} GPUs"
        if dropped:
            why += " since the re-admission bridge's streams ended"
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
        if dropped:
            fields["BRIDGE_ENDED"] = f"{obs.bridge_ended:.3f}"
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
