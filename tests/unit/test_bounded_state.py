"""What the daemon keeps between passes stays bounded by what the node has now, never by
how many containers, scopes or events it has seen: many passes of the container access
step over containers that come and go (a fake v1 node, one container replaced per pass)
leave every structure the step owns no larger than for the containers alive at the end.
Counts, not timings (bench/soak.py measures the daemon's RSS over a real systemd)."""

from __future__ import annotations

import asyncio
import gc
import io
import shutil
from pathlib import Path
from typing import Any

from fakenode import FakeContainer, build_node
from gpuguard.config import load_config
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.engine.oneshot import OneShotServices
from gpuguard.engine.passes import PassContext, Work
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.steps.container_access import ContainerAccessStep

LIVE = 8  # containers on the node at any time
PASSES = 120  # each replacing one container: 15 generations of the whole node


def _sizes(step: ContainerAccessStep) -> dict[str, int]:
    """Every container-, scope- or event-keyed structure the step keeps between passes."""
    s: Any = step.state
    out = {
        "durable": len(s.durable),
        "pod_restarts": len(s.pod_restarts),
        "carried": len(s.carried.outcomes) + len(s.carried.findings) + len(s.carried.ids),
        "observer_cache": len(s.observer._cache),
        "v1_good": len(s.cgroups.v1._good),
        "scopes_waiting": len(s.scopes._found) + len(s.scopes._announced),
        "scope_queue": len(s.scopes.queue._first_seen) + len(s.scopes.queue._attempts),
        "conditions": sum(len(v) for v in s.conditions._scopes.values()),
        "conditions_meta": len(s.conditions._since) + len(s.conditions._updates),
    }
    return out


def test_container_churn_leaves_no_trace(tmp_path: Path) -> None:
    root = tmp_path / "root"
    made: list[FakeContainer] = []

    def container(n: int) -> FakeContainer:
        # every other one denied its GPU (the devices.list runc leaves after a reload)
        listed = "a *:* rwm\n" if n % 2 else "c 1:3 rwm\n"
        return FakeContainer(pod=n, number=n, gpus=(n % 2,), devices_list=listed)

    made = [container(n) for n in range(LIVE)]
    inventory = build_node(root, made)
    conf = root / "etc/gpuguard/gpuguard.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(f"[Inventory]\nFile={inventory}\n[Devices]\nDurableGrants=no\n")
    svc = OneShotServices(
        Root(root), load_config(Root(root)), EventLog(stream=io.StringIO()), apply=ChangeExecutor(),
        bus_address="",
    )  # fmt: skip
    step = ContainerAccessStep()

    async def no_inventory() -> None:
        return None

    def one_pass(i: int) -> None:
        ctx = PassContext(
            Work(frozenset({"container_access"}), (f"audit {i}",), 0, 0), no_inventory
        )
        asyncio.run(step(svc, ctx))
        step.state.carried.take()  # what the daemon does with each pass's result

    sizes = []
    for i in range(PASSES):
        one_pass(i)
        gone = made.pop(0)  # the oldest container stops, a new one starts
        shutil.rmtree(root / gone.cgroup.lstrip("/"))
        shutil.rmtree(root / f"proc/{gone.pid}")
        new = container(LIVE + i)
        made.append(new)
        fresh = tmp_path / f"new{i}"  # its files made apart, then moved in (renames)
        build_node(fresh, [new])
        for part in (new.cgroup.lstrip("/"), f"proc/{new.pid}"):
            (root / part).parent.mkdir(parents=True, exist_ok=True)
            (fresh / part).rename(root / part)
        sizes.append(_sizes(step))
    one_pass(PASSES)
    gc.collect()
    end = _sizes(step)
    assert all(v <= 2 * LIVE for v in end.values()), end  # a few per live container at most
    # and no structure grew between the first generation and the last
    first = sizes[LIVE]
    assert all(end[k] <= max(first[k], LIVE) for k in end), (first, end)
