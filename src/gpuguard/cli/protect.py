"""`gpuguard protect`: make every running GPU container's present grant durable before a
`systemctl daemon-reload`, and nothing else.

The package's maintainer scripts run it before every reload they cause (debhelper's,
their own, RPM's): systemd 247 and 252 re-apply every scope's device policy at a reload,
which takes away a grant the legacy NVIDIA hook made behind systemd's back (F2). It
writes each such scope's drop-in (`60-gpuguard-devices.conf`, actuate/dropins.py) with
the nodes the kernel admits now, so the reload rebuilds the policy with them. It makes
no D-Bus call (the reload that follows applies the drop-in), grants no node the kernel
denies, touches no checkpoint, node or unit, and runs the same in observe and repair
mode: keeping the package's own reload from taking a device away is not a repair of the
node. The off switch and DurableGrants=no are honoured (it writes nothing and says so).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Optional, Sequence

from gpuguard import exitcodes
from gpuguard.actuate.change import Change
from gpuguard.cli.args import config_from, log_from, opt, root_from
from gpuguard.errors import GpuguardError

if TYPE_CHECKING:
    from gpuguard.config import Config
    from gpuguard.host.paths import Root
    from gpuguard.journal.log import EventLog
    from gpuguard.steps.container_access.protect import Device, Protection

KIND = "grant-protected"
DEFAULT_REASON = "before a systemctl daemon-reload"


def cmd_protect(args: argparse.Namespace) -> int:
    from gpuguard.host.offswitch import read_off_switch

    root = root_from(args)
    reason = opt(args, "reason") or DEFAULT_REASON
    off = read_off_switch(root)
    cfg, broken = _config_or_default(args, root)
    log = log_from(args, cfg, root)
    if broken:
        log.warning(f"{broken}; protecting with the default settings")
    if off is not None or not cfg.devices.durable_grants:
        why = off.describe() if off is not None else "DurableGrants=no"
        print(
            f"gpuguard protect: {why}: nothing written; a daemon-reload may take a GPU away "
            "from a container whose grant systemd does not hold"
        )
        return exitcodes.OK
    plan = _plan(root, cfg)
    if plan is None:
        print("gpuguard protect: no NVIDIA driver registered: no GPU container to protect")
        return exitcodes.OK
    from gpuguard.engine.executor import ChangeExecutor

    apply = ChangeExecutor(dry_run=args.dry_run)
    failed = 0
    for p in plan:
        if p.add:
            failed += not apply.run(_write(root, log, p, reason))
    _summary(plan, failed, apply.pick(made="made", described="would make"))
    return exitcodes.FINDINGS if failed else exitcodes.OK


def _config_or_default(args: argparse.Namespace, root: Root) -> tuple[Config, str]:
    """The configuration; a broken one must not leave the containers unprotected (the
    package reloads either way): the defaults then, and why."""
    try:
        return config_from(args, root), ""
    except GpuguardError as e:
        from gpuguard.config import Config

        return Config(), e.message


def _plan(root: Root, cfg: Config) -> Optional[tuple[Protection, ...]]:
    from gpuguard.actuate.dropins import DropInError, read_dropin
    from gpuguard.engine.snapshot import HostSnapshot
    from gpuguard.steps.container_access.cgroups import Cgroups
    from gpuguard.steps.container_access.observe import AccessObserver
    from gpuguard.steps.container_access.protect import plan_protect

    snapshot = HostSnapshot(root, cfg.kubelet.checkpoint_path)
    view = AccessObserver(Cgroups()).observe(root, None, snapshot, cfg.device_plugin.socket_dir)
    if view is None:
        return None
    dropins: dict[str, Optional[Sequence[Device]]] = {}
    for c in view.containers:
        if c.unit is not None:
            try:
                dropins[c.unit] = read_dropin(root, c.unit)
            except DropInError:
                dropins[c.unit] = None  # not ours: the write refuses it and says why
    return plan_protect(view, dropins)


def _write(root: Root, log: EventLog, p: Protection, reason: str) -> Change[bool]:
    """The protection's drop-in as a change: True unless the write failed."""
    from gpuguard.actuate.dropins import DropInError, would_write, write_device_dropin

    lines = " ".join(f"DeviceAllow={d} {perm}" for d, perm in p.add)
    fields = {
        "UNIT": p.unit,
        "POD_UID": p.pod_uid,
        "CONTAINER_ID": p.container_id,
        "DEVICE": ",".join(p.nodes),
        "REASON": reason,
    }

    def describe() -> bool:
        where = would_write(root, p.unit)
        print(f"dry-run:   {p.unit}: would add {lines} to {where or 'its drop-in'} ({reason})")
        return True

    def make() -> bool:
        try:
            path = write_device_dropin(root, p.unit, p.add)
        except DropInError as e:
            log.event(KIND, f"{p.unit}: not protected: {e.message}", level="error", fields=fields)
            return False
        log.event(
            KIND,
            f"{p.unit}: its present grant made durable ({lines} in {path}) {reason}",
            level="notice",
            fields={**fields, "PATH": path},
        )
        return True

    return Change("protect", make, describe)


def _summary(plan: Sequence[Protection], failed: int, verb: str) -> None:
    added = sum(1 for p in plan if p.add)
    held = sum(1 for p in plan if not p.add and p.kept)
    left = [p for p in plan if p.denied or p.unknown]
    print(
        f"gpuguard protect: {len(plan)} GPU container(s) in a systemd scope: {verb} "
        f"{added - failed} grant(s) durable, {held} durable already, {failed} failed"
    )
    for p in left:
        gone = ", ".join([*p.denied, *(f"{n} (unknown)" for n in p.unknown)])
        print(f"left:      {p.unit}: {gone}: not admitted now; protect repairs nothing")
