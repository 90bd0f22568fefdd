"""Structured event log: every entry to journald when the host has one, and to stderr.

Every entry has a `kind` with a fixed MESSAGE_ID (see gpuguard.journal.catalog), so
`journalctl -x` can explain it and `journalctl MESSAGE_ID=...` can find it. Entries go
to the journal whenever the root's journald socket exists, whatever stderr is: a
person's `gpuguard check` on a terminal leaves the same record as the daemon. stderr
gets one human-readable line per entry, or one JSON line (the shape Alibaba's gpuops
used: `level`, `msg`, `time`, plus the structured fields) when asked with `--log-json`
or GPUGUARD_LOG_FORMAT=json; nothing when stderr already is the journal (no duplicate).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import stat
import struct
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, TextIO

from gpuguard.host.echo import cut
from gpuguard.journal.catalog import message_id
from gpuguard.model import Finding, Outcome

LEVELS = {"debug": 7, "info": 6, "notice": 5, "warning": 4, "error": 3}
MESSAGE_MAX = 2000  # characters of one journal message: a few findings' worth
FIELD_MAX = 1000  # of one structured field's value

Sender = Callable[..., None]


def under_journald(stream: TextIO) -> bool:
    """True when `stream` is connected to journald (systemd sets JOURNAL_STREAM=dev:ino)."""
    value = os.environ.get("JOURNAL_STREAM", "")
    if ":" not in value:
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError):
        return False
    dev, _, ino = value.partition(":")
    return f"{st.st_dev}:{st.st_ino}" == f"{dev}:{ino}"


JOURNAL_SOCKET = "/run/systemd/journal/socket"
FORMAT_ENV = "GPUGUARD_LOG_FORMAT"  # json | text
_BAD_KEY = re.compile(r"[^A-Z0-9_]")


class JournalSocket:
    """journald's native protocol (systemd.io/JOURNAL_NATIVE_PROTOCOL) on a given socket.

    Not python3-systemd's journal.send: that always writes to the running system's
    socket, while `--root /proc/PID/root` (a node in another mount namespace) must log
    to that node's journald, and a test root without one must log to none. One
    datagram per entry; an OSError (no journald, entry too large) is the caller's
    signal to fall back to stderr.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._sock: Optional[socket.socket] = None

    def __call__(self, msg: str, **fields: str) -> None:
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        out = bytearray()
        for key, value in {"MESSAGE": msg, **fields}.items():
            k = _BAD_KEY.sub("_", key.upper()).lstrip("_").encode() or b"X"
            v = str(value).encode("utf-8", "replace")
            if b"\n" in v:  # binary-safe form: KEY, newline, 64-bit LE length, data
                out += k + b"\n" + struct.pack("<Q", len(v)) + v + b"\n"
            else:
                out += k + b"=" + v + b"\n"
        self._sock.sendto(bytes(out), str(self.path))


def journal_sender(root_prefix: Path) -> Optional[Sender]:
    """A sender to the journald of the host at `root_prefix`, or None without one."""
    path = root_prefix / JOURNAL_SOCKET.lstrip("/")
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return None
    except OSError:
        return None
    return JournalSocket(path)


