"""The bridge with pods from an API server: what it leaves out of its offer (a pod
deleted while the node was down; readmit/plan.py), what it does when the API server
cannot be read, its withdrawal once the pods are re-admitted (readmit/withdraw.py), and
its gRPC side (readmit/serve.py) over a real channel: the second ListAndWatch message,
the stream left open, Allocate refused with a reason."""

from __future__ import annotations

import io
import json
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import pytest

from gpuguard.host.kubeapi import ApiPod, OwnerRef
from gpuguard.host.protowire import field, fields, text
from gpuguard.journal.log import EventLog
from gpuguard.readmit import withdraw as wd
from gpuguard.readmit.plan import READ, STANDALONE, UNREAD, ApiView, Offer, decide
from unit.test_readmit import GLOBS, entry

PRESENT = frozenset({"GPU-a", "GPU-b", "GPU-c", "GPU-d"})


def api_pod(uid: str, name: str, **kw: Any) -> ApiPod:
    return ApiPod(
        uid,
        kw.get("ns", "default"),
        name,
        kw.get("phase", "Running"),
        kw.get("deleting", False),
        (OwnerRef("ReplicaSet", "train-7d9", "rs-1"),) if kw.get("owned") else (),
        kw.get("mirror", ""),
        "2026-11-28T12:00:00Z",
    )


ENTRIES = [
    entry("uid-bare", ["GPU-a"]),
    entry("uid-deleted", ["GPU-b"]),  # its Deployment's pod, deleted while the node was down
    entry("uid-static", ["GPU-c"]),  # a static pod: the API server has its mirror pod
    entry("uid-failed", ["GPU-d"]),
]
API = ApiView(
    READ,
    (
        api_pod("uid-bare", "bare"),
        api_pod("uid-mirror", "static-gpu-node", ns="kube-system", mirror="uid-static"),
        api_pod("uid-failed", "job-x", phase="Failed"),
        api_pod("uid-new", "train-7d9-new", owned=True, phase="Pending"),
    ),
    "gpu-node",
    "4 pods",
    1.0,
)


def test_a_deleted_pods_gpu_is_left_out_and_a_static_pods_kept() -> None:
    d = decide(ENTRIES, GLOBS, PRESENT, frozenset(), API)
    (o,) = d.offers
    assert o.healthy == ("GPU-a", "GPU-c")  # never GPU-b (deleted) nor GPU-d (Failed)
    assert o.pods == ("uid-bare", "uid-static")
    assert o.held == (("uid-bare", ("GPU-a",)), ("uid-static", ("GPU-c",)))
    why = {x.pod_uid: x.why for x in o.left_out}
    assert why == {
        "uid-deleted": "no longer exists in the API server",
        "uid-failed": "is Failed (default/job-x)",
    }
    assert "pod UID uid-deleted no longer exists in the API server" in d.left_out_text()
    assert d.unread == ""
    being_deleted = ApiView(READ, (api_pod("uid-bare", "bare", deleting=True),), at=2.0)
    d = decide([entry("uid-bare", ["GPU-a"])], GLOBS, PRESENT, frozenset(), being_deleted)
    assert d.offers == () and "is being deleted (default/bare)" in d.left_out_text()


def test_without_an_api_server_or_an_answer_every_pod_is_offered_and_unread_is_said() -> None:
    standalone = decide(ENTRIES, GLOBS, PRESENT, frozenset(), ApiView(STANDALONE, at=1.0))
    assert standalone.offers[0].healthy == ("GPU-a", "GPU-b", "GPU-c", "GPU-d")
    assert standalone.unread == ""
    down = ApiView(UNREAD, detail="https://10.0.0.1:6443: timed out", at=1.0)
    d = decide(ENTRIES, GLOBS, PRESENT, frozenset(), down)
    assert d.offers[0].healthy == ("GPU-a", "GPU-b", "GPU-c", "GPU-d")
    assert d.unread == "https://10.0.0.1:6443: timed out"


def test_only_deleted_pods_waiting_gets_no_offer() -> None:
    """The bare pod runs (a kubelet restart): the deleted one alone does not make the
    bridge register (that would only race the plugin's re-registration)."""
    entries = [entry("uid-bare", ["GPU-a"]), entry("uid-deleted", ["GPU-b"])]
    d = decide(entries, GLOBS, PRESENT, frozenset({"uid-bare"}), API)
    assert d.offers == () and [x.pod_uid for x in d.left_out] == ["uid-deleted"]


# -- the loop with an API view (readmit/__init__.py) ------------------------------------


class FakeApi:
    def __init__(self, view: ApiView) -> None:
        self.v = view
        self.wanted = 0

    def view(self) -> ApiView:
        return self.v

    def want(self) -> None:
        self.wanted += 1

    def stop(self) -> None:
        pass


class FakeWithdrawal:
    def __init__(self) -> None:
        self.started: list[tuple[tuple[str, ...], float]] = []
        self.cancelled = 0

    def start(self, offers: Sequence[Offer], started: float) -> None:
        self.started.append((tuple(o.resource for o in offers), started))

    def cancel(self) -> None:
        self.cancelled += 1


def bridge_node(tmp_path: Path, elog: EventLog, api: FakeApi) -> tuple[Any, Any, FakeWithdrawal]:
    """A fake root with the checkpoint of ENTRIES and a Readmit over ``api``."""
    from gpuguard.checkpoint.codec import marshal
    from gpuguard.checkpoint.model import Checkpoint
    from gpuguard.config import load_config
    from gpuguard.host.paths import Root
    from gpuguard.readmit import Inputs, Readmit
    from unit.test_readmit import FakeBridge

    root = Root(tmp_path)
    plugins = tmp_path / "var/lib/kubelet/device-plugins"
    plugins.mkdir(parents=True)
    cp = Checkpoint("v2", tuple(ENTRIES), {}, 0)
    (plugins / "kubelet_internal_checkpoint").write_bytes(marshal(cp))
    (tmp_path / "etc/gpuguard").mkdir(parents=True)
    (tmp_path / "etc/gpuguard/gpuguard.conf").write_text("")
    bridge = FakeBridge()
    w = FakeWithdrawal()

    def inputs() -> Inputs:
        return Inputs(load_config(root), PRESENT, "")

    r = Readmit(root, elog, inputs, bridge, api=api, withdrawal=w)  # type: ignore[arg-type]
    return r, bridge, w


def journal(emit: Any) -> list[dict[str, Any]]:
    out = io.StringIO()
    emit(EventLog(stream=out, level="debug"))
    return [json.loads(line) for line in out.getvalue().splitlines()]


def readmit_api_entries(tmp: Path) -> list[dict[str, Any]]:
    """A kubelet start with the API server's pods read, and one with it unreachable."""
    out = []
    for i, view in enumerate((API, ApiView(UNREAD, detail="connection refused", at=1.0))):

        def emit(elog: EventLog, view: ApiView = view, i: int = i) -> None:
            r, _b, _w = bridge_node(tmp / f"n{i}", elog, FakeApi(view))
            r.prepare()
            r.on_kubelet_start()

        out += journal(emit)
    return out


def test_the_offer_is_journaled_with_what_was_left_out_and_the_withdrawal_started(
    tmp_path: Path,
) -> None:
    api = FakeApi(API)
    entries: list[dict[str, Any]] = []

    def emit(elog: EventLog) -> None:
        r, bridge, w = bridge_node(tmp_path, elog, api)
        r.prepare()
        assert api.wanted  # pods wait: the API server is read
        r.on_kubelet_start()
        assert bridge.registered == [("nvidia.com/gpu", ("GPU-a", "GPU-c"))]
        assert [res for res, _t in w.started] == [("nvidia.com/gpu",)] and w.cancelled == 1

    entries = journal(emit)
    (offered,) = [e for e in entries if e["kind"] == "readmit-offered"]
    assert "left out: pod UID uid-deleted no longer exists in the API server" in offered["msg"]
    assert offered["LEFT_OUT"] == "uid-deleted,uid-failed"
    assert not [e for e in entries if e["kind"] == "readmit-api-unread"]


def test_an_unreadable_api_server_is_journaled_and_every_pod_offered(tmp_path: Path) -> None:
    entries = readmit_api_entries(tmp_path)
    unread = [e for e in entries if e["kind"] == "readmit-api-unread"]
    assert len(unread) == 1 and unread[0]["PROBLEM"] == "connection refused"
    offered = [e for e in entries if e["kind"] == "readmit-offered"]
    assert offered[-1]["DEVICES"] == "GPU-a,GPU-b,GPU-c,GPU-d"


def test_a_new_api_answer_makes_the_decision_again_at_kubelets_start(tmp_path: Path) -> None:
    """At boot the bridge decides before the API server answered; the answer that comes
    before kubelet's start is the one used."""
    api = FakeApi(ApiView(UNREAD, detail="no answer yet", at=-1.0))
    r, bridge, _w = bridge_node(tmp_path, EventLog(stream=io.StringIO()), api)  # type: ignore[arg-type]
    r.prepare()
    api.v = API
    r.on_kubelet_start()
    assert bridge.registered == [("nvidia.com/gpu", ("GPU-a", "GPU-c"))]


# -- the withdrawal (readmit/withdraw.py) -----------------------------------------------


OFFER = Offer(
    "nvidia.com/gpu",
    ("GPU-a", "GPU-c"),
    (),
    ("uid-bare", "uid-static"),
    (("uid-bare", ("GPU-a",)), ("uid-static", ("GPU-c",))),
)


def test_pending_and_plan_are_pure() -> None:
    assert wd.pending([OFFER], None) == ("uid-bare", "uid-static")  # kubelet not asked
    assert wd.pending([OFFER], {"nvidia.com/gpu": frozenset({"GPU-a"})}) == ("uid-static",)
    assert wd.pending([OFFER], {"nvidia.com/gpu": frozenset({"GPU-a", "GPU-c", "X"})}) == ()
    assert wd.plan(1.0, (), None, ()) == wd.WAIT_  # seen once: looked at again
    assert wd.plan(2.0, (), (), ()) == wd.WITHDRAW
    assert wd.plan(2.0, (), (), ("nvidia-gpu.sock",)) == wd.HANDED_OVER
    assert wd.plan(wd.WAIT, ("uid-static",), ("uid-static",), ()) == wd.WITHDRAW
    assert wd.plan(wd.WAIT + 9, (), (), ("nvidia-gpu.sock",)) == wd.HANDED_OVER


class Looks:
    """kubelet's List and the plugins directory, one answer per look."""

    def __init__(
        self, lists: list[Optional[dict[str, frozenset[str]]]], socks: list[tuple[str, ...]]
    ) -> None:
        self.lists, self.socks = lists, socks
        self.withdrawn: list[str] = []
        self.t = 100.0

    def listed(self) -> Optional[dict[str, frozenset[str]]]:
        return self.lists.pop(0) if len(self.lists) > 1 else self.lists[0]

    def sockets(self) -> tuple[str, ...]:
        return self.socks.pop(0) if len(self.socks) > 1 else self.socks[0]

    def clock(self) -> float:
        self.t += 1.0
        return self.t

    def withdraw(self, resource: str) -> int:
        self.withdrawn.append(resource)
        return 1


def run_withdrawal(looks: Looks, elog: EventLog, monkeypatch: pytest.MonkeyPatch) -> wd.Outcome:
    monkeypatch.setattr(wd, "POLL", 0.0)
    w = wd.Withdrawal(
        Path("/nonexistent"), elog, looks.withdraw, looks.sockets, looks.listed, looks.clock
    )
    return w.run((OFFER,), 100.0, threading.Event())


HELD = {"nvidia.com/gpu": frozenset({"GPU-a", "GPU-c"})}


def withdrawal_entries() -> list[dict[str, Any]]:
    """Each outcome once: after the admissions, at the deadline, handed over."""
    out = []
    with pytest.MonkeyPatch.context() as mp:
        for looks in (
            Looks([None, HELD], [()]),
            Looks([{}], [()]),
            Looks([None], [(), ("nvidia-gpu.sock",)]),
        ):
            out += journal(lambda elog, looks=looks: run_withdrawal(looks, elog, mp))
    return out


def test_the_withdrawal_follows_the_admissions(monkeypatch: pytest.MonkeyPatch) -> None:
    looks = Looks([None, {"nvidia.com/gpu": frozenset({"GPU-a"})}, HELD], [()])
    entries = journal(lambda elog: run_withdrawal(looks, elog, monkeypatch))
    assert looks.withdrawn == ["nvidia.com/gpu"]
    (e,) = entries
    assert e["kind"] == "readmit-withdrawn" and e["PENDING"] == "" and e["DEVICES"] == "GPU-a,GPU-c"
    assert looks.t < 100 + wd.WAIT  # before the deadline: at the second look showing both


def test_the_deadline_withdraws_and_names_who_did_not_come(monkeypatch: pytest.MonkeyPatch) -> None:
    looks = Looks([{"nvidia.com/gpu": frozenset({"GPU-a"})}], [()])
    (e,) = journal(lambda elog: run_withdrawal(looks, elog, monkeypatch))
    assert looks.withdrawn == ["nvidia.com/gpu"] and e["PENDING"] == "uid-static"
    assert looks.t >= 100 + wd.WAIT


def test_never_withdrawn_once_a_plugin_socket_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    # a socket at the third look, before any admission: handed over, nothing sent
    looks = Looks([None], [(), (), ("nvidia-gpu.sock",)])
    (e,) = journal(lambda elog: run_withdrawal(looks, elog, monkeypatch))
    assert looks.withdrawn == [] and e["kind"] == "readmit-handed-over"
    # the pods re-admitted, but the plugin's socket appears at the moment of sending
    looks = Looks([HELD], [(), (), ("nvidia-gpu.sock",)])
    (e,) = journal(lambda elog: run_withdrawal(looks, elog, monkeypatch))
    assert looks.withdrawn == [] and e["PLUGINS"] == "nvidia-gpu.sock"


def test_kubelets_list_answer_is_decoded() -> None:
    def devices(resource: str, *ids: str) -> bytes:
        return field(2, text(1, resource) + b"".join(text(2, i) for i in ids))

    ctr = text(1, "main") + devices("nvidia.com/gpu", "GPU-a") + devices("example.com/nic", "n1")
    pods = field(1, text(1, "bare") + text(2, "default") + field(3, ctr))
    pods += field(1, text(1, "other") + text(2, "default") + field(3, text(1, "c")))
    assert wd.decode_list(pods) == {
        "nvidia.com/gpu": frozenset({"GPU-a"}),
        "example.com/nic": frozenset({"n1"}),
    }
    with pytest.raises(ValueError):
        wd.decode_list(b"\x0a\x05ab")  # truncated


# -- the gRPC side over a real channel (readmit/serve.py) -------------------------------


@pytest.fixture
def grpc_dir() -> Iterator[Path]:
    pytest.importorskip("grpc")
    d = Path(tempfile.mkdtemp(prefix="gg-", dir="/tmp"))  # AF_UNIX: 108 bytes at most
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def fake_kubelet(d: Path) -> Any:
    """kubelet's Registration service: accepts every RegisterRequest."""
    from concurrent import futures

    import grpc  # type: ignore[import-untyped]

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handlers = {
        "Register": grpc.unary_unary_rpc_method_handler(
            lambda _r, _c: b"", request_deserializer=None, response_serializer=None
        )
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("v1beta1.Registration", handlers),)
    )
    server.add_insecure_port(f"unix://{d / 'kubelet.sock'}")
    server.start()
    return server


def devices_of(msg: bytes) -> list[tuple[str, str]]:
    out = []
    for dev in fields(msg).get(1, []):
        f = fields(dev)
        out.append((f[1][0].decode(), f[2][0].decode()))
    return out


