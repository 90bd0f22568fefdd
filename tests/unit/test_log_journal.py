"""EventLog's journald output: the native protocol on the root's socket, whatever stderr
is, and stderr as text, JSON (when asked) or nothing (when it is the journal)."""

from __future__ import annotations

import io
import json
import socket
import struct
from pathlib import Path

import pytest

from gpuguard.journal.catalog import message_id
from gpuguard.journal.log import FORMAT_ENV, EventLog, journal_sender


def parse_native(data: bytes) -> dict[str, str]:
    """journald's side of the native protocol."""
    out: dict[str, str] = {}
    while data:
        line, _, rest = data.partition(b"\n")
        if b"=" in line:
            k, _, v = line.partition(b"=")
            out[k.decode()] = v.decode()
            data = rest
        else:
            (n,) = struct.unpack("<Q", rest[:8])
            out[line.decode()] = rest[8 : 8 + n].decode()
            assert rest[8 + n : 9 + n] == b"\n"
            data = rest[9 + n :]
    return out


@pytest.fixture
def journald(tmp_path: Path):  # type: ignore[no-untyped-def]
    path = tmp_path / "run/systemd/journal/socket"
    path.parent.mkdir(parents=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(2)
    yield s
    s.close()


def test_entries_go_to_the_roots_journal_and_text_to_a_terminal(
    tmp_path: Path, journald: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(FORMAT_ENV, raising=False)
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    log = EventLog.auto(root=tmp_path)
    stream = io.StringIO()
    log.stream = stream
    log.event(
        "checkpoint-repaired",
        "rewrote it",
        level="notice",
        fields={"backup": "/b", "traceback-ish": "two\nlines"},
    )
    entry = parse_native(journald.recv(65536))
    assert entry["MESSAGE"] == "rewrote it" and entry["PRIORITY"] == "5"
    assert entry["MESSAGE_ID"] == message_id("checkpoint-repaired")
    assert entry["SYSLOG_IDENTIFIER"] == "gpuguard" and entry["BACKUP"] == "/b"
    assert entry["TRACEBACK_ISH"] == "two\nlines"
    assert stream.getvalue() == "gpuguard: notice: rewrote it [checkpoint-repaired]\n"


def test_json_on_stderr_only_when_asked(
    tmp_path: Path, journald: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FORMAT_ENV, "json")
    log = EventLog.auto(root=tmp_path)
    log.stream = io.StringIO()
    log.event("info", "hello")
    assert parse_native(journald.recv(65536))["MESSAGE"] == "hello"
    assert json.loads(log.stream.getvalue())["msg"] == "hello"


def test_no_journald_under_the_root_falls_back_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(FORMAT_ENV, raising=False)
    assert journal_sender(tmp_path) is None
    log = EventLog.auto(root=tmp_path)
    log.stream = io.StringIO()
    log.event("warning", "careful", level="warning")
    assert log.stream.getvalue() == "gpuguard: warning: careful [warning]\n"


def test_a_journald_that_went_away_still_leaves_the_entry_on_stderr(
    tmp_path: Path, journald: socket.socket
) -> None:
    log = EventLog(journal=journal_sender(tmp_path), stream=io.StringIO(), stream_format="none")
    journald.close()
    (tmp_path / "run/systemd/journal/socket").unlink()
    log.event("error", "lost", level="error")
    assert log.stream.getvalue() == "gpuguard: error: lost [error]\n"
