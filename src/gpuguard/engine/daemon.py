"""`gpuguard daemon`: one asyncio loop, sources mark work, one coalesced pass at a time.

Start-up order matters: subscribe to udev and systemd FIRST, then run the initial
full pass (so nothing that happens during start-up falls in between), and only then
tell systemd READY=1 (units ordered After=gpuguard.service, kubelet among them, start
once the node has been repaired).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from gpuguard.config import Config, load_config
from gpuguard.engine.coalescer import Coalescer
from gpuguard.engine.gcpause import collector_paused, freeze_long_lived, thaw
from gpuguard.engine.inventory_reader import InventoryReader
from gpuguard.engine.operation import OffSwitchGate, journal_observe
from gpuguard.engine.passes import STATUS_FILE, PassContext, Step, Work
from gpuguard.engine.snapshot import HostSnapshot, Planned
from gpuguard.errors import ConfigError, GpuguardError
from gpuguard.host.inventory import Inventory
from gpuguard.host.notify import Notifier, watchdog_interval
from gpuguard.host.paths import Root
from gpuguard.host.systemd import Systemd, bus_address_for
from gpuguard.journal.log import EventLog
from gpuguard.reporting.ledger import Ledger
from gpuguard.reporting.metrics_output import MetricsOutput
from gpuguard.reporting.metrics_state import REPAIR_HISTOGRAM
from gpuguard.sources import Sources
from gpuguard.steps.registry import CONTAINER_ACCESS, STEP_ORDER, check_names

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
        dry_run: bool = False,
        metrics: Optional[MetricsOutput] = None,
    ) -> None:
        # Steps run in step_order (steps/registry.py says why); marks name steps from it.
        check_names(steps, step_order, "Daemon(steps=...)")
        self.root = root
        self.config = config
        self.config_path = config_path
        self.log = log
        self.notifier = notifier
        self.inventory_reader = InventoryReader(log, config, inventory_path)  # each pass's GPUs
        self.bus_address = bus_address or bus_address_for(root.prefix)
        self.cli_dry_run = dry_run  # --dry-run: kept across reloads
        self.dry_run = dry_run or config.daemon.observe  # Mode=observe, DryRun=yes
        self.step_order = tuple(step_order)
        self.steps = {name: steps[name] for name in self.step_order if name in steps}
        self.passes = 0
        self.started_wall = time.time()
        self.last_pass: dict[str, Any] = {}
        self.first_pass: dict[str, Any] = {}
        self.ledger = Ledger()  # each step's latest result and the last hour's changes
        self.metrics = metrics
        self.inventory: Optional[Inventory] = None
        self._followups: dict[tuple[frozenset[str], str], float] = {}
        self._planned = Planned()  # a dry-run's nodes and links not made (snapshot.py)
        self.first_pass_done = asyncio.Event()
        self.coalescer = self._make_coalescer()
        self.sources = sources
        self.sd_source = sources.systemd if sources is not None else None
        if sources is not None:
            sources.sink.connect(
                self.mark, self.coalescer.hold, self.on_reloaded, self.on_scope_started
            )
        self.udev: Any = None
        self.transient: Any = None  # sources/transient.py, once started
        self.off_switch = OffSwitchGate(root, log)  # once seen, the daemon stops

    @property
    def systemd(self) -> Optional[Systemd]:
        """The live bus connection, None while the bus is down."""
        return self.sd_source.client if self.sd_source is not None else None

    def mark(self, names: frozenset[str], why: str, urgent: bool) -> None:
        """Every mark, the sources' and the follow-ups': steps by their registry names."""
        check_names(names, self.step_order, f"mark ({why})")
        self.coalescer.mark(names, why, urgent)

    # -- fast paths: work that must not wait for the quiet period or a running pass --

    def on_reloaded(self, signal: float) -> None:
        """systemd ended a daemon-reload/reexec: each step's reload fast path, inline on
        the loop, now (the pass that repairs the rest is marked next, urgently), with no
        garbage collection in between (gcpause.py)."""
        if self.switched_off():
            return
        with collector_paused():
            for name, step in self.steps.items():
                fast = getattr(step, "on_reload", None)
                if fast is None:
                    continue
                try:
                    fast(self, signal)
                except Exception as e:  # the pass that follows retries: never the loop down
                    self.log.crashed(name, "reload fast path", e)
        # This reload's repair time, written with the next pass's metrics
        repair = getattr(self.steps.get(CONTAINER_ACCESS), "last_reload", None)
        done = repair.restored if repair is not None and repair.signal == signal else None
        if self.metrics is not None and done is not None:
            self.metrics.state.observe(REPAIR_HISTOGRAM, max(0.0, done - signal))

    def on_scope_started(self, unit: str) -> None:
        """A container scope's job ended: its step handles that scope on its own, and
        asks for a pass when it is done (or marks one at once when it has no fast path)."""
        if self.switched_off():
            return
        step = self.steps.get(CONTAINER_ACCESS)
        fast = getattr(step, "on_new_scope", None)

        def again(why: str) -> None:
            self.mark(frozenset({CONTAINER_ACCESS}), why, False)

        if fast is None:
            again(f"systemd: new container scope {unit}")
            return
        gpus = self.inventory.gpus if self.inventory is not None else ()
        fast(self, unit, gpus, again)

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
        if self.dry_run:
            journal_observe(self.log, "start-up")
        self.mark(frozenset(self.step_order), "start-up", True)
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
            thaw()
        return 0

    def _start_udev(self, loop: asyncio.AbstractEventLoop, make: Callable[..., Any]) -> None:
        try:
            self.udev = make(loop)
            self.udev.start()
        except Exception as e:  # no netlink permission, no libudev: the audit still runs
            self.udev = None
            self.log.warning(f"udev events unavailable ({e}); relying on systemd and the audit")

    def _start_transient(self, loop: asyncio.AbstractEventLoop, make: Callable[..., Any]) -> None:
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
            self.dry_run = True
            self._write_status()
            self.notifier.stopping("stopping: gpuguard is disabled (gpuguard enable)")
            self.coalescer.stop()
        return self.off_switch.seen is not None

    def stop(self, why: str = "stop") -> None:
        self.dry_run = self.dry_run or self.off_switch.check(quiet=True) is not None
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
        was, self.dry_run = self.dry_run, self.cli_dry_run or new.daemon.observe
        if self.dry_run and not was:
            journal_observe(self.log, "configuration reloaded")
        self.log.set_level(new.daemon.log_level)
        c, d = self.coalescer, new.daemon
        c.quiet, c.urgent_quiet, c.max_delay = d.quiet_period, d.reload_quiet_period, d.max_delay
        if self.sources is not None:
            self.sources.reconfigure(new)
        self.log.event("config-reloaded", "configuration reloaded (SIGHUP)", level="notice")
        self.notifier.send("READY=1", f"STATUS={self.status_line()}")
        self.mark(frozenset(self.step_order), "configuration reloaded", False)

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
        ctx = PassContext(work, self.inventory_reader.read, previous_inventory=self.inventory)
        if self.dry_run:  # plan on the last pass's planned nodes and links, as the real
            # run acts on the ones it made then (its follow-up pass: durable grants)
            ctx.snapshot = self._snapshot_with(self._planned)
        steps_ms: dict[str, float] = {}
        for name, step in self.steps.items():  # in step_order: it matters
            if name not in work.reconcilers:
                continue
            t_step = time.monotonic()
            n_findings, n_outcomes, error = len(ctx.findings), len(ctx.outcomes), None
            gauges_before = set(ctx.gauges)
            try:
                await step(self, ctx)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                self.log.crashed(name, f"reconciler {name}", e)
            steps_ms[name] = round((time.monotonic() - t_step) * 1000, 2)
            self.ledger.record(
                name,
                self.passes,
                ctx.findings[n_findings:],
                ctx.outcomes[n_outcomes:],
                error,
                gauges={k: v for k, v in ctx.gauges.items() if k not in gauges_before},
            )
        duration = time.monotonic() - t0
        if self.dry_run and ctx.snapshot is not None:
            self._planned = ctx.snapshot.planned
        if ctx.known_inventory is not None:
            self.inventory = ctx.known_inventory
        changed = [o for o in ctx.outcomes if o.status == "done"]
        self.last_pass = {
            "number": self.passes,
            "reasons": list(work.reasons[:8]),
            "reconcilers": sorted(work.reconcilers),
            "first_mark_age_ms": round((t0 - work.first_mark) * 1000, 1),
            "started": started_wall,
            "ended": time.time(),
            "duration_ms": round(duration * 1000, 2),
            "steps_ms": steps_ms,
            "findings": [f.to_json() for f in ctx.findings],
            "outcomes": [o.to_json() for o in ctx.outcomes],
            "gpus": len(self.inventory.gpus) if self.inventory else None,
        }
        if not self.first_pass:
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
        self._write_status()
        self._schedule_followups(ctx.followups)
        self.notifier.status(self.status_line())
        self.first_pass_done.set()
        if ctx.findings or ctx.outcomes:
            await self._run_hooks(work, ctx)

    def _snapshot_with(self, planned: Planned) -> HostSnapshot:
        seed = Planned(dict(planned.nodes), set(planned.links))
        return HostSnapshot(self.root, self.config.kubelet.checkpoint_path, planned=seed)

    def _schedule_followups(self, followups: list[tuple[float, frozenset[str], str]]) -> None:
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
            dry_run=self.dry_run,
        )
        for r in results:
            kind = "hook-run" if r.ok else "hook-failed"
            self.log.event(kind, r.describe(), level="info" if r.ok else "warning")

    # -- reporting -------------------------------------------------------------

    def status_line(self) -> str:
        p = self.last_pass
        if not p:
            return "starting"
        gpus = "no GPU inventory" if p["gpus"] is None else f"{p['gpus']} GPU(s)"
        bus = "bus ok" if self.systemd is not None else "bus down"
        return (
            f"pass {p['number']}: {len(p['findings'])} finding(s), "
            f"{sum(o['status'] == 'done' for o in p['outcomes'])} change(s); {gpus}; {bus}"
        )

    def _reload_signal(self) -> dict[str, Any]:
        """Where systemd's Reloading comes from (sources/reload_socket.py)."""
        sd = self.sd_source
        private = sd.private if sd is not None else None
        return {
            "private_socket": private is not None and private.connected,
            "last_via": sd.last_reload_via if sd is not None else "",
            # every reload arrives on both paths and is acted on once
            "reloads": sd.reloads_acted if sd is not None else 0,
            "received": {
                via: {"starts": n[0], "ends": n[1]}
                for via, n in (sd.received.items() if sd is not None else ())
            },
        }

    def _write_status(self) -> None:
        from gpuguard.actuate.files import write_new

        fast_status = getattr(self.steps.get(CONTAINER_ACCESS), "fast_status", None)
        doc = {
            "pid": os.getpid(),
            "started": self.started_wall,
            "passes": self.passes,
            "bus_connected": self.systemd is not None,
            "reload_signal": self._reload_signal(),
            "dry_run": self.dry_run,
            "off_switch": self.off_switch.seen.to_json() if self.off_switch.seen else None,
            "first_pass": self.first_pass,
            "last_pass": self.last_pass,
            "fast_paths": fast_status() if fast_status is not None else {},
            **self.ledger.to_json(),
        }
        path = self.root.path(STATUS_FILE)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_new(path, json.dumps(doc, indent=1).encode(), mode=0o644)
        except OSError as e:
            self.log.debug(f"cannot write {path}: {e}")
        except GpuguardError as e:  # a state directory that is a link or not root's
            self.log.warning(f"status file not written: {e.message}")
        if self.metrics is not None:
            self.metrics.after_pass(
                self.last_pass, doc, self.root, self.config.metrics.textfile_directory, self.log
            )
