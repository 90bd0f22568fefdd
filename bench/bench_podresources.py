"""What asking kubelet for its allocatable devices costs the device plugin step.

A kubelet stand-in serves ``v1.PodResourcesLister/GetAllocatableResources`` on a unix
socket (``--gpus`` GPUs, one ContainerDevices each, as kubelet 1.34 answers, plus 64
CPU ids); a fresh Python process, as the daemon is, then makes the step's call
(steps/device_plugin/podresources.py read_allocatable) ``--runs`` times. Prints the
first call, p50/p95/p99 of the later ones, and the process's RSS before the first call
and after the last (the call is HTTP/2 by hand, host/unarygrpc.py), then what importing
grpcio on top would add (what it would cost the daemon). Figures only, never an
assertion.

    .venv/bin/python bench/bench_podresources.py [--runs 200] [--gpus 8]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from concurrent import futures
from pathlib import Path

from gpuguard.host.protowire import field, varint

CHILD = r"""
import json, sys, time
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0
from pathlib import Path
from gpuguard.host.paths import Root
from gpuguard.steps.device_plugin.podresources import read_allocatable
root, runs = Path(sys.argv[1]), int(sys.argv[2])
before = rss()
t = time.perf_counter()
first = read_allocatable(Root(root), "/var/lib/kubelet/device-plugins")
first_ms = (time.perf_counter() - t) * 1000
times = []
for _ in range(runs):
    t = time.perf_counter()
    got = read_allocatable(Root(root), "/var/lib/kubelet/device-plugins")
    times.append((time.perf_counter() - t) * 1000)
    assert not got.unchecked, got
after = rss()
loaded = "grpc" in sys.modules
import grpc
print(json.dumps({"first_ms": first_ms, "times": times, "rss_before_kb": before,
                  "rss_after_kb": after, "rss_grpc_kb": rss(), "counts": dict(first.counts),
                  "grpc_loaded_by_the_call": loaded}))
"""


def answer(gpus: int) -> bytes:
    devs = b"".join(
        field(
            1,
            field(1, b"nvidia.com/gpu")
            + field(2, f"GPU-{i:08x}".encode())
            + field(3, field(1, b"\x08\x00")),
        )
        for i in range(gpus)
    )
    return devs + field(2, b"".join(varint(c) for c in range(64)))


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--gpus", type=int, default=8)
    args = ap.parse_args()
    import grpc  # type: ignore[import-untyped]

    root = Path(tempfile.mkdtemp(prefix="gg-bench-", dir="/tmp"))
    sock = root / "var/lib/kubelet/pod-resources/kubelet.sock"
    sock.parent.mkdir(parents=True)
    reply = answer(args.gpus)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(lambda _req, _ctx: reply)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "v1.PodResourcesLister", {"GetAllocatableResources": handler}
            ),
        )
    )
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(root), str(args.runs)],
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        server.stop(0)
        shutil.rmtree(root)
    if out.returncode:
        sys.exit(f"the measuring process failed:\n{out.stderr}")
    r = json.loads(out.stdout)
    t = r["times"]
    print(f"kubelet's answer: {len(reply)} bytes, {r['counts']}")
    print(f"first call: {r['first_ms']:.2f} ms (grpc loaded: {r['grpc_loaded_by_the_call']})")
    print(
        f"later calls ({len(t)}): p50 {pct(t, 50):.2f} ms, p95 {pct(t, 95):.2f} ms, "
        f"p99 {pct(t, 99):.2f} ms, max {max(t):.2f} ms"
    )
    grew = (r["rss_after_kb"] - r["rss_before_kb"]) / 1024
    print(
        f"RSS: {r['rss_before_kb'] / 1024:.1f} MiB before the first call, "
        f"{r['rss_after_kb'] / 1024:.1f} MiB after the last (+{grew:.1f} MiB); "
        f"importing grpcio would add {(r['rss_grpc_kb'] - r['rss_after_kb']) / 1024:.1f} MiB"
    )


if __name__ == "__main__":
    main()
