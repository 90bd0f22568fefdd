"""`gpuguard disable` and `gpuguard enable`: the off switch (host/offswitch.py) in one
command each, for an operator in an incident (and ssh loops over a fleet).

disable: the switch first (from then on nothing changes: the daemon, kubelet's
pre-start hook and `gpuguard check` all look at it before they write), then the
daemon stopped. enable: the switch removed, then gpuguard.service started, only if it
is enabled in systemd (an operator's `systemctl disable` is a separate choice, kept).
"""

from __future__ import annotations

import argparse
import os
import pwd
import sys
from typing import Any

from gpuguard import exitcodes
from gpuguard.cli.args import log_from, root_from
from gpuguard.errors import GpuguardError
from gpuguard.host.echo import cut

UNIT = "gpuguard.service"


def _who() -> str:
    user = os.environ.get("SUDO_USER") or os.environ.get("LOGNAME") or os.environ.get("USER")
    if not user:
        try:
            user = pwd.getpwuid(os.getuid()).pw_name
        except KeyError:
            user = f"uid {os.getuid()}"
    return user


def _systemctl(root: Any, *argv: str, timeout: float = 120.0) -> tuple[int, str]:
    """systemctl on this host; (127, why) where there is none to ask (another root, no
    systemd as PID 1)."""
    from gpuguard.host.commands import CommandError, run

    if not root.is_host or not os.path.isdir("/run/systemd/system"):
        return 127, "systemd is not running here"
    try:
        res = run(["systemctl", *argv], timeout=timeout)
    except CommandError as e:
        return 127, str(e)
    return res.returncode, (res.stdout + res.stderr).strip()


def _inside_root(root: Any, host_dir: str) -> None:
    """Refuse to write through a link that leaves --root (an etc/gpuguard linked to a
    directory outside it): the switch would be set somewhere else, or written there."""
    prefix = os.path.realpath(root.prefix)
    real = os.path.realpath(root.path(host_dir))
    if real != prefix and not real.startswith(prefix.rstrip("/") + "/"):
        raise GpuguardError(
            f"{root.path(host_dir)}: it leads to {cut(real, 200)}, outside {prefix}; nothing "
            "written — make it a directory inside the root",
            exit_code=exitcodes.USAGE,
        )


def cmd_disable(args: argparse.Namespace) -> int:
    from gpuguard.actuate.offswitch import set_off_switch
    from gpuguard.host.offswitch import OFF_SWITCH, REASON_MAX

    root = root_from(args)
    given = " ".join(args.reason.split())
    if len(given) > REASON_MAX:  # the switch's reader shows its first REASON_MAX characters
        print(
            f"gpuguard: --reason is {len(given)} characters: kept its first {REASON_MAX}, "
            "which is what status, doctor and the journal show",
            file=sys.stderr,
        )
    # escaped (ESC, OSC, U+202E...): the reason is shown on terminals and in the journal
    reason = cut(given, REASON_MAX) or "no reason given (gpuguard disable --reason TEXT)"
    who = cut(_who(), 64)
    _inside_root(root, os.path.dirname(OFF_SWITCH))
    try:
        set_off_switch(root, reason, who)
    except OSError as e:
        raise GpuguardError(
            f"{root.path(OFF_SWITCH)}: cannot write it ({e.strerror}); nothing changed — "
            "run as root",
            exit_code=exitcodes.USAGE,
        ) from None
    log = log_from(args, None, root)
    code, out = _systemctl(root, "stop", UNIT)
    stopped = (
        f"{UNIT} stopped"
        if code == 0
        else f"{UNIT} not stopped ({cut(out.splitlines()[-1], 200) if out else f'exit {code}'})"
    )
    log.event(
        "gpuguard-disabled",
        f"gpuguard disabled by {who}: {reason}; {stopped}",
        level="notice",
        fields={"REASON": reason, "BY": who, "OFF_SWITCH": OFF_SWITCH},
    )
    print(
        f"gpuguard: disabled ({OFF_SWITCH}): {reason}\n"
        f"  {stopped}; kubelet's pre-start hook, driver loads and `gpuguard check` change "
        "nothing while the file exists (also after reboots and upgrades)\n"
        "  turn it back on: gpuguard enable"
    )
    return exitcodes.OK


def cmd_enable(args: argparse.Namespace) -> int:
    from gpuguard.actuate.offswitch import clear_off_switch
    from gpuguard.host.offswitch import OFF_SWITCH, read_off_switch

    root = root_from(args)
    _inside_root(root, os.path.dirname(OFF_SWITCH))
    was = read_off_switch(root)
    try:
        cleared = clear_off_switch(root)
    except OSError as e:
        raise GpuguardError(
            f"{root.path(OFF_SWITCH)}: cannot remove it ({e.strerror}); gpuguard stays "
            "disabled — remove it by hand",
            exit_code=exitcodes.USAGE,
        ) from None
    code, state = _systemctl(root, "is-enabled", UNIT, timeout=30)
    if code == 127:
        started, ok = f"{UNIT} not started ({state})", True
    elif state.splitlines()[-1:] != ["enabled"]:
        what = cut(state.splitlines()[-1], 80) if state else "unknown"
        started = f"{UNIT} is {what} in systemd, so not started (systemctl enable --now gpuguard)"
        ok = True
    else:
        code, _out = _systemctl(root, "start", UNIT)
        ok = code == 0
        started = f"{UNIT} started" if ok else f"{UNIT} did not start: systemctl status gpuguard"
    if cleared:
        who = cut(_who(), 64)
        log_from(args, None, root).event(
            "gpuguard-enabled",
            f"gpuguard enabled by {who} (it was {was.describe() if was else 'disabled'}); "
            f"{started}",
            level="notice",
            fields={"BY": who, "OFF_SWITCH": OFF_SWITCH},
        )
        print(f"gpuguard: enabled ({OFF_SWITCH} removed); {started}")
    else:
        print(f"gpuguard: was not disabled (no {OFF_SWITCH}); {started}")
    if not ok:
        print(f"gpuguard: {started}", file=sys.stderr)
        return exitcodes.FINDINGS
    return exitcodes.OK
