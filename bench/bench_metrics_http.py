#!/usr/bin/env python3
"""The metrics endpoint's scrape latency, alone and beside held connections.

Serves a metrics.json of a busy node (200 GPU containers' worth of series) with the
server gpuguard-metrics.service runs (reporting/metrics_http.py) on 127.0.0.1, then
scrapes it `--scrapes` times (a new connection each, as Prometheus does): first with
nothing else connected, then while `--idle` connections that never send a byte and
`--slow` ones that sent half a request line are held open (the server closes them
after its 5 s request timeout, so they are opened again before each round). Prints
p50/p99/max per case. Asserts nothing; no root needed:

  .venv/bin/python bench/bench_metrics_http.py [--scrapes 50] [--idle 200] [--slow 50]
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from gpuguard.reporting.metrics import render_file  # noqa: E402
from gpuguard.reporting.metrics_file import SPEC  # noqa: E402
from gpuguard.reporting.metrics_http import listen, make_server  # noqa: E402
from gpuguard.reporting.metrics_state import MetricsState  # noqa: E402


def busy_state() -> MetricsState:
    state = MetricsState()
    for i in range(200):
        state.inc("gpuguard_findings", "container-device-denied", "container_access")
        state.inc("gpuguard_actions", f"kind-{i % 20}", "done")
        state.set("gpuguard_open_findings", i, f"kind-{i}", "container_access")
    return state


def pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def hold(port: int, idle: int, slow: int) -> List[socket.socket]:
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(idle + slow)]
    for s in held[idle:]:
        s.sendall(b"GET /metr")
    return held


def scrape(port: int) -> float:
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        assert r.status == 200
        r.read()
    return (time.perf_counter() - t0) * 1000


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scrapes", type=int, default=50)
    ap.add_argument("--idle", type=int, default=200)
    ap.add_argument("--slow", type=int, default=50)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "metrics.json"
        path.write_bytes(SPEC.encode(busy_state().to_values()))
        server = make_server(listen("127.0.0.1:0"), path, render_file)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port = server.server_address[1]
        scrape(port)  # warm-up: imports, first render
        alone = [scrape(port) for _ in range(args.scrapes)]
        beside: List[float] = []
        for _ in range(args.scrapes):
            held = hold(port, args.idle, args.slow)
            try:
                beside.append(scrape(port))
            finally:
                for s in held:
                    s.close()
        server.shutdown()
        server.server_close()
        size = len(render_file(path))
    print(f"exposition: {size} bytes; {args.scrapes} scrapes per case")
    for name, values in (("alone", alone), (f"beside {args.idle} idle + {args.slow} slow", beside)):
        print(
            f"{name:32} p50 {pct(values, 50):7.2f} ms  p99 {pct(values, 99):7.2f} ms  "
            f"max {max(values):7.2f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
