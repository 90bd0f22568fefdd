"""Reloading from systemd's private socket (sources/reload_socket.py, dbuswire.py): the
wire reader judged against dbus-next's own marshaller, and the watch against a unix
socket server speaking the protocol's opening as systemd does: Reloading reported in
order among other signals, a closed connection made again (each connection announced,
so the source counts from there), garbage drops the connection with one warning and it
reconnects."""

from __future__ import annotations

import asyncio
import io
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from dbus_next import Message, MessageType, Variant
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.host.systemd import MANAGER
from gpuguard.journal.log import EventLog
from gpuguard.sources.dbuswire import FIXED, WireError, auth_request, header, reloading
from gpuguard.sources.reload_socket import PrivateReloadWatch

PATH = "/org/freedesktop/systemd1"


def _signal(member: str, signature: str = "", body: Optional[list[Any]] = None) -> bytes:
    iface = "org.freedesktop.DBus.Properties" if member == "PropertiesChanged" else MANAGER
    msg = Message(
        message_type=MessageType.SIGNAL,
        path=PATH,
        interface=iface,
        member=member,
        signature=signature,
        body=body or [],
    )
    return bytes(msg._marshall(negotiate_unix_fd=False))


RELOAD_TRUE = _signal("Reloading", "b", [True])
RELOAD_FALSE = _signal("Reloading", "b", [False])
UNIT_NEW = _signal("UnitNew", "so", ["a.service", "/org/freedesktop/systemd1/unit/a_2eservice"])
CHANGED = _signal(
    "PropertiesChanged",
    "sa{sv}as",
    ["org.freedesktop.systemd1.Unit", {"ActiveState": Variant("s", "active")}, []],
)


def _judge(raw: bytes) -> Optional[bool]:
    h = header(raw[:FIXED])
    assert h.total == len(raw)
    return reloading(raw, h)


def test_reloading_is_read_from_its_header_and_nothing_else_is() -> None:
    assert _judge(RELOAD_TRUE) is True and _judge(RELOAD_FALSE) is False
    assert _judge(UNIT_NEW) is None and _judge(CHANGED) is None
    # "Reloading" from another interface is not systemd's
    other = Message(
        message_type=MessageType.SIGNAL, path=PATH, interface="x.y", member="Reloading",
        signature="b", body=[False],
    )  # fmt: skip
    assert _judge(bytes(other._marshall(False))) is None
    assert auth_request(0) == b"\0AUTH EXTERNAL 30\r\n"


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"x" + RELOAD_FALSE[1:], "endianness"),
        (RELOAD_FALSE[:3] + b"\x02" + RELOAD_FALSE[4:], "version"),
        (RELOAD_FALSE[:4] + (1 << 30).to_bytes(4, "little") + RELOAD_FALSE[8:], "bytes"),
    ],
)
def test_a_bad_fixed_header_is_refused(raw: bytes, why: str) -> None:
    with pytest.raises(WireError, match=why):
        header(raw[:FIXED])


@settings(max_examples=400, deadline=None)
@given(st.binary(min_size=FIXED, max_size=300), st.integers(0, 299), st.binary(max_size=8))
def test_no_input_raises_anything_but_wire_error(raw: bytes, at: int, patch: bytes) -> None:
    """Random bytes, and real signals with a few bytes changed anywhere."""
    for data in (raw, (RELOAD_FALSE[:at] + patch + RELOAD_FALSE[at + len(patch) :])):
        try:
            h = header(data[:FIXED])
            reloading(data[: h.total], h)
        except WireError:
            pass


