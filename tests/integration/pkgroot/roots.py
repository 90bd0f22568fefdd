"""Debootstrapped Debian roots of several releases, built once and cached.

Each suite's root is a ``debootstrap --variant=minbase`` tree with the suite's own
systemd, D-Bus, containerd, runc, crun, python3 and gpuguard's run-time dependencies
(those the suite has), so a test can boot the release's own systemd
(:class:`integration.pkgroot.PackageRoot`) and install gpuguard's .deb offline.

Cache: ``/var/cache/gpuguard-tests/debootstrap-<suite>-<key>`` (``GPUGUARD_TEST_CACHE``
moves it). The key hashes the suite, variant, mirror, package list, this module's
format number and a stamp, the current month (``GPUGUARD_TEST_ROOT_STAMP`` sets it): the
archive moves (sid daily, stable at point releases), so a root is rebuilt at the
first run of each month, or at once when its package list or mirror changes. Building
a new root of a suite removes that suite's roots of earlier months (same package list).
A root is made in a temporary directory inside a private mount namespace (a
debootstrap failing half-way leaves no proc/sys mounts on the host) and renamed into
place only once complete: a half-built root is never used. ``manifest.json`` in each
root records what was built and when.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

DEBIAN_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
MIRROR = os.environ.get("GPUGUARD_TEST_MIRROR", "http://deb.debian.org/debian")
CACHE = Path(os.environ.get("GPUGUARD_TEST_CACHE", "/var/cache/gpuguard-tests"))
FORMAT = "2"  # bump when the way a root is made changes

#: In every root: systemd + D-Bus to boot, udev for udevadm, gpuguard's dependencies
#: (so `apt-get install ./gpuguard_*.deb` needs no network), the runtimes.
COMMON: Tuple[str, ...] = (
    "systemd",
    "dbus",
    "udev",
    "python3",
    "python3-pyudev",
    "python3-systemd",
    "python3-yaml",
    "procps",
    "util-linux",
    "containerd",
    "runc",
    "crun",
)


@dataclass(frozen=True)
class Suite:
    """A Debian release as the stack tests use it."""

    name: str
    extra: Tuple[str, ...]  # packages beyond COMMON
    boots_v1: bool  # its systemd still runs on cgroup v1 (258 and newer refuse)

    @property
    def packages(self) -> Tuple[str, ...]:
        return tuple(sorted({*COMMON, *self.extra}))


SUITES: Dict[str, Suite] = {
    # Python 3.9 (RHEL 9's interpreter class), systemd 247, containerd 1.4: no
    # python3-dbus-next in this release; python3-venv and man-db for the unit suite's
    # run under 3.9 (test_python39.py).
    "bullseye": Suite("bullseye", ("python3-venv", "man-db"), boots_v1=True),
    "bookworm": Suite("bookworm", ("python3-dbus-next",), boots_v1=True),
    "trixie": Suite("trixie", ("python3-dbus-next",), boots_v1=True),
    "sid": Suite("sid", ("python3-dbus-next",), boots_v1=False),
}


def debian_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = DEBIAN_PATH
    env["LC_ALL"] = "C.UTF-8"
    return env


def stamp() -> str:
    return os.environ.get("GPUGUARD_TEST_ROOT_STAMP") or datetime.date.today().strftime("%Y-%m")


def root_key_text(suite: Suite) -> str:
    """What a root is made from: its cache key hashes this."""
    return "|".join([FORMAT, suite.name, "minbase", MIRROR, ",".join(suite.packages), stamp()])


def root_key(suite: Suite) -> str:
    return cache_key(root_key_text(suite))


def root_path(name: str) -> Path:
    suite = SUITES[name]
    return CACHE / f"debootstrap-{suite.name}-{root_key(suite)}"


def cache_key(key_text: str) -> str:
    return hashlib.sha256(key_text.encode()).hexdigest()[:16]


def cached(
    kind: str,
    key_text: str,
    make: Callable[[Path], None],
    *,
    superseded: Callable[[Path], bool] = lambda old: True,
) -> Path:
    """``CACHE/<kind>-<key>``, made by ``make(directory)`` if absent, in a temporary
    directory renamed into place when complete; one maker at a time (a lock per kind).
    Once made, the other directories of ``kind`` that are ``superseded`` are removed."""
    final = CACHE / f"{kind}-{cache_key(key_text)}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".lock-{kind}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / ".complete").exists():
            return final
        tmp = CACHE / f".tmp-{kind}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            make(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        (tmp / ".complete").write_text(key_text + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        for old in CACHE.glob(f"{kind}-*"):
            if old != final and superseded(old):
                shutil.rmtree(old, ignore_errors=True)
        return final


def debian_root(name: str = "bookworm") -> Tuple[Path, Optional[float]]:
    """The cached root of suite ``name`` (made if absent) and the seconds it took to make,
    if made now."""
    suite = SUITES[name]
    took: List[float] = []

    def make(tmp: Path) -> None:
        t0 = time.monotonic()
        argv = ["debootstrap", "--variant=minbase", "--include=" + ",".join(suite.packages)]
        argv += [suite.name, str(tmp), MIRROR]
        res = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "--", *argv],
            env=debian_env(),
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if res.returncode != 0:
            log = tmp / "debootstrap/debootstrap.log"
            detail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise AssertionError(
                f"debootstrap {suite.name} failed ({res.returncode}):\n"
                f"{res.stdout[-2000:]}\n{res.stderr[-2000:]}\n{detail}"
            )
        # Drop downloaded .debs; keep apt lists (offline dependency resolution).
        for deb in (tmp / "var/cache/apt/archives").glob("*.deb"):
            deb.unlink()
        seconds = time.monotonic() - t0
        manifest = {
            "format": FORMAT,
            "suite": suite.name,
            "mirror": MIRROR,
            "packages": list(suite.packages),
            "stamp": stamp(),
            "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(seconds, 1),
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        took.append(seconds)

    final = cached(
        f"debootstrap-{suite.name}",
        root_key_text(suite),
        make,
        superseded=lambda old: superseded(old, suite),
    )
    assert final == root_path(name)
    return final, (took[0] if took else None)


def superseded(path: Path, suite: Suite) -> bool:
    """A root of this suite made the same way from an earlier stamp (a checkout with
    another package list may still be using its own: left alone)."""
    try:
        made = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(
        made.get("format") == FORMAT
        and made.get("packages") == list(suite.packages)
        and str(made.get("stamp", "")) < stamp()
    )
