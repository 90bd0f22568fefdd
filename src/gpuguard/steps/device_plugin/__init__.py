"""The daemon's device_plugin step: observe, assess, restart within limits, verify.

Never a restart loop: the limits (Restart=, MaxRestartsPerHour=, the cool-down from
the plugin's start, the budget per plugin identity in any hour, exponential back-off
after failed attempts) are judged in limits.py; besides, one restart per plugin per
pass, and none while an earlier one awaits verification.

With ``NvmlProbe=yes`` every served plugin (a container or a host service) is also
probed for NVML in its own context (steps/device_plugin/nvml_probe.py: one child process per
plugin process and pass, off the event loop); NvmlProbe=no runs no probe at all.

Every decision is a journal entry, the declined ones included (plugin-restart-declined
with REASON). The budget lives in this object and in
``/var/lib/gpuguard/plugin-restarts.json`` (restarts are recorded BEFORE acting), so a
daemon restart, or a crash in the middle of one, does not reset it.

Modules (docs/architecture.md has the map of the packages):

- the device plugin step (F3/F4): the pass, restart decisions and their journal entries
  (`__init__.py`), when a restart may happen, cool-down, budget, back-off (`limits.py`,
  pure), what it remembers of each plugin across gpuguard restarts (`state.py`); the
  plugins, the containers with NVIDIA nodes and kubelet's start (`observe.py`); health
  (`reconcile.py`); a plugin kubelet dropped after it registered, 0 allocatable GPUs
  (`allocatable.py`, pure) as kubelet's podresources API answers (`podresources.py`, one
  bounded call through `host/unarygrpc.py`, decoded by hand); restart through the
  runtime or systemd and verification (`actuate.py`); the optional NVML probe, what the
  child does in the plugin's cgroups and mount namespace (`nvml_probe.py`)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Callable, Optional

from gpuguard.actuate.units import UnitJobs
from gpuguard.devices.kubeletstart import KubeletStartWatch
from gpuguard.devices.plugins import (
    GPU_NODE,
    KUBELET_SOCKET,
    NodeInfo,
    discover_plugins,
    list_nodes,
)
from gpuguard.devices.processes import ProcessInfo, still_running
from gpuguard.errors import GpuguardError
from gpuguard.host.paths import Root
from gpuguard.journal.conditions import Conditions, log_findings
from gpuguard.model import Finding, Outcome
from gpuguard.steps.device_plugin.actuate import PluginRestarter, check_new_plugin, verify
from gpuguard.steps.device_plugin.allocatable import allocatable_judged
from gpuguard.steps.device_plugin.bridge_end import SETTLE, BridgeEndClock
from gpuguard.steps.device_plugin.limits import HOUR, why_not
from gpuguard.steps.device_plugin.observe import (
    PluginObservation,
    bridge_registered,
    container_devs,
    kubelet_started,
)
from gpuguard.steps.device_plugin.podresources import read_allocatable
from gpuguard.steps.device_plugin.reconcile import (
    K_DECLINED,
    K_FAILED,
    K_RECOVERED,
    K_RESTARTED,
    RECONCILER,
    RestartPlugin,
    assess,
)
from gpuguard.steps.device_plugin.state import STATE_FILE as STATE_FILE
from gpuguard.steps.device_plugin.state import PluginState as PluginState
from gpuguard.steps.device_plugin.state import read_states

if TYPE_CHECKING:
    from gpuguard.config import DevicePluginConfig
    from gpuguard.engine.passes import PassContext, Services
    from gpuguard.engine.snapshot import HostSnapshot
    from gpuguard.journal.log import EventLog
    from gpuguard.steps.device_plugin.nvml_probe import NvmlResult

log = logging.getLogger(__name__)


class DevicePluginStep:
    """``steps={"device_plugin": DevicePluginStep()}``; one object for the daemon's life."""

    def __init__(
        self,
        *,
        restarter: Optional[PluginRestarter] = None,
        clock: Callable[[], float] = time.time,
        verify_timeout: float = 30.0,
        poll: float = 0.25,
        backoff_base: float = 60.0,
        backoff_max: float = HOUR,
        forget_after: float = HOUR,
        cgroup_root: str = "/",
        dev_dir: str = "/dev",
        extra_sockets: Optional[dict[str, str]] = None,
        state_file: str = STATE_FILE,
        nvml_timeout: float = 10.0,
    ) -> None:
        self.restarter = restarter
        self.clock = clock
        self.verify_timeout = verify_timeout
        self.poll = poll
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.forget_after = forget_after
        self.cgroup_root = cgroup_root
        self.dev_dir = dev_dir
        self.extra = extra_sockets
        self.state_file = state_file
        self.nvml_timeout = nvml_timeout
        self.conditions = Conditions()  # findings are journaled when they change only
        self.state: dict[str, PluginState] = {}
        self._loaded_from: Optional[Root] = None
        # [Systemd] KubeletUnits= (set each pass): only a trusted kubelet's start counts
        self.kubelet_units: tuple[str, ...] = ()
        self.read_allocatable = read_allocatable  # kubelet's podresources API (tests: a stub)
        self.bridge_end = BridgeEndClock()  # when the bridge's streams ended
        self.kubelet_watch: Optional[KubeletStartWatch] = None  # kubelet.sock's listener

    # -- persisted state -----------------------------------------------------------

    def _load(self, root: Root, elog: EventLog) -> None:
        if self._loaded_from == root:
            return
        self._loaded_from = root
        self.state = read_states(root.path(self.state_file), elog)

    def _save(self, root: Root, elog: EventLog) -> None:
        from gpuguard.actuate.statefile import write_state
        from gpuguard.steps.device_plugin.state import SPEC

        path = root.path(self.state_file)
        try:
            write_state(path, SPEC, self.state)
        except (OSError, GpuguardError) as e:
            elog.warning(f"cannot save plugin restart budgets to {path}: {e}")

    # -- the pass --------------------------------------------------------------------

    def host_nodes(self, root: Root) -> tuple[NodeInfo, ...]:
        return list_nodes(root.path(self.dev_dir)) or ()

    def observe(
        self,
        root: Root,
        cfg: DevicePluginConfig,
        unit_started: Optional[float],
        snapshot: Optional[HostSnapshot] = None,
    ) -> PluginObservation:
        """``snapshot``: the pass's, whose kubepods walk container access shares."""
        if snapshot is None:  # a caller outside a pass (bench, tests)
            from gpuguard.engine.snapshot import HostSnapshot

            snapshot = HostSnapshot(root, "")
        now = self.clock()
        plugins = discover_plugins(root, cfg.socket_dir, extra=self.extra)
        served = {p.identity for p in plugins if p.process is not None}
        remembered: dict[str, Optional[ProcessInfo]] = {}
        for ident, st in self.state.items():
            if ident in served or st.last is None:
                continue
            if still_running(root, st.last):
                remembered[ident] = st.last
            elif now - st.last_seen < self.forget_after:
                remembered[ident] = None
        sock = root.path(cfg.socket_dir) / KUBELET_SOCKET
        if self.kubelet_watch is None or self.kubelet_watch.path != sock:
            self.kubelet_watch = KubeletStartWatch(root, sock)  # remembered across passes
        started = kubelet_started(
            root,
            cfg.socket_dir,
            unit_started=unit_started,
            units=self.kubelet_units,
            watch=self.kubelet_watch,
        )
        return PluginObservation(
            now=now,
            host_nodes=self.host_nodes(root),
            plugins=plugins,
            kubelet_started=started,
            containers=container_devs(root, snapshot.containers(self.cgroup_root)),
            remembered=remembered,
            bridge_registered=bridge_registered(root, started),
            bridge_ended=self.bridge_end.ended(root, started, now),
            kubelet_told_by=run.told_by() if (run := self.kubelet_watch.current) else "",
        )

    def probe_nvml(self, root: Root, obs: PluginObservation) -> dict[str, NvmlResult]:
        """NVML in each served plugin's context, by identity (one probe per process)."""
        from gpuguard.steps.device_plugin import nvml_probe  # ctypes: only with NvmlProbe=yes

        return nvml_probe.probe_plugins(root, obs, timeout=self.nvml_timeout)

    async def _kubelet_unit_started(self, svc: Services) -> Optional[float]:
        sd = svc.systemd
        if sd is None:
            return None
        from gpuguard.host.systemd import SystemdError

        unit = svc.config.kubelet.unit
        if unit is None:  # [Kubelet] Unit= empty: the one kubelet runs in
            from gpuguard.devices.kubelettrust import kubelet_unit

            unit, _why = kubelet_unit(svc.root, svc.config.systemd.kubelet_units)
        try:
            st = await sd.unit_state(unit)
        except SystemdError:
            return None
        if not st.active or st.inactive_exit_us <= 0:
            return None
        return st.inactive_exit_us / 1e6

    async def __call__(self, svc: Services, ctx: PassContext) -> None:
        cfg = svc.config.device_plugin
        root, elog = svc.root, svc.log
        self._load(root, elog)
        unit_started = await self._kubelet_unit_started(svc)
        self.kubelet_units = svc.config.systemd.kubelet_units  # whose starts count
        obs = await asyncio.to_thread(self.observe, root, cfg, unit_started, ctx.host(svc))
        obs = await self._with_allocatable(root, cfg, ctx, obs)
        nvml = await asyncio.to_thread(self.probe_nvml, root, obs) if cfg.nvml_probe else {}
        result = assess(obs, registration_grace=cfg.registration_grace, nvml=nvml)
        ended = obs.bridge_ended
        if ended is not None and obs.now < ended + SETTLE:
            # kubelet may not have marked the dropped plugin's devices yet: look again
            ctx.recheck(ended + SETTLE - obs.now + 0.2, "the re-admission bridge's streams ended")
        k = obs.kubelet_started
        if k is not None and obs.now < k + cfg.registration_grace:
            # F4 can only be judged once the grace period is over: ask for that pass.
            ctx.recheck(
                k + cfg.registration_grace - obs.now + 0.2,
                "device plugin registration grace period over",
            )
        for p in obs.plugins:
            if p.process is not None:
                st = self.state.setdefault(p.identity, PluginState())
                st.last, st.last_seen, st.socket = p.process, obs.now, p.socket
        for ident in [k for k, v in self.state.items() if self._forgettable(v, obs.now)]:
            del self.state[ident]
        log_findings(elog, self.conditions, RECONCILER, result.findings)
        ctx.findings += result.findings
        await self._check_pending(svc, ctx, obs)
        restarter = self.restarter or PluginRestarter.from_config(svc.config.runtime)
        for action in result.actions:
            ctx.outcomes.append(await self._decide(svc, ctx, cfg, restarter, action))
        self._save(root, elog)

    async def _with_allocatable(
        self, root: Root, cfg: DevicePluginConfig, ctx: PassContext, obs: PluginObservation
    ) -> PluginObservation:
        """The node's GPU count (the inventory known now, else its /dev/nvidiaN: NVML is
        not waited for) and, only when the rule has a plugin to judge, kubelet's
        allocatable devices (one bounded gRPC call in a worker thread)."""
        inv = getattr(ctx, "known_inventory", None)  # a stand-in pass may have none
        gpus = len(inv.gpus) if inv is not None else 0
        if gpus and inv is not None:  # which resources may be empty on purpose (MIG)
            obs = dataclasses.replace(
                obs,
                whole_gpus=sum(not g.mig for g in inv.gpus),
                mig_devices=sum(len(g.mig) for g in inv.gpus),
            )
        if not gpus:
            gpus = sum(bool(GPU_NODE.fullmatch(os.path.basename(n.path))) for n in obs.host_nodes)
        obs = dataclasses.replace(obs, gpus=gpus)
        if not allocatable_judged(obs, cfg.registration_grace):
            return obs
        got = await asyncio.to_thread(self.read_allocatable, root, cfg.socket_dir)
        return dataclasses.replace(obs, allocatable=got)

    def _forgettable(self, st: PluginState, now: float) -> bool:
        recent = [t for t in st.restarts if now - t < HOUR]
        st.restarts = recent
        return (
            not recent
            and not st.pending_deadline
            and now - st.last_seen > self.forget_after
            and (st.last is None or now - st.last_failure > self.backoff_max)
        )

    # -- decisions ---------------------------------------------------------------------

    def _journal(
        self,
        elog: EventLog,
        kind: str,
        a: RestartPlugin,
        msg: str,
        level: str,
        **extra: str,
    ) -> None:
        elog.event(kind, msg, level=level, fields=a.entry_fields(**extra))

    async def _decide(
        self,
        svc: Services,
        ctx: PassContext,
        cfg: DevicePluginConfig,
        restarter: PluginRestarter,
        a: RestartPlugin,
    ) -> Outcome:
        root, elog = svc.root, svc.log
        now = self.clock()
        st = self.state.setdefault(a.identity, PluginState())
        why = why_not(cfg, st, a, now, backoff_base=self.backoff_base, backoff_max=self.backoff_max)
        if why is None:  # a dry-run declines here, saying how the real run restarts it
            how = f"dry run: would restart it via {restarter.plan(a.process)}"  # access(2) only
            why = svc.apply.pick(made=None, described=("dry-run", how))
        if why is not None:
            code, sentence = why
            if code == "cool-down":
                # Nothing else announces the end of the cool-down: ask for that pass
                # (the budget and back-off are checked again then).
                ctx.recheck(
                    a.process.start + cfg.cool_down - now + 0.2, "device plugin cool-down over"
                )
            level = "info" if st.declined == code else "notice"
            st.declined = code
            self._journal(
                elog,
                K_DECLINED,
                a,
                f"not restarting device plugin {a.identity} ({a.target}), {a.reason}: {sentence}",
                level,
                REASON=code,
            )
            return Outcome(a, "dry-run" if code == "dry-run" else "declined", sentence)
        st.declined = ""
        st.restarts.append(now)
        self._save(root, elog)  # counted before acting: a crash cannot reset the budget
        units = UnitJobs(svc.systemd, elog) if svc.systemd else None
        res = await restarter.restart(root, a, units)
        if not res.ok:
            st.failures += 1
            st.last_failure = self.clock()
            self._journal(
                elog,
                K_FAILED,
                a,
                f"restarting device plugin {a.identity} ({a.target}) failed: {res.detail}",
                "error",
                METHOD=res.method,
            )
            return Outcome(a, "failed", res.detail)
        if not res.journaled:  # a unit restart's entry is the unit-job actuator's
            self._journal(
                elog,
                K_RESTARTED,
                a,
                f"restarted device plugin {a.identity} ({a.target}) because {a.reason}: "
                f"{res.detail}",
                "notice",
                METHOD=res.method,
            )
        timeout = min(self.verify_timeout, cfg.registration_grace or self.verify_timeout)
        v = await verify(
            root,
            cfg.socket_dir,
            a.identity,
            a.process,
            lambda: self.host_nodes(root),
            timeout=timeout,
            poll=self.poll,
            extra=self.extra,
        )
        if v.ok and v.plugin is not None and v.plugin.process is not None:
            self._recovered(elog, st, a, v.plugin.process, v.waited)
            return Outcome(a, "done", f"{res.detail}; verified in {v.waited:.1f}s")
        if v.status == "still-stale":
            self._failed(elog, st, a, f"the new plugin still lacks {', '.join(v.missing)}")
            return Outcome(a, "failed", f"{res.detail}; new plugin still lacks {v.missing}")
        st.pending_since = now
        st.pending_deadline = now + max(cfg.registration_grace, timeout)
        st.pending_old = a.process
        return Outcome(a, "done", f"{res.detail}; no new plugin yet after {v.waited:.0f}s")

    def _recovered(
        self, elog: EventLog, st: PluginState, a: RestartPlugin, new: ProcessInfo, waited: float
    ) -> None:
        st.failures, st.last_failure = 0, 0.0
        st.pending_deadline, st.pending_old = 0.0, None
        st.last, st.last_seen = new, self.clock()
        self._journal(
            elog,
            K_RECOVERED,
            a,
            f"device plugin {a.identity} is back as {new.describe()} {waited:.1f}s after "
            "the restart and sees every NVIDIA node the host has",
            "notice",
            NEW_PLUGIN_PID=str(new.pid),
        )

    def _failed(self, elog: EventLog, st: PluginState, a: RestartPlugin, why: str) -> None:
        st.failures += 1
        st.last_failure = self.clock()
        st.pending_deadline, st.pending_old = 0.0, None
        self._journal(
            elog,
            K_FAILED,
            a,
            f"restarting device plugin {a.identity} did not help: {why}",
            "error",
        )

    async def _check_pending(self, svc: Services, ctx: PassContext, obs: PluginObservation) -> None:
        cfg = svc.config.device_plugin
        for ident, st in self.state.items():
            if not st.pending_deadline or st.pending_old is None:
                continue
            old = st.pending_old
            plugin, missing = await asyncio.to_thread(
                check_new_plugin,
                svc.root,
                cfg.socket_dir,
                ident,
                old,
                obs.host_nodes,
                extra=self.extra,
            )
            a = RestartPlugin(
                reconciler=RECONCILER,
                reason="verifying an earlier restart",
                target=old.describe(),
                identity=ident,
                socket=st.socket,
                process=old,
                cause="verify",
            )
            if plugin is not None and plugin.process is not None and not missing:
                self._recovered(svc.log, st, a, plugin.process, obs.now - st.pending_since)
            elif plugin is not None:
                self._failed(svc.log, st, a, f"the new plugin still lacks {', '.join(missing)}")
                ctx.findings.append(
                    Finding(K_FAILED, RECONCILER, f"{ident}: new plugin still lacks {missing}")
                )
            elif obs.now > st.pending_deadline:
                self._failed(svc.log, st, a, "no new plugin process came up in time")
                ctx.findings.append(
                    Finding(K_FAILED, RECONCILER, f"{ident}: no new plugin after the restart")
                )
