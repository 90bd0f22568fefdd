"""The container access step's writes: grants written to a v1 devices cgroup,
DeviceAllow= set on a container's systemd scope, and a v2 device program replaced. Each
change is offered as a `Change` (what makes it, what describes it) that the engine's
executor runs one half of; either half returns the Outcome the step journals (one entry
per change, with the action's reason).

Control files are written with one write(2) per rule and without O_CREAT/O_TRUNC: the
kernel parses each write as one rule (devcgroup_access_write), and cgroupfs files
cannot be created or truncated anyway.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

from gpuguard.actuate.change import AsyncChange, Change
from gpuguard.actuate.safewrite import UnsafeWriteError, open_control_file
from gpuguard.devices.rules import DeviceRules, allows, parse_rule, parsed_devices_list
from gpuguard.errors import GpuguardError
from gpuguard.host.safeio import CGROUP_MAX, UnsafeFileError, read_kernel_text
from gpuguard.model import Outcome
from gpuguard.steps.container_access.actions import CgroupV1Allow, UnitDropInRemove

if TYPE_CHECKING:
    from gpuguard.actuate.bpf import Replacement
    from gpuguard.actuate.containers import ContainerStopper
    from gpuguard.host.paths import Root
    from gpuguard.host.systemd import Systemd
    from gpuguard.model import Action
    from gpuguard.steps.container_access.reconcile import UnitDeviceAllow, V2ProgramReplace


class CgroupWriteError(GpuguardError):
    """A cgroup control file refused a write; the message names the file and the rule."""


def _write_lines(path: Path, lines: Iterable[str]) -> None:
    try:
        fd = open_control_file(path)  # no link, no FIFO, never blocks
    except UnsafeWriteError as e:
        raise CgroupWriteError(e.message) from None
    try:
        for line in lines:
            try:
                os.write(fd, line.encode())
            except OSError as e:
                raise CgroupWriteError(
                    f"{path}: writing {line!r} failed: {e.strerror}; the cgroup may be gone "
                    "or its parent may not allow the device"
                ) from None
    finally:
        os.close(fd)


def write_allow(cgroup_dir: Path, rules: Iterable[str]) -> None:
    """Append allow rules (``c 195:0 rw``) to a v1 devices cgroup's devices.allow."""
    try:
        _write_lines(cgroup_dir / "devices.allow", rules)
    except FileNotFoundError:
        raise CgroupWriteError(
            f"{cgroup_dir}/devices.allow does not exist: the container is gone or this "
            "is not a cgroup v1 devices directory"
        ) from None


def read_devices_list(cgroup_dir: Path) -> Optional[DeviceRules]:
    """The cgroup's devices.list, parsed; None when the cgroup went away. Raises
    UnsafeFileError (a FIFO, a link, too big: never read without bound) or ValueError
    (not what the kernel writes)."""
    path = cgroup_dir / "devices.list"
    text = read_kernel_text(path, what="devices.list", max_bytes=CGROUP_MAX)
    return None if text is None else parsed_devices_list(text)


# Every re-grant after a reload writes the same few lines: each parsed once.
_parsed_rule = functools.lru_cache(maxsize=256)(parse_rule)


def grants_change(
    cgroup_dir: Path, rules: Sequence[str], through: Sequence[Path] = ()
) -> Change[tuple[str, str]]:
    """The direct re-grant: microseconds, CUDA works again at once. Either half returns
    an Outcome's status and detail; the caller builds the action after its last write
    (cgroupv1.py's reload sweep: building one costs more than the write). A `done` from
    here is provisional until `confirm_v1` has read it back: callers write every
    container first (each one's access back as soon as possible), then confirm them all."""
    above = "".join(f" (and first to {d})" for d in through)

    def make() -> tuple[str, str]:
        try:
            for d in (*through, cgroup_dir):
                write_allow(d, rules)
        except (CgroupWriteError, OSError) as e:
            return "failed", str(e)
        return "done", "wrote " + "; ".join(rules) + above

    def describe() -> tuple[str, str]:
        return "dry-run", "would write " + "; ".join(rules) + above

    return Change("v1-grant", make, describe)


