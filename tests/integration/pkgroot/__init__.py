"""Throw-away Debian 12 roots for package tests, and the package builds they install.

* :func:`built_packages` runs packaging/build-deb and packaging/build-rpm once per
  pytest process and version suffix (into build/test-dist/).
* :func:`debian_root` makes (once, cached under /var/cache/gpuguard-tests/) a
  debootstrapped Debian 12 minbase root with systemd, dbus, udev and gpuguard's
  dependencies, so installing the .deb needs no network.
* :class:`PackageRoot` boots a real systemd as PID 1 of private namespaces in a
  copy-on-write copy of that root (pkgroot/boot-root.sh), reusing the safety
  measures and API of harness.sysns.SystemdNamespace: per-instance cgroups,
  container mode, private /run /tmp /dev, masks, pdeathsig, SIGRTMIN+4 stop.
  The host's /etc/systemd, /run, /dev and dpkg database are never touched: the
  host root is detached (pivot_root) before systemd starts.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

from integration.harness.sysns import DEFAULT_MASKS, INNER_PATH, REQUIRED_TOOLS, SystemdNamespace

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
BOOT_SCRIPT = HERE / "boot-root.sh"
DEBIAN_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"

SUITE = "bookworm"
MIRROR = os.environ.get("GPUGUARD_TEST_MIRROR", "http://deb.debian.org/debian")
#: Installed in the cached root: systemd + D-Bus to boot, udev for udevadm, and
#: the .deb's dependencies so `apt-get install ./gpuguard_*.deb` works offline.
ROOT_PACKAGES: Tuple[str, ...] = (
    "systemd",
    "dbus",
    "udev",
    "python3",
    "python3-pyudev",
    "python3-dbus-next",
    "python3-systemd",
    "procps",
)
CACHE = Path(os.environ.get("GPUGUARD_TEST_CACHE", "/var/cache/gpuguard-tests"))

#: Inside the root nothing needs these either.
ROOT_EXTRA_MASKS: Tuple[str, ...] = (
    "systemd-networkd.service",
    "systemd-resolved.service",
    "systemd-logind.service",
    "getty@tty1.service",
    "serial-getty@.service",
    "apt-daily.service",
    "apt-daily-upgrade.service",
)

_built: Dict[str, Dict[str, Path]] = {}
build_seconds: Dict[str, float] = {}


def debian_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = DEBIAN_PATH
    env["LC_ALL"] = "C.UTF-8"
    return env


def built_packages(suffix: str = "") -> Dict[str, Path]:
    """{"deb": path, "rpm": path} of this checkout, version + ``suffix`` (e.g. "+test1")."""
    if suffix in _built:
        return _built[suffix]
    dist = REPO / "build" / "test-dist" / (suffix.lstrip("+") or "base")
    shutil.rmtree(dist, ignore_errors=True)
    dist.mkdir(parents=True)
    env = debian_env()
    env["DIST"] = str(dist)
    env["GPUGUARD_VERSION_SUFFIX"] = suffix
    out: Dict[str, Path] = {}
    for kind, script in (("deb", "build-deb"), ("rpm", "build-rpm")):
        t0 = time.monotonic()
        res = subprocess.run(
            [str(REPO / "packaging" / script)], env=env, capture_output=True, text=True, timeout=600
        )
        build_seconds[f"{kind}{suffix}"] = time.monotonic() - t0
        if res.returncode != 0:
            raise AssertionError(f"{script} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        out[kind] = Path(res.stdout.strip().splitlines()[-1])
        assert out[kind].is_file(), res.stdout
    _built[suffix] = out
    return out


def source_version() -> str:
    for line in (REPO / "src" / "gpuguard" / "__init__.py").read_text().splitlines():
        if line.startswith("__version__ = "):
            return line.split('"')[1]
    raise AssertionError("no __version__ in src/gpuguard/__init__.py")


def root_key() -> str:
    text = "|".join(["v1", SUITE, "minbase", MIRROR, ",".join(sorted(ROOT_PACKAGES))])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def debian_root() -> Tuple[Path, Optional[float]]:
    """The cached debootstrap root (made if absent) and the seconds it took to make, if made now."""
    CACHE.mkdir(parents=True, exist_ok=True)
    final = CACHE / f"debootstrap-{SUITE}-{root_key()}"
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / ".complete").exists():
            return final, None
        shutil.rmtree(final, ignore_errors=True)
        tmp = CACHE / f".tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.monotonic()
        # In a private mount namespace: a debootstrap failing half-way cannot
        # leave its proc/sys mounts behind on the host.
        res = subprocess.run(
            [
                "unshare",
                "-m",
                "--propagation",
                "private",
                "--",
                "debootstrap",
                "--variant=minbase",
                "--include=" + ",".join(ROOT_PACKAGES),
                SUITE,
                str(tmp),
                MIRROR,
            ],
            env=debian_env(),
            capture_output=True,
            text=True,
            timeout=1200,
        )
        if res.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise AssertionError(
                f"debootstrap failed ({res.returncode}):\n"
                f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
            )
        # Drop downloaded .debs; keep apt lists (offline dependency resolution).
        for deb in (tmp / "var/cache/apt/archives").glob("*.deb"):
            deb.unlink()
        (tmp / ".complete").write_text(f"{SUITE} {MIRROR} {' '.join(ROOT_PACKAGES)}\n")
        os.rename(tmp, final)
        return final, time.monotonic() - t0


def require_pkgroot_tools() -> None:
    from conftest import require_root, require_tool

    require_root()
    require_tool(*REQUIRED_TOOLS, "debootstrap", "pivot_root", "dpkg-buildpackage", "rpmbuild")


class PackageRoot(SystemdNamespace):
    """SystemdNamespace whose root is a copy-on-write copy of ``lower`` (not the host's)."""

    def __init__(self, workdir: Path, lower: Path, **kwargs: object) -> None:
        kwargs.setdefault("extra_mask", ROOT_EXTRA_MASKS)
        super().__init__(workdir, **kwargs)  # type: ignore[arg-type]
        self.lower = lower

    @property
    def upper(self) -> Path:
        """Host dir holding every file the root changed (overlayfs upper layer)."""
        return self.state / "upper"

    def _prepare_state(self) -> None:
        super()._prepare_state()
        # The harness binds the repository and stages /etc/systemd/system; a
        # foreign root keeps its own /etc/systemd/system: only the test's binds.
        rows = [f"{src.resolve()}\t{dst}\tro\n" for dst, src in self.ro_binds.items()] + [
            f"{src.resolve()}\t{dst}\trw\n" for dst, src in self.binds.items()
        ]
        (self.state / "binds.tsv").write_text("".join(rows))

    def _launch(self) -> None:
        # The harness's launcher (cgroup moves, setpriv --pdeathsig, unshare
        # --kill-child ...), with boot-root.sh instead of sysns-init.sh.
        script = 'set -e; for f in "$@"; do echo $$ > "$f"; done; exec ' + " ".join(
            shlex.quote(a)
            for a in [*self._unshare_argv(), str(BOOT_SCRIPT), str(self.state), str(self.lower)]
        )
        procs = [str(d / "cgroup.procs") for d in self._cgroups.values()]
        with open(self.log_path, "wb") as log:
            self._launcher = subprocess.Popen(
                ["/bin/sh", "-c", script, "sh", *procs],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd="/",
                env={"PATH": INNER_PATH, "LANG": "C.UTF-8"},
                start_new_session=True,
            )


__all__ = ["DEFAULT_MASKS", "PackageRoot", "built_packages", "debian_root", "require_pkgroot_tools"]
