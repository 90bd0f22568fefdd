"""The one apply path: every change a step plans is made here, or under dry-run
described here; no other module of the package reads the dry-run flag
(tests/unit/test_layout.py).

A change is a `Change` (actuate/change.py): what makes it and what says what it
would make, reading only. Actuators offer both halves and steps hand the pair over, so
no actuator or step chooses between them and a dry-run describes what the real run
makes (issue 10). A choice that follows from whether changes are made (the last pass's
plan as the snapshot to start from, whether a loss is journaled as an event or a
state) is the executor's too (`choose`, `pick`), given both values.

The executor also holds the mode: the command line's `--dry-run` (kept across reloads),
`Mode=observe` or `DryRun=yes`, and the off switch (once seen, nothing more is made).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Literal, TypeVar

from gpuguard.actuate.change import AsyncChange, Change

T = TypeVar("T")

Mode = Literal["observe", "repair"]


class ChangeExecutor:
    """Makes or describes every planned change, and counts each by kind."""

    def __init__(self, *, dry_run: bool = False, observe: bool = False) -> None:
        self._cli_dry_run = dry_run  # --dry-run: kept across reloads
        self._observe = observe  # Mode=observe, DryRun=yes
        self._off = False  # the off switch, once seen
        self.made: Counter[str] = Counter()
        self.described: Counter[str] = Counter()

    @property
    def _dry_run(self) -> bool:
        return self._cli_dry_run or self._observe or self._off

    @property
    def mode(self) -> Mode:
        """What the status file, the hooks and `gpuguard check` say the run is."""
        return "observe" if self._dry_run else "repair"

    @property
    def dry_run(self) -> bool:
        """The flag as the status file and the hooks' environment serialise it."""
        return self._dry_run

    @property
    def records_own_state(self) -> bool:
        """Whether gpuguard's own state (the GPU identity history) is recorded: when
        changes are made, and in observe mode (not under --dry-run nor the off switch:
        nothing at all is written then)."""
        return not self._dry_run or (self._observe and not self._cli_dry_run and not self._off)

    def reconfigure(self, observe: bool) -> bool:
        """A reload's `Mode=observe`/`DryRun=`; True when it turned describing on."""
        was, self._observe = self._dry_run, observe
        return self._dry_run and not was

    def switch_off(self) -> None:
        """The off switch is set: nothing more is made."""
        self._off = True

    def run(self, change: Change[T]) -> T:
        if self._dry_run:
            self.described[change.what] += 1
            return change.describe()
        self.made[change.what] += 1
        return change.make()

    async def run_async(self, change: AsyncChange[T]) -> T:
        if self._dry_run:
            self.described[change.what] += 1
            return change.describe()
        self.made[change.what] += 1
        return await change.make()

    def pick(self, *, made: T, described: T) -> T:
        """`choose` for values at hand."""
        return described if self._dry_run else made

    def choose(self, *, made: Callable[[], T], described: Callable[[], T]) -> T:
        """A value that follows from whether changes are made (no change: not counted)."""
        return described() if self._dry_run else made()
