"""The new-scope queue: one handling per scope, bounded in flight, retries without
holding a slot, one scope's error its own, a full queue left to the pass."""

from __future__ import annotations

import asyncio

from gpuguard.steps.container_access.scopequeue import ScopeQueue


class Harness:
    def __init__(self, **kwargs: object) -> None:
        self.calls: list[str] = []
        self.running = 0
        self.peak = 0
        self.not_ready: dict[str, int] = {}  # key -> tries answered "not yet"
        self.fail: set[str] = set()
        self.given_up: list[tuple[str, str]] = []
        self.errors: list[tuple[str, str]] = []
        self.release = asyncio.Event()
        self.release.set()
        self.queue = ScopeQueue(
            self.handle,
            on_give_up=lambda k, why: self.given_up.append((k, why)),
            on_error=lambda k, e: self.errors.append((k, str(e))),
            **kwargs,  # type: ignore[arg-type]
        )

    async def handle(self, key: str) -> bool:
        self.calls.append(key)
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await self.release.wait()
            await asyncio.sleep(0)
            if key in self.fail:
                raise RuntimeError(f"{key} broke")
            left = self.not_ready.get(key, 0)
            if left:
                self.not_ready[key] = left - 1
                return False
            return True
        finally:
            self.running -= 1

    async def drain(self, timeout: float = 5.0) -> None:
        async def idle() -> None:
            while not self.queue.idle:
                await asyncio.sleep(0.001)

        await asyncio.wait_for(idle(), timeout)


def test_a_burst_gets_one_handling_each_at_most_n_at_once() -> None:
    async def main() -> Harness:
        h = Harness(concurrency=4)
        h.release.clear()
        keys = [f"s{i}" for i in range(50)]
        for k in keys:
            assert h.queue.add(k)
        for k in keys[:10]:  # announced again while waiting or handled: dropped
            assert not h.queue.add(k)
        await asyncio.sleep(0.01)
        assert h.running == 4 and h.queue.busy() == frozenset(keys)
        h.release.set()
        await h.drain()
        return h

    h = asyncio.run(main())
    assert sorted(h.calls) == sorted(f"s{i}" for i in range(50))  # once each
    assert h.peak == 4 and h.queue.peak_running == 4
    assert h.queue.handled == 50 and h.queue.busy() == frozenset()


def test_not_ready_is_tried_again_without_holding_a_slot() -> None:
    async def main() -> Harness:
        h = Harness(concurrency=1, retry_delays=(0.02,))
        h.not_ready["slow"] = 3
        h.queue.add("slow")
        h.queue.add("quick")  # handled while "slow" waits for its retry
        await h.drain()
        return h

    h = asyncio.run(main())
    assert h.calls[:2] == ["slow", "quick"]
    assert h.calls.count("slow") == 4 and h.calls.count("quick") == 1
    assert h.given_up == [] and h.errors == []


def test_never_ready_is_given_up_and_left_to_the_pass() -> None:
    now = [0.0]

    async def main() -> Harness:
        h = Harness(give_up_after=1.0, retry_delays=(0.001,), clock=lambda: now[0])
        h.not_ready["stuck"] = 10**6
        h.queue.add("stuck")
        while len(h.calls) < 3:
            await asyncio.sleep(0.001)
        now[0] = 1.5  # past give_up_after
        await h.drain()
        assert h.queue.busy() == frozenset()
        h.not_ready["stuck"] = 0
        assert h.queue.add("stuck")  # a later announcement is queued again
        await h.drain()
        return h

    h = asyncio.run(main())
    assert h.given_up == [("stuck", "not ready after 1s")]


def test_one_scope_error_is_its_own() -> None:
    async def main() -> Harness:
        h = Harness(concurrency=2)
        h.fail.add("bad")
        for k in ("a", "bad", "b", "c"):
            h.queue.add(k)
        await h.drain()
        return h

    h = asyncio.run(main())
    assert h.errors == [("bad", "bad broke")]
    assert sorted(h.calls) == ["a", "b", "bad", "c"]
    assert h.queue.handled == 4


def test_past_capacity_new_scopes_are_left_to_the_pass() -> None:
    async def main() -> Harness:
        h = Harness(concurrency=1, capacity=3)
        h.release.clear()
        added = [h.queue.add(f"s{i}") for i in range(5)]
        assert added == [True, True, True, False, False]
        h.release.set()
        await h.drain()
        return h

    h = asyncio.run(main())
    assert [k for k, _ in h.given_up] == ["s3", "s4"]
    assert sorted(h.calls) == ["s0", "s1", "s2"]
