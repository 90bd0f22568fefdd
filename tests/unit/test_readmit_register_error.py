"""A Register kubelet refuses is journaled with its gRPC status and details
(readmit/rpcerror.py), not the first line of grpcio's error text ("<_InactiveRpcError
of RPC that terminated with:"): the real bridge (readmit/serve.py, grpcio) registers
with a grpcio stand-in for kubelet's Registration service that refuses it."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest

from gpuguard.checkpoint.model import PodDevicesEntry
from gpuguard.host.paths import Root
from gpuguard.readmit import Inputs, Readmit, rpcerror, wire

REFUSAL = "Unsupported device plugin API version: v0\nsecond line"


@pytest.fixture
def short_root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="gg-rr-", dir="/tmp"))  # sun_path: 108 bytes
    try:
        yield d
    finally:
        shutil.rmtree(d)


def refusing_kubelet(sock: Path) -> Any:
    grpc = pytest.importorskip("grpc")

    def register(_req: bytes, ctx: Any) -> bytes:
        ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, REFUSAL)

    service, method = wire.REGISTER.strip("/").split("/")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                service, {method: grpc.unary_unary_rpc_method_handler(register)}
            ),
        )
    )
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    return server


def test_a_refused_register_is_journaled_with_its_status_and_details(short_root: Path) -> None:
    pytest.importorskip("grpc")
    from gpuguard.checkpoint.codec import marshal
    from gpuguard.checkpoint.model import Checkpoint
    from gpuguard.config import load_config
    from gpuguard.journal.log import EventLog
    from gpuguard.readmit.serve import Bridge

    root = Root(short_root)
    plugins = short_root / "var/lib/kubelet/device-plugins"
    plugins.mkdir(parents=True)
    held = PodDevicesEntry("pod-a", "main", "nvidia.com/gpu", ((0, ("GPU-a",)),), b"\n\x03abc")
    (plugins / "kubelet_internal_checkpoint").write_bytes(marshal(Checkpoint("v2", (held,), {}, 0)))
    said: list[tuple[str, str, dict[str, str]]] = []

    class Log(EventLog):
        def event(self, kind: str, msg: str, **kw: Any) -> None:  # type: ignore[override]
            said.append((kind, msg, dict(kw.get("fields") or {})))

    bridge = Bridge(plugins, lambda _r, _n: None)
    r = Readmit(
        root,
        Log(stream_format="none"),
        lambda: Inputs(load_config(root), frozenset({"GPU-a"}), ""),
        bridge,
    )
    server = refusing_kubelet(plugins / "kubelet.sock")
    try:
        r.on_kubelet_start()
    finally:
        server.stop(0)
        bridge.stop()
    (failed,) = [s for s in said if s[0] == "readmit-failed"]
    assert failed[1] == (
        "registering nvidia.com/gpu failed: gRPC INVALID_ARGUMENT (3): "
        r"Unsupported device plugin API version: v0\nsecond line"
    )
    assert failed[2]["GRPC_CODE"] == "INVALID_ARGUMENT"
    assert failed[2]["GRPC_DETAILS"].startswith("Unsupported device plugin API version")


def test_other_errors_say_their_first_line() -> None:
    assert rpcerror.describe(OSError("no such directory\nmore")) == ("no such directory", {})
    assert rpcerror.describe(RuntimeError()) == ("RuntimeError", {})


def accepting_kubelet(sock: Path, seen: list[bytes]) -> Any:
    grpc = pytest.importorskip("grpc")

    def register(req: bytes, _ctx: Any) -> bytes:
        seen.append(req)
        return b""

    service, method = wire.REGISTER.strip("/").split("/")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(register)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {method: handler}),)
    )
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    return server


def test_register_waits_out_a_kubelet_sock_that_refuses_for_a_moment(short_root: Path) -> None:
    """kubelet.sock found while it refuses connections (bound but not yet listening, or
    the old kubelet's socket just before the new one replaces it): the bridge tries
    again within its deadline instead of failing the kubelet start's registration."""
    pytest.importorskip("grpc")
    import socket
    import threading
    import time

    from gpuguard.readmit.serve import Bridge

    plugins = short_root / "var/lib/kubelet/device-plugins"
    plugins.mkdir(parents=True)
    sock = plugins / "kubelet.sock"
    refusing = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    refusing.bind(str(sock))  # bound, never listening: connect() is refused
    seen: list[bytes] = []
    servers: list[Any] = []

    def kubelet_listens() -> None:
        time.sleep(0.05)
        refusing.close()
        sock.unlink()
        servers.append(accepting_kubelet(sock, seen))

    t = threading.Thread(target=kubelet_listens)
    bridge = Bridge(plugins, lambda _r, _n: None)
    t.start()
    try:
        bridge.register("nvidia.com/gpu", ("GPU-a",), timeout=5.0)
    finally:
        t.join()
        for s in servers:
            s.stop(0)
        bridge.stop()
    assert seen == [wire.register_request("nvidia.com/gpu", "gpuguard/readmit-nvidia.com_gpu.sock")]
