"""Daemon steps: observe (in a worker thread), reconcile (pure), actuate, log.

Each step is an object built in main() and called once per pass whose work names it;
state that must outlive a pass (caches, rate limits) lives in the step object.

Modules (docs/architecture.md has the map of the packages):

- `registry.py`: every step by name with the events that wake it, the pass order
  (`STEP_ORDER`) and `gpuguard check`'s (`CHECK_ORDER`), each reason once; the `Step`,
  `ReloadFastPath`, `ScopeFastPath` and `ScopeDevicesFastPath` protocols; marks name
  steps by these names and the daemon refuses any other
- `events.py`: the event kinds sources (and steps) emit, and `Event`
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuguard.steps.registry import build_steps

__all__ = ["build_steps"]


def __getattr__(name: str) -> object:
    # Loaded on first use: kubelet's pre-start hook imports steps.checkpoint's records
    # (kubelet_hook, memo) and, on a healthy node, never needs the step table.
    if name == "build_steps":
        from gpuguard.steps.registry import build_steps

        return build_steps
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
