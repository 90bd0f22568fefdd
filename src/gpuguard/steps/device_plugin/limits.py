"""When the device plugin step may restart a plugin: the limits that make a restart
loop impossible, as one pure judgement (no clock, no file: the step passes both in).

In order: ``Restart=no`` or ``MaxRestartsPerHour=0`` (report only); an earlier restart
still being verified; the cool-down from the plugin's START (a plugin younger than
``CoolDown`` is still starting, or was just restarted; not for a plugin kubelet
dropped when the re-admission bridge's streams ended, which had registered); at
most ``MaxRestartsPerHour`` restarts per plugin identity (its resource, or its socket
name: container ids and pids change with every restart) in any hour; exponential
back-off after failed attempts (``backoff_base`` * 2^(failures-1), capped at ``backoff_max``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from gpuguard.config import DevicePluginConfig
    from gpuguard.steps.device_plugin.reconcile import RestartPlugin
    from gpuguard.steps.device_plugin.state import PluginState

HOUR = 3600.0


def why_not(
    cfg: DevicePluginConfig,
    st: PluginState,
    a: RestartPlugin,
    now: float,
    *,
    backoff_base: float,
    backoff_max: float,
) -> Optional[tuple[str, str]]:
    """(code, sentence) when this restart must not happen now; None when it may."""
    if not cfg.restart:
        return "disabled", "restarts are off (Restart=no)"
    if cfg.max_restarts_per_hour == 0:
        return "disabled", "restarts are off (MaxRestartsPerHour=0)"
    if st.pending_deadline:
        return "pending", "an earlier restart is still being verified"
    age = now - a.process.start
    if age < cfg.cool_down and not a.prompt:
        return (
            "cool-down",
            f"it started {age:.0f}s ago, less than CoolDown={cfg.cool_down:.0f}s: "
            "it may still be starting",
        )
    recent = [t for t in st.restarts if now - t < HOUR]
    if len(recent) >= cfg.max_restarts_per_hour:
        return (
            "budget",
            f"{len(recent)} restart(s) in the last hour already "
            f"(MaxRestartsPerHour={cfg.max_restarts_per_hour}); "
            "recreate it by hand once the cause is fixed",
        )
    if st.failures:
        wait = min(backoff_base * 2 ** (st.failures - 1), backoff_max)
        if now < st.last_failure + wait:
            return (
                "back-off",
                f"{st.failures} failed attempt(s); next one not before "
                f"{st.last_failure + wait - now:.0f}s from now",
            )
    return None
