"""The metrics endpoint cannot be blocked: idle, slow and oversized clients held open
beside a scrape, the oldest waiting connection closed at the limit, every connection
closed after its request timeout. Latency is measured by bench/bench_metrics_http.py,
not asserted here."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from gpuguard.reporting import metrics_http
from gpuguard.reporting.metrics import render_file
from gpuguard.reporting.metrics_file import SPEC
from gpuguard.reporting.metrics_http import listen, make_server
from gpuguard.reporting.metrics_state import MetricsState
from unit.test_metrics import a_pass


@pytest.fixture
def state_file(tmp_path: Path) -> Path:
    state = MetricsState()
    state.observe_pass(*a_pass())
    path = tmp_path / "metrics.json"
    path.write_bytes(SPEC.encode(state.to_values()))
    return path


def serving(path: Path, disabled: Any = lambda: False) -> Any:
    server = make_server(listen("127.0.0.1:0"), path, render_file, disabled)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def server(state_file: Path) -> Iterator[Any]:
    s = serving(state_file)
    yield s
    s.shutdown()
    s.server_close()


def scrape(server: Any, timeout: float = 10.0) -> tuple[int, bytes]:
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def connect(server: Any) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=10)


def still_open(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        s.setblocking(True)


def test_a_scrape_is_answered_beside_idle_slow_and_oversized_clients(server: Any) -> None:
    idle = [connect(server) for _ in range(40)]
    slow = [connect(server) for _ in range(20)]
    for s in slow:
        s.sendall(b"GET /metr")  # and then nothing more for now
    big = connect(server)
    big.sendall(b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * 20000 + b"\r\n\r\n")
    try:
        code, body = scrape(server)
        assert code == 200 and b"gpuguard_passes_total 1.0" in body
        # ... while every idle and slow client is still connected
        assert all(still_open(s) for s in idle + slow)
        answer = big.recv(65536)
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:80]
        for s in slow:  # a slow client that finishes in time is answered too
            s.sendall(b"ics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert all(s.recv(65536).startswith(b"HTTP/1.1 200 ") for s in slow)
    finally:
        for s in [*idle, *slow, big]:
            s.close()


def test_at_the_limit_the_oldest_waiting_connection_makes_room(
    state_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics_http, "MAX_CONNECTIONS", 8)
    server = serving(state_file)
    held = [connect(server) for _ in range(8)]
    try:
        deadline = time.monotonic() + 10
        while server.open < 8 and time.monotonic() < deadline:  # all accepted
            time.sleep(0.01)
        code, _ = scrape(server)
        assert code == 200
        assert not still_open(held[0]) and still_open(held[-1])
    finally:
        for s in held:
            s.close()
        server.shutdown()
        server.server_close()


def test_a_connection_without_a_request_is_closed_after_the_timeout(
    state_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics_http, "REQUEST_TIMEOUT", 0.3)
    server = serving(state_file)
    s = connect(server)
    try:
        s.settimeout(10)
        assert s.recv(1) == b""  # closed by the server, no answer
    finally:
        s.close()
        server.shutdown()
        server.server_close()


def test_bad_requests_get_one_line_answers(server: Any) -> None:
    for request, status in (
        (b"POST /metrics HTTP/1.1\r\n\r\n", b"405"),
        (b"GET /other HTTP/1.1\r\n\r\n", b"404"),
        (b"nonsense\r\n\r\n", b"400"),
        (b"HEAD /metrics HTTP/1.1\r\n\r\n", b"200"),
    ):
        s = connect(server)
        try:
            s.sendall(request)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        finally:
            s.close()
        assert answer.split(b" ", 2)[1] == status, answer[:80]
        if request.startswith(b"HEAD"):
            assert answer.endswith(b"\r\n\r\n")  # headers only


def test_the_off_switch_is_reported_even_without_the_daemons_file(tmp_path: Path) -> None:
    server = serving(tmp_path / "metrics.json", lambda: True)
    try:
        code, body = scrape(server)
        assert code == 200 and b"\ngpuguard_disabled 1.0\n" in body
    finally:
        server.shutdown()
        server.server_close()


def test_while_off_every_condition_is_unknown_whatever_the_last_pass_found(
    state_file: Path,
) -> None:
    """The daemon's last metrics say ok or problem; with the switch set nothing is
    checked, so the scrape says unknown, as `gpuguard npd` does (never OK)."""
    on = render_file(state_file, False).decode()
    assert (
        'gpuguard_node_condition_status{condition="GPUDeviceAccessLost",status="unknown"} 0.0' in on
    )
    off = render_file(state_file, True).decode()
    lines = [line for line in off.splitlines() if line.startswith("gpuguard_node_condition")]
    assert lines and all(line.endswith(" 0.0") != ('status="unknown"' in line) for line in lines)
    assert not any(line.startswith("gpuguard_node_condition{") for line in lines)
    assert "\ngpuguard_disabled 1.0\n" in off
