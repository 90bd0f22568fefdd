"""The executor (engine/executor.py): one half of each change runs, by the mode it holds."""

from __future__ import annotations

import asyncio

from gpuguard.actuate.change import AsyncChange, Change
from gpuguard.engine.executor import ChangeExecutor


def _change(log: list[str]) -> Change[str]:
    return Change("k", lambda: log.append("made") or "made", lambda: "described")


def test_a_dry_run_describes_and_makes_nothing() -> None:
    log: list[str] = []
    ex = ChangeExecutor(dry_run=True)
    assert ex.run(_change(log)) == "described" and log == []
    assert (ex.described["k"], ex.made["k"], ex.mode) == (1, 0, "observe")


def test_a_real_run_makes_and_counts() -> None:
    log: list[str] = []
    ex = ChangeExecutor()
    assert ex.run(_change(log)) == "made" and log == ["made"]

    async def make() -> str:
        return "awaited"

    assert asyncio.run(ex.run_async(AsyncChange("k", make, lambda: "no"))) == "awaited"
    assert (ex.made["k"], ex.described["k"], ex.mode) == (2, 0, "repair")


def test_the_mode_across_reloads_and_the_off_switch() -> None:
    ex = ChangeExecutor(observe=False)
    assert ex.reconfigure(observe=True) and ex.dry_run and ex.records_own_state
    assert not ex.reconfigure(observe=False) and not ex.dry_run
    cli = ChangeExecutor(dry_run=True, observe=True)
    assert not cli.records_own_state  # --dry-run writes nothing, not even the history
    cli.reconfigure(observe=False)
    assert cli.dry_run, "a reload dropped the command line's --dry-run"
    ex.reconfigure(observe=True)
    ex.switch_off()
    assert not ex.records_own_state
    ex.reconfigure(observe=False)
    assert ex.dry_run, "a reload undid the off switch"