def v1_change(a: CgroupV1Allow) -> Change[Outcome]:
    """`grants_change` for an action planned by a pass."""
    g = grants_change(Path(a.cgroup_dir), a.rules, [Path(d) for d in a.through])
    return Change(g.what, lambda: Outcome(a, *g.make()), lambda: Outcome(a, *g.describe()))


def confirm_v1(o: Outcome) -> Outcome:
    """`done` only once the cgroup's devices.list, read back, admits every rule written:
    a write the kernel took can still be undone at once by systemd re-applying the
    unit's rules (its deny-all, then its own allows), and the journal must not say a
    grant held then. Other outcomes pass through."""
    a = o.action
    if o.status != "done" or not isinstance(a, CgroupV1Allow):
        return o
    cg = Path(a.cgroup_dir)
    try:
        now = read_devices_list(cg)
    except (UnsafeFileError, ValueError) as e:  # ValueError: a list that does not parse
        return Outcome(a, "failed", f"wrote {'; '.join(a.rules)}, but {cg}/devices.list: {e}")
    if now is None:
        return Outcome(a, "failed", f"wrote {'; '.join(a.rules)}, but {cg} is gone")
    lost = []
    for line in a.rules:
        r = _parsed_rule(line)
        if not allows(now, r.type, r.major, r.minor, r.access):
            lost.append(line)
    if lost:
        return Outcome(
            a,
            "failed",
            f"wrote {'; '.join(a.rules)}, but {cg}/devices.list does not admit "
            f"{'; '.join(lost)} read back (its rules were re-applied meanwhile, as systemd "
            "does on a daemon-reload); the next pass judges the container again",
        )
    return o


def device_allow_change(
    a: UnitDeviceAllow, sd: Optional[Systemd], root: Optional[Root]
) -> AsyncChange[Outcome]:
    """The durable grant: a runtime DeviceAllow= that systemd re-applies on every reload.
    With a root, the scope's drop-in first (actuate/dropins.py: durable against a reload
    at once, whatever systemd is busy with), then the call for systemd's running state;
    done only once systemd has answered."""
    paths = [d for d, _ in a.devices]

    async def make() -> Outcome:
        from dbus_next import Variant

        from gpuguard.actuate.dropins import DropInError, write_device_dropin
        from gpuguard.host.systemd import SystemdError

        dropin = ""
        if root is not None:
            try:
                dropin = f"; {write_device_dropin(root, a.unit, a.devices)} written first"
            except DropInError as e:  # the call alone still makes it durable
                dropin = f"; no drop-in: {e.message}"
        if sd is None:
            return Outcome(a, "failed", f"system bus down{dropin}; the next pass retries")
        value = Variant("a(ss)", [[dev, perm] for dev, perm in a.devices])
        try:
            await sd.set_unit_properties(a.unit, a.runtime, [("DeviceAllow", value)])
        except SystemdError as e:
            return Outcome(a, "failed", f"{e}{dropin}")
        return Outcome(a, "done", f"DeviceAllow={' '.join(paths)}{dropin}")

    def describe() -> Outcome:
        from gpuguard.actuate.dropins import would_write

        path = would_write(root, a.unit) if root is not None else None
        first = f"would write {path} and " if path is not None else "would "
        return Outcome(a, "dry-run", f"{first}set DeviceAllow= {', '.join(paths)}")

    return AsyncChange("device-allow", make, describe)


