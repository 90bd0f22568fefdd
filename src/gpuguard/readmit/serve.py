"""The bridge's gRPC side (grpcio): its endpoints in kubelet's device-plugins
directory and its registration with kubelet.

One endpoint per resource, under the ``gpuguard/`` subdirectory: kubelet removes the
sockets of the directory when it starts, not those of subdirectories, so the servers
are made once, before kubelet starts, and registering costs one call. Messages are
encoded by readmit/wire.py (no generated code, no python3-protobuf).

Each ListAndWatch answers with the devices offered for that registration, healthy,
and then keeps the stream open until kubelet closes it: when the real plugin registers
later, kubelet replaces the bridge's endpoint without closing its stream, and if that
stream then ended, kubelet would look the resource's client up by name and disconnect
the real plugin. For the same reason an update sent on it later would be applied to
the resource by name, over the real plugin's devices: the one later message, the
withdrawal (every device Unhealthy, :meth:`Bridge.withdraw`), is sent only while no
plugin socket exists (readmit/withdraw.py decides), and the stream stays open after
it. Allocate is answered FAILED_PRECONDITION (the bridge allocates no device; kubelet
asks only for a new pod, whose device comes from healthy devices no pod holds, which
the bridge never reports) and journaled through ``on_allocate``;
GetPreferredAllocation and PreStartContainer are not served (UNIMPLEMENTED): the
registration's options say kubelet never calls them.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from gpuguard.readmit import wire

SUBDIR = "gpuguard"
RETRY = 0.005  # seconds between Register tries while kubelet.sock refuses connections
NO_ALLOCATE = (
    "gpuguard's re-admission bridge allocates no device: the device plugin has not registered yet"
)


def _same(b: bytes) -> bytes:
    return b


def endpoint(resource: str) -> str:
    """The endpoint (relative to the device-plugins directory) serving ``resource``."""
    return f"{SUBDIR}/readmit-{re.sub(r'[^A-Za-z0-9._-]', '_', resource)}.sock"


class Bridge:
    """The endpoints, made on demand, and the registration."""

    def __init__(
        self,
        plugins_dir: Path,
        on_stream: Callable[[str, int], None],
        on_allocate: Optional[Callable[[str, tuple[str, ...]], None]] = None,
    ) -> None:
        import grpc  # type: ignore[import-untyped]  # ~40 ms: loaded before kubelet starts

        self.grpc: Any = grpc
        self.dir = plugins_dir
        self.on_stream = on_stream  # (resource, devices sent): for the journal
        self.on_allocate = on_allocate  # (resource, device IDs asked): for the journal
        self.offers: dict[str, tuple[str, ...]] = {}
        self.withdrawn: set[str] = set()  # resources whose devices are now Unhealthy
        self.wakers: dict[str, set[threading.Event]] = {}  # resource -> open streams
        self.servers: dict[str, Any] = {}
        self.streams = 0  # open ListAndWatch streams
        self.lock = threading.Lock()
        self.serving = threading.Lock()  # the loop and the registrations' threads

    def _list_and_watch(self, resource: str) -> Callable[[bytes, Any], Iterator[bytes]]:
        def handler(_request: bytes, context: Any) -> Iterator[bytes]:
            ids = self.offers.get(resource, ())
            closed = threading.Event()
            wake = threading.Event()

            def ended() -> None:
                closed.set()
                wake.set()

            context.add_callback(ended)
            with self.lock:
                self.streams += 1
                self.wakers.setdefault(resource, set()).add(wake)
                withdrawn = resource in self.withdrawn
            try:
                health = wire.UNHEALTHY if withdrawn else wire.HEALTHY
                yield wire.list_and_watch_response(ids, health)
                self.on_stream(resource, 0 if withdrawn else len(ids))
                while not closed.is_set():  # kubelet's whole run: never end it ourselves
                    wake.wait()
                    wake.clear()
                    with self.lock:
                        now = resource in self.withdrawn
                    if now and not withdrawn and not closed.is_set():
                        withdrawn = True
                        yield wire.list_and_watch_response(ids, wire.UNHEALTHY)
            finally:
                with self.lock:
                    self.streams -= 1
                    self.wakers.get(resource, set()).discard(wake)

        return handler

    def _allocate(self, resource: str) -> Callable[[bytes, Any], bytes]:
        def handler(request: bytes, context: Any) -> bytes:
            if self.on_allocate is not None:
                try:
                    ids = wire.allocate_request_ids(request)
                except ValueError:
                    ids = ()
                self.on_allocate(resource, ids)
            context.abort(self.grpc.StatusCode.FAILED_PRECONDITION, NO_ALLOCATE)
            return b""  # not reached: abort raises

        return handler

    def withdraw(self, resource: str) -> int:
        """Report every device of ``resource``'s offer Unhealthy, once, on its open
        streams (and on any opened later in this registration); how many were open.
        The caller makes sure no device plugin has registered (readmit/withdraw.py)."""
        with self.lock:
            self.withdrawn.add(resource)
            wakers = tuple(self.wakers.get(resource, ()))
        for w in wakers:
            w.set()
        return len(wakers)

    def serve(self, resource: str) -> None:
        """The endpoint of ``resource``, listening (made once)."""
        with self.serving:
            if resource not in self.servers:
                self._serve(resource)

    def _serve(self, resource: str) -> None:
        from concurrent import futures

        grpc = self.grpc
        sock = self.dir / endpoint(resource)
        sock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        sock.unlink(missing_ok=True)
        handlers = {
            "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(
                lambda _req, _ctx: wire.device_plugin_options(),
                request_deserializer=_same,
                response_serializer=_same,
            ),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                self._list_and_watch(resource),
                request_deserializer=_same,
                response_serializer=_same,
            ),
            "Allocate": grpc.unary_unary_rpc_method_handler(
                self._allocate(resource),
                request_deserializer=_same,
                response_serializer=_same,
            ),
        }
        # one thread per open stream (kubelet keeps one per registration it has not
        # closed) plus the options call
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(wire.SERVICE, handlers),)
        )
        server.add_insecure_port(f"unix://{sock}")
        server.start()
        self.servers[resource] = server

    def register(self, resource: str, ids: tuple[str, ...], timeout: float = 5.0) -> None:
        """Offer ``ids`` for ``resource`` and register its endpoint with kubelet.
        Raises grpc.RpcError when kubelet refuses or does not answer."""
        self.serve(resource)
        with self.lock:
            self.offers[resource] = ids
            self.withdrawn.discard(resource)  # a new registration: healthy again
        grpc = self.grpc
        request = wire.register_request(resource, endpoint(resource))
        deadline = time.monotonic() + timeout
        while True:
            # a fresh channel per try: a channel whose connect failed waits out gRPC's
            # reconnect backoff (1 s), far past kubelet's re-admission (40-80 ms)
            with grpc.insecure_channel(f"unix://{self.dir / 'kubelet.sock'}") as channel:
                call = channel.unary_unary(
                    wire.REGISTER, request_serializer=_same, response_deserializer=_same
                )
                left = deadline - time.monotonic()
                try:
                    call(request, timeout=max(left, 0.001))
                    return
                except grpc.RpcError as e:
                    # kubelet.sock seen between kubelet's bind and listen, or the old
                    # kubelet's socket just before the new one replaces it: refused
                    # now, answered a few milliseconds later
                    if e.code() != grpc.StatusCode.UNAVAILABLE or left <= RETRY:
                        raise
            time.sleep(RETRY)

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop(0)
