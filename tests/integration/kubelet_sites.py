"""Where a real-kubelet GPU node runs (integration/kubelet_node.py): one scenario body,
two kinds of stack under it.

* :class:`HostSite` (``"host"``): this machine's own systemd (Debian 12: 252), containerd
  (1.6) and runc (1.1) in a :class:`~integration.harness.SystemdNamespace` on cgroup v1
  (hybrid); gpuguard runs from this checkout (the repo's units pointed at its venv,
  integration/gpuguard_ns.py). Every real-kubelet test runs here.
* :class:`RootSite` (a release's name, e.g. ``"trixie"``): a debootstrapped Debian root
  (integration/pkgroot, cached) booted with its OWN systemd as PID 1 of private
  namespaces on cgroup v1, its own containerd (CRI plugin) and runc; gpuguard installed
  from its .deb as the stacks cells install it (integration/stacks), with the fake
  driver's registration bound into its unit and its configuration as a drop-in. Bound
  in read-only: the cached kubelet (a static Go binary) and this checkout, each at its
  own path (the runtime hook and the plugin double run from there with the root's
  python3), and grpcio and protobuf for the root's CPython (pkgroot/wheels.py: the
  versions of this checkout's venv, whose grpc_tools generated the plugin's API code).
  The root must run the stack its release stands for (:data:`ROOT_STACKS`: systemd,
  containerd, runc, and the containerd kubelet says it talks to), or the test fails,
  whatever ``CI`` says.

Only v1: a kubelet cannot run pods on cgroup v2 on these machines, whose kernel keeps
the cpu and memory controllers in its v1 hierarchies (harness/kubelet.py); systemd 258
and newer (sid) refuse v1, so trixie (257) is the newest release that can run it here.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional, Protocol

from integration.gpu_scopes import FAKE_DRIVER, node_units
from integration.harness import SystemdNamespace
from integration.harness.kubelet import kubelet_binary, plugin_unit
from integration.harness.sysns import REPO
from integration.pkgroot import (
    SUITES,
    PackageRoot,
    built_packages,
    debian_root,
    require_pkgroot_tools,
    version_of,
)
from integration.pkgroot.wheels import site_packages
from integration.stacks.node import Node, StackError, copy_debs
from integration.stacks.scenario import install_gpuguard

NsFactory = Callable[..., SystemdNamespace]
#: What each release's root must run for its kubelet cells: version prefixes.
ROOT_STACKS: Dict[str, Dict[str, str]] = {
    "trixie": {"systemd": "257", "containerd": "1.7.", "runc": "1.1."},
}
PYSITE = "/run/host/pysite"  # grpcio and protobuf for the root's python3
CONFIG_DROPIN = "/etc/gpuguard/gpuguard.conf.d/50-kubelet-test.conf"
PACKAGED_DROPIN = "/usr/lib/systemd/system/kubelet.service.d/10-gpuguard.conf"


def stack_versions(ns: SystemdNamespace, kubelet: Optional[Path] = None) -> Dict[str, str]:
    """The versions the namespace runs (what the matrix shows), and its release."""

    def of(*argv: str) -> str:
        res = ns.run(list(argv), timeout=30)
        return version_of(res.stdout + res.stderr).split("~")[0]

    kubelet = subprocess.run(
        [str(kubelet or kubelet_binary()), "--version"], capture_output=True, text=True, check=True
    ).stdout
    release = dict(
        line.split("=", 1)
        for line in ns.path("/etc/os-release").read_text().splitlines()
        if "=" in line
    )
    systemd = re.match(r"systemd (\d+)", ns.run(["systemctl", "--version"]).stdout)
    return {
        "release": release.get("VERSION_CODENAME", "").strip('"'),
        "kubelet": version_of(kubelet),
        "systemd": systemd[1] if systemd else "",
        "containerd": of("containerd", "--version"),
        "runc": of("runc", "--version"),
        "python": of("python3", "--version"),
    }


class Site(Protocol):
    """Boots the node's namespace and installs gpuguard there."""

    name: str
    layout: str
    install: str  # how gpuguard got onto the node (the matrix's column)

    def start(
        self,
        tmp: Path,
        *,
        units: Mapping[str, str],
        binds: Mapping[str, Path],
        ro_binds: Mapping[str, Path],
        gpuguard: bool,
    ) -> SystemdNamespace: ...

    def plugin_unit(self) -> str: ...

    def install_gpuguard(self, ns: SystemdNamespace, config: str) -> None: ...

    def check(self, ns: SystemdNamespace, runtime_seen: str) -> None: ...

    def stop(self) -> None: ...


