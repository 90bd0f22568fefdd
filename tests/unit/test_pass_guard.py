"""Never a repair loop (engine/passguard.py): a pass whose changes repaired nothing holds
the next one back, doubling up to a cap, whatever step or event woke it; an urgent
event still runs a pass at once. The loop Debian 11 showed (a DeviceAllow= that wakes
the next pass, which finds the same loss and sets it again) is made here with the real
coalescer: a few passes, not hundreds."""

from __future__ import annotations

import asyncio
import time

from gpuguard.engine.coalescer import Coalescer
from gpuguard.engine.passes import Work
from gpuguard.engine.passguard import BASE, CAP, RepairLoopGuard

DENIED = frozenset({("container-device-denied", "c1", "195:0")})
STEP = frozenset({"container_access"})


def test_a_pass_that_acted_and_found_the_same_doubles_the_wait() -> None:
    g = RepairLoopGuard()
    assert g.after_pass(True, DENIED).wait == 0  # the first repair: nothing to compare
    waits = [g.after_pass(True, DENIED).wait for _ in range(12)]
    assert waits[:4] == [BASE, 2 * BASE, 4 * BASE, 8 * BASE]
    assert max(waits) == CAP and waits[-1] == CAP
    assert g.streak == 12


def test_what_ends_a_streak() -> None:
    g = RepairLoopGuard()
    for _ in range(4):
        g.after_pass(True, DENIED)
    # the repair took: the next pass finds something else
    assert g.after_pass(True, frozenset()).wait == 0 and g.streak == 0
    for _ in range(4):
        g.after_pass(True, DENIED)
    # a pass that changes nothing schedules nothing of its own
    v = g.after_pass(False, DENIED)
    assert v.wait == 0 and v.streak == 4
    assert g.after_pass(False, DENIED).wait == 0 and g.streak == 0


def test_a_loss_that_comes_back_later_is_repaired_each_time_without_a_wait() -> None:
    """kubelet's CPU manager rewrites a container's devices at each reconcile (every
    10 s): each pass finds the same loss and repairs it, brought by marks that came
    long after the previous pass ended. That is no loop: never held back. The same
    passes brought at once (a pass's own change waking the next) are."""
    g = RepairLoopGuard()
    assert all(g.after_pass(True, DENIED, prompt=False).wait == 0 for _ in range(20))
    assert g.streak == 0
    assert g.after_pass(True, DENIED, prompt=True).wait == BASE


def test_lasting_findings_without_changes_never_hold_a_pass_back() -> None:
    """A finding gpuguard cannot end (a container without uvm) and passes that change
    nothing: no back-off, each pass runs when it is asked for."""
    g = RepairLoopGuard()
    assert all(g.after_pass(False, DENIED).wait == 0 for _ in range(10))
    # one unrelated change among them: at most one short wait, then none
    g.after_pass(True, DENIED)
    assert g.after_pass(False, DENIED).wait == 0


def test_a_self_waking_repair_runs_a_few_passes_not_hundreds() -> None:
    """Each pass 'sets a DeviceAllow=' that wakes the next one (as the transient watch
    does) and finds the same denial: with the guard's wait the coalescer runs a handful
    of passes in 3 s, where without it it ran one each quiet period, without end."""

    async def main() -> int:
        passes = 0
        c: Coalescer

        async def run(w: Work) -> None:
            nonlocal passes
            passes += 1
            c.after_pass(True, DENIED, w.first_mark)
            c.mark(STEP, "systemd: scope devices set")  # the pass's own change wakes one

        c = Coalescer(run, quiet=0.01, max_delay=0.05)
        c.loop_guard = RepairLoopGuard(base=0.2)
        task = asyncio.create_task(c.run())
        c.mark(STEP, "audit")
        await asyncio.sleep(3.0)
        c.stop()
        await task
        return passes

    n = asyncio.run(asyncio.wait_for(main(), timeout=20))
    # waits 0.2, 0.4, 0.8, 1.6 s: at most 6 passes in 3 s (without the guard, one every
    # quiet period: hundreds)
    assert 2 <= n <= 6, n


def test_the_same_loss_coming_back_later_is_never_held_back() -> None:
    """The same finding and a change in every pass, but each pass brought by a mark that
    comes 0.3 s after the previous pass ended (an outside cause, here with PROMPT made
    0.1 s): every one runs when asked, none waits."""

    async def main() -> tuple[int, list[float]]:
        passes = 0
        waits: list[float] = []
        c: Coalescer

        async def run(w: Work) -> None:
            nonlocal passes
            passes += 1
            waits.append(c.after_pass(True, DENIED, w.first_mark).wait)

        c = Coalescer(run, quiet=0.01, max_delay=0.05)
        task = asyncio.create_task(c.run())
        for _ in range(6):
            c.mark(STEP, "systemd: scope devices set by the runtime")
            await asyncio.sleep(0.3)
        c.stop()
        await task
        return passes, waits

    import gpuguard.engine.coalescer as coalescer

    saved = coalescer.PROMPT
    coalescer.PROMPT = 0.1
    try:
        n, waits = asyncio.run(asyncio.wait_for(main(), timeout=20))
    finally:
        coalescer.PROMPT = saved
    assert n == 6 and waits == [0.0] * 6, (n, waits)


def test_an_urgent_mark_is_not_held_back() -> None:
    async def main() -> list[float]:
        started: list[float] = []
        c: Coalescer

        async def run(w: Work) -> None:
            started.append(time.monotonic())

        c = Coalescer(run, quiet=0.01, urgent_quiet=0.001, max_delay=0.05)
        task = asyncio.create_task(c.run())
        c.hold_off(30.0)
        t0 = time.monotonic()
        c.mark(STEP, "systemd: reload ended", urgent=True)
        await asyncio.sleep(0.3)
        c.mark(STEP, "audit")  # held back: 30 s
        await asyncio.sleep(0.3)
        c.stop()
        await task
        return [t - t0 for t in started]

    got = asyncio.run(asyncio.wait_for(main(), timeout=20))
    assert len(got) == 1 and got[0] < 0.25, got
