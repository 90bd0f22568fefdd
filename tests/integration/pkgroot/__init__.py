"""Throw-away Debian roots for package and stack tests, and the package builds they install.

* :func:`built_packages` runs packaging/build-deb and packaging/build-rpm once per
  pytest process, version suffix and variant (into build/test-dist/).
* :func:`debian_root` makes (once, cached under /var/cache/gpuguard-tests/) a
  debootstrapped minbase root of a Debian release (bullseye, bookworm, trixie, sid)
  with its own systemd, dbus, udev, containerd, runc, crun and gpuguard's
  dependencies, so installing the .deb needs no network (``roots.py``).
* :class:`PackageRoot` boots the root's OWN systemd as PID 1 of private namespaces in
  a copy-on-write copy of that root (pkgroot/boot-root.sh), reusing the safety
  measures and API of harness.sysns.SystemdNamespace: per-instance cgroups,
  container mode, private /run /tmp /dev, masks, pdeathsig, SIGRTMIN+4 stop.
  The host's /etc/systemd, /run, /dev and dpkg database are never touched: the
  host root is detached (pivot_root) before systemd starts. It checks that the
  namespace runs the stack it was asked for (layout, systemd version) and fails
  when it does not. ``units`` go to the root's own /etc/systemd/system once it runs
  (then a daemon-reload), as :meth:`~PackageRoot.write_unit` does afterwards.
"""

from __future__ import annotations

import functools
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

