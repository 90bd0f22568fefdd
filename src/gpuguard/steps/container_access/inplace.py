"""When an in-place repair on cgroup v2 (V2Remedy=inplace) is attempted, and when not.

A scope-less v2 container's device policy is the one program its runtime attached.
gpuguard replaces it only when exactly one program is attached to the container's
cgroup: with several (another tool's, or a hook's next to runc's) it cannot know which
one denies, and replacing any of them could never be judged safe, so the container gets
a finding (`container-program-unexpected`) and nothing changes. In a scope every
program the kernel runs was read, and the one replaced is named by its id: a runtime's
that denies what systemd's programs admit (cgroupv2.py); its back-off is the same.

A replacement that failed (no CAP_BPF/CAP_SYS_ADMIN, BPF_PROG_QUERY refused, a frozen
cgroup whose probe cannot confirm, an unknown program shape) is not tried again on every
pass: the failure is remembered by cgroup and the program ids that were attached, and
the next attempt waits until either changes or a back-off has passed (doubling from
`BASE` up to `CAP`). Meanwhile the container has a `container-repair-backoff` finding
saying how often it failed, the last reason and when gpuguard tries again.

`hold_back` is pure (a table of failures and a time in, actions and findings out);
`Backoff` keeps the table across passes, fed by the step with each outcome.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from gpuguard.model import Action, Finding
from gpuguard.steps.container_access.reconcile import RECONCILER, V2ProgramReplace

FINDING_UNEXPECTED = "container-program-unexpected"
FINDING_BACKOFF = "container-repair-backoff"

BASE = 60.0  # seconds before the first retry; doubles with each failure
CAP = 3600.0

Programs = Optional[tuple[int, ...]]  # ids attached to the cgroup; None: the query failed


@dataclass(frozen=True)
class Failure:
    programs: Programs  # what was attached when it failed
    count: int  # consecutive failures with these programs
    at: float  # clock time of the last one
    reason: str

    @property
    def wait(self) -> float:
        return float(min(BASE * 2.0 ** (self.count - 1), CAP))

    def holds(self, programs: Programs, now: float) -> bool:
        """Still held back: the same programs and the back-off not over yet."""
        return programs == self.programs and now < self.at + self.wait


def _ids(programs: Programs) -> str:
    return "none readable" if programs is None else ", ".join(map(str, programs)) or "none"


def _fields(a: V2ProgramReplace, programs: Programs) -> dict[str, str]:
    return {
        "POD_UID": a.pod_uid,
        "CONTAINER_ID": a.container_id,
        "DEVICE": ",".join(a.nodes),
        "DEVICE_NUMBERS": ",".join(a.numbers),
        "CGROUP": a.cgroup_dir,
        "CGROUP_LAYOUT": "v2",
        "DEVICE_MECHANISM": "own-program",
        "BPF_PROGRAMS": _ids(programs),
    }


def hold_back(
    actions: Sequence[Action],
    programs: Mapping[str, Programs],
    failures: Mapping[str, Failure],
    now: float,
) -> tuple[tuple[Action, ...], tuple[Finding, ...]]:
    """Drop the V2ProgramReplace actions that must not run now, with a finding for each.

    ``programs``: container_id -> ids attached to its own cgroup (absent: unknown, left
    to the actuator); ``failures``: cgroup dir -> the last failed attempt there."""
    kept: list[Action] = []
    findings: list[Finding] = []
    for a in actions:
        if not isinstance(a, V2ProgramReplace):
            kept.append(a)
            continue
        short = a.container_id[:12]
        ids = programs.get(a.container_id, ())
        # a program named by its id (a runtime's in a scope) is one gpuguard judged
        if ids is not None and len(ids) > 1 and not a.program_id:
            findings.append(
                Finding(
                    kind=FINDING_UNEXPECTED,
                    reconciler=RECONCILER,
                    summary=f"pod {a.pod_uid} container {short}: {a.cgroup_dir} has "
                    f"{len(ids)} device programs attached ({_ids(ids)}), gpuguard replaces "
                    "only a single one (runc's); nothing changed, "
                    f"{', '.join(a.nodes)} stay denied: restart the container "
                    "(V2Remedy=restart-container) or detach what attached the others",
                    fields=_fields(a, ids),
                    severity="error",
                )
            )
            continue
        f = failures.get(a.cgroup_dir)
        if f is not None and f.holds(programs.get(a.container_id), now):
            findings.append(
                Finding(
                    kind=FINDING_BACKOFF,
                    reconciler=RECONCILER,
                    summary=f"pod {a.pod_uid} container {short}: replacing the device "
                    f"program of {a.cgroup_dir} failed {f.count} time(s), last: {f.reason}; "
                    f"gpuguard tries again {f.wait:.0f}s after that failure or when the "
                    "cgroup's programs change; restart the container to end it sooner",
                    fields={**_fields(a, f.programs), "FAILURES": str(f.count)},
                    severity="error",
                )
            )
            continue
        kept.append(a)
    return tuple(kept), tuple(findings)


class Backoff:
    """Failed in-place replacements by cgroup dir, kept across passes."""

    def __init__(self) -> None:
        self.failures: dict[str, Failure] = {}

    def record(
        self, cgroup_dir: str, programs: Programs, ok: bool, reason: str, now: float
    ) -> None:
        if ok:
            self.failures.pop(cgroup_dir, None)
            return
        prev = self.failures.get(cgroup_dir)
        count = prev.count + 1 if prev is not None and prev.programs == programs else 1
        self.failures[cgroup_dir] = Failure(programs, count, now, reason)

    def keep_only(self, cgroup_dirs: set[str]) -> None:
        """Forget cgroups that are gone (a new container starts with a clean slate)."""
        for gone in set(self.failures) - cgroup_dirs:
            del self.failures[gone]
