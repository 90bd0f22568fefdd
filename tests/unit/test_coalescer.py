"""The coalescer's contract: bursts become one pass, one pass at a time, nothing lost."""

from __future__ import annotations

import asyncio

from gpuguard.engine.coalescer import Coalescer
from gpuguard.engine.passes import Work

A = frozenset({"checkpoint"})
B = frozenset({"container_access"})


def _run(coro_fn) -> None:  # type: ignore[no-untyped-def]
    asyncio.run(asyncio.wait_for(coro_fn(), timeout=20))


def test_burst_is_one_pass() -> None:
    async def main() -> None:
        passes: list[Work] = []

        async def run(w: Work) -> None:
            passes.append(w)

        c = Coalescer(run, quiet=0.05, max_delay=5)
        task = asyncio.create_task(c.run())
        for i in range(300):
            c.mark(A if i % 2 else B, f"signal {i}")
            c.mark(A, "the same reason each time")
        await asyncio.sleep(0.3)
        c.stop()
        await task
        assert len(passes) == 1
        assert passes[0].reconcilers == A | B
        assert passes[0].reasons[:2] == ("signal 0", "the same reason each time")
        assert len(passes[0].reasons) == 64  # a bounded sample, not 600
        assert passes[0].reasons.count("the same reason each time") == 1  # each once

    _run(main)


def test_marks_during_a_pass_make_exactly_one_more_pass() -> None:
    async def main() -> None:
        passes: list[Work] = []
        in_pass = asyncio.Event()
        release = asyncio.Event()
        concurrent = 0
        max_concurrent = 0

        async def run(w: Work) -> None:
            nonlocal concurrent, max_concurrent
            concurrent += 1
            max_concurrent = max(max_concurrent, concurrent)
            passes.append(w)
            in_pass.set()
            if len(passes) == 1:
                await release.wait()
            concurrent -= 1

        c = Coalescer(run, quiet=0.01, max_delay=1)
        task = asyncio.create_task(c.run())
        c.mark(A, "first")
        await in_pass.wait()
        for i in range(10):
            c.mark(B, f"during {i}")
        release.set()
        await asyncio.sleep(0.2)
        c.stop()
        await task
        assert [p.reasons[0] for p in passes] == ["first", "during 0"]
        assert passes[1].reconcilers == B
        assert max_concurrent == 1

    _run(main)


def test_max_delay_bounds_a_steady_trickle() -> None:
    async def main() -> None:
        passes: list[Work] = []

        async def run(w: Work) -> None:
            passes.append(w)

        c = Coalescer(run, quiet=0.1, max_delay=0.2)
        task = asyncio.create_task(c.run())
        for i in range(30):  # a mark every 30 ms never leaves a 100 ms quiet period
            c.mark(A, f"tick {i}")
            await asyncio.sleep(0.03)
        c.stop()
        await task
        assert len(passes) >= 2  # without max_delay this would be 0 until the trickle ends

    _run(main)


def test_hold_defers_until_released_and_urgent_is_quick() -> None:
    async def main() -> None:
        passes: list[Work] = []

        async def run(w: Work) -> None:
            passes.append(w)

        c = Coalescer(run, quiet=5.0, urgent_quiet=0.01, max_delay=10, max_hold=10)
        task = asyncio.create_task(c.run())
        c.hold(True)
        c.mark(A, "during reload", urgent=True)
        await asyncio.sleep(0.2)
        assert passes == []  # held: units are in flux
        c.hold(False)
        c.mark(A, "reload finished", urgent=True)
        await asyncio.sleep(0.2)  # urgent quiet period (10 ms), not the 5 s one
        c.stop()
        await task
        assert len(passes) == 1
        assert passes[0].reasons == ("during reload", "reload finished")

    _run(main)


def test_stop_finishes_the_running_pass() -> None:
    async def main() -> None:
        finished = []

        async def run(w: Work) -> None:
            await asyncio.sleep(0.1)
            finished.append(w)

        c = Coalescer(run, quiet=0.0, max_delay=1)
        task = asyncio.create_task(c.run())
        c.mark(A, "x")
        await asyncio.sleep(0.02)
        assert c.running
        c.stop()
        await task
        assert len(finished) == 1

    _run(main)


def test_work_says_whether_an_urgent_mark_is_among_its_marks() -> None:
    async def main() -> None:
        passes: list[Work] = []

        async def run(w: Work) -> None:
            passes.append(w)

        c = Coalescer(run, quiet=0.02, urgent_quiet=0.01, max_delay=1)
        task = asyncio.create_task(c.run())
        c.mark(B, "periodic audit")
        c.mark(A, "systemd: daemon-reload/reexec finished", urgent=True)
        await asyncio.sleep(0.1)
        c.mark(B, "systemd: new container scope x")
        await asyncio.sleep(0.1)
        c.stop()
        await task
        assert [w.urgent for w in passes] == [True, False]

    _run(main)
