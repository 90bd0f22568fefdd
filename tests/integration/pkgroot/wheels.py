"""Python packages for another release's CPython, fetched on this machine and cached.

A root's own interpreter (Debian 11's 3.9, Debian 13's 3.13) gets what a test needs
beyond the release's packages as binary wheels for that CPython, fetched here with
this checkout's pip (``--python-version``, ``--only-binary=:all:``) and kept under
``/var/cache/gpuguard-tests`` (``GPUGUARD_TEST_CACHE``), keyed by what was asked for and
the month (:func:`integration.pkgroot.roots.stamp`): :func:`cached` makes a directory
once, in a temporary one renamed into place when complete, and removes the older ones
of the same kind.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Callable, Sequence, Tuple

from integration.pkgroot.roots import CACHE, stamp


def pip_target(python: str) -> Tuple[str, ...]:
    """pip's options for binary wheels of CPython ``python`` ("3.13") on x86-64 Linux."""
    tag = "cp" + python.replace(".", "")
    return (
        "--python-version", python, "--implementation", "cp", "--abi", tag,
        "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64",
        "--only-binary=:all:",
    )  # fmt: skip


def cached(kind: str, key_text: str, make: Callable[[Path], None]) -> Path:
    """``CACHE/<kind>-<key>``, made by ``make(directory)`` if absent; one maker at a
    time (a lock per kind); the other directories of ``kind`` removed once it is made."""
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    final = CACHE / f"{kind}-{key}"
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
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return final


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