class HostSite:
    """This machine's systemd, containerd and runc (a pytest ``systemd_ns`` factory)."""

    name = "host"
    layout = "v1"
    install = "this checkout (the repo's units, its venv)"

    def __init__(self, factory: NsFactory) -> None:
        self.factory = factory

    def start(
        self,
        tmp: Path,
        *,
        units: Mapping[str, str],
        binds: Mapping[str, Path],
        ro_binds: Mapping[str, Path],
        gpuguard: bool,
    ) -> SystemdNamespace:
        return self.factory(
            units=node_units(units) if gpuguard else units, binds=binds, ro_binds=ro_binds
        )

    def plugin_unit(self) -> str:
        return plugin_unit()

    def install_gpuguard(self, ns: SystemdNamespace, config: str) -> None:
        (ns.path("/etc/gpuguard") / "gpuguard.conf").write_text(config)

    def check(self, ns: SystemdNamespace, runtime_seen: str) -> None:
        """Whatever this machine has is its stack (the matrix records it)."""

    def stop(self) -> None:
        """The factory's fixture stops the namespace."""


class RootSite:
    """A debootstrapped release's own systemd, containerd and runc; gpuguard's .deb."""

    layout = "v1"

    def __init__(self, suite: str) -> None:
        if suite not in ROOT_STACKS or not SUITES[suite].boots_v1:
            raise ValueError(f"no kubelet stack for {suite!r}: one of {sorted(ROOT_STACKS)}")
        self.name = suite
        self.install = ""
        self.ns: Optional[PackageRoot] = None
        self.tmp = Path()

    def start(
        self,
        tmp: Path,
        *,
        units: Mapping[str, str],
        binds: Mapping[str, Path],
        ro_binds: Mapping[str, Path],
        gpuguard: bool,
    ) -> SystemdNamespace:
        require_pkgroot_tools()
        self.tmp = tmp / f"site-{self.name}"
        lower, _made = debian_root(self.name)
        kubelet_dir = kubelet_binary().parent
        ro = {
            **ro_binds,
            str(REPO): REPO,
            str(kubelet_dir): kubelet_dir,
            PYSITE: site_packages(python_of(lower), ("grpcio", "protobuf")),
        }
        if gpuguard:
            debs = copy_debs(self.tmp / "debs", built_packages()["deb"])
            if "python3-dbus-next" not in SUITES[self.name].packages:
                copy_debs(debs / "bundled", built_packages(variant="bundled")["deb"])
            ro["/run/host/debs"] = debs
        self.ns = PackageRoot(
            self.tmp / "root",
            lower,
            suite=self.name,
            layout=self.layout,
            units=units,
            binds=binds,
            ro_binds=ro,
        )
        self.ns.start()
        try:
            self.check(self.ns, "")
        except BaseException:
            self.stop()
            raise
        return self.ns

    def plugin_unit(self) -> str:
        return plugin_unit("/usr/bin/python3", PYSITE)

    def install_gpuguard(self, ns: SystemdNamespace, config: str) -> None:
        """Configuration and the fake driver's drop-in first: the package starts the
        daemon. ``apt-get install`` of the .deb, offline (the root holds its
        dependencies)."""
        assert self.ns is ns, "installs into the root this site booted"
        node = Node(self.ns, self.tmp)
        node.write(CONFIG_DROPIN, config)
        (dropin,) = FAKE_DRIVER.items()
        node.write(f"/etc/systemd/system/{dropin[0]}", dropin[1])
        ns.systemctl("daemon-reload")
        self.install = install_gpuguard(node, self.name)
        # kubelet's pre-start hook must be the package's, not one of this checkout
        dropins = ns.unit_property("kubelet.service", "DropInPaths").split()
        if PACKAGED_DROPIN not in dropins:
            raise StackError(f"kubelet.service's drop-ins {dropins}: not {PACKAGED_DROPIN}")

    def check(self, ns: SystemdNamespace, runtime_seen: str) -> None:
        """Fail unless the root runs its release's stack (the layout and systemd are
        checked by PackageRoot), and kubelet talks to that containerd."""
        want = ROOT_STACKS[self.name]
        have = stack_versions(ns)
        for tool, prefix in want.items():
            if not have[tool].startswith(prefix):
                raise StackError(f"{self.name} root runs {tool} {have[tool]}, expected {prefix}*")
        if runtime_seen and not runtime_seen.startswith(f"containerd {want['containerd']}"):
            raise StackError(f"kubelet's runtime is {runtime_seen!r}, not the root's containerd")

    def stop(self) -> None:
        if self.ns is not None:
            self.ns.stop()


def python_of(root: Path) -> str:
    """The root's python3 version ("3.13"), from where /usr/bin/python3 points."""
    target = os.readlink(root / "usr/bin/python3")
    m = re.fullmatch(r"python(3\.\d+)", target)
    if not m:
        raise StackError(f"{root}/usr/bin/python3 -> {target}: not python3.N")
    return m.group(1)


def site(name: str, factory: NsFactory) -> Site:
    """The site called ``name``: "host", or a release of :data:`ROOT_STACKS`."""
    return HostSite(factory) if name == "host" else RootSite(name)