from integration.harness.sysns import (
    DEFAULT_MASKS,
    INNER_PATH,
    REQUIRED_TOOLS,
    NamespaceError,
    SystemdNamespace,
)
from integration.pkgroot.roots import (
    CACHE,
    DEBIAN_PATH,
    SUITES,
    debian_env,
    debian_root,
    root_path,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
BOOT_SCRIPT = HERE / "boot-root.sh"
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

#: Package variants: the build scripts' options for each.
VARIANTS: Dict[str, Dict[str, Tuple[str, ...]]] = {
    "": {"deb": (), "rpm": ()},
    # dbus-next shipped privately (Ubuntu 22.04, Debian 11; RHEL 9's .rpm)
    "bundled": {"deb": ("--bundle-dbus-next",), "rpm": ("--el9",)},
}


def built_packages(suffix: str = "", variant: str = "") -> Dict[str, Path]:
    """{"deb": path, "rpm": path} of this checkout, version + ``suffix`` (e.g. "+test1");
    ``variant`` "bundled": the .deb with dbus-next bundled and the .rpm for el9."""
    key = f"{suffix}/{variant}"
    if key in _built:
        return _built[key]
    name = "-".join(x for x in (suffix.lstrip("+"), variant) if x) or "base"
    dist = REPO / "build" / "test-dist" / name
    shutil.rmtree(dist, ignore_errors=True)
    dist.mkdir(parents=True)
    env = debian_env()
    env["DIST"] = str(dist)
    env["GPUGUARD_VERSION_SUFFIX"] = suffix
    out: Dict[str, Path] = {}
    for kind, script in (("deb", "build-deb"), ("rpm", "build-rpm")):
        t0 = time.monotonic()
        res = subprocess.run(
            [str(REPO / "packaging" / script), *VARIANTS[variant][kind]],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        build_seconds[f"{kind}{suffix}{variant}"] = time.monotonic() - t0
        if res.returncode != 0:
            raise AssertionError(f"{script} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        out[kind] = Path(res.stdout.strip().splitlines()[-1])
        assert out[kind].is_file(), res.stdout
        # Tests name the packages by source_version(), computed once per run.
        assert f"{source_version(suffix)}-1" in out[kind].name, (
            f"{out[kind].name} is not version {source_version(suffix)}: the checkout "
            "changed (a commit or an edit) during this test run; run it again"
        )
    _built[key] = out
    return out


def source_version(suffix: str = "") -> str:
    """The package version (dpkg's upstream part, rpm's Version) this checkout builds,
    as packaging/version derives it from git, with built_packages' ``suffix`` ("+test1":
    a further part of the local version); the checkout's computed once per run."""
    base = _checkout_version()
    if not suffix:
        return base
    return f"{base}.{suffix[1:]}" if "+" in base else f"{base}{suffix}"


@functools.cache
def _checkout_version() -> str:
    env = {k: v for k, v in debian_env().items() if k != "GPUGUARD_VERSION_SUFFIX"}
    res = subprocess.run(
        ["/usr/bin/python3", str(REPO / "packaging" / "version"), str(REPO)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return res.stdout.strip()


def require_pkgroot_tools() -> None:
    from conftest import require_root, require_tool

    require_root()
    require_tool(*REQUIRED_TOOLS, "debootstrap", "pivot_root", "dpkg-buildpackage", "rpmbuild")


#: systemd versions each suite's root may run (sid moves: any version 258 on).
SYSTEMD_VERSIONS: Dict[str, Tuple[int, int]] = {
    "bullseye": (247, 247),
    "bookworm": (252, 252),
    "trixie": (257, 257),
    "sid": (258, 9999),
}
#: What ``stat -fc %T /sys/fs/cgroup`` shows inside on each layout.
LAYOUT_FSTYPE = {"v1": "tmpfs", "v2": "cgroup2fs"}


def version_of(text: str) -> str:
    """The first dotted version number in a tool's --version output."""
    m = re.search(r"(?<![\w/.])v?(\d+(?:\.\d+)+(?:[~+-]\w[\w.~+-]*)?)", text) or re.search(
        r"(?<![\w/.])(\d+)\b", text
    )
    if not m:
        raise NamespaceError(f"no version in {text!r}")
    return m.group(1)


class PackageRoot(SystemdNamespace):
    """SystemdNamespace whose root is a copy-on-write copy of ``lower`` (not the host's).

    ``suite``: the Debian release ``lower`` holds; the booted systemd's version must be
    that release's (:data:`SYSTEMD_VERSIONS`). The layout is checked in every case."""

    def __init__(
        self, workdir: Path, lower: Path, *, suite: Optional[str] = None, **kwargs: object
    ) -> None:
        kwargs.setdefault("extra_mask", ROOT_EXTRA_MASKS)
        super().__init__(workdir, **kwargs)  # type: ignore[arg-type]
        self.lower = lower
        self.suite = suite
        self.systemd_version: Optional[int] = None

    @property
    def units_dir(self) -> Path:
        """The root's own /etc/systemd/system once booted (the harness's staging
        directory before: a foreign root keeps its own, see :meth:`_prepare_state`)."""
        return self.path("/etc/systemd/system") if self._pid is not None else super().units_dir

    @property
    def upper(self) -> Path:
        """Host dir holding every file the root changed (overlayfs upper layer)."""
        return self.state / "upper"

    def start(self) -> None:
        super().start()
        try:
            self.check_stack()
            if self.units:
                for name, text in self.units.items():
                    self.write_unit(name, text)
                self.systemctl("daemon-reload")
        except BaseException:
            self.stop()
            raise

    def check_stack(self) -> None:
        """Fail unless the namespace runs what was asked: the layout, and the suite's
        systemd (a harness that booted another stack would prove nothing)."""
        fstype = self.run(["stat", "-fc", "%T", "/sys/fs/cgroup"], check=True).stdout.strip()
        if fstype != LAYOUT_FSTYPE[self.layout]:
            raise NamespaceError(
                f"asked for cgroup {self.layout}, booted /sys/fs/cgroup is {fstype}"
            )
        out = self.run(["systemctl", "--version"], check=True).stdout
        m = re.match(r"systemd (\d+)", out)
        if not m:
            raise NamespaceError(f"systemctl --version: {out!r}")
        self.systemd_version = int(m.group(1))
        if self.suite is not None:
            lo, hi = SYSTEMD_VERSIONS[self.suite]
            if not lo <= self.systemd_version <= hi:
                raise NamespaceError(
                    f"{self.suite} root runs systemd {self.systemd_version}, expected {lo}-{hi}"
                )

    def tool_version(self, argv: Tuple[str, ...]) -> str:
        """``argv`` (e.g. ("runc", "--version")) run inside: its version number."""
        res = self.run(list(argv), check=True)
        return version_of(res.stdout + res.stderr)

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


__all__ = [
    "CACHE",
    "DEBIAN_PATH",
    "DEFAULT_MASKS",
    "SUITES",
    "PackageRoot",
    "built_packages",
    "debian_env",
    "debian_root",
    "require_pkgroot_tools",
    "root_path",
]
