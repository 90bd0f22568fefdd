"""sources/transient.py on a throw-away /run/systemd: a runtime property written for a
container scope marks the container access step; anything else marks nothing."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from gpuguard.sources.transient import TransientWatch, make_transient_watch
from gpuguard.steps.events import Event, EventKind
from gpuguard.steps.registry import CONTAINER_ACCESS, woken_by

SCOPE = "cri-containerd-" + "ab" * 32 + ".scope"


def write_atomically(path: Path, text: str) -> None:
    """As systemd writes a runtime property: a temporary file, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".#{path.name}")
    tmp.write_text(text)
    os.rename(tmp, path)


async def settle_events(w: TransientWatch) -> None:
    for _ in range(20):  # the reader runs on the loop: a few turns
        await asyncio.sleep(0.01)


def run(run_systemd: Path, actions) -> tuple[list[str], TransientWatch]:
    marks: list[str] = []

    async def main() -> TransientWatch:
        loop = asyncio.get_running_loop()

        def mark(e: Event) -> None:
            assert e.kind is EventKind.SCOPE_DEVICES_SET and not e.urgent
            assert woken_by(e.kind) == frozenset({CONTAINER_ACCESS})
            marks.append(e.why)

        w = make_transient_watch(loop, mark, str(run_systemd))
        assert w is not None
        try:
            for act in actions:
                act()
                await settle_events(w)
        finally:
            w.close()
        return w

    return marks, asyncio.run(main())


def test_device_allow_set_at_runtime_marks(tmp_path: Path) -> None:
    transient = tmp_path / "systemd/transient"
    (transient / f"{SCOPE}.d").mkdir(parents=True)
    marks, w = run(
        tmp_path / "systemd",
        [lambda: write_atomically(transient / f"{SCOPE}.d/50-DeviceAllow.conf", "DeviceAllow=\n")],
    )
    assert len(marks) == 1 and SCOPE in marks[0] and "DeviceAllow=" in marks[0]
    assert w.fd == -1  # closed


def test_new_scope_directory_is_watched(tmp_path: Path) -> None:
    transient = tmp_path / "systemd/transient"
    transient.mkdir(parents=True)
    d = transient / f"{SCOPE}.d"
    marks, _ = run(
        tmp_path / "systemd",
        [
            lambda: d.mkdir(),
            lambda: write_atomically(d / "50-DevicePolicy.conf", "DevicePolicy=strict\n"),
        ],
    )
    assert len(marks) == 1 and "DevicePolicy=" in marks[0]


def test_transient_directory_created_later(tmp_path: Path) -> None:
    run_systemd = tmp_path / "systemd"
    run_systemd.mkdir()
    d = run_systemd / "transient" / f"{SCOPE}.d"
    marks, _ = run(
        run_systemd,
        [
            lambda: (run_systemd / "transient").mkdir(),
            lambda: d.mkdir(),
            lambda: write_atomically(d / "50-DeviceAllow.conf", "DeviceAllow=\n"),
        ],
    )
    assert len(marks) == 1 and SCOPE in marks[0]


def test_other_units_and_properties_mark_nothing(tmp_path: Path) -> None:
    transient = tmp_path / "systemd/transient"
    transient.mkdir(parents=True)
    svc = transient / "kubelet.service.d"
    scope = transient / f"{SCOPE}.d"
    marks, _ = run(
        tmp_path / "systemd",
        [
            lambda: svc.mkdir(),
            lambda: write_atomically(svc / "50-DeviceAllow.conf", "DeviceAllow=\n"),
            lambda: scope.mkdir(),
            lambda: write_atomically(scope / "50-CPUQuota.conf", "CPUQuota=50%\n"),
            lambda: write_atomically(transient / SCOPE, "[Scope]\n"),  # the unit file itself
        ],
    )
    assert marks == []


def test_no_run_systemd_no_watch(tmp_path: Path) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert make_transient_watch(loop, lambda *a: None, str(tmp_path / "absent")) is None

    asyncio.run(main())


def test_a_link_in_place_of_a_scope_directory_is_not_followed(tmp_path: Path) -> None:
    transient = tmp_path / "systemd/transient"
    transient.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (transient / f"{SCOPE}.d").symlink_to(elsewhere)
    marks, _ = run(
        tmp_path / "systemd",
        [lambda: write_atomically(elsewhere / "50-DeviceAllow.conf", "DeviceAllow=\n")],
    )
    assert marks == []


def test_transient_directory_removed_and_made_again(tmp_path: Path) -> None:
    run_systemd = tmp_path / "systemd"
    transient = run_systemd / "transient"
    transient.mkdir(parents=True)
    d = transient / f"{SCOPE}.d"
    marks, _ = run(
        run_systemd,
        [
            lambda: transient.rmdir(),
            lambda: transient.mkdir(),
            lambda: d.mkdir(),
            lambda: write_atomically(d / "50-DeviceAllow.conf", "DeviceAllow=\n"),
        ],
    )
    assert len(marks) == 1 and SCOPE in marks[0]
