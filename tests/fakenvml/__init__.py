"""The fake libnvidia-ml.so.1 (fakenvml.c), built with the machine's gcc, and its GPUs.

`build(dest)` compiles it once per source text into the test cache and copies it to
`dest`; `write_conf(dir, ...)` writes the fakenvml.conf the library reads at each
nvmlInit (its format: fakenvml.c). Driven through the real pynvml, it exercises
gpuguard's NVML path the way a node's driver would, errors included.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

SOURCE = Path(__file__).with_name("fakenvml.c")
LIBRARY = "libnvidia-ml.so.1"
CACHE = Path(os.environ.get("GPUGUARD_TEST_CACHE", "/var/cache/gpuguard-tests")) / "fakenvml"
DRIVER_NOT_LOADED, GPU_IS_LOST, UNKNOWN = 9, 15, 999
FLAGS = ("-shared", "-fPIC", "-O2", "-Wall", "-Werror")


@dataclass(frozen=True)
class FakeGpu:
    uuid: str
    minor: int
    bus_id: str
    code: int = 0  # what every call about this GPU returns (GPU_IS_LOST)
    name: str = "NVIDIA A100-SXM4-40GB"
    mig: tuple[tuple[str, int, int], ...] = ()  # (uuid, gi, ci)


def gpus(n: int, prefix: str = "GPU-0000") -> list[FakeGpu]:
    return [
        FakeGpu(f"{prefix}{i:04x}-1111-2222-3333-444444444444", i, f"00000000:00:{7 + i:02x}.0")
        for i in range(n)
    ]


def _built() -> Path:
    """The library for this source text, compiled once (a cache entry per hash). No
    soname: a process that loaded it by path must not answer a later
    dlopen("libnvidia-ml.so.1") with it."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    try:
        CACHE.mkdir(parents=True, exist_ok=True)
        cache = CACHE
    except OSError:  # no writable cache (not root): a private one
        cache = Path(tempfile.gettempdir()) / f"fakenvml-{os.getuid()}"
        cache.mkdir(exist_ok=True)
    out = cache / f"{digest}.so"
    if not out.exists():
        tmp = cache / f".{digest}.{os.getpid()}.so"
        subprocess.run(
            ["gcc", *FLAGS, "-o", str(tmp), str(SOURCE), "-ldl"],
            check=True,
        )  # fmt: skip
        os.replace(tmp, out)  # whole or absent, for a concurrent test run
    return out


def build(dest: Path, name: str = LIBRARY) -> Path:
    """The fake library copied to `dest`/`name` (root-owned, mode 0644 as a driver's)."""
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / name
    shutil.copyfile(_built(), path)
    path.chmod(0o644)
    return path


def write_conf(
    directory: Path,
    gpu_list: Sequence[FakeGpu],
    *,
    driver: str = "580.82.07",
    init_error: int = 0,
    count_error: int = 0,
    init_sleep: int = 0,
) -> Path:
    lines = [f"driver {driver}"]
    if init_error:
        lines.append(f"init_error {init_error}")
    if count_error:
        lines.append(f"count_error {count_error}")
    if init_sleep:
        lines.append(f"init_sleep {init_sleep}")
    for g in gpu_list:
        lines.append(f"gpu {g.uuid} {g.minor} {g.bus_id} {g.code} {g.name}")
        lines += [f"mig {u} {gi} {ci}" for u, gi, ci in g.mig]
    path = directory / "fakenvml.conf"
    tmp = directory / ".fakenvml.conf.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)  # the library never reads half a file
    return path
