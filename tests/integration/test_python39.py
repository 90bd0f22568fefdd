"""The unit suite under Python 3.9 (RHEL 9's interpreter class), for real.

Debian 11's root (integration/pkgroot, cached) is booted with its own systemd and its
python3.9; a virtual environment with its system site packages (Debian 11's
python3-pyudev and python3-systemd, as a host that installed the package has them) gets
the test dependencies from wheels fetched on this machine for CPython 3.9 (cached beside
the roots, keyed by the requirement list and the month); a copy of the checkout's
tracked files runs ``pytest tests/unit`` there. The daemon's start-up under 3.9 is
proven by the Debian 11 cells of test_stacks_f2.py (gpuguard.service from the package,
Type=notify, active after its first pass).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO
from integration.pkgroot import PackageRoot, debian_root, require_pkgroot_tools
from integration.pkgroot.roots import cached, stamp
from integration.pkgroot.wheels import pip, pip_target

pytestmark = pytest.mark.root

#: The test dependencies (pyproject's [test] extra less the linters, which run on the
#: build machine) and what Debian 11 lacks at run time (dbus-next, nvidia-ml-py).
REQUIREMENTS = (
    "pytest>=7",
    "hypothesis>=6",
    "pyyaml>=5",
    "kubernetes-validate>=1.28",
    "jsonschema",
    "prometheus-client",
    "dbus-next>=0.2.3",
    "nvidia-ml-py>=11.450",
)
#: What those need on Python < 3.11 only: pip download evaluates environment markers
#: with the interpreter it runs on, not the target's, so they are named here.
BACKPORTS = ("exceptiongroup", "tomli", "importlib-metadata", "zipp", "typing-extensions")
#: To install the checkout itself as `scripts/bootstrap` does (pip install -e): Debian
#: 11's pip 20.3 predates editable installs from pyproject.toml.
TOOLS = ("pip>=23", "setuptools>=61", "wheel")
PIP_TARGET = pip_target("3.9")


def wheelhouse() -> Path:
    """The CPython 3.9 wheels of REQUIREMENTS and their dependencies, fetched once."""
    text = "|".join([*REQUIREMENTS, *BACKPORTS, *TOOLS, *TOOLS, *PIP_TARGET, stamp()])
    wanted = [*REQUIREMENTS, *BACKPORTS, *TOOLS]
    return cached(
        "wheels-py39",
        text,
        lambda d: pip("download", "--quiet", *PIP_TARGET, "-d", str(d), *wanted),
    )


def tracked_copy(dest: Path) -> Path:
    """The checkout's tracked and untracked-but-not-ignored files (no venv, no build)."""
    files = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for f in filter(None, files):
        src = REPO / os.fsdecode(f)
        if src.is_file():
            (dest / os.fsdecode(f)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / os.fsdecode(f))
    return dest


def test_unit_suite_under_python39(tmp_path: Path) -> None:
    require_pkgroot_tools()
    timings = {}
    t0 = time.monotonic()
    lower, _made = debian_root("bullseye")
    wheels = wheelhouse()
    repo = tracked_copy(tmp_path / "repo")
    timings["prepare"] = time.monotonic() - t0
    ns = PackageRoot(
        tmp_path / "root",
        lower,
        suite="bullseye",
        layout="v2",
        ro_binds={"/run/host/wheels": wheels},
        binds={"/run/host/repo": repo},
    )
    ns.start()
    try:
        assert ns.tool_version(("python3", "--version")).startswith("3.9."), "not Python 3.9"
        t1 = time.monotonic()
        venv = "/run/host/repo/.venv"  # where the checkout's own tools look (bench/)
        pip = [f"{venv}/bin/pip", "install", "--quiet", "--no-index", "-f", "/run/host/wheels"]
        for argv in (
            ["python3", "-m", "venv", "--system-site-packages", venv],
            [*pip, *TOOLS],
            [*pip, *REQUIREMENTS],
            [*pip, "--no-deps", "-e", "/run/host/repo"],
        ):
            res = ns.run(argv, timeout=300)
            assert res.returncode == 0, f"{argv}: {res.stdout}\n{res.stderr}"
        timings["venv"] = time.monotonic() - t1
        t2 = time.monotonic()
        res = ns.run(
            ["sh", "-c", f"cd /run/host/repo && exec {venv}/bin/python -m pytest tests/unit "
             "-q -p no:cacheprovider --tb=line -W error::SyntaxWarning"],
            env={"PYTHONPATH": "/run/host/repo/src", "PYTHONDONTWRITEBYTECODE": "1"},
            timeout=1500,
        )  # fmt: skip
        timings["pytest tests/unit"] = time.monotonic() - t2
    finally:
        ns.stop()
    tail = (res.stdout + res.stderr)[-6000:]
    print(f"\n{tail}\ntimings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    assert res.returncode == 0, tail
    m = re.search(r"(\d+) passed", tail)
    assert m and int(m.group(1)) > 500, tail
