"""The device plugin reconciler (pure): observation in, findings and restarts out.

Rules:

- F3, stale view: the NVIDIA device plugin hands a container ``/dev/nvidiactl``,
  ``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools`` and ``/dev/nvidia-modeset`` only
  if ``stat()`` finds them in ITS OWN /dev (seed 004), and that /dev is fixed when
  it starts. A plugin whose /dev lacks a node the host has (or has it with other
  numbers: a reloaded driver's new dynamic uvm major) is stale: restart it. When
  its /dev cannot be read, a host node created after the plugin started is taken
  as missing from its view.
- F4, not registered: kubelet removes the plugin sockets when it starts; a plugin
  re-registers by serving a new socket. Once ``RegistrationGrace`` has passed since
  the latest kubelet start, each known plugin (seen before, remembered across
  passes) must have a socket created after that start; if not, restart it (when its
  process is still known), else report.
  Where gpuguard's re-admission bridge registered in this kubelet run, the socket
  must be newer than the bridge's registration: an older one may have registered
  first and been replaced by the bridge, which allocates nothing (its restart makes
  it register after; its new socket is then newer, so this happens once per run).
- F4, registered but dropped by kubelet: 0 allocatable GPUs (allocatable.py): restart.
- GPU containers whose /dev lacks ``/dev/nvidia-uvm`` while the host has it were
  given their devices by a stale plugin: a cgroup grant cannot add a node to a
  container's /dev, so they must be recreated. Reported, never acted on here.
- A plugin socket nobody listens on is reported (the plugin died; kubelet or the
  runtime restarts it).
- NVML (``NvmlProbe=yes``, results from steps/device_plugin/nvml_probe.py): a plugin in whose
  context NVML cannot initialise ("Failed to initialize NVML: Unknown Error") is
  restarted, unless a stale view already asks for that; a probe that could not run
  (no verdict) is reported as a warning only.

Whether a restart is allowed (cool-down, hourly budget, back-off) is the step's
business: the reconciler only says what would make the node healthy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional

from gpuguard.devices.plugins import UVM_PATH, NodeInfo, PluginInfo
from gpuguard.devices.processes import ProcessInfo
from gpuguard.model import Action, Finding
from gpuguard.steps.device_plugin.allocatable import dropped_at_bridge_end, not_allocatable
from gpuguard.steps.device_plugin.observe import PluginObservation
from gpuguard.steps.registry import DEVICE_PLUGIN

if TYPE_CHECKING:
    from gpuguard.steps.device_plugin.nvml_probe import NvmlResult

RECONCILER = DEVICE_PLUGIN

K_MISSING_DEVICE = "plugin-missing-device"
K_NOT_REGISTERED = "plugin-not-registered"
K_NOT_SERVING = "plugin-not-serving"
K_CONTAINER_NO_UVM = "container-missing-uvm"
K_NVML_FAILED = "plugin-nvml-failed"
K_NVML_UNCHECKED = "plugin-nvml-unchecked"
# The step's decisions about a restart (a restart through systemd is journaled by the
# unit-job actuator, with the same kind and fields).
K_RESTARTED = "plugin-restarted"
K_DECLINED = "plugin-restart-declined"
K_RECOVERED = "plugin-recovered"
K_FAILED = "plugin-restart-failed"

CAUSE_STALE = "stale-view"
CAUSE_UNREGISTERED = "not-registered"
CAUSE_NVML = "nvml-failed"  # NVML cannot initialise in the plugin's context
CAUSE_NOT_ALLOCATABLE = "not-allocatable"  # kubelet dropped it (allocatable.py)

# A node is "newer than the plugin" only beyond start-time precision (btime is whole
# seconds, start is in clock ticks).
START_SLACK = 1.5


@dataclass(frozen=True)
class RestartPlugin(Action):
    identity: str
    socket: str
    process: ProcessInfo
    cause: str  # CAUSE_STALE | CAUSE_UNREGISTERED | CAUSE_NVML | CAUSE_NOT_ALLOCATABLE
    missing: tuple[str, ...] = ()
    # kubelet dropped it when the bridge's streams ended: it is not starting, so the
    # cool-down from its start does not hold it (the hourly budget does)
    prompt: bool = False

    @property
    def kind(self) -> str:
        return "restart-plugin"

    def fields(self) -> Mapping[str, str]:
        p = self.process
        out = {
            "PLUGIN": self.identity,
            "PLUGIN_SOCKET": self.socket,
            "PLUGIN_PID": str(p.pid),
            "CAUSE": self.cause,
        }
        if p.container_id:
            out["CONTAINER_ID"] = p.container_id
            out["CONTAINER_RUNTIME"] = p.runtime
        if p.pod_uid:
            out["POD_UID"] = p.pod_uid
        if p.unit:
            out["UNIT"] = p.unit
        if self.missing:
            out["MISSING"] = " ".join(self.missing)
        return out

    def entry_fields(self, **extra: str) -> dict[str, str]:
        """The fields of a journal entry about this restart: the step, the action, the
        plugin, and ``extra`` (METHOD, REASON ...)."""
        step = {"GPUGUARD_RECONCILER": RECONCILER, "GPUGUARD_ACTION": self.kind}
        return step | dict(self.fields()) | extra


@dataclass(frozen=True)
class Assessment:
    findings: tuple[Finding, ...]
    actions: tuple[RestartPlugin, ...]
    healthy: tuple[str, ...]  # identities of plugins that serve and see every node


def view_gaps(
    host: tuple[NodeInfo, ...], view: Optional[tuple[NodeInfo, ...]], start: float
) -> tuple[list[str], str]:
    """(paths the plugin lacks, how we know). Empty when it sees everything."""
    if view is None:
        newer = [n.path for n in host if (n.ctime or 0.0) > start + START_SLACK]
        return newer, "created after the plugin started; its /dev is not readable"
    seen = {n.path: n.key for n in view}
    gaps: list[str] = []
    wrong: list[str] = []
    for n in host:
        have = seen.get(n.path)
        if have is None:
            gaps.append(n.path)
        elif have != n.key:
            wrong.append(f"{n.path} ({_mm(have)}, host has {_mm(n.key)})")
    how = []
    if gaps:
        how.append(f"absent from its /dev: {', '.join(gaps)}")
    if wrong:
        how.append(f"present with stale numbers: {', '.join(wrong)}")
    return gaps + [w.split(" ", 1)[0] for w in wrong], "; ".join(how)


def _mm(numbers: tuple[str, int, int]) -> str:
    return f"{numbers[1]}:{numbers[2]}"


def _fields(p: PluginInfo) -> dict[str, str]:
    out = {"PLUGIN": p.identity, "PLUGIN_SOCKET": p.socket}
    if p.process is not None:
        out["PLUGIN_PID"] = str(p.process.pid)
        if p.process.container_id:
            out["CONTAINER_ID"] = p.process.container_id
        if p.process.unit:
            out["UNIT"] = p.process.unit
    return out


def assess(
    obs: PluginObservation,
    *,
    registration_grace: float,
    nvml: Optional[Mapping[str, NvmlResult]] = None,
) -> Assessment:
    """``nvml``: NVML probe results by plugin identity (empty: NvmlProbe=no)."""
    findings: list[Finding] = []
    actions: dict[str, RestartPlugin] = {}
    healthy: list[str] = []
    stale: list[str] = []
    driver_up = bool(obs.host_nodes)

    for p in obs.plugins:
        if p.process is None:
            findings.append(
                Finding(
                    K_NOT_SERVING,
                    RECONCILER,
                    f"device plugin socket {p.socket} ({p.identity}) has no listening "
                    "process: the plugin exited; kubelet or its runtime should start it again",
                    _fields(p),
                    "warning",
                )
            )
            continue
        if not driver_up:
            continue
        res = (nvml or {}).get(p.identity)
        if res is not None and not res.ok:
            findings.append(_nvml_finding(p, p.process, res))
        gaps, how = view_gaps(obs.host_nodes, p.dev, p.process.start)
        if not gaps:
            if res is not None and res.failed:
                actions[p.identity] = RestartPlugin(
                    reconciler=RECONCILER,
                    reason=f"NVML cannot initialise in its context: {res.detail}",
                    target=p.process.describe(),
                    identity=p.identity,
                    socket=p.socket,
                    process=p.process,
                    cause=CAUSE_NVML,
                )
            else:
                healthy.append(p.identity)
            continue
        stale.append(p.identity)
        findings.append(
            Finding(
                K_MISSING_DEVICE,
                RECONCILER,
                f"device plugin {p.identity} ({p.process.describe()}) does not see the "
                f"host's {', '.join(gaps)} ({how}): containers it sets up will not get "
                "them (CUDA 'unknown error'); it must be restarted",
                {**_fields(p), "MISSING": " ".join(gaps)},
                "warning",  # what gpuguard does about it is journaled with its outcome
            )
        )
        actions[p.identity] = RestartPlugin(
            reconciler=RECONCILER,
            reason=f"its /dev lacks {', '.join(gaps)}",
            target=p.process.describe(),
            identity=p.identity,
            socket=p.socket,
            process=p.process,
            cause=CAUSE_STALE,
            missing=tuple(gaps),
        )

    findings += _registration(obs, registration_grace, actions)
    findings += _allocatable(obs, registration_grace, actions)
    findings += _containers(obs, stale)
    return Assessment(tuple(findings), tuple(actions.values()), tuple(healthy))


def _nvml_finding(p: PluginInfo, proc: ProcessInfo, res: NvmlResult) -> Finding:
    fields = {**_fields(p), "NVML_ERROR": res.detail}
    if res.code is not None:
        fields["NVML_CODE"] = str(res.code)
    if res.library:
        fields["NVML_LIBRARY"] = res.library
    if not res.failed:
        return Finding(
            K_NVML_UNCHECKED,
            RECONCILER,
            f"cannot check NVML in device plugin {p.identity}'s context "
            f"({proc.describe()}): {res.detail}",
            {**fields, "NVML_STAGE": res.stage},
            "warning",
        )
    said = f"Failed to initialize NVML: {res.detail}" if res.stage == "init" else res.detail
    return Finding(
        K_NVML_FAILED,
        RECONCILER,
        f"NVML cannot initialise in device plugin {p.identity}'s context "
        f"({proc.describe()}): {said}; it must be restarted",
        fields,
        "error",
    )


def _registration(
    obs: PluginObservation, grace: float, actions: dict[str, RestartPlugin]
) -> list[Finding]:
    k = obs.kubelet_started
    if k is None or obs.now < k + grace:
        return []
    out: list[Finding] = []
    current = {p.identity: p for p in obs.plugins}
    identities = sorted(set(current) | set(obs.remembered))
    bridge = obs.bridge_registered
    after = max(k, bridge) if bridge is not None else k
    for ident in identities:
        p = current.get(ident)
        if p is not None and p.socket_ctime >= after:
            continue
        proc = p.process if p is not None else None
        if proc is None:
            proc = obs.remembered.get(ident)
        since = obs.now - k
        what = (
            "its socket is gone"
            if p is None
            else "its socket predates kubelet's start"
            if p.socket_ctime < k
            else "its socket predates the registration of gpuguard's re-admission bridge, "
            "which may have replaced it"
        )
        fields = {"PLUGIN": ident, "KUBELET_STARTED": f"{k:.3f}"}
        if obs.kubelet_told_by:  # its socket's listener, or its inode only (and why)
            fields["KUBELET_START_BY"] = obs.kubelet_told_by
        if bridge is not None:
            fields["BRIDGE_REGISTERED"] = f"{bridge:.3f}"
        if proc is not None:
            fields["PLUGIN_PID"] = str(proc.pid)
            if proc.container_id:
                fields["CONTAINER_ID"] = proc.container_id
        out.append(
            Finding(
                K_NOT_REGISTERED,
                RECONCILER,
                f"device plugin {ident} has not registered with kubelet {since:.0f}s after "
                f"kubelet started ({what}): the node advertises none of its devices"
                + ("" if proc is not None else "; its process is gone, nothing to restart"),
                fields,
                "error",
            )
        )
        if proc is not None and ident not in actions:
            actions[ident] = RestartPlugin(
                reconciler=RECONCILER,
                reason=f"not registered {since:.0f}s after kubelet started",
                target=proc.describe(),
                identity=ident,
                socket=p.socket if p is not None else "",
                process=proc,
                cause=CAUSE_UNREGISTERED,
            )
    return out


def _allocatable(
    obs: PluginObservation, grace: float, actions: dict[str, RestartPlugin]
) -> list[Finding]:
    findings, dropped = not_allocatable(obs, grace)
    for p, reason in dropped:
        if p.process is not None and p.identity not in actions:
            actions[p.identity] = RestartPlugin(
                reconciler=RECONCILER,
                reason=reason,
                target=p.process.describe(),
                identity=p.identity,
                socket=p.socket,
                process=p.process,
                cause=CAUSE_NOT_ALLOCATABLE,
                prompt=dropped_at_bridge_end(obs, p),
            )
    return findings


def _containers(obs: PluginObservation, stale: list[str]) -> list[Finding]:
    if not any(n.path == UVM_PATH for n in obs.host_nodes):
        return []
    out: list[Finding] = []
    plugin_ids = {p.process.container_id for p in obs.plugins if p.process is not None}
    for c in obs.containers:
        if c.container_id in plugin_ids:  # the plugin itself: handled above
            continue
        if not c.is_gpu or any(n.path == UVM_PATH for n in c.dev):
            continue
        by = f" (stale plugin(s): {', '.join(stale)})" if stale else ""
        out.append(
            Finding(
                K_CONTAINER_NO_UVM,
                RECONCILER,
                f"GPU container {c.container_id[:13]} of pod {c.pod_uid} has no "
                f"{UVM_PATH} in its /dev: it was set up by a device plugin that did not "
                f"see the node{by}; a cgroup grant cannot add the node, the container "
                "must be recreated (delete its pod)",
                {
                    "CONTAINER_ID": c.container_id,
                    "POD_UID": c.pod_uid,
                    "CONTAINER_RUNTIME": c.runtime,
                    "MISSING": UVM_PATH,
                    "GPU_NODES": " ".join(
                        n.path.rsplit("/", 1)[-1] for n in c.dev if n.path != UVM_PATH
                    ),
                },
                "warning",
            )
        )
    return out
