#!/usr/bin/env python3
"""What the reload fast path costs per container on its own: no systemd, no bus,
nothing else running. The bench_container_access.py figures add a real systemd
re-applying every unit on 2 cores; this is gpuguard's own share of them.

N real cgroups (removed afterwards), the container access step's `on_reload` run on
them as after a daemon-reload:

  v1: cgroups under /sys/fs/cgroup/devices with runc's default rules (every GPU node
      wiped), two entitled nodes each (a GPU and nvidiactl): on_reload reads each,
      writes the grants, then reads every one back (`confirm_v1`).
  v2: cgroups under /sys/fs/cgroup/unified, each with a runtime program admitting its
      GPU and a program of systemd's (`sd_devices`, its own id, as after a reload:
      nothing cached) denying it: the bridges sweep (look, bridge, verify).

Prints ms per container, min and p50 over --runs (the wall time to the last write and the
thread's CPU time), and checks only that every container was repaired. Needs root
and a hybrid cgroup layout (both hierarchies):

  sudo .venv/bin/python bench/bench_reload_sweep.py [--containers 200] [--runs 20] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
import types
import uuid
from pathlib import Path
from typing import Callable, List, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "src"))

from gpuguard.actuate.bpfbridge import detach_bridges  # noqa: E402
from gpuguard.devices.containers import ContainerCgroup  # noqa: E402
from gpuguard.devices.entitlement import Entitlement, VisibleDevices  # noqa: E402
from gpuguard.devices.nodes import ROLE_CTL, ROLE_GPU, DeviceNode  # noqa: E402
from gpuguard.engine.executor import ChangeExecutor  # noqa: E402
from gpuguard.steps.container_access import ContainerAccessStep  # noqa: E402
from integration.harness.bpfdev import (  # noqa: E402
    DEFAULT_RULES,
    attach,
    program,
)
from unit.test_bpfprog import SYSTEMD_252, _code  # noqa: E402

V1, V2 = Path("/sys/fs/cgroup/devices"), Path("/sys/fs/cgroup/unified")
GPU = DeviceNode("/dev/nvidia1", 195, 1, ROLE_GPU)
CTL = DeviceNode("/dev/nvidiactl", 195, 255, ROLE_CTL)
RUNC = ("c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm", "c 1:9 rwm", "c 5:0 rwm",
        "c 5:2 rwm", "c 136:* rwm")  # fmt: skip


Pair = tuple[ContainerCgroup, Entitlement]


def pair(cg: Path, i: int, v1: bool, nodes: Sequence[DeviceNode]) -> Pair:
    cid = f"{i:064x}"
    c = ContainerCgroup("pod", cid, "containerd", "systemd", cg if v1 else None,
                        None if v1 else cg, f"cri-containerd-{cid}.scope", (1,))  # fmt: skip
    return c, Entitlement("pod", cid, tuple(nodes), tuple(nodes), (), (), VisibleDevices("unset"))


def wipe_v1(cg: Path) -> None:
    """What systemd's re-apply leaves: deny all, then runc's defaults."""
    for file, line in (("devices.deny", "a"), *(("devices.allow", r) for r in RUNC)):
        with open(cg / file, "w") as f:
            f.write(line)


def attach_sd(cg: Path) -> None:
    """A new program of systemd's (its own id) denying the GPU."""
    attach(cg, _code(SYSTEMD_252), b"sd_devices")


def attach_runtime(cg: Path) -> None:
    attach(cg, program([*DEFAULT_RULES, ("c", 195, 1)]))


def scope_v2(cg: Path) -> None:
    attach_runtime(cg)
    attach_sd(cg)


def cgroups(
    hierarchy: Path, tag: str, n: int, made: List[Path], setup: Callable[[Path], None]
) -> List[Path]:
    """N new cgroups under `hierarchy`, each set up; all recorded in `made`, children
    before their parent (removed in that order)."""
    base = hierarchy / f"gg-bench-sweep-{tag}"
    base.mkdir()
    made.append(base)
    out = []
    for i in range(n):
        cg = base / f"c{i}"
        cg.mkdir()
        made.insert(0, cg)
        setup(cg)
        out.append(cg)
    return out


