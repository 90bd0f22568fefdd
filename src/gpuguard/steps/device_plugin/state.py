"""What the device plugin step remembers across restarts of gpuguard: per plugin, its
restart budget, back-off and pending verification (plugin-restarts.json), and how
that file is read (a bad file starts the budgets afresh, with a warning)."""

from __future__ import annotations

import errno
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from gpuguard.devices.processes import ProcessInfo
from gpuguard.host import safeio
from gpuguard.host.paths import STATE_DIR

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
    def from_json(cls, d: dict[str, Any]) -> PluginState:
        def proc(v: Any) -> Optional[ProcessInfo]:
            return ProcessInfo.from_json(v) if isinstance(v, dict) else None

        def ok(v: Any) -> bool:  # a finite time or count, as this daemon writes them
            return isinstance(v, (int, float)) and -(2**53) <= v <= 2**53

        def num(v: Any) -> float:
            return float(v) if ok(v) else 0.0

        r = d.get("restarts")
        return cls(
            restarts=[float(x) for x in r if ok(x)] if isinstance(r, list) else [],
            failures=int(num(d.get("failures"))),
            last_failure=num(d.get("last_failure")),
            last=proc(d.get("last")),
            last_seen=num(d.get("last_seen")),
            socket=str(d.get("socket") or ""),
            pending_since=num(d.get("pending_since")),
            pending_deadline=num(d.get("pending_deadline")),
            pending_old=proc(d.get("pending_old")),
        )


def read_states(path: Path, elog: EventLog) -> dict[str, PluginState]:
    """The remembered state of each plugin, by identity ({} when absent or unreadable)."""
    try:
        doc = json.loads(
            safeio.read_text(path, what="plugin state file", max_bytes=safeio.STATUS_MAX)
        )
        plugins = doc.get("plugins", {}) if isinstance(doc, dict) else {}
        return {str(k): PluginState.from_json(v) for k, v in plugins.items() if isinstance(v, dict)}
    except safeio.UnsafeFileError as e:
        if e.errno != errno.ENOENT:
            elog.warning(f"ignoring {e.message}; plugin restart budgets start afresh")
        return {}
    except (OSError, ValueError, AttributeError, RecursionError) as e:
        elog.warning(f"ignoring unreadable {path} ({e}); plugin restart budgets start afresh")
        return {}
