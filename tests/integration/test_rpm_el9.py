"""The .rpm RHEL 9 installs: `packaging/build-rpm --el9` built here, every Requires of it
satisfied by what RHEL 9's BaseOS/AppStream provide (packaging/rpm/el9-provides.txt,
with where each line was read).

No RHEL machine is reachable from CI, so the check is rpm's own answer about the built
package (`rpm -qp --requires`) against that list: python(abi) = 3.9 (RHEL 9's only
python3), dbus-next bundled (RHEL 9 has no python3-dbus-next), nothing else.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from conftest import require_tool
from integration.pkgroot import REPO, built_packages, debian_env

PROVIDES = REPO / "packaging/rpm/el9-provides.txt"
#: Capabilities rpm itself or the package satisfies.
SELF = re.compile(r"^(rpmlib\(|config\(gpuguard\))")


def el9_provides() -> Dict[str, str]:
    """capability -> version ("" when the line gives none)."""
    out: Dict[str, str] = {}
    for line in PROVIDES.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        cap = line.split("\t")[0]
        name, _, version = cap.partition(" = ")
        out[name.strip()] = version.strip()
    return out


def vercmp(a: str, b: str) -> int:
    """rpm's comparison, enough for plain dotted versions (what these lines hold)."""
    pa = [int(x) for x in re.findall(r"\d+", a)]
    pb = [int(x) for x in re.findall(r"\d+", b)]
    return (pa > pb) - (pa < pb)


def satisfied(req: str, provides: Dict[str, str]) -> Tuple[bool, str]:
    m = re.match(r"^(\S+)(?:\s+(<=|>=|=|<|>)\s+(\S+))?$", req)
    assert m, req
    name, op, want = m.groups()
    if name not in provides:
        return False, f"{name}: RHEL 9 provides no such capability (el9-provides.txt)"
    have = provides[name]
    if op is None:
        return True, ""
    c = vercmp(have, want.split("-")[0])
    ok = {"=": c == 0, ">=": c >= 0, "<=": c <= 0, ">": c > 0, "<": c < 0}[op]
    return ok, "" if ok else f"{req}: RHEL 9 has {name} {have}"


def requires(rpm: Path) -> List[str]:
    res = subprocess.run(
        ["rpm", "-qp", "--requires", str(rpm)],
        capture_output=True,
        text=True,
        check=True,
        env=debian_env(),
    )
    return sorted(set(res.stdout.split("\n")) - {""})


@pytest.fixture(scope="module")
def el9_rpm() -> Path:
    require_tool("rpmbuild", "dpkg-buildpackage")
    return built_packages(variant="bundled")["rpm"]


def test_every_requirement_is_in_rhel9(el9_rpm: Path) -> None:
    provides = el9_provides()
    reqs = requires(el9_rpm)
    print("\n" + "\n".join(reqs))
    missing = [
        why for r in reqs if not SELF.match(r) for ok, why in [satisfied(r, provides)] if not ok
    ]
    assert not missing, "\n".join(missing)
    assert "python(abi) = 3.9" in reqs, reqs
    assert not [r for r in reqs if "dbus-next" in r or "dbus_next" in r], reqs


def test_built_for_el9_python(el9_rpm: Path) -> None:
    assert el9_rpm.name.endswith(".el9.noarch.rpm"), el9_rpm.name
    files = subprocess.run(
        ["rpm", "-qlp", str(el9_rpm)], capture_output=True, text=True, check=True
    ).stdout.split()
    assert "/usr/lib/python3.9/site-packages/gpuguard/__init__.py" in files
    assert "/usr/lib/gpuguard/vendor/dbus_next/__init__.py" in files
    # no bytecode made by the build machine's newer python
    assert not [f for f in files if f.endswith(".pyc")]
    provides = subprocess.run(
        ["rpm", "-qp", "--provides", str(el9_rpm)], capture_output=True, text=True, check=True
    ).stdout
    assert "bundled(python3dist(dbus-next)) = 0.2.3" in provides


def test_the_check_would_catch_a_missing_capability() -> None:
    provides = el9_provides()
    assert satisfied("python(abi) = 3.11", provides)[0] is False
    assert satisfied("python3-dbus-next", provides)[0] is False
    assert satisfied("python3.9dist(pyudev) >= 0.22", provides)[0] is True
    assert satisfied("python3.9dist(pyudev) >= 0.23", provides)[0] is False


def test_the_bundled_deb_needs_no_python3_dbus_next() -> None:
    require_tool("dpkg-buildpackage")
    deb = built_packages(variant="bundled")["deb"]
    depends = subprocess.run(
        ["dpkg-deb", "-f", str(deb), "Depends"], capture_output=True, text=True, check=True
    ).stdout
    assert "dbus-next" not in depends, depends
    files = subprocess.run(
        ["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True
    ).stdout
    assert "./usr/lib/gpuguard/vendor/dbus_next/__init__.py" in files