def measure(runs: int, n: int, once: Callable[[], float], reset: Callable[[], None],
            profile: bool) -> str:  # fmt: skip
    walls, cpus = [], []
    prof = cProfile.Profile()
    for r in range(runs):
        c0 = time.thread_time()
        if profile and r == runs - 1:
            prof.enable()
        walls.append(once() * 1000 / n)
        if profile and r == runs - 1:
            prof.disable()
        cpus.append((time.thread_time() - c0) * 1000 / n)
        reset()
    if profile:
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    # the minimum too: on a shared VM it moves least between runs (a p50 of a few runs
    # moves by half with the neighbours' load)
    return (f"to the last write min {min(walls):.3f} / p50 {statistics.median(walls):.3f} ms, "
            f"thread CPU min {min(cpus):.3f} / p50 {statistics.median(cpus):.3f} ms "
            "per container")  # fmt: skip


def main(argv: Sequence[str] = ()) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--containers", type=int, default=200)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="cProfile the last run of each")
    args = ap.parse_args(list(argv) or None)
    n, tag = args.containers, uuid.uuid4().hex[:8]
    made: List[Path] = []
    quiet = types.SimpleNamespace(finding=lambda f: None, outcome=lambda o: None)
    try:
        # v1: on_reload as the daemon runs it, from the signal to the read-backs
        step = ContainerAccessStep()
        pairs = [
            pair(cg, i, True, (GPU, CTL)) for i, cg in enumerate(cgroups(V1, tag, n, made, wipe_v1))
        ]
        step.state.observer.know(pairs)
        devices = types.SimpleNamespace(regrant=True, durable_grants=False)
        svc = types.SimpleNamespace(apply=ChangeExecutor(), systemd=None, log=quiet,
                                    config=types.SimpleNamespace(devices=devices))  # fmt: skip

        def v1_once() -> float:
            step.on_reload(svc, time.monotonic())  # type: ignore[arg-type]
            r = step.state.last_reload
            assert r is not None and r.containers == n and r.last_write is not None, r
            outcomes, _findings, _ids = step.state.carried.take()
            assert all(o.status == "done" for o in outcomes), "a re-grant not done"
            return r.last_write - r.signal

        print(f"reload fast path, {n} containers, {args.runs} runs")
        print("  v1 re-grant, read back:", measure(args.runs, n, v1_once,
              lambda: [wipe_v1(p[0].cgroup_v1_devices) for p in pairs], args.profile))  # type: ignore[arg-type]  # fmt: skip

        # v2: the bridges sweep on scopes whose systemd program is new
        step = ContainerAccessStep()
        pairs = [
            pair(cg, i, False, (GPU,)) for i, cg in enumerate(cgroups(V2, tag, n, made, scope_v2))
        ]
        step.state.observer.know(pairs)
        bridges = step.state.cgroups.v2.bridges

        def v2_once() -> float:  # to the last swap (the sweep builds its outcomes after)
            t0 = time.monotonic()
            out, _ = bridges.sweep(pairs, svc, record=False)  # type: ignore[arg-type]
            took = max(t for t, _o in out.values()) - t0
            assert len(out) == n and all(o.status == "done" for _t, o in out.values()), [
                o.detail for _t, o in out.values() if o.status != "done"
            ][:2]
            bridges.pending.clear()
            return took

        def v2_reset() -> None:  # a reload: systemd's new program, the bridge detached
            for c, _ in pairs:
                assert c.cgroup_v2 is not None
                attach_sd(c.cgroup_v2)
                detach_bridges(c.cgroup_v2)

        print("  v2 bridge (look, bridge, verify):",
              measure(args.runs, n, v2_once, v2_reset, args.profile))  # fmt: skip
    finally:
        for cg in made:
            for _ in range(50):
                try:
                    cg.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
