"""F4's second rule (pure): a plugin kubelet dropped after it registered.

kubelet 1.26+ takes the registration it handles last as a resource's endpoint and does
not close the replaced one's stream; when that stream ends (the re-admission bridge's,
at a stop or a crash of gpuguard-readmit while kubelet runs), kubelet's handler looks
the client up by resource name, disconnects the CURRENT plugin and marks every device
of that resource unhealthy. The plugin keeps serving its socket, created after
kubelet's start, so the socket-time rule (reconcile.py) sees nothing; the node
advertises 0 of the resource until the plugin registers again, which a restart makes
it do.

So: once RegistrationGrace has passed since the latest kubelet start, when the node has
GPUs, for each resource a plugin serves whose socket is younger than kubelet but older
than RegistrationGrace (a plugin registering now is not judged): when kubelet's
podresources API (podresources.py) reports no allocatable device of it although the
node's inventory says it should have some, that plugin is restarted (within the step's
limits). Each resource is judged on its own (a drop is per resource: ``nvidia.com/gpu``
at 0 beside ``nvidia.com/mig-1g.10gb`` at 14 is a drop of the first). What the
inventory (host/inventory.py: the GPUs and their MIG devices) says a resource should
have, since a resource may be empty on purpose:

- a MIG profile (``nvidia.com/mig-*``): some, when the node has a MIG device;
- any other (``nvidia.com/gpu``, a renamed or shared one): some, when the node has a
  GPU without MIG devices, or when no plugin serves a MIG profile (MIG strategy
  ``none`` or ``single``: every GPU is advertised under it). Under the ``mixed``
  strategy it counts only the GPUs without MIG, so with every GPU in MIG mode it may
  be 0 on purpose. A GPU in MIG mode with no MIG device yet is taken as a GPU without
  MIG (the inventory holds its MIG devices, not its mode).

Where the inventory is not known (the GPUs counted from /dev/nvidiaN), which resource
may be empty on purpose cannot be told: a drop is then judged only when every resource
the node's plugins serve is at 0.
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
MIG_PREFIX = "nvidia.com/mig-"  # NVIDIA's plugin's MIG profiles (strategy mixed)


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


def should_have(obs: PluginObservation, resource: str, mig_served: bool) -> str:
    """What of the node's says ``resource`` should have allocatable devices ("": it may
    be empty on purpose). ``mig_served``: a plugin serves a MIG profile."""
    whole, mig = obs.whole_gpus, obs.mig_devices
    if whole is None or mig is None:
        return f"the node's {obs.gpus} GPUs"  # every served resource is at 0
    if resource.startswith(MIG_PREFIX):
        return f"the node's {mig} MIG devices" if mig else ""
    if whole:
        return f"the node's {obs.gpus} GPUs ({whole} without MIG)"
    if not mig_served:
        return f"the node's {obs.gpus} GPUs (no MIG profile served)"
    return ""


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
    if obs.whole_gpus is None and any(a.counts.get(p.resource, 0) for p in served):
        return [], []  # the inventory unknown: any resource may be empty on purpose
    mig_served = any(p.resource.startswith(MIG_PREFIX) for p in served)
    findings: list[Finding] = []
    restart: list[tuple[PluginInfo, str]] = []
    for p in served:
        dropped = dropped_at_bridge_end(obs, p)
        if p.process is None or p.socket_ctime < k:
            continue  # the socket-time rule says it
        if obs.now < p.socket_ctime + grace and not dropped:
            continue  # it is registering now
        if a.counts.get(p.resource, 0):
            continue
        has = should_have(obs, p.resource, mig_served)
        if not has:
            continue  # may be empty on purpose
        why = f"kubelet reports 0 allocatable {p.resource} of {has}"
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
