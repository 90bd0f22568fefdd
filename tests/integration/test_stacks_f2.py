"""F2 on the stacks fleets run: four Debian releases' own systemd, containerd, runc and
crun, gpuguard installed from its .deb, on cgroup v2 and (where the release's systemd
still boots there) v1.

Each (release, layout) is booted once (integration/stacks: the release's debootstrapped
root, cached; its own systemd as PID 1 of private namespaces) with three runc and three
crun GPU containers granted behind the runtime's back. First the release alone: a
daemon-reload, a daemon-reexec, the runtime's update and a ``DeviceAllow=`` reset of
every scope, and which containers the kernel then denies their GPU. Then with gpuguard
running, the same events twice over; after each, once its passes have gone quiet, every
container must open its GPU and must not open the one it was not given, and `gpuguard
status` must list every container. Each cell writes its counts to build/stacks/ (the
support matrix in docs/support-matrix.md is rendered from them: scripts/stack-matrix).

Each runtime also runs a privileged GPU container (a device plugin, dcgm-exporter or the
GPU operator's pods run so): its scope admits every device, and after every event with
gpuguard running it must still open every device it opened before (`/dev/kmsg` among
them, and the GPUs): none narrowed. crun runs the container's process in
``SCOPE/container`` with a device program of its own there (1.8 and newer); gpuguard
must find it there and judge it by both programs. crun 0.17 and 1.8 cannot make a
container on v2 on these machines: those cells check that they still cannot, with the
runtime's own error, and say so in the matrix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Tuple, Union

import pytest

from integration.pkgroot import REPO, require_pkgroot_tools
from integration.stacks.scenario import RUNTIMES, Stack

pytestmark = pytest.mark.root

RESULTS = REPO / "build" / "stacks"
#: (release, layout) booted, in the order they run.
STACKS: Tuple[Tuple[str, str], ...] = (
    ("bullseye", "v1"),
    ("bullseye", "v2"),
    ("bookworm", "v1"),
    ("bookworm", "v2"),
    ("trixie", "v1"),
    ("trixie", "v2"),
    ("sid", "v2"),  # systemd 258 and newer refuse cgroup v1
)
#: What each cell is expected to do today other than pass: an xfail reason, or
#: ("not run", why) for a runtime that cannot make a container on these machines.
EXPECTED: Dict[Tuple[str, str, str], Union[str, Tuple[str, str]]] = {
    ("bullseye", "v2", "crun"): ("not run", "CAP_SYS_RESOURCE"),
    ("bookworm", "v2", "crun"): ("not run", "CAP_SYS_RESOURCE"),
}

_stacks: Dict[Tuple[str, str], Union[Stack, BaseException]] = {}


def booted(suite: str, layout: str, tmp: Path) -> Stack:
    """The (release, layout)'s scenario, run once for both runtimes' cells."""
    key = (suite, layout)
    if key not in _stacks:
        stack = Stack(suite, layout, tmp)
        try:
            stack.run()
            _stacks[key] = stack
        except BaseException as e:
            _stacks[key] = e
    got = _stacks[key]
    if isinstance(got, BaseException):
        raise got
    return got


def cells() -> list:  # type: ignore[type-arg]
    out = []
    for suite, layout in STACKS:
        for rt in RUNTIMES:
            want = EXPECTED.get((suite, layout, rt))
            marks = [pytest.mark.xfail(strict=True, reason=want)] if isinstance(want, str) else []
            out.append(pytest.param(suite, layout, rt, marks=marks, id=f"{suite}-{layout}-{rt}"))
    return out


@pytest.mark.parametrize(("suite", "layout", "runtime"), cells())
def test_f2_cell(
    suite: str, layout: str, runtime: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    require_pkgroot_tools()
    stack = booted(suite, layout, tmp_path_factory.mktemp(f"stack-{suite}-{layout}"))
    want = EXPECTED.get((suite, layout, runtime))
    test = f"tests/integration/test_stacks_f2.py::test_f2_cell[{suite}-{layout}-{runtime}]"
    if isinstance(want, tuple):
        why = stack.not_run.get(runtime, "")
        assert want[1] in why, f"{runtime} was expected not to start ({want[1]}): {why!r}"
        stack.write_not_run(runtime, RESULTS, test)
        return
    assert runtime not in stack.not_run, stack.not_run[runtime]
    cell = stack.cells[runtime]
    cell.write(RESULTS, test, want or "")
    print(f"\n{cell}")
    assert cell.placement, cell
    made = cell.containers + cell.privileged
    assert cell.found == made, f"gpuguard status lists {cell.found} of {made} {runtime} containers"
    assert cell.privileged == 1, cell
    assert cell.losses == 0, f"{cell.losses} GPU(s) lost over {cell.events} events: {cell}"
    assert cell.over_grants == 0, f"{cell.over_grants} over-grant(s): {cell}"
    assert cell.narrowed == 0, f"{cell.narrowed} privileged container-event(s) narrowed: {cell}"
    assert not cell.notes or all("did not go quiet" not in n for n in cell.notes), cell.notes