class EventLog:
    """The one logger, built in main() and passed to whoever logs."""

    def __init__(
        self,
        *,
        level: str = "info",
        stream: Optional[TextIO] = None,  # default: sys.stderr as it is when built
        journal: Optional[Sender] = None,
        static_fields: Optional[Mapping[str, str]] = None,
        stream_format: str = "json",  # json | text | none (stderr already is the journal)
    ) -> None:
        self.threshold = LEVELS[level]
        self.stream = stream if stream is not None else sys.stderr
        self.journal = journal
        self.static = dict(static_fields or {})
        self.stream_format = stream_format
        self._routed: list[logging.Logger] = []  # module loggers sent here (route_modules)
        # False: findings and outcomes are not written to stderr as text, because the
        # command prints them itself (`gpuguard check`'s report): each fact once. The
        # journal and --log-json still get every entry.
        self.facts_as_text = True
        # The daemon's: an outcome that is not a change (a dry-run plan, a declined or
        # failed action) said again within this many seconds goes to debug, so a plan
        # repeated by every pass is journaled once an hour. None: every time (one-shots).
        self.repeat_window: Optional[float] = None
        self._repeats: dict[tuple[str, ...], float] = {}

    @classmethod
    def auto(
        cls, *, level: str = "info", force_json: bool = False, root: Path = Path("/")
    ) -> EventLog:
        """Journal when the root has one; stderr: JSON when asked (option or
        GPUGUARD_LOG_FORMAT=json), nothing when it is the journal, text otherwise."""
        sender = journal_sender(root)
        if force_json or os.environ.get(FORMAT_ENV, "").lower() == "json":
            fmt = "json"
        elif sender is not None and under_journald(sys.stderr):
            fmt = "none"
        else:
            fmt = "text"
        return cls(level=level, journal=sender, stream_format=fmt)

    def set_level(self, level: str) -> None:
        self.threshold = LEVELS[level]
        for logger in self._routed:
            logger.setLevel(self._stdlib_level())

    def _stdlib_level(self) -> int:
        # Below LogLevel=debug a module's debug call costs no record at all.
        return logging.DEBUG if self.threshold >= LEVELS["debug"] else logging.INFO

    def route_modules(self, package: str = "gpuguard") -> None:
        """Send every module logger under `package` (``logging.getLogger(__name__)`` in
        devices/, steps/, ...) to this log, at its level: their debug lines reach the
        journal with LogLevel=debug instead of Python's last-resort handler."""
        logger = logging.getLogger(package)
        logger.handlers[:] = [_Bridge(self)]
        logger.propagate = False
        logger.setLevel(self._stdlib_level())
        self._routed = [logger]

    def event(
        self,
        kind: str,
        msg: str,
        *,
        level: str = "info",
        fields: Optional[Mapping[str, Any]] = None,
        exc: Optional[BaseException] = None,
        fact: bool = False,
    ) -> None:
        prio = LEVELS[level]
        if prio > self.threshold:
            return
        # Whatever a message echoes (file contents, names, command output): one line,
        # bounded and escaped (host/echo.py); a field's value bounded (journald and the
        # JSON lines carry a newline in a field safely)
        msg = cut(msg, MESSAGE_MAX)
        extra = {**self.static, **{k: str(v)[:FIELD_MAX] for k, v in (fields or {}).items()}}
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)) if exc else ""
        sent = False
        if self.journal is not None:
            jf = {k.upper(): v for k, v in extra.items()}
            if tb:
                jf["TRACEBACK"] = tb
            try:
                self.journal(
                    msg,
                    PRIORITY=str(prio),
                    MESSAGE_ID=message_id(kind),
                    SYSLOG_IDENTIFIER="gpuguard",
                    GPUGUARD_KIND=kind,
                    **jf,
                )
                sent = True
            except OSError:
                pass  # journald gone or the entry too large: stderr still has it
        fmt = self.stream_format
        if fmt == "none" and not sent:
            fmt = "text"
        if fmt == "text" and (self.facts_as_text or not fact):
            self.stream.write(f"gpuguard: {level}: {msg} [{kind}]\n" + tb)
            self.stream.flush()
        if fmt != "json":
            return
        line: dict[str, Any] = {
            "level": level,
            "msg": msg,
            "time": datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds"),
            "kind": kind,
        }
        line.update(extra)
        if tb:
            line["traceback"] = tb
        self.stream.write(json.dumps(line, ensure_ascii=False) + "\n")
        self.stream.flush()

    def finding(self, f: Finding) -> None:
        self.event(
            f.kind,
            f.summary,
            level=f.severity,
            fields={"GPUGUARD_RECONCILER": f.reconciler, **f.fields},
            fact=True,
        )

    def outcome(self, o: Outcome) -> None:
        """One journal entry per change (or declined/failed change), with its reason."""
        a = o.action
        level = {"done": "notice", "failed": "error", "declined": "warning"}.get(o.status, "info")
        # A plan (dry-run) is the same plan whatever its detail says of the host now
        # (a program id that each daemon-reload renews): keyed by what it would change.
        said = a.describe() if o.status == "dry-run" else o.detail
        if o.status != "done" and self._repeated((a.kind, a.target, o.status, said)):
            level = "debug"
        detail = f": {o.detail}" if o.detail else ""
        self.event(
            a.kind,
            f"{a.describe()} [{o.status}{detail}]",
            level=level,
            fields={
                "GPUGUARD_RECONCILER": a.reconciler,
                "GPUGUARD_ACTION": a.kind,
                "GPUGUARD_STATUS": o.status,
                **a.fields(),
            },
            fact=True,
        )

    def _repeated(self, key: tuple[str, ...]) -> bool:
        """Whether `key` was journaled within repeat_window (and if not: it is now)."""
        if self.repeat_window is None:
            return False
        now = time.monotonic()
        last = self._repeats.get(key)
        if last is not None and now - last < self.repeat_window:
            return True
        if len(self._repeats) > 4096:  # forget what is long past
            self._repeats = {k: t for k, t in self._repeats.items() if now - t < self.repeat_window}
        self._repeats[key] = now
        return False

    def crashed(self, reconciler: str, what: str, exc: BaseException) -> None:
        """A bug in a step (`what` raised `exc`): the step's name and the traceback; the
        caller goes on."""
        self.event(
            "reconciler-crashed",
            f"{what} raised {type(exc).__name__}: {exc}",
            level="error",
            fields={"GPUGUARD_RECONCILER": reconciler},
            exc=exc,
        )

    def debug(self, msg: str, **fields: Any) -> None:
        self.event("debug", msg, level="debug", fields=fields)

    def info(self, msg: str, **fields: Any) -> None:
        self.event("info", msg, level="info", fields=fields)

    def warning(self, msg: str, **fields: Any) -> None:
        self.event("warning", msg, level="warning", fields=fields)

    def error(self, msg: str, **fields: Any) -> None:
        self.event("error", msg, level="error", fields=fields)


class _Bridge(logging.Handler):
    """Routes a library's stdlib logging into the EventLog (one logger, one format)."""

    def __init__(self, log: EventLog) -> None:
        super().__init__()
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        level = {50: "error", 40: "error", 30: "warning", 20: "info"}.get(record.levelno, "debug")
        exc = record.exc_info[1] if record.exc_info else None
        self.log.event(level, record.getMessage(), level=level, exc=exc)


def stdlib_logger(log: EventLog, name: str) -> logging.Logger:
    logger = logging.getLogger(f"gpuguard.{name}")
    logger.handlers[:] = [_Bridge(log)]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger
