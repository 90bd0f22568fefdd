"""F4's second rule: a registered plugin kubelet dropped (0 allocatable GPUs), the
podresources answer it is judged from, and the fallback where kubelet cannot be asked.

kubelet's answer is built here in protobuf's wire format by hand, field numbers from
k8s.io/kubelet/pkg/apis/podresources/v1/api.proto (AllocatableResourcesResponse: devices
= 1, cpu_ids = 2 (packed int64), memory = 3; ContainerDevices: resource_name = 1,
device_ids = 2, topology = 3 (TopologyInfo{nodes = 1: NUMANode{ID = 1}})), as kubelet
1.34 sends it: one ContainerDevices per device.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuguard.devices.nodes import ROLE_OTHER
from gpuguard.devices.plugins import NodeInfo, PluginInfo, resource_for_socket
from gpuguard.devices.processes import ProcessInfo
from gpuguard.host.paths import Root
from gpuguard.host.protowire import field, varint
from gpuguard.steps.device_plugin import podresources
from gpuguard.steps.device_plugin.allocatable import (
    K_ALLOCATABLE_UNCHECKED,
    K_NOT_ALLOCATABLE,
    allocatable_judged,
)
from gpuguard.steps.device_plugin.observe import PluginObservation
from gpuguard.steps.device_plugin.podresources import (
    METHOD,
    Allocatable,
    decode_allocatable,
    kubelet_dir,
    read_allocatable,
)
from gpuguard.steps.device_plugin.reconcile import (
    CAUSE_NOT_ALLOCATABLE,
    CAUSE_UNREGISTERED,
    K_NOT_REGISTERED,
    assess,
)

T0 = 1_700_000_000.0
KUBELET = T0 + 100  # kubelet's latest start
GRACE = 120.0
SOCKETS = "/var/lib/kubelet/device-plugins"
HOST = (
    NodeInfo("/dev/nvidia0", 195, 0, ROLE_OTHER, ctime=T0 - 1000),
    NodeInfo("/dev/nvidia1", 195, 1, ROLE_OTHER, ctime=T0 - 1000),
    NodeInfo("/dev/nvidiactl", 195, 255, ROLE_OTHER, ctime=T0 - 1000),
)


# -- the wire format -------------------------------------------------------------------


def device(resource: str, *ids: str, numa: Optional[int] = 0) -> bytes:
    topo = field(3, field(1, varint(1 << 3) + varint(numa))) if numa is not None else b""
    return field(1, resource.encode()) + b"".join(field(2, i.encode()) for i in ids) + topo


def answer(*devices: bytes, cpus: tuple[int, ...] = (0, 1, 2, 3)) -> bytes:
    packed = field(2, b"".join(varint(c) for c in cpus)) if cpus else b""
    memory = field(3, varint(1 << 3) + b"\x0e" + field(3, b""))  # ContainerMemory{...}
    return b"".join(field(1, d) for d in devices) + packed + memory


def test_one_entry_per_device_as_kubelet_sends_it() -> None:
    data = answer(
        device("nvidia.com/gpu", "GPU-a"),
        device("nvidia.com/gpu", "GPU-b", numa=1),
        device("example.com/nic", "nic0", numa=None),
    )
    assert decode_allocatable(data) == {"nvidia.com/gpu": 2, "example.com/nic": 1}


def test_ids_counted_once_and_entries_summed() -> None:
    data = answer(device("nvidia.com/gpu", "GPU-a", "GPU-b"), device("nvidia.com/gpu", "GPU-a"))
    assert decode_allocatable(data) == {"nvidia.com/gpu": 2}


def test_an_empty_answer_is_nothing_allocatable() -> None:
    assert decode_allocatable(b"") == {}
    assert decode_allocatable(answer(cpus=())) == {}


def test_fixed_width_and_unpacked_fields_are_skipped() -> None:
    data = (
        varint(2 << 3) + varint(7) + varint(9 << 3 | 1) + bytes(8) + varint(9 << 3 | 5) + bytes(4)
    )
    assert decode_allocatable(data + answer(device("nvidia.com/gpu", "GPU-a"))) == {
        "nvidia.com/gpu": 1
    }


@pytest.mark.parametrize(
    "data",
    [
        field(1, device("nvidia.com/gpu", "GPU-a"))[:-2],  # truncated
        b"\x0a\x80",  # truncated length varint
        varint(1 << 3 | 3) + b"\x00",  # group wire types: not in proto3
        field(1, field(1, b"\xff\xfe")),  # a resource name that is not UTF-8
    ],
)
def test_a_malformed_answer_is_an_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_allocatable(data)


def test_kubelet_dir_is_the_device_plugins_parent() -> None:
    assert kubelet_dir(SOCKETS) == "/var/lib/kubelet"
    assert kubelet_dir(SOCKETS + "/") == "/var/lib/kubelet"
    assert kubelet_dir("/device-plugins") == "/"


# -- the rule ----------------------------------------------------------------------------


def proc(start: float = T0, pid: int = 4242) -> ProcessInfo:
    return ProcessInfo(pid, start, "nvidia-device-plugin", "unit", unit="nvidia-dp.service")


def plugin(name: str = "nvidia-gpu.sock", ctime: float = KUBELET + 1) -> PluginInfo:
    return PluginInfo(f"{SOCKETS}/{name}", resource_for_socket(name), ctime, proc(), HOST)


def obs(*plugins: PluginInfo, **kw: Any) -> PluginObservation:
    args: dict[str, Any] = dict(
        now=KUBELET + 600, host_nodes=HOST, kubelet_started=KUBELET, gpus=2, allocatable=None
    )
    args.update(kw)
    return PluginObservation(plugins=plugins or (plugin(),), **args)


def counts(by_resource: Optional[dict[str, int]] = None) -> Allocatable:
    return Allocatable("/var/lib/kubelet/pod-resources/kubelet.sock", by_resource or {})


def test_dropped_plugin_is_restarted_as_not_allocatable() -> None:
    r = assess(obs(allocatable=counts({"nvidia.com/gpu": 0})), registration_grace=GRACE)
    (f,) = r.findings
    assert f.kind == K_NOT_ALLOCATABLE and f.severity == "error"
    assert f.fields["RESOURCE"] == "nvidia.com/gpu" and f.fields["GPUS"] == "2"
    assert f.fields["ALLOCATABLE"] == "0" and f.fields["UNIT"] == "nvidia-dp.service"
    assert "0 allocatable nvidia.com/gpu of the node's 2 GPUs" in f.summary
    (a,) = r.actions
    assert a.cause == CAUSE_NOT_ALLOCATABLE and a.identity == "nvidia.com/gpu"
    assert a.socket == f"{SOCKETS}/nvidia-gpu.sock" and a.process.pid == 4242
    assert a.reason == "kubelet reports 0 allocatable nvidia.com/gpu of the node's 2 GPUs"


def test_an_absent_resource_counts_as_zero() -> None:
    r = assess(obs(allocatable=counts({"example.com/nic": 4})), registration_grace=GRACE)
    assert [f.kind for f in r.findings] == [K_NOT_ALLOCATABLE] and len(r.actions) == 1


def test_allocatable_devices_mean_registered() -> None:
    r = assess(obs(allocatable=counts({"nvidia.com/gpu": 2})), registration_grace=GRACE)
    assert r.findings == () and r.actions == ()
    # fewer than the node has is gpu_count's business (a GPU may be unhealthy), not a drop
    r = assess(obs(allocatable=counts({"nvidia.com/gpu": 1})), registration_grace=GRACE)
    assert r.findings == () and r.actions == ()


def test_one_resource_allocatable_is_enough() -> None:
    """MIG's mixed strategy: nvidia.com/gpu may be empty on purpose beside a profile."""
    plugins = (plugin(), plugin("nvidia-mig-1g.10gb.sock"))
    for empty in (counts({"nvidia.com/mig-1g.10gb": 7}), counts({"nvidia.com/gpu": 1})):
        r = assess(obs(*plugins, allocatable=empty), registration_grace=GRACE)
        assert r.findings == () and r.actions == (), empty
    r = assess(obs(*plugins, allocatable=counts()), registration_grace=GRACE)
    assert sorted(a.identity for a in r.actions) == ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb"]


@pytest.mark.parametrize(
    "why, kw",
    [
        ("kubelet's grace not over", dict(now=KUBELET + GRACE - 1)),
        ("kubelet not running", dict(kubelet_started=None)),
        ("no GPU on the node", dict(gpus=0)),
        ("the plugin registering now", dict(plugins=(plugin(ctime=KUBELET + 590),))),
    ],
)
def test_not_judged(why: str, kw: dict[str, Any]) -> None:
    plugins = kw.pop("plugins", ())
    r = assess(obs(*plugins, allocatable=counts(), **kw), registration_grace=GRACE)
    assert K_NOT_ALLOCATABLE not in [f.kind for f in r.findings], why
    assert all(a.cause != CAUSE_NOT_ALLOCATABLE for a in r.actions), why


def test_a_plugin_that_never_registered_is_the_socket_rule_s_once() -> None:
    old = plugin(ctime=KUBELET - 50)
    r = assess(obs(old, allocatable=counts()), registration_grace=GRACE)
    assert [f.kind for f in r.findings] == [K_NOT_REGISTERED]
    assert [a.cause for a in r.actions] == [CAUSE_UNREGISTERED]


def test_a_plugin_without_process_is_not_restarted() -> None:
    gone = dataclasses.replace(plugin(), process=None, dev=None)
    o = obs(gone, allocatable=counts())
    assert not allocatable_judged(o, GRACE)
    assert all(f.kind != K_NOT_ALLOCATABLE for f in assess(o, registration_grace=GRACE).findings)


def test_unchecked_is_said_never_ok_and_the_socket_rule_still_judges() -> None:
    blind = Allocatable("/var/lib/kubelet/pod-resources/kubelet.sock", unchecked="no socket")
    r = assess(obs(allocatable=blind), registration_grace=GRACE)
    (f,) = r.findings
    assert f.kind == K_ALLOCATABLE_UNCHECKED and f.severity == "info"
    assert f.fields["REASON"] == "no socket" and r.actions == ()
    r = assess(obs(plugin(ctime=KUBELET - 1), allocatable=blind), registration_grace=GRACE)
    assert sorted(f.kind for f in r.findings) == [K_ALLOCATABLE_UNCHECKED, K_NOT_REGISTERED]
    assert [a.cause for a in r.actions] == [CAUSE_UNREGISTERED]


def test_not_asked_is_no_finding() -> None:
    r = assess(obs(), registration_grace=GRACE)
    assert r.findings == () and r.actions == ()


# -- asking kubelet -------------------------------------------------------------------------


@pytest.fixture
def short_root() -> Iterator[Path]:
    """A root whose socket path fits sun_path (108 bytes), unlike pytest's tmp_path."""
    d = Path(tempfile.mkdtemp(prefix="gg-pr-", dir="/tmp"))
    (d / "var/lib/kubelet/pod-resources").mkdir(parents=True)
    try:
        yield d
    finally:
        shutil.rmtree(d)


def serve(root: Path, reply: Optional[bytes]) -> Any:
    """A kubelet stand-in on pod-resources/kubelet.sock: GetAllocatableResources answers
    ``reply``; None serves nothing (UNIMPLEMENTED, as a kubelet before 1.21)."""
    grpc = pytest.importorskip("grpc")
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    if reply is not None:
        service, method = METHOD.strip("/").split("/")
        handler = grpc.unary_unary_rpc_method_handler(
            lambda _req, _ctx: reply, request_deserializer=None, response_serializer=None
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {method: handler}),)
        )
    server.add_insecure_port(f"unix://{root}/var/lib/kubelet/{podresources.SOCKET}")
    server.start()
    return server


def test_kubelet_answers(short_root: Path) -> None:
    server = serve(short_root, answer(device("nvidia.com/gpu", "GPU-a"), cpus=()))
    try:
        got = read_allocatable(Root(short_root), SOCKETS)
    finally:
        server.stop(0)
    assert got == Allocatable(
        "/var/lib/kubelet/pod-resources/kubelet.sock", {"nvidia.com/gpu": 1}, ""
    )


def test_kubelet_without_the_call_is_unchecked(short_root: Path) -> None:
    server = serve(short_root, None)
    try:
        got = read_allocatable(Root(short_root), SOCKETS)
    finally:
        server.stop(0)
    # the refusal's status and message, read from the answer's trailers (HPACK)
    assert got.counts == {} and "code 12 UNIMPLEMENTED: " in got.unchecked, got


def test_kubelet_answering_nonsense_is_unchecked(short_root: Path) -> None:
    server = serve(short_root, b"\x0b")
    try:
        got = read_allocatable(Root(short_root), SOCKETS)
    finally:
        server.stop(0)
    assert got.counts == {} and "not readable" in got.unchecked


def test_no_socket_is_unchecked(short_root: Path) -> None:
    got = read_allocatable(Root(short_root), SOCKETS)
    assert "No such file" in got.unchecked and got.counts == {}
    (short_root / "var/lib/kubelet/pod-resources/kubelet.sock").write_text("")
    assert read_allocatable(Root(short_root), SOCKETS).unchecked.endswith("is not a socket")


def test_a_socket_nobody_serves_is_unchecked(short_root: Path) -> None:
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(str(short_root / "var/lib/kubelet/pod-resources/kubelet.sock"))  # never listens
    try:
        got = read_allocatable(Root(short_root), SOCKETS, timeout=0.3)
    finally:
        s.close()
    assert got.unchecked.endswith("kubelet.sock: Connection refused"), got


def test_a_kubelet_that_never_answers_is_unchecked_within_the_timeout(short_root: Path) -> None:
    import socket
    import time

    s = socket.socket(socket.AF_UNIX)
    s.bind(str(short_root / "var/lib/kubelet/pod-resources/kubelet.sock"))
    s.listen(1)  # accepts (the kernel's backlog), never answers
    try:
        t = time.monotonic()
        got = read_allocatable(Root(short_root), SOCKETS, timeout=0.3)
        took = time.monotonic() - t
    finally:
        s.close()
    assert "no answer within the timeout" in got.unchecked, got
    assert took < 5  # bounded by the timeout (0.3 s), not by the server


def test_the_daemon_s_read_loads_no_grpcio(short_root: Path) -> None:
    """grpcio costs 10-14 MB of RSS: the daemon's call is HTTP/2 by hand."""
    import subprocess
    import sys

    server = serve(short_root, answer(device("nvidia.com/gpu", "GPU-a")))
    code = (
        "import sys; from pathlib import Path; from gpuguard.host.paths import Root; "
        "from gpuguard.steps.device_plugin.podresources import read_allocatable as r; "
        f"a = r(Root(Path({str(short_root)!r})), {SOCKETS!r}); "
        "print(dict(a.counts), a.unchecked, 'grpc' in sys.modules)"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    finally:
        server.stop(0)
    assert out.stdout.strip() == "{'nvidia.com/gpu': 1}  False", out.stdout + out.stderr


# -- the step asks only when there is something to judge ---------------------------------


def test_the_step_asks_kubelet_only_when_judging(tmp_path: Path) -> None:
    from gpuguard.config import Config
    from gpuguard.steps.device_plugin import DevicePluginStep

    asked: list[str] = []

    def fake(root: Root, socket_dir: str, timeout: float = 0.5) -> Allocatable:
        asked.append(socket_dir)
        return counts()

    step = DevicePluginStep()
    step.read_allocatable = fake
    cfg = Config().device_plugin

    class Ctx:
        known_inventory = None

    def with_alloc(o: PluginObservation) -> PluginObservation:
        coro = step._with_allocatable(Root(tmp_path), cfg, Ctx(), o)  # type: ignore[arg-type]
        return asyncio.run(coro)

    early = with_alloc(obs(now=KUBELET + 1, gpus=0))
    assert asked == [] and early.allocatable is None and early.gpus == 2  # /dev/nvidia0, 1
    later = with_alloc(obs(gpus=0))
    assert asked == [SOCKETS] and later.allocatable == counts() and later.gpus == 2


def test_the_step_restarts_a_dropped_plugin_within_its_limits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the F4 restart path: journaled with its reason and cause, the cool-down
    from the plugin's start and the hourly budget holding (never a loop)."""
    import gpuguard.steps.device_plugin as step_mod
    from gpuguard.steps.device_plugin.actuate import Verification
    from unit.test_plugins_step import HOST as STEP_HOST
    from unit.test_plugins_step import Clock, FakeRestarter, Step, entries, make, run

    async def recovered(root: Root, d: str, ident: str, old: ProcessInfo, *a: Any, **k: Any) -> Any:
        new = dataclasses.replace(old, pid=old.pid + 1, start=old.start + 5)
        return Verification("recovered", PluginInfo("/x", ident, 0, new, STEP_HOST), (), 0.1)

    monkeypatch.setattr(step_mod, "verify", recovered)

    class Dropped(Step):
        def observe(self, *a: Any, **k: Any) -> PluginObservation:
            o = super().observe(*a, **k)
            p = dataclasses.replace(o.plugins[0], socket_ctime=self.clock() - 300)
            return dataclasses.replace(o, plugins=(p,), kubelet_started=self.clock() - 400)

    svc, out = make(tmp_path, cool_down=300.0, registration_grace=2.0, max_restarts_per_hour=1)
    r, clock = FakeRestarter(), Clock()
    s = Dropped(clock, r)
    s.view, s.start = STEP_HOST, clock.t - 200  # sees every node; started 200 s ago
    s.read_allocatable = lambda root, socket_dir, timeout=0.5: counts()
    ctx = run(s, svc)
    assert r.calls == [] and [o.status for o in ctx.outcomes] == ["declined"]
    assert entries(out, "plugin-not-allocatable")[0]["GPUS"] == "1"  # /dev/nvidia0
    clock.t += 101  # the cool-down over
    ctx = run(s, svc)
    (a,) = r.calls
    assert a.cause == CAUSE_NOT_ALLOCATABLE and "0 allocatable nvidia.com/gpu" in a.reason
    (done,) = entries(out, "plugin-restarted")
    assert done["CAUSE"] == CAUSE_NOT_ALLOCATABLE and "0 allocatable" in done["msg"]
    s.start = clock.t - 400  # dropped again at once: the budget (1 an hour) declines it
    ctx = run(s, svc)
    assert len(r.calls) == 1 and ctx.outcomes[-1].status == "declined"
    assert entries(out, "plugin-restart-declined")[-1]["REASON"] == "budget"


def test_the_bench_prints_its_figures() -> None:
    """bench/bench_podresources.py runs (figures reported, not checked)."""
    import re
    import subprocess
    import sys

    pytest.importorskip("grpc")
    bench = Path(__file__).resolve().parents[2] / "bench/bench_podresources.py"
    argv = [sys.executable, str(bench), "--runs", "3", "--gpus", "2"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "{'nvidia.com/gpu': 2}" in res.stdout, res.stdout
    assert re.search(r"^later calls \(3\): p50 [\d.]+ ms", res.stdout, re.M), res.stdout
    assert re.search(r"^RSS: [\d.]+ MiB before", res.stdout, re.M), res.stdout


# -- each resource judged on its own (a mixed-MIG node) ---------------------------------


def judged(inventory: Any, *plugins: PluginInfo, alloc: dict[str, int]) -> Any:
    """The step's pass from the inventory it knows to the reconciler's assessment."""
    from gpuguard.config import Config
    from gpuguard.steps.device_plugin import DevicePluginStep

    step = DevicePluginStep()
    step.read_allocatable = lambda root, socket_dir, timeout=0.5: counts(alloc)

    class Ctx:
        known_inventory = inventory

    o = obs(*plugins, gpus=0)
    coro = step._with_allocatable(Root(Path("/nonexistent")), Config().device_plugin, Ctx(), o)
    return assess(asyncio.run(coro), registration_grace=GRACE)


def mixed_node(mig_devices: int = 7, whole: int = 1) -> Any:
    from gpuguard.host.inventory import Gpu, Inventory, MigDevice

    migs = tuple(MigDevice(f"MIG-{i}", i, 0) for i in range(mig_devices))
    gpus = [Gpu(f"GPU-w{i}", i, i, f"0000:0{i}:00.0") for i in range(whole)]
    if mig_devices:
        gpus.append(Gpu("GPU-m", whole, whole, "0000:09:00.0", mig=migs))
    return Inventory(tuple(gpus), "test")


MIXED = (plugin(), plugin("nvidia-mig-1g.10gb.sock"))


def test_a_partial_drop_on_a_mixed_mig_node_is_a_finding() -> None:
    """nvidia.com/gpu at 0 beside nvidia.com/mig-1g.10gb at 14, on a node with a GPU
    without MIG: kubelet dropped the gpu resource's plugin (issue: a partial drop was
    called OK because one resource was allocatable)."""
    r = judged(mixed_node(), *MIXED, alloc={"nvidia.com/gpu": 0, "nvidia.com/mig-1g.10gb": 14})
    (f,) = r.findings
    assert f.kind == K_NOT_ALLOCATABLE and f.fields["RESOURCE"] == "nvidia.com/gpu"
    assert "(1 without MIG)" in f.summary
    assert [a.identity for a in r.actions] == ["nvidia.com/gpu"]
    r = judged(mixed_node(), *MIXED, alloc={"nvidia.com/gpu": 1, "nvidia.com/mig-1g.10gb": 0})
    assert [a.identity for a in r.actions] == ["nvidia.com/mig-1g.10gb"]
    assert "of the node's 7 MIG devices" in r.findings[0].summary


def test_a_resource_empty_on_purpose_is_no_finding() -> None:
    """Every GPU in MIG mode under the mixed strategy: nvidia.com/gpu counts none; a node
    without MIG devices: no MIG profile to allocate."""
    every_gpu_mig = mixed_node(whole=0)
    r = judged(every_gpu_mig, *MIXED, alloc={"nvidia.com/mig-1g.10gb": 7})
    assert r.findings == () and r.actions == ()
    r = judged(mixed_node(mig_devices=0, whole=2), *MIXED, alloc={"nvidia.com/gpu": 2})
    assert r.findings == () and r.actions == ()
    # strategy single (no profile served): every GPU is advertised as nvidia.com/gpu
    r = judged(every_gpu_mig, plugin(), alloc={})
    assert [a.identity for a in r.actions] == ["nvidia.com/gpu"]