def dropin_remove_change(a: UnitDropInRemove, root: Root) -> Change[Outcome]:
    """Remove a gone scope's drop-in, once its cgroup is checked gone here (a scope that
    started after the pass looked keeps its own). Blocking: run it from a thread."""
    from gpuguard.actuate.dropins import DropInError, dropin_path, remove_dropin
    from gpuguard.devices.containers import find_scope

    def make() -> Outcome:
        if find_scope(root, a.unit) is not None:
            return Outcome(a, "skipped", "the scope exists: its drop-in stays")
        try:
            return Outcome(a, "done", f"removed {remove_dropin(root, a.unit)}")
        except DropInError as e:
            return Outcome(a, "failed", e.message)

    def describe() -> Outcome:
        if find_scope(root, a.unit) is not None:
            return Outcome(a, "skipped", "the scope exists: its drop-in stays")
        return Outcome(a, "dry-run", f"would remove {root.path(dropin_path(a.unit))}")

    return Change("dropin-remove", make, describe)


def program_replace_change(a: V2ProgramReplace, root: Root) -> Change[Outcome]:
    """V2Remedy=inplace: previous program + the lost nodes, checked by a probe of each
    node from inside the cgroup. Blocking (bpf(2), probe forks): run it from a thread."""
    from gpuguard.actuate.bpf import BpfReplaceError, replace_change

    cg = Path(a.cgroup_dir)
    where = Path(a.probe_dir or a.cgroup_dir)  # where the container's process is
    numbers = [(int(ma), int(mi)) for ma, mi in (n.split(":") for n in a.numbers)]

    def verify() -> bool:  # the kernel's word on every node, from one child in the cgroup
        from gpuguard.devices.probe import probe_open_all

        res = probe_open_all([root.path(n) for n in a.nodes], [where])
        return all(r.verdict is True for r in res)

    change = replace_change(cg, numbers, verify, program_id=a.program_id)

    def outcome(half: Callable[[], Replacement], status: str) -> Outcome:
        try:
            r = half()
        except BpfReplaceError as e:
            return Outcome(a, "failed", str(e))
        except OSError as e:  # the old program is attached until the detach, which is last
            return Outcome(a, "failed", f"{cg}: {e.strerror}; the old program stays")
        return Outcome(a, status, r.describe())

    return Change(
        change.what,
        lambda: outcome(change.make, "done"),
        lambda: outcome(change.describe, "dry-run"),
    )


POD_RESTART_WINDOW = 3600.0  # V2Remedy=restart-container: one restart per pod per hour


def decline_or_restart(
    a: Action,
    pod_restarts: dict[str, float],
    now: float,
    stopper: ContainerStopper,
) -> Outcome | AsyncChange[Outcome]:
    """A v2 container without a scope: V2Remedy=report declines; restart-container stops
    it through the CRI, at most once per pod per POD_RESTART_WINDOW (`pod_restarts`:
    pod UID -> when we last stopped one of its containers). A decline is an Outcome,
    a stop the change that makes it."""
    from gpuguard.steps.container_access.reconcile import RestartContainer, V2ReportOnly

    if isinstance(a, V2ReportOnly):
        return Outcome(
            a,
            "declined",
            "cgroup v2 without a systemd scope and V2Remedy=report: runc's device program "
            "is left as it is; recreate the container (V2Remedy=inplace or "
            "restart-container does it)",
        )
    assert isinstance(a, RestartContainer)
    # Never a restart loop: kubelet recreates the container, and if the new one is
    # denied too, stopping it again would be a loop. One restart per pod per window.
    last = pod_restarts.get(a.pod_uid)
    if last is not None and now - last < POD_RESTART_WINDOW:
        return Outcome(
            a,
            "declined",
            f"pod {a.pod_uid} was already restarted {now - last:.0f}s ago (at most one "
            f"restart per pod per {POD_RESTART_WINDOW / 60:.0f} min); recreate it by hand",
        )
    restart = a

    async def make() -> Outcome:
        pod_restarts[restart.pod_uid] = now
        res = await stopper.stop(restart.container_id)
        if not res.ok:
            return Outcome(restart, "failed", res.detail[:200])
        return Outcome(restart, "done", f"stopped ({res.detail}); kubelet recreates it")

    def describe() -> Outcome:
        return Outcome(restart, "dry-run", "would stop the container through the CRI")

    return AsyncChange("container-restart", make, describe)
