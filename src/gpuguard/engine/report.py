"""What the daemon reports after each pass: the status file's model built from its
state (reporting/status.py), written through the one state-file writer, then the
metrics from the same model."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Mapping, Optional, Protocol

from gpuguard.engine.passes import STATUS_FILE
from gpuguard.errors import GpuguardError
from gpuguard.reporting.metrics_state import RESET_HISTOGRAM
from gpuguard.reporting.status import SPEC as STATUS_SPEC
from gpuguard.reporting.status import Status
from gpuguard.reporting.status_figures import FastPaths, ReloadSignal
from gpuguard.steps.registry import ReloadFastPath, ResetRepairTimes

if TYPE_CHECKING:
    from gpuguard.config import Config
    from gpuguard.engine.executor import ChangeExecutor
    from gpuguard.engine.operation import OffSwitchGate
    from gpuguard.host.paths import Root
    from gpuguard.host.systemd import Systemd
    from gpuguard.journal.log import EventLog
    from gpuguard.reporting.ledger import Ledger
    from gpuguard.reporting.metrics_output import MetricsOutput
    from gpuguard.reporting.status import PassRecord
    from gpuguard.sources.systemd import SystemdSource
    from gpuguard.steps.registry import Step


class Reporting(Protocol):
    """What the daemon's report reads of it (engine/daemon.py's Daemon)."""

    @property
    def root(self) -> Root: ...
    @property
    def config(self) -> Config: ...
    @property
    def log(self) -> EventLog: ...
    @property
    def apply(self) -> ChangeExecutor: ...
    @property
    def steps(self) -> Mapping[str, Step]: ...
    @property
    def passes(self) -> int: ...
    @property
    def started_wall(self) -> float: ...
    @property
    def first_pass(self) -> Optional[PassRecord]: ...
    @property
    def last_pass(self) -> Optional[PassRecord]: ...
    @property
    def ledger(self) -> Ledger: ...
    @property
    def metrics(self) -> Optional[MetricsOutput]: ...
    @property
    def sd_source(self) -> Optional[SystemdSource]: ...
    @property
    def systemd(self) -> Optional[Systemd]: ...
    @property
    def off_switch(self) -> OffSwitchGate: ...


def reload_signal(sd: Optional[SystemdSource]) -> ReloadSignal:
    """Where systemd's Reloading comes from (sources/reload_socket.py)."""
    if sd is None:
        return ReloadSignal()
    private = sd.private
    return ReloadSignal(
        private_socket=private is not None and private.connected,
        last_via=sd.last_reload_via,
        reloads=sd.reloads_acted,  # every reload arrives on both paths, acted on once
        received={via: (n[0], n[1]) for via, n in sd.received.items()},
    )


def daemon_status(d: Reporting) -> Status:
    """The status file's model as of now."""
    from gpuguard.reporting.npd import judge_conditions

    fast_paths = FastPaths()
    for step in d.steps.values():
        if isinstance(step, ReloadFastPath):
            fast_paths = fast_paths.merged(step.fast_status())
    steps = dict(d.ledger.steps)
    node, conditions = judge_conditions(steps, time.time())
    return Status(
        pid=os.getpid(),
        started=d.started_wall,
        passes=d.passes,
        bus_connected=d.systemd is not None,
        dry_run=d.apply.mode == "observe",
        reload_signal=reload_signal(d.sd_source),
        first_pass=d.first_pass,
        last_pass=d.last_pass,
        fast_paths=fast_paths,
        steps=steps,
        recent_changes=d.ledger.recent_changes(),
        node=node,
        conditions=conditions,
        mode=d.apply.mode,
        off_switch=d.off_switch.seen,
    )


def write_status(d: Reporting) -> None:
    """The status file, then the metrics after the pass."""
    from gpuguard.actuate.statefile import write_state

    status = daemon_status(d)
    path = d.root.path(STATUS_FILE)
    try:
        write_state(path, STATUS_SPEC, status)
    except OSError as e:
        d.log.debug(f"cannot write {path}: {e}")
    except GpuguardError as e:  # a state directory that is a link or not root's
        d.log.warning(f"status file not written: {e.message}")
    if d.metrics is not None and d.last_pass is not None:
        for step in d.steps.values():  # the fast paths' repairs since the last pass
            if isinstance(step, ResetRepairTimes):
                for seconds in step.take_reset_seconds():
                    d.metrics.state.observe(RESET_HISTOGRAM, seconds)
        d.metrics.after_pass(
            d.last_pass, status, d.root, d.config.metrics.textfile_directory, d.log
        )