def test_the_stream_gets_the_withdrawal_and_stays_open(grpc_dir: Path) -> None:
    import grpc

    from gpuguard.readmit.serve import Bridge, endpoint

    kubelet = fake_kubelet(grpc_dir)
    bridge = Bridge(grpc_dir, lambda _r, _n: None)
    try:
        bridge.register("nvidia.com/gpu", ("GPU-a", "GPU-c"))
        with grpc.insecure_channel(f"unix://{grpc_dir / endpoint('nvidia.com/gpu')}") as ch:
            law = ch.unary_stream("/v1beta1.DevicePlugin/ListAndWatch")
            stream = law(b"", timeout=30)  # a bridge that never sends fails here, not hangs
            first = next(stream)
            assert devices_of(first) == [("GPU-a", "Healthy"), ("GPU-c", "Healthy")]
            assert bridge.withdraw("nvidia.com/gpu") == 1
            second = next(stream)
            assert devices_of(second) == [("GPU-a", "Unhealthy"), ("GPU-c", "Unhealthy")]
            assert stream.is_active() and bridge.streams == 1  # never ended by the bridge
            assert bridge.withdraw("nvidia.com/gpu") == 1  # once: nothing more is sent
            stream.cancel()  # kubelet closing it ends the handler
            with pytest.raises(grpc.RpcError) as e:
                next(stream)
            assert e.value.code() == grpc.StatusCode.CANCELLED
    finally:
        bridge.stop()
        kubelet.stop(0)


def test_allocate_is_refused_with_a_reason_and_journaled(grpc_dir: Path) -> None:
    import grpc

    from gpuguard.readmit.serve import Bridge, endpoint

    asked: list[tuple[str, tuple[str, ...]]] = []
    bridge = Bridge(grpc_dir, lambda _r, _n: None, lambda r, ids: asked.append((r, ids)))
    try:
        bridge.serve("nvidia.com/gpu")
        with grpc.insecure_channel(f"unix://{grpc_dir / endpoint('nvidia.com/gpu')}") as ch:
            allocate = ch.unary_unary("/v1beta1.DevicePlugin/Allocate")
            req = field(1, text(1, "GPU-b"))  # AllocateRequest{[{devices_ids: [GPU-b]}]}
            with pytest.raises(grpc.RpcError) as e:
                allocate(req, timeout=30)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert e.value.details() == (
            "gpuguard's re-admission bridge allocates no device: the device plugin has "
            "not registered yet"
        )
        assert asked == [("nvidia.com/gpu", ("GPU-b",))]
    finally:
        bridge.stop()


def allocate_entries() -> list[dict[str, Any]]:
    return journal(lambda elog: wd.allocate_refused(elog, "nvidia.com/gpu", ("GPU-b",)))


def test_the_readers_view_fresh_stale_and_failed() -> None:
    """readmit/apipods.py: the latest good answer while fresh; a failure after it does
    not hide it; an old one is not used (UNREAD); the first read starts at want()."""
    import time

    from gpuguard.readmit import apipods

    asked = threading.Event()

    def read_once() -> ApiView:
        asked.set()
        return ApiView(READ, API.pods, "gpu-node", "4 pods", time.monotonic())

    r = apipods.NodePods(read_once)
    assert r.view().source == UNREAD and r.view().detail == "no answer yet"
    r.want()
    try:
        assert asked.wait(30)
    finally:
        r.stop()
        assert r.thread is not None
        r.thread.join(30)
    assert r.view().node == "gpu-node"  # the thread's answer
    r.good = ApiView(READ, at=time.monotonic())
    r.failed = None
    assert r.view().source == READ
    r.good = ApiView(READ, at=time.monotonic() - apipods.STALE - 1)
    assert r.view().source == UNREAD and "old" in r.view().detail
    r.failed = ApiView(UNREAD, detail="HTTP 403: pods is forbidden", at=time.monotonic())
    assert r.view().detail == "HTTP 403: pods is forbidden"


def test_a_withdrawal_cancelled_by_the_next_kubelet_start_sends_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    looks = Looks([HELD], [()])
    monkeypatch.setattr(wd, "POLL", 0.0)
    w = wd.Withdrawal(
        Path("/nonexistent"), EventLog(stream=io.StringIO()), looks.withdraw, looks.sockets,
        looks.listed, looks.clock,
    )  # fmt: skip
    stop = threading.Event()
    stop.set()  # kubelet started again after the last look
    assert w.run((OFFER,), 100.0, stop).step == "" and looks.withdrawn == []
