"""Python packages for another release's CPython, fetched on this machine and cached.

A root's own interpreter (Debian 11's 3.9, Debian 13's 3.13) gets what a test needs
beyond the release's packages as binary wheels for that CPython, fetched here with
this checkout's pip (``--python-version``, ``--only-binary=:all:``) and kept under
``/var/cache/gpuguard-tests`` (``GPUGUARD_TEST_CACHE``), keyed by what was asked for and
the month (:func:`integration.pkgroot.roots.stamp`), made once by
:func:`integration.pkgroot.roots.cached` as the roots are.
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Sequence, Tuple

from integration.pkgroot.roots import cached, stamp


def pip_target(python: str) -> Tuple[str, ...]:
    """pip's options for binary wheels of CPython ``python`` ("3.13") on x86-64 Linux."""
    tag = "cp" + python.replace(".", "")
    return (
        "--python-version", python, "--implementation", "cp", "--abi", tag,
        "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64",
        "--only-binary=:all:",
    )  # fmt: skip


def pip(*args: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if res.returncode != 0:
        raise AssertionError(f"pip {' '.join(args[:3])} ... failed:\n{res.stderr[-3000:]}")


def site_packages(python: str, dists: Sequence[str]) -> Path:
    """The distributions ``dists`` (names of this checkout's venv: the versions it has,
    so that code generated here runs there) and their dependencies, installed for
    CPython ``python`` into one directory to put on that interpreter's PYTHONPATH."""
    pins = [f"{d}=={version(d)}" for d in dists]
    target = pip_target(python)
    kind = f"site-cp{python.replace('.', '')}"
    return cached(
        kind,
        "|".join([*pins, *target, stamp()]),
        lambda d: pip("install", "--quiet", *target, "--target", str(d), *pins),
    )
