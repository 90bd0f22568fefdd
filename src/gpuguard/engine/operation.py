"""How the daemon is operated: the off switch it obeys (host/offswitch.py) and
observe-only mode (`[Daemon] Mode=observe`), each said once in the journal."""

from __future__ import annotations

from typing import Optional

from gpuguard.host.offswitch import OffSwitch, read_off_switch
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog


class OffSwitchGate:
    """The off switch as the daemon sees it: read (one lstat while unset) before every
    pass and fast path; once seen, it stays seen (the daemon is stopping)."""

    def __init__(self, root: Root, log: EventLog) -> None:
        self.root = root
        self.log = log
        self.seen: Optional[OffSwitch] = None

    def check(self, *, quiet: bool = False) -> Optional[OffSwitch]:
        """The switch if it is set; journaled the first time it is seen (unless `quiet`:
        `gpuguard disable` journals it, then stops the daemon)."""
        if self.seen is not None:
            return self.seen
        off = read_off_switch(self.root)
        if off is not None:
            self.seen = off
        if off is not None and not quiet:
            self.log.event(
                "gpuguard-disabled",
                f"{off.describe()}: the daemon stops and changes nothing until `gpuguard enable`",
                level="notice",
                fields={"REASON": off.reason, "OFF_SWITCH": off.path},
            )
        return off


def journal_observe(log: EventLog, why: str) -> None:
    """Observe-only mode, said when the daemon starts in it or a reload turns it on."""
    log.event(
        "observe-only",
        f"observe-only ({why}): Mode=observe or DryRun=yes; gpuguard reports and journals "
        "its plan, and changes nothing",
        level="notice",
    )
