"""The daemon's own figures in its status file (reporting/status.py): where systemd's
Reloading came from (sources/reload_socket.py) and the fast paths' last repairs, read
through the same typed loader."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from gpuguard.host.statefile import Obj, SchemaError, number

COUNT_MAX = 2**53  # a count: exact in a JSON reader's double


@dataclass(frozen=True)
class ReloadSignal:
    """Where systemd's Reloading came from (sources/reload_socket.py)."""

    private_socket: bool = False
    last_via: str = ""
    reloads: int = 0
    received: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # via -> starts, ends

    @classmethod
    def parse(cls, v: Any, where: str) -> ReloadSignal:
        o = Obj(v, where)

        def pair(x: Any, w: str) -> tuple[int, int]:
            p = Obj(x, w)
            return p.integer("starts", hi=COUNT_MAX), p.integer("ends", hi=COUNT_MAX)

        return cls(
            private_socket=o.flag("private_socket"),
            last_via=o.text("last_via", max_len=64),
            reloads=o.integer("reloads", hi=COUNT_MAX),
            received=o.mapping("received", pair, max_items=16),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "private_socket": self.private_socket,
            "last_via": self.last_via,
            "reloads": self.reloads,
            "received": {k: {"starts": s, "ends": e} for k, (s, e) in self.received.items()},
        }


Figure = Union[int, float, tuple[float, ...]]


def _figure(v: Any, where: str) -> Figure:
    """A count (kept an integer, as written), a figure, or a few (p50, p99)."""
    if isinstance(v, list):
        if len(v) > 8:
            raise SchemaError(f"{where}: more than 8 numbers")
        return tuple(number(x, f"{where}[{i}]") for i, x in enumerate(v))
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) <= COUNT_MAX:
        return v
    return number(v, where)


FigureIn = Union[int, float, Sequence[float]]


def figures(values: Mapping[str, FigureIn]) -> dict[str, Figure]:
    """A fast path's figures as the status file's loader reads them back (`_figure`): a
    count kept an integer, a figure a float, a few (p50, p99) a tuple of floats; so
    the daemon's own model is the one `gpuguard status` reads from its file."""
    out: dict[str, Figure] = {}
    for k, v in values.items():
        if isinstance(v, (int, float)):
            count = isinstance(v, int) and not isinstance(v, bool) and abs(v) <= COUNT_MAX
            out[k] = v if count else float(v)
        else:
            out[k] = tuple(float(x) for x in v)
    return out


def _real(v: Optional[float]) -> Optional[float]:
    return None if v is None else float(v)


@dataclass(frozen=True)
class ReloadFigures:
    """The reload fast path's last repair (container_access durable.ReloadRepair)."""

    signal: float
    containers: int
    checked: int
    first_write: Optional[float] = None
    last_write: Optional[float] = None
    cpu_ms: Optional[float] = None
    cpu_wait_ms: Optional[float] = None
    restored: Optional[float] = None

    @classmethod
    def of(
        cls,
        signal: float,
        containers: int,
        checked: int,
        first_write: Optional[float] = None,
        last_write: Optional[float] = None,
        cpu_ms: Optional[float] = None,
        cpu_wait_ms: Optional[float] = None,
        restored: Optional[float] = None,
    ) -> ReloadFigures:
        """From the fast path's own figures, as the loader reads them (reals as floats)."""
        return cls(
            float(signal),
            containers,
            checked,
            _real(first_write),
            _real(last_write),
            _real(cpu_ms),
            _real(cpu_wait_ms),
            _real(restored),
        )

    @classmethod
    def parse(cls, v: Any, where: str) -> ReloadFigures:
        o = Obj(v, where)
        return cls(
            signal=o.real("signal"),
            containers=o.integer("containers", hi=COUNT_MAX),
            checked=o.integer("checked", hi=COUNT_MAX),
            first_write=o.opt_real("first_write"),
            last_write=o.opt_real("last_write"),
            cpu_ms=o.opt_real("cpu_ms"),
            cpu_wait_ms=o.opt_real("cpu_wait_ms"),
            restored=o.opt_real("restored"),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "signal": self.signal,
            "containers": self.containers,
            "checked": self.checked,
            "first_write": self.first_write,
            "last_write": self.last_write,
            "cpu_ms": self.cpu_ms,
            "cpu_wait_ms": self.cpu_wait_ms,
            "restored": self.restored,
        }


@dataclass(frozen=True)
class FastPaths:
    """The fast paths' last figures: the reload's re-grant, new scopes' grants, the
    grants set again after a scope's DeviceAllow= was reset at runtime, and the device
    watch's repairs of cgroups rewritten behind systemd's back."""

    reload: Optional[ReloadFigures] = None
    new_scopes: Mapping[str, Figure] = field(default_factory=dict)
    scope_resets: Mapping[str, Figure] = field(default_factory=dict)
    device_watch: Mapping[str, Figure] = field(default_factory=dict)

    @classmethod
    def parse(cls, v: Any, where: str) -> FastPaths:
        o = Obj(v, where)
        reload = o.opt_obj("reload")
        return cls(
            reload=ReloadFigures.parse(reload.doc, reload.where) if reload else None,
            new_scopes=o.mapping("new_scopes", _figure, max_items=32, default={}),
            scope_resets=o.mapping("scope_resets", _figure, max_items=32, default={}),
            device_watch=o.mapping("device_watch", _figure, max_items=32, default={}),
        )

    def merged(self, other: FastPaths) -> FastPaths:
        """`other`'s figures over these, where it has them (one step has fast paths)."""
        return FastPaths(
            reload=other.reload if other.reload is not None else self.reload,
            new_scopes=other.new_scopes or self.new_scopes,
            scope_resets=other.scope_resets or self.scope_resets,
            device_watch=other.device_watch or self.device_watch,
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            name: {k: list(v) if isinstance(v, tuple) else v for k, v in figures.items()}
            for name, figures in (
                ("new_scopes", self.new_scopes),
                ("scope_resets", self.scope_resets),
                ("device_watch", self.device_watch),
            )
        }
        if self.reload is not None:
            out["reload"] = self.reload.to_json()
        return out
