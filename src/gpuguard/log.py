"""Structured event log: journald entries when run under journald, JSON lines otherwise.

Every entry has a `kind` with a fixed MESSAGE_ID (see gpuguard.catalog), so
`journalctl -x` can explain it and `journalctl MESSAGE_ID=...` can find it. Without
journald the same entry is one JSON line on stderr, in the shape Alibaba's gpuops
used (`level`, `msg`, `time`) plus the structured fields.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from datetime import datetime, timezone
from typing import Any, Callable, Mapping, Optional, TextIO

from gpuguard.catalog import message_id
from gpuguard.model import Finding, Outcome

LEVELS = {"debug": 7, "info": 6, "notice": 5, "warning": 4, "error": 3}

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


def journal_sender() -> Optional[Sender]:
    try:
        from systemd import journal  # python3-systemd; optional
    except ImportError:
        return None
    send: Sender = journal.send
    return send


class EventLog:
    """The one logger, built in main() and passed to whoever logs."""

    def __init__(
        self,
        *,
        level: str = "info",
        stream: Optional[TextIO] = None,  # default: sys.stderr as it is when built
        journal: Optional[Sender] = None,
        static_fields: Optional[Mapping[str, str]] = None,
    ) -> None:
        self.threshold = LEVELS[level]
        self.stream = stream if stream is not None else sys.stderr
        self.journal = journal
        self.static = dict(static_fields or {})

    @classmethod
    def auto(cls, *, level: str = "info", force_json: bool = False) -> EventLog:
        sender = None if force_json or not under_journald(sys.stderr) else journal_sender()
        return cls(level=level, journal=sender)

    def set_level(self, level: str) -> None:
        self.threshold = LEVELS[level]

    def event(
        self,
        kind: str,
        msg: str,
        *,
        level: str = "info",
        fields: Optional[Mapping[str, Any]] = None,
        exc: Optional[BaseException] = None,
    ) -> None:
        prio = LEVELS[level]
        if prio > self.threshold:
            return
        extra = {**self.static, **{k: str(v) for k, v in (fields or {}).items()}}
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)) if exc else ""
        if self.journal is not None:
            jf = {k.upper(): v for k, v in extra.items()}
            if tb:
                jf["TRACEBACK"] = tb
            self.journal(
                msg,
                PRIORITY=str(prio),
                MESSAGE_ID=message_id(kind),
                SYSLOG_IDENTIFIER="gpuguard",
                GPUGUARD_KIND=kind,
                **jf,
            )
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
        )

    def outcome(self, o: Outcome) -> None:
        """One journal entry per change (or declined/failed change), with its reason."""
        a = o.action
        level = {"done": "notice", "failed": "error", "declined": "warning"}.get(o.status, "info")
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
