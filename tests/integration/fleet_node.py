"""A booted Debian root that stands for a GPU node, shared by the installer tests.

A kubelet stand-in unit runs in it: the installer must never restart kubelet, so
its invocation and its single "Started" journal entry must never change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict

from integration.pkgroot import PackageRoot, built_packages

KUBELET_UNIT = """[Unit]
Description=kubelet stand-in (must never be restarted by the installer)

[Service]
ExecStart=/bin/sleep infinity
"""
KUBELET_PROPS = ("InvocationID", "NRestarts", "ExecMainStartTimestampMonotonic", "ActiveState")
#: systemd's "Started UNIT" (SD_MESSAGE_UNIT_STARTED): kubelet's must appear once only.
UNIT_STARTED = "39f53479d3a045ac8e11786248231fbf"


def package_dir(tmp: Path, suffix: str) -> Path:
    """What the image carries in /usr/share/gpuguard-installer: one .deb, one .rpm."""
    out = tmp / (suffix.lstrip("+") or "base")
    out.mkdir()
    for pkg in built_packages(suffix).values():
        (out / pkg.name).write_bytes(pkg.read_bytes())
    return out


def kubelet(ns: PackageRoot) -> Dict[str, str]:
    return {p: ns.unit_property("kubelet.service", p) for p in KUBELET_PROPS}


def installed(ns: PackageRoot) -> str:
    res = ns.run(["dpkg-query", "-W", "-f", "${Status} ${Version}", "gpuguard"])
    return res.stdout if res.returncode == 0 else "not known to dpkg"


def start_kubelet(ns: PackageRoot) -> Dict[str, str]:
    """Start the kubelet stand-in in ``ns``; its properties, to compare later."""
    ns.run(["mkdir", "-p", "/var/lib/kubelet/device-plugins"], check=True)
    ns.path("/etc/systemd/system/kubelet.service").write_text(KUBELET_UNIT)
    ns.systemctl("daemon-reload")
    ns.systemctl("start", "kubelet.service")
    ns.wait_active("kubelet.service")
    return kubelet(ns)


def kubelet_starts(ns: PackageRoot) -> int:
    return sum(
        1
        for e in ns.journal()
        if e.get("UNIT") == "kubelet.service" and e.get("MESSAGE_ID") == UNIT_STARTED
    )
