"""No package operation stops or restarts the re-admission bridge while kubelet runs.

kubelet 1.26+ keeps the bridge's ListAndWatch stream after the real plugin replaced
its endpoint; when that stream ends, kubelet disconnects the real plugin and the node
advertises 0 GPUs until it registers again (docs/checkpoint.md). So the packages
install gpuguard-readmit.service as a plain file: no debhelper or rpm systemd macro
manages it (their upgrade would restart it, their removal stop it), no maintainer
script names it, and no unit ties its stop or restart to gpuguard.service's (which
an upgrade restarts). A new version of the bridge runs from the next boot. If it
ends anyway (a crash, an operator's stop), the daemon's device plugin step notices
the unit's process ending and restarts a plugin kubelet dropped.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNIT = "gpuguard-readmit.service"
SCRIPTS = ("gpuguard.preinst", "gpuguard.postinst", "gpuguard.prerm", "gpuguard.postrm")


def code_lines(path: Path) -> list[str]:
    """The lines of a script or makefile that are not comments."""
    return [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_debian_maintainer_script_names_the_bridge(script: str) -> None:
    assert not [ln for ln in code_lines(REPO / "packaging/debian" / script) if "readmit" in ln]


def test_debhelper_does_not_manage_the_bridge_unit() -> None:
    lines = code_lines(REPO / "packaging/debian/rules")
    named = [ln.strip() for ln in lines if "readmit" in ln]
    # installed as a plain file, beside the other units debhelper does not manage
    assert named == [
        "install -D -m 0644 units/gpuguard-readmit.service \\",
        "$(PKG)/usr/lib/systemd/system/gpuguard-readmit.service",
    ], named
    systemd = [ln for ln in lines if "dh_installsystemd" in ln]
    assert systemd and all("--name=gpuguard-metrics" in ln or "readmit" not in ln for ln in systemd)
    assert not [ln for ln in lines if re.search(r"debian/gpuguard\.gpuguard-readmit", ln)]


def test_no_rpm_scriptlet_names_the_bridge() -> None:
    spec = (REPO / "packaging/rpm/gpuguard.spec").read_text()
    body = spec.split("\n%install", 1)[1]
    scriptlets = re.split(r"\n%(?=pre|post|preun|postun|posttrans|files)\b", body)
    for part in scriptlets:
        if part.startswith("files"):
            continue
        for ln in part.splitlines():
            if "readmit" in ln and not ln.lstrip().startswith("#"):
                assert ln.startswith("install -D -m 0644 units/gpuguard-readmit.service"), ln
    preset = (REPO / "packaging/rpm/50-gpuguard.preset").read_text()
    assert "readmit" not in preset  # pulled in by gpuguard.service, never enabled itself


def test_no_unit_ties_the_bridge_to_the_daemon_s_restart() -> None:
    bridge = code_lines(REPO / "units" / UNIT)
    assert not [ln for ln in bridge if re.match(r"(PartOf|BindsTo|Requisite)=", ln)]
    daemon = code_lines(REPO / "units/gpuguard.service")
    ties = [ln for ln in daemon if "readmit" in ln]
    assert ties == [f"Wants={UNIT}"], ties  # a restart of the daemon leaves it running
