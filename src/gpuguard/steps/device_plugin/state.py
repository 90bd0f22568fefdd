"""What the device plugin step remembers across restarts of gpuguard: per plugin, its
restart budget, back-off and pending verification (plugin-restarts.json), and how
that file is read (a bad file starts the budgets afresh, with a warning)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from gpuguard.devices.processes import ProcessInfo
from gpuguard.host.paths import STATE_DIR
from gpuguard.host.statefile import Obj, StateFile, load, number

if TYPE_CHECKING:
    from gpuguard.journal.log import EventLog

STATE_FILE = f"{STATE_DIR}/plugin-restarts.json"


@dataclass
class PluginState:
    restarts: list[float] = field(default_factory=list)  # wall-clock times, last hour
    failures: int = 0  # consecutive failed attempts
    last_failure: float = 0.0
    last: Optional[ProcessInfo] = None  # the last process seen serving it
    last_seen: float = 0.0
    socket: str = ""
    pending_since: float = 0.0  # when the restart awaiting verification happened
    pending_deadline: float = 0.0  # restarted, not verified yet: give up after this
    pending_old: Optional[ProcessInfo] = None
    declined: str = ""  # code of the last decline, so repeats log quieter

    def to_json(self) -> dict[str, Any]:
        return {
            "restarts": self.restarts,
            "failures": self.failures,
            "last_failure": self.last_failure,
            "last": self.last.to_json() if self.last else None,
            "last_seen": self.last_seen,
            "socket": self.socket,
            "pending_since": self.pending_since,
            "pending_deadline": self.pending_deadline,
            "pending_old": self.pending_old.to_json() if self.pending_old else None,
        }

    @classmethod
    def parse(cls, v: Any, where: str) -> PluginState:
        o = Obj(v, where)
        return cls(
            restarts=list(o.items("restarts", lambda x, w: number(x, w, 0.0), max_items=1000)),
            failures=o.integer("failures", hi=1_000_000),
            last_failure=o.real("last_failure"),
            last=_process(o, "last"),
            last_seen=o.real("last_seen"),
            socket=o.text("socket", max_len=4096),
            pending_since=o.real("pending_since"),
            pending_deadline=o.real("pending_deadline"),
            pending_old=_process(o, "pending_old"),
        )


def _process(o: Obj, key: str) -> Optional[ProcessInfo]:
    p = o.opt_obj(key)
    if p is None:
        return None
    return ProcessInfo(
        pid=p.integer("pid", hi=2**22),
        start=p.real("start"),
        comm=p.text("comm", max_len=64),
        kind=p.text("kind", max_len=64),
        container_id=p.text("container_id", max_len=256),
        runtime=p.text("runtime", max_len=64),
        pod_uid=p.text("pod_uid", max_len=256),
        unit=p.text("unit", max_len=1024),
        cgroup=p.text("cgroup", max_len=4096),
    )


SPEC: StateFile[dict[str, PluginState]] = StateFile(
    path=STATE_FILE,
    what="plugin state file",
    version=1,
    parse=lambda o: o.mapping("plugins", PluginState.parse, max_items=1000),
    render=lambda states: {"plugins": {k: v.to_json() for k, v in sorted(states.items())}},
    mode=0o644,
)


def read_states(path: Path, elog: EventLog) -> dict[str, PluginState]:
    """The remembered state of each plugin, by identity ({} when absent; an unusable
    file is said once and the budgets start afresh)."""
    got = load(path, SPEC)
    if got.value is None:
        if not got.absent:
            elog.warning(f"ignoring {got.why}; plugin restart budgets start afresh")
        return {}
    return got.value
