#!/usr/bin/env python3
"""In-process cost of a checkpoint repair: parse + verify + analyse + rewrite (marshal).

Two checkpoints of 1,000 pod entries on an 8-GPU node (GPUs 0-3 on NUMA node 0, 4-7 on
NUMA node 1), AllocResp built like the NVIDIA device plugin's ContainerAllocateResponse
(NVIDIA_VISIBLE_DEVICES env + /dev/nvidia* device specs):

- realistic: one distinct AllocResp per distinct GPU set (pods of 1, 2, 4 or 8 GPUs,
  so a few dozen distinct responses repeat across the 1,000 entries);
- worst case: every AllocResp differs (each also carries a per-pod annotation).

GPU 5 came back with a new UUID, so the entries holding it are stale and analyse()
returns a repaired checkpoint for marshal() to write (dropped: no GPU identity history).
Then the remap: every GPU came back with a new UUID in its slot, the history knows the
old ones, and every entry is remapped (IDs and AllocResp rewritten). Prints p50/p95 per
phase. Figures only: nothing is asserted. Targets: realistic total < 50 ms; remap,
realistic total < 200 ms.

    .venv/bin/python bench/bench_checkpoint.py [--runs N] [--entries N]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from gpuguard.checkpoint import (
    Checkpoint,
    PodDevicesEntry,
    marshal,
    parse,
    spew,
    verify,
)
from gpuguard.checkpoint.history import History, generation_of
from gpuguard.host.inventory import Gpu, Inventory
from gpuguard.steps.checkpoint.reconcile import DEFAULT_RESOURCES, analyse
from gpuguard.steps.checkpoint.remap import RemapInputs

GPUS = 8
RESOURCE = "nvidia.com/gpu"
SETS: Tuple[Tuple[int, ...], ...] = (
    *((i,) for i in range(8)),
    *((i, i + 1) for i in range(0, 8, 2)),
    (0, 1, 2, 3),
    (4, 5, 6, 7),
    tuple(range(8)),
)
WEIGHTS = (*(6,) * 8, *(3,) * 4, 2, 2, 1)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(num: int, payload: bytes) -> bytes:
    return bytes([num << 3 | 2]) + _varint(len(payload)) + payload


def _kv(num: int, key: str, value: str) -> bytes:
    return _field(num, _field(1, key.encode()) + _field(2, value.encode()))


def _device(path: str) -> bytes:
    return _field(3, _field(1, path.encode()) + _field(2, path.encode()) + _field(3, b"rw"))


def alloc_resp(uuids: List[str], indices: Tuple[int, ...], annotation: str = "") -> bytes:
    """A ContainerAllocateResponse like nvidia/k8s-device-plugin's (envs, devices)."""
    msg = _kv(1, "NVIDIA_VISIBLE_DEVICES", ",".join(uuids))
    for path in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"):
        msg += _device(f"/dev/{path}")
    for i in indices:
        msg += _device(f"/dev/nvidia{i}")
    if annotation:
        msg += _kv(4, "cdi.k8s.io/gpuguard-bench", annotation)
    return msg


def gpu_uuid(rng: random.Random) -> str:
    return "GPU-" + str(uuid.UUID(int=rng.getrandbits(128)))


def build(
    entries: int, *, unique: bool, seed: int = 1, all_new: bool = False
) -> Tuple[bytes, Inventory, Optional[RemapInputs]]:
    rng = random.Random(seed)
    uuids = [gpu_uuid(rng) for _ in range(GPUS)]
    responses: Dict[Tuple[int, ...], bytes] = {}
    out = []
    for n in range(entries):
        gset = rng.choices(SETS, WEIGHTS)[0]
        ids = [uuids[i] for i in gset]
        numa: Dict[int, List[str]] = {}
        for i in gset:
            numa.setdefault(i // 4, []).append(uuids[i])
        pod = str(uuid.UUID(int=rng.getrandbits(128)))
        if unique:
            resp = alloc_resp(ids, gset, annotation=f"{pod}-{n}")
        else:
            resp = responses.setdefault(gset, alloc_resp(ids, gset))
        out.append(
            PodDevicesEntry(
                pod,
                f"worker-{n % 3}",
                RESOURCE,
                tuple((k, tuple(v)) for k, v in numa.items()),
                resp,
            )
        )
    cp = Checkpoint("v2", tuple(out), ((RESOURCE, tuple(uuids)),), 0)
    raw = marshal(cp)
    # GPU 5 (or every GPU) came back with a new UUID after an instance replacement.
    now = list(uuids)
    for i in range(GPUS) if all_new else (5,):
        now[i] = gpu_uuid(rng)

    def inventory(ids: List[str]) -> Inventory:
        gpus = tuple(Gpu(u, i, i, f"00000000:{0x10 + i:02X}:00.0") for i, u in enumerate(ids))
        return Inventory(gpus, source="bench")

    if not all_new:
        return raw, inventory(now), None
    numa = {f"0000:{0x10 + i:02x}:00.0": i // 4 for i in range(GPUS)}
    old = generation_of(inventory(uuids).gpus, numa, when=1.0, boot_id="", source="bench")
    return raw, inventory(now), RemapInputs(History((old,)), "", "history", numa, 2.0, 1.0)


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def pct(values: List[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def bench(name: str, raw: bytes, inv: Inventory, runs: int, inputs: Optional[RemapInputs]) -> None:
    phases: Dict[str, List[float]] = {
        k: [] for k in ("parse", "verify", "analyse", "marshal", "total")
    }
    stale = 0
    distinct = 0
    for _ in range(runs):
        spew.clear_caches()  # every run pays for its tables, as one `gpuguard check` does
        t0 = time.perf_counter()
        t = time.perf_counter()
        cp = parse(raw, source="bench")
        phases["parse"].append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        ok = verify(cp)
        phases["verify"].append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        analysis = analyse(cp, inv, DEFAULT_RESOURCES, inputs)
        phases["analyse"].append((time.perf_counter() - t) * 1000)
        assert ok and analysis.repaired is not None
        repaired = analysis.repaired
        t = time.perf_counter()
        out = marshal(repaired)
        phases["marshal"].append((time.perf_counter() - t) * 1000)
        phases["total"].append((time.perf_counter() - t0) * 1000)
        stale = len(analysis.stale_entries) + len(analysis.remaps)
        distinct = len({e.alloc_resp for e in cp.entries or ()})
    assert verify(parse(out, source="repaired"))
    print(
        f"{name}: {len(raw) / 1024:.0f} KiB, {len(cp.entries or ())} entries, "
        f"{distinct} distinct AllocResp, {stale} stale ({len(analysis.remaps)} remapped); "
        f"{runs} runs"
    )
    for k, v in phases.items():
        print(f"  {k:8} p50 {pct(v, 50):7.2f} ms   p95 {pct(v, 95):7.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--entries", type=int, default=1000)
    args = ap.parse_args()
    print(
        f"python {sys.version.split()[0]}; targets: realistic total < 50 ms, "
        "remap realistic total < 200 ms"
    )
    for name, unique, all_new in (
        ("realistic", False, False),
        ("worst case (every AllocResp differs)", True, False),
        ("remap, realistic (every GPU new, history)", False, True),
        ("remap, worst case (every AllocResp differs)", True, True),
    ):
        raw, inv, inputs = build(args.entries, unique=unique, all_new=all_new)
        bench(name, raw, inv, args.runs, inputs)


if __name__ == "__main__":
    main()
