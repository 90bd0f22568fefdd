"""Daemon steps: observe (in a worker thread), reconcile (pure), actuate, log.

Each step is an object built in main() and called once per pass whose work names it;
state that must outlive a pass (caches, rate limits) lives in the step object.
"""

from __future__ import annotations

from gpuguard.steps.registry import build_steps

__all__ = ["build_steps"]
