"""ledger.py: each step's latest result wins; changes of the last hour only."""

from __future__ import annotations

from dataclasses import dataclass

from gpuguard.model import Action, Finding, Outcome
from gpuguard.reporting.ledger import RECENT_WINDOW, Ledger


@dataclass(frozen=True)
class Poke(Action):
    @property
    def kind(self) -> str:
        return "poke"


def test_latest_result_per_step_wins_and_old_changes_age_out() -> None:
    led = Ledger()
    f = Finding("container-device-denied", "container_access", "denied")
    done = Outcome(Poke("container_access", "why", "c1"), "done")
    led.record("container_access", 1, [f], [done], now=1000.0)
    led.record(
        "checkpoint", 1, [], [Outcome(Poke("checkpoint", "why", "cp"), "skipped")], now=1000.0
    )
    led.record("container_access", 2, [], [], now=2000.0, unknown=["no inventory"])
    assert led.steps["container_access"].pass_number == 2
    assert led.steps["container_access"].findings == ()
    assert led.steps["container_access"].unknown == ("no inventory",)
    assert led.steps["checkpoint"].pass_number == 1  # a pass without the step keeps its result
    assert [c.target for c in led.recent_changes(now=2000.0)] == ["c1"]  # skipped is no change
    assert led.recent_changes(now=1000.0 + RECENT_WINDOW + 1) == ()


def test_a_crashed_step_is_recorded_as_such() -> None:
    led = Ledger()
    led.record("gpu_count", 4, [], [], error="ValueError: boom", now=5.0)
    assert led.steps["gpu_count"].error == "ValueError: boom"