class FakeSystemd:
    """A unix socket server with systemd's side of the opening: reads the NUL and the
    AUTH line, answers OK, reads BEGIN, then sends what the test gives it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.queues: list[asyncio.Queue[Optional[bytes]]] = []  # one per connection
        self.auth: list[bytes] = []
        self.server: Optional[asyncio.AbstractServer] = None

    async def start(self) -> None:
        self.server = await asyncio.start_unix_server(self._client, str(self.path))

    async def send(self, data: Optional[bytes]) -> None:
        """To the newest connection (None: close it)."""
        await self.queues[-1].put(data)

    async def _client(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.auth.append(await r.readuntil(b"\r\n"))
        w.write(b"OK 0123456789abcdef0123456789abcdef\r\n")
        self.auth.append(await r.readuntil(b"\r\n"))
        q: asyncio.Queue[Optional[bytes]] = asyncio.Queue()
        self.queues.append(q)
        while True:
            data = await q.get()
            if data is None:
                w.close()
                return
            w.write(data)
            await w.drain()


async def _until(cond: Callable[[], bool], what: str) -> None:
    for _ in range(400):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_watch_reports_reloads_reconnects_and_survives_garbage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("gpuguard.sources.reload_socket.BACKOFF_FIRST", 0.01)
    out = io.StringIO()
    log = EventLog(stream=out, level="debug")
    got: list[bool] = []
    connects: list[int] = []

    def events() -> list[dict[str, Any]]:
        return [json.loads(line) for line in out.getvalue().splitlines()]

    async def scenario() -> None:
        sd = FakeSystemd(tmp_path / "private")
        watch = PrivateReloadWatch(sd.path, got.append, log, uid=os.geteuid())
        watch.on_connect = lambda: connects.append(len(connects) + 1)
        task = asyncio.ensure_future(watch.run())
        await asyncio.sleep(0.05)  # no server yet: one journal entry, retries quietly
        await sd.start()
        await _until(lambda: len(sd.queues) == 1, "the connection")
        assert sd.auth[0] == auth_request(os.geteuid()) and sd.auth[1] == b"BEGIN\r\n"
        for m in (UNIT_NEW, RELOAD_TRUE, CHANGED, UNIT_NEW, RELOAD_FALSE):
            await sd.send(m)
        await _until(lambda: got == [True, False], "a reload")
        # closed inside a reload (a reexec): nothing more (the bus brings its end)
        await sd.send(RELOAD_TRUE)
        await _until(lambda: got == [True, False, True], "the second start")
        await sd.send(None)
        await _until(lambda: len(sd.queues) == 2, "the reconnection")
        assert got == [True, False, True] and connects == [1, 2]
        got.append(False)  # (what the bus delivered meanwhile, for the counts below)
        # garbage: the connection is dropped with a warning, then made again
        await sd.send(b"\x00" * 16)
        await _until(lambda: any("unexpected data" in e["msg"] for e in events()), "the warning")
        await _until(lambda: len(sd.queues) == 3, "the reconnection after garbage")
        await sd.send(RELOAD_TRUE + RELOAD_FALSE)
        await _until(lambda: got[-2:] == [True, False] and len(got) == 6, "a later reload")
        watch.stop()
        await asyncio.wait_for(task, 2)
        assert sd.server is not None
        sd.server.close()

    asyncio.run(scenario())
    failed = [e for e in events() if e["kind"] == "dbus-lost" and "retrying" in e["msg"]]
    assert len(failed) == 1, failed  # the refused connections before the server: once
    warned = [e for e in events() if e.get("level") == "warning" or e.get("PRIORITY") == "4"]
    assert [e for e in warned if "unexpected data" in e["msg"]], events()


def test_a_connection_closed_during_authentication_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemd closing the socket before its OK (it refuses a peer it cannot see), or an
    answer line past the reader's limit, is a failed attempt like any other: retried."""
    monkeypatch.setattr("gpuguard.sources.reload_socket.BACKOFF_FIRST", 0.01)
    out = io.StringIO()
    got: list[bool] = []
    tries: list[int] = []

    async def server(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        tries.append(1)
        await r.readuntil(b"\r\n")
        if len(tries) == 1:  # closed at once
            w.close()
            return
        if len(tries) == 2:  # a line with no end
            w.write(b"x" * 200_000)
            await w.drain()
            await asyncio.sleep(1)
            w.close()
            return
        w.write(b"OK 0123456789abcdef0123456789abcdef\r\n")
        await r.readuntil(b"\r\n")
        w.write(RELOAD_TRUE + RELOAD_FALSE)
        await w.drain()
        await asyncio.sleep(1)

    async def scenario() -> None:
        srv = await asyncio.start_unix_server(server, str(tmp_path / "private"))
        watch = PrivateReloadWatch(
            tmp_path / "private", got.append, EventLog(stream=out, level="debug")
        )
        task = asyncio.ensure_future(watch.run())
        await _until(lambda: got == [True, False], "a reload after two failed attempts")
        assert len(tries) == 3 and not task.done()
        watch.stop()
        await asyncio.wait_for(task, 2)
        srv.close()

    asyncio.run(scenario())


def test_a_bug_in_the_report_ends_the_watch_with_it(tmp_path: Path) -> None:
    """The report runs in the read callback; an exception there is a bug: it reaches
    run()'s caller (the daemon exits 70) and is not taken for a closed socket."""

    def report(active: bool) -> None:
        raise RuntimeError("a bug")

    async def scenario() -> None:
        sd = FakeSystemd(tmp_path / "private")
        await sd.start()
        watch = PrivateReloadWatch(sd.path, report, EventLog(stream=io.StringIO()))
        task = asyncio.ensure_future(watch.run())
        await _until(lambda: len(sd.queues) == 1, "the connection")
        await sd.send(UNIT_NEW + RELOAD_TRUE)
        with pytest.raises(RuntimeError, match="a bug"):
            await asyncio.wait_for(task, 2)
        assert not watch.connected
        assert sd.server is not None
        sd.server.close()

    asyncio.run(scenario())
