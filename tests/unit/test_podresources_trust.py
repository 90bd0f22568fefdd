"""Only kubelet's podresources socket counts (steps/device_plugin/podresources.py): its
answer of 0 allocatable devices restarts plugins, so a pod with a read-write hostPath
on ``pod-resources`` must not be able to give it. Each case serves that answer (a
grpcio server, or a minimal HTTP/2 one run as nobody) from a place kubelet's is not:
reached through a link, a socket owned by a user, a directory others may write, a
server that is not root. Each is "unchecked" with the reason, never 0 allocatable."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuguard.host.paths import Root
from gpuguard.steps.device_plugin.podresources import METHOD, SOCKET, read_allocatable

SOCKETS = "/var/lib/kubelet/device-plugins"
PODRES = "var/lib/kubelet/pod-resources"


@pytest.fixture(autouse=True)
def _root() -> None:
    if os.geteuid() != 0:
        pytest.skip("root-owned sockets and chown need root")


@pytest.fixture
def short_root() -> Iterator[Path]:
    """A root whose socket path fits sun_path (108 bytes), unlike pytest's tmp_path."""
    d = Path(tempfile.mkdtemp(prefix="gg-prt-", dir="/tmp"))
    (d / PODRES).mkdir(parents=True)
    try:
        yield d
    finally:
        shutil.rmtree(d)


def serve_zero(path: Path) -> Any:
    """A GetAllocatableResources server on `path` that says: no device allocatable."""
    grpc = pytest.importorskip("grpc")
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    service, method = METHOD.strip("/").split("/")
    handler = grpc.unary_unary_rpc_method_handler(lambda _req, _ctx: b"")
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {method: handler}),)
    )
    server.add_insecure_port(f"unix:{path}" if not path.is_absolute() else f"unix://{path}")
    server.start()
    return server


def test_kubelet_s_own_socket_is_asked(short_root: Path) -> None:
    server = serve_zero(short_root / PODRES / "kubelet.sock")
    try:
        got = read_allocatable(Root(short_root), SOCKETS)
    finally:
        server.stop(0)
    assert got.unchecked == "" and got.counts == {}  # answered: 0 allocatable


def test_a_socket_reached_through_a_link_is_not_followed(short_root: Path) -> None:
    (short_root / "pod").mkdir()
    server = serve_zero(short_root / "pod/fake.sock")
    up = os.path.relpath(short_root / "pod/fake.sock", short_root / PODRES)  # followed as is
    os.symlink(up, short_root / PODRES / "kubelet.sock")
    try:
        got = read_allocatable(Root(short_root), SOCKETS)
    finally:
        server.stop(0)
    assert got.unchecked == (
        "not kubelet's socket: /var/lib/kubelet/pod-resources/kubelet.sock: a symbolic link"
    )


def test_a_socket_owned_by_a_user_is_not_asked(short_root: Path) -> None:
    sock = short_root / PODRES / "kubelet.sock"
    server = serve_zero(sock)
    os.chown(sock, 1000, 1000)
    try:
        got = read_allocatable(Root(short_root), SOCKETS)
    finally:
        server.stop(0)
    assert got.unchecked == (
        "not kubelet's socket: /var/lib/kubelet/pod-resources/kubelet.sock is owned by "
        "uid 1000, not root"
    )


def test_a_directory_others_may_write_is_not_trusted(short_root: Path) -> None:
    server = serve_zero(short_root / PODRES / "kubelet.sock")
    (short_root / PODRES).chmod(0o1777)  # a hostPath made writable for a pod
    try:
        got = read_allocatable(Root(short_root), SOCKETS)
    finally:
        server.stop(0)
    assert got.unchecked == (
        "not kubelet's socket: /var/lib/kubelet/pod-resources: a directory writable by "
        "others (sticky is not enough)"
    )


# A root-owned socket whose server runs as nobody: bound as root, listening after
# setuid, answering "0 allocatable" (HEADERS, an empty message, grpc-status 0).
NOBODY = """
import os, socket, struct, sys
def frame(kind, flags, payload):
    head = struct.pack(">I", len(payload))[1:] + bytes((kind, flags))
    return head + struct.pack(">I", 1) + payload
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
os.setgroups([]); os.setgid(65534); os.setuid(65534)
s.listen(1)
print("listening", flush=True)
s.settimeout(10)
conn, _ = s.accept()
conn.settimeout(10)
conn.recv(65536)
conn.sendall(frame(1, 4, b"\\x88") + frame(0, 0, b"\\x00" * 5)
             + frame(1, 5, b"\\x40\\x0bgrpc-status\\x010"))
try:
    while conn.recv(65536):
        pass
except OSError:
    pass
"""


def test_a_server_that_is_not_root_is_not_believed(short_root: Path) -> None:
    sock = short_root / PODRES / "kubelet.sock"
    with subprocess.Popen(
        [sys.executable, "-c", NOBODY, str(sock)], stdout=subprocess.PIPE, text=True
    ) as p:
        try:
            assert p.stdout is not None and p.stdout.readline() == "listening\n"
            assert sock.stat().st_uid == 0  # the file is root's: only the peer tells
            got = read_allocatable(Root(short_root), SOCKETS, timeout=5.0)
        finally:
            p.kill()
    assert got.counts == {} and got.unchecked == (
        f"not kubelet's socket: /var/lib/kubelet/{SOCKET}: the server runs as uid 65534, not 0"
    )


def test_a_root_prefix_longer_than_sun_path_is_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connected through its directory's descriptor: the socket's own path may exceed
    the 108 bytes of sun_path (a root prefix under pytest's tmp)."""
    root = tmp_path / ("x" * 60)
    (root / PODRES).mkdir(parents=True)
    assert len(str(root / PODRES / "kubelet.sock")) > 108
    monkeypatch.chdir(root / PODRES)
    server = serve_zero(Path("kubelet.sock"))  # grpcio binds it relative to the cwd
    try:
        got = read_allocatable(Root(root), SOCKETS)
    finally:
        server.stop(0)
    assert got.unchecked == "" and got.counts == {}
