"""Shared test guards.

Tests that need root or a real component call require_root()/require_tool(). On a
developer machine without them they skip; under CI=true they FAIL, so CI can never
pass by skipping the integration tests.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
CHECKPOINTS = FIXTURES / "kubelet-checkpoint"
sys.path.insert(0, str(REPO / "tests"))


def _missing(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but {reason}: this test must run in CI", pytrace=False)
    pytest.skip(reason)


def require_root() -> None:
    if os.geteuid() != 0:
        _missing("needs root")


def require_tool(*names: str) -> None:
    for name in names:
        if shutil.which(name) is None and not Path(name).exists():
            _missing(f"needs {name}")
