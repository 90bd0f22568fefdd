"""Test harnesses that run real components in private namespaces.

``systemd_ns`` is a pytest fixture factory: import it into a test module
(``from integration.harness import systemd_ns as systemd_ns``) and call it::

    def test_x(systemd_ns):
        ns = systemd_ns(units={"x.service": "..."})
        ns.wait_active("x.service")

``layout`` is a fixture parametrized over both cgroup layouts ("v1", "v2"): a test
that takes it and passes ``layout=layout`` on runs once on each; under CI=true a
layout that cannot be booted fails the test (NamespaceError), never skips it.

Every namespace it made is stopped (by PID) and its cgroups removed when the
test ends, pass or fail. See sysns.py for the safety measures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, List

import pytest

from .sysns import DEFAULT_MASKS, LAYOUTS, REQUIRED_TOOLS, NamespaceError, SystemdNamespace

__all__ = [
    "DEFAULT_MASKS",
    "LAYOUTS",
    "REQUIRED_TOOLS",
    "NamespaceError",
    "SystemdNamespace",
    "layout",
    "require_systemd_ns",
    "systemd_ns",
]


def require_systemd_ns() -> None:
    """Skip (or, under CI=true, fail) unless root and every needed tool is present."""
    from conftest import require_root, require_tool

    require_root()
    require_tool(*REQUIRED_TOOLS)


@pytest.fixture(params=LAYOUTS)
def layout(request: pytest.FixtureRequest) -> str:
    """Each cgroup layout in turn: "v1" (hybrid, devices.list) and "v2" (unified, BPF)."""
    return str(request.param)


@pytest.fixture
def systemd_ns(tmp_path: Path) -> Iterator[Callable[..., SystemdNamespace]]:
    """Factory: ``systemd_ns(**SystemdNamespace kwargs)`` boots and returns one instance."""
    require_systemd_ns()
    made: List[SystemdNamespace] = []

    def factory(**kwargs: Any) -> SystemdNamespace:
        ns = SystemdNamespace(tmp_path / f"sysns{len(made)}", **kwargs)
        made.append(ns)
        ns.start()
        return ns

    try:
        yield factory
    finally:
        errors = []
        for ns in reversed(made):
            try:
                ns.stop()
            except Exception as e:  # stop them all, then report
                errors.append(f"{ns.name}: {e}")
        if errors:
            raise NamespaceError("; ".join(errors))
