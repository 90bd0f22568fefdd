"""`gpuguard daemon`: one asyncio loop, sources emit events, one coalesced pass at a time.

An event wakes the steps the registry declares for its kind (steps/registry.py): the
fast paths that serve it run first (found by their protocols), then those steps are
marked; a pass runs them through the one runner (runner.py), as `gpuguard check` does.

Start-up order matters: subscribe to udev and systemd FIRST, then run the initial
full pass (so nothing that happens during start-up falls in between), and only then
tell systemd READY=1 (units ordered After=gpuguard.service, kubelet among them, start
once the node has been repaired).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import Executor
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

from gpuguard.config import Config, load_config
from gpuguard.engine import report
from gpuguard.engine.coalescer import Coalescer
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.engine.fastpaths import run_fast_paths
from gpuguard.engine.gcpause import freeze_long_lived, thaw
from gpuguard.engine.inventory_reader import InventoryReader
from gpuguard.engine.operation import OffSwitchGate, journal_observe
from gpuguard.engine.passes import PassContext, Work
from gpuguard.engine.runner import Due, PassRunner
from gpuguard.engine.snapshot import HostSnapshot, Planned
from gpuguard.errors import ConfigError
from gpuguard.host import aio
from gpuguard.host.inventory import Inventory
from gpuguard.host.memtrim import MemoryTrim
from gpuguard.host.notify import Notifier, watchdog_interval
from gpuguard.host.paths import Root
from gpuguard.host.systemd import Systemd, bus_address_for
from gpuguard.journal.conditions import finding_id
from gpuguard.journal.log import EventLog
from gpuguard.reporting.ledger import Ledger
from gpuguard.reporting.metrics_output import MetricsOutput
from gpuguard.reporting.status import OutcomeRecord, PassRecord, Status
from gpuguard.sources import Sources
from gpuguard.steps.events import Event, EventKind
from gpuguard.steps.registry import (
    STEP_ORDER,
    WAKES,
    Step,
    Wakes,
    check_names,
    woken_by,
)

if TYPE_CHECKING:  # made on the daemon's loop, imported there
    from gpuguard.sources.transient import TransientWatch
    from gpuguard.sources.udev import UdevSource

PASS_STUCK_AFTER = 300.0  # a pass this old stops the watchdog pings: systemd restarts us


class Daemon:
    def __init__(
        self,
        *,
        root: Root,
        config: Config,
        config_path: Optional[Path],
        log: EventLog,
        notifier: Notifier,
        inventory_path: Optional[Path],
        bus_address: Optional[str],
        steps: Mapping[str, Step],
        sources: Optional[Sources] = None,
        step_order: Sequence[str] = STEP_ORDER,
        wakes: Wakes = WAKES,
        apply: Optional[ChangeExecutor] = None,
        metrics: Optional[MetricsOutput] = None,
        executor: Optional[Executor] = None,
    ) -> None:
        # Steps run in step_order (steps/registry.py says why), woken by the events the
        # registry declares for them (`wakes`); marks name steps from it.
        check_names(steps, step_order, "Daemon(steps=...)")
        self.root = root
        self.config = config
        self.config_path = config_path
        self.log = log
        self.notifier = notifier
        # each pass's GPUs; NVML appearing or its GPUs changing is an event
        self.inventory_reader = InventoryReader(
            log, config, inventory_path, root=root, on_change=self.on_event
        )
        self.memtrim = MemoryTrim()  # the C heap's freed pages back to the kernel
        # where the blocking reads run (asyncio.to_thread): main bounds it (workers.py)
        self.executor = executor
        self.bus_address = bus_address or bus_address_for(root.prefix)
        # every change through one executor, which holds the mode (engine/executor.py)
        self.apply = apply or ChangeExecutor(observe=config.daemon.observe)
        self.step_order = tuple(step_order)
        self.runner = PassRunner(steps, self.step_order, wakes=wakes)
        self.steps = self.runner.steps  # in step_order
        self.wakes = wakes
        self.passes = 0
        self.started_wall = time.time()
        self.last_pass: Optional[PassRecord] = None
        self.first_pass: Optional[PassRecord] = None
        self.ledger = Ledger()  # each step's latest result and the last hour's changes
        self.metrics = metrics
        self.inventory: Optional[Inventory] = None
        self._followups: dict[tuple[frozenset[str], str], float] = {}
        self._planned = Planned()  # a dry-run's nodes and links not made (snapshot.py)
        self.first_pass_done = aio.Event()
        self.coalescer = self._make_coalescer()
        self.sources = sources
        self.sd_source = sources.systemd if sources is not None else None
        if sources is not None:
            sources.sink.connect(self.on_event, self.coalescer.hold)
        self.udev: Optional[UdevSource] = None  # sources/udev.py, once started
        self.transient: Optional[TransientWatch] = None  # sources/transient.py, once started
        self.off_switch = OffSwitchGate(root, log)  # once seen, the daemon stops

    @property
    def systemd(self) -> Optional[Systemd]:
        """The live bus connection, None while the bus is down."""
        return self.sd_source.client if self.sd_source is not None else None

    def mark(self, names: frozenset[str], why: str, urgent: bool) -> None:
        """Every mark, the events' and the follow-ups': steps by their registry names."""
        check_names(names, self.step_order, f"mark ({why})")
        self.coalescer.mark(names, why, urgent)

    def on_event(self, event: Event) -> None:
        """An event from a source (or the daemon's own: start-up, SIGHUP): the steps the
        registry wakes on it are marked, after the fast paths that serve it. Nothing once
        the off switch is set (the daemon is stopping)."""
        if self.switched_off():
            return
        names = woken_by(event.kind, frozenset(self.step_order), self.wakes)
        names -= run_fast_paths(self, names, event)
        if names:
            self.mark(names, event.why, event.urgent)

    def again(self, name: str) -> Callable[[str], None]:
        """What a fast path calls to ask for its step's pass once it is done."""

        def again(why: str) -> None:
            self.mark(frozenset({name}), why, False)

        return again

    def _make_coalescer(self) -> Coalescer:
        d = self.config.daemon
        return Coalescer(
            self._run_pass,
            quiet=d.quiet_period,
            urgent_quiet=d.reload_quiet_period,
            max_delay=d.max_delay,
        )

    # -- lifecycle -------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stop, "SIGTERM")
        loop.add_signal_handler(signal.SIGINT, self.stop, "SIGINT")
        loop.add_signal_handler(signal.SIGHUP, self.reload_config)
        if self.executor is not None:
            loop.set_default_executor(self.executor)
        if self.sources is not None and self.sources.udev is not None:
            self._start_udev(loop, self.sources.udev)
        if self.sources is not None and self.sources.transient is not None:
            self._start_transient(loop, self.sources.transient)
        sd_task = asyncio.create_task(self.sd_source.run()) if self.sd_source else None
        if self.sd_source is not None:
            try:
                await asyncio.wait_for(self.sd_source.first_attempt_done.wait(), timeout=10)
            except asyncio.TimeoutError:
                self.log.warning("systemd did not answer in 10s; going on without it for now")
        if self.switched_off():
            return 0
        if self.apply.mode == "observe":
            journal_observe(self.log, "start-up")
        self.on_event(Event(EventKind.START_UP, "start-up", urgent=True))
        pass_task = asyncio.create_task(self.coalescer.run())
        first = asyncio.create_task(self.first_pass_done.wait())
        await asyncio.wait({first, pass_task}, return_when=asyncio.FIRST_COMPLETED)
        if pass_task.done():
            pass_task.result()  # a crash of the pass loop itself: let it surface
            return 0  # stopped before the first pass ended
        self.notifier.ready(self.status_line())
        self.log.event("daemon-started", f"gpuguard daemon ready: {self.status_line()}")
        freeze_long_lived()  # after READY: kubelet's start does not wait for it
        helpers = []
        if self.sources is not None:
            helpers.append(asyncio.create_task(self.sources.timer.run()))
            if self.sources.watch is not None:
                helpers.append(asyncio.create_task(self.sources.watch.run()))
        interval = watchdog_interval()
        if interval is not None:
            helpers.append(asyncio.create_task(self._watchdog(interval)))
        try:
            if sd_task is not None:  # a source that crashed is a bug: the daemon exits 70
                await asyncio.wait({pass_task, sd_task}, return_when=asyncio.FIRST_COMPLETED)
                if sd_task.done() and not sd_task.cancelled() and sd_task.exception():
                    pass_task.cancel()
                    sd_task.result()
            await pass_task
        finally:
            for t in helpers:
                t.cancel()
            if self.sd_source is not None and sd_task is not None:
                self.sd_source.stop()
                helpers.append(sd_task)
                sd_task.cancel()
            if self.udev is not None:
                self.udev.stop()
            if self.transient is not None:
                self.transient.close()
            await asyncio.gather(*helpers, return_exceptions=True)
            self.memtrim.cancel()
            thaw()
        return 0

    def _start_udev(
        self,
        loop: asyncio.AbstractEventLoop,
        make: Callable[[asyncio.AbstractEventLoop], UdevSource],
    ) -> None:
        try:
            self.udev = make(loop)
            self.udev.start()
        except Exception as e:  # no netlink permission, no libudev: the audit still runs
            self.udev = None
            self.log.warning(f"udev events unavailable ({e}); relying on systemd and the audit")

    def _start_transient(
        self,
        loop: asyncio.AbstractEventLoop,
        make: Callable[[asyncio.AbstractEventLoop], Optional[TransientWatch]],
    ) -> None:
        try:
            self.transient = make(loop)
        except OSError as e:  # no inotify (a full table of watches): the audit still runs
            self.log.warning(
                f"runtime property watch unavailable ({e}); a runtime's DeviceAllow= "
                "reset is seen at the next audit"
            )

    def switched_off(self) -> bool:
        """The off switch is set: nothing more is written, and the daemon stops."""
        if self.off_switch.seen is None and self.off_switch.check() is not None:
            self.apply.switch_off()
            self._write_status()
            self.notifier.stopping("stopping: gpuguard is disabled (gpuguard enable)")
            self.coalescer.stop()
        return self.off_switch.seen is not None

    def stop(self, why: str = "stop") -> None:
        if self.off_switch.check(quiet=True) is not None:
            self.apply.switch_off()
        self.log.event("daemon-stopping", f"{why}: finishing the current pass and exiting")
        self.notifier.stopping(f"stopping ({why})")
        self.coalescer.stop()

    def reload_config(self) -> None:
        if self.switched_off():
            return
        self.notifier.reloading()
        try:
            new = load_config(self.root, path=self.config_path)
        except ConfigError as e:
            self.log.event(
                "config-rejected", f"kept the previous configuration: {e.message}", level="error"
            )
            self.notifier.send("READY=1", f"STATUS=config rejected; {self.status_line()}")
            return
        self.config = new
        for warning in new.warnings:
            self.log.warning(warning)  # a deprecated key, still read
        self.inventory_reader.reconfigure(new)
        if self.apply.reconfigure(new.daemon.observe):
            journal_observe(self.log, "configuration reloaded")
        self.log.set_level(new.daemon.log_level)
        c, d = self.coalescer, new.daemon
        c.quiet, c.urgent_quiet, c.max_delay = d.quiet_period, d.reload_quiet_period, d.max_delay
        if self.sources is not None:
            self.sources.reconfigure(new)
        self.log.event("config-reloaded", "configuration reloaded (SIGHUP)", level="notice")
        self.notifier.send("READY=1", f"STATUS={self.status_line()}")
        self.on_event(Event(EventKind.CONFIG_RELOADED, "configuration reloaded"))

    async def _watchdog(self, interval: float) -> None:
        while True:
            c = self.coalescer
            stuck = c.running and time.monotonic() - c.pass_started > PASS_STUCK_AFTER
            if not stuck:  # a stuck pass withholds the ping, so systemd restarts us
                self.notifier.watchdog()
            await asyncio.sleep(interval)

    # -- passes ----------------------------------------------------------------

    async def _run_pass(self, work: Work) -> None:
        if self.switched_off():
            return
        started_wall, t0 = time.time(), time.monotonic()
        self.passes += 1
        reader = self.inventory_reader
        ctx = PassContext(
            work, reader.read, previous_inventory=self.inventory, driver_wait=lambda: reader.pending
        )
        # a dry-run plans on the last pass's planned nodes and links, as the real run
        # acts on the ones it made then (its follow-up pass: durable grants)
        ctx.snapshot = self.apply.choose(
            made=lambda: None, described=lambda: self._snapshot_with(self._planned)
        )
        results = await self.runner.run(self, ctx, work.reconcilers)
        for r in results:
            self.ledger.record(
                r.name,
                self.passes,
                list(r.findings),
                list(r.outcomes),
                r.error,
                gauges=r.gauges,
                unknown=list(r.unknown),
            )
        steps_ms = {r.name: r.ms for r in results}
        duration = time.monotonic() - t0
        if ctx.snapshot is not None:
            snap = ctx.snapshot
            self._planned = self.apply.choose(
                made=lambda: self._planned, described=lambda: snap.planned
            )
        if ctx.known_inventory is not None:
            self.inventory = ctx.known_inventory
        changed = [o for o in ctx.outcomes if o.status == "done"]
        self.last_pass = PassRecord(
            number=self.passes,
            reasons=tuple(work.reasons[:8]),
            reconcilers=tuple(sorted(work.reconcilers)),
            first_mark_age_ms=round((t0 - work.first_mark) * 1000, 1),
            started=started_wall,
            ended=time.time(),
            duration_ms=round(duration * 1000, 2),
            steps_ms=steps_ms,
            findings=tuple(ctx.findings),
            outcomes=tuple(OutcomeRecord.of(o) for o in ctx.outcomes),
            gpus=len(self.inventory.gpus) if self.inventory else None,
        )
        if self.first_pass is None:
            self.first_pass = self.last_pass
        level = "notice" if changed else "debug"  # findings are journaled by their steps
        self.log.event(
            "pass-complete",
            f"pass {self.passes} ({work.reasons[0]}{', ...' if len(work.reasons) > 1 else ''}): "
            f"{len(ctx.findings)} finding(s), {len(changed)} change(s) in {duration * 1000:.1f} ms",
            level=level,
            fields={
                "PASS": self.passes,
                "REASONS": "; ".join(work.reasons[:8]),
                "FINDINGS": len(ctx.findings),
                "ACTIONS": len(ctx.outcomes),
                "DURATION_MS": f"{duration * 1000:.2f}",
            },
        )
        acted = any(o.status in ("done", "failed") for o in ctx.outcomes)
        findings = frozenset(map(finding_id, ctx.findings))
        v = self.coalescer.after_pass(acted, findings, work.first_mark)
        if v.wait:  # never a repair loop (passguard.py)
            self.log.event("pass-backoff", v.message(len(ctx.findings)), **v.entry())
        self._write_status()
        self._schedule_followups(self.runner.due(ctx))
        self.notifier.status(self.status_line())
        self.memtrim.after_pass()
        self.first_pass_done.set()
        if ctx.findings or ctx.outcomes:
            await self._run_hooks(work, ctx)

    def _snapshot_with(self, planned: Planned) -> HostSnapshot:
        seed = Planned(dict(planned.nodes), set(planned.links))
        return HostSnapshot(self.root, self.config.kubelet.checkpoint_path, planned=seed)

    def _schedule_followups(self, followups: list[Due]) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        for delay, reconcilers, why in followups:
            due = now + delay
            key = (reconcilers, why)
            # One timer per reason: the earliest due time wins, repeats are dropped.
            if key in self._followups and self._followups[key] <= due:
                continue
            self._followups[key] = due
            loop.call_later(delay, self._followup_due, key)

    def _followup_due(self, key: tuple[frozenset[str], str]) -> None:
        due = self._followups.get(key)
        if due is None or due > asyncio.get_running_loop().time() + 0.001:
            return  # superseded by an earlier timer that already fired
        del self._followups[key]
        self.mark(key[0], key[1], False)

    async def _run_hooks(self, work: Work, ctx: PassContext) -> None:
        from gpuguard.engine.hooks import plan_hooks, run_hooks

        runnable, refused = plan_hooks(self.root)
        for path, why in refused:
            self.log.event("hook-refused", f"refused hook {path}: {why}", level="warning")
        results = await run_hooks(
            runnable,
            event=work.reasons[0],
            findings=ctx.findings,
            outcomes=ctx.outcomes,
            timeout=self.config.daemon.hook_timeout,
            env_base=dict(os.environ),
            mode=self.apply.mode,
        )
        for r in results:
            kind = "hook-run" if r.ok else "hook-failed"
            self.log.event(kind, r.describe(), level="info" if r.ok else "warning")

    # -- reporting -------------------------------------------------------------

    def status_line(self) -> str:
        p = self.last_pass
        if p is None:
            return "starting"
        gpus = "no GPU inventory" if p.gpus is None else f"{p.gpus} GPU(s)"
        bus = "bus ok" if self.systemd is not None else "bus down"
        return (
            f"pass {p.number}: {len(p.findings)} finding(s), {p.changes} change(s); {gpus}; {bus}"
        )

    def status(self) -> Status:
        """The status file's model (reporting/status.py) as of now."""
        return report.daemon_status(self)

    def _write_status(self) -> None:
        report.write_status(self)
