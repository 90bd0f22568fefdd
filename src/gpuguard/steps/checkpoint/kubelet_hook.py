"""What kubelet's pre-start hook did, in a form its caller can verify after a restart.

RestartUnit's job ends `done` whatever the hook did: the drop-in's `-` prefix makes
systemd ignore its exit status (no driver, bad configuration, killed), so a `done` job
proves nothing about the checkpoint. The caller therefore reports a repair only when
(1) the hook left a result for THIS restart saying it repaired the file, and (2) the
checkpoint, re-read and re-analysed after the restart, names no stale device.

How the hook knows which restart it serves: the caller writes REQUEST (a random token)
before RestartUnit, the hook copies the token into RESULT. A file rather than
`systemctl set-environment`: the manager's environment is inherited by every unit
started afterwards and outlives the call, while a root-owned file in the runtime
directory (tmpfs: gone at reboot) is read by the hook alone, at the moment it runs. A
RESULT carrying another token (an earlier restart, a restart nobody asked for, a
record left by a crash) is never taken for this restart's outcome.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from gpuguard.actuate.files import write_new
from gpuguard.host.paths import Root
from gpuguard.steps.registry import CHECKPOINT

if TYPE_CHECKING:  # the hook's healthy path parses and analyses nothing
    from gpuguard.host.inventory import Inventory
    from gpuguard.journal.log import EventLog

REQUEST = "/run/gpuguard/kubelet-hook.request"
RESULT = "/run/gpuguard/kubelet-hook.result"

# Outcomes a hook run can record. Only "repaired" (and "healthy": the file needed
# nothing when the hook looked) can make a caller's repair count as verified.
REPAIRED = "repaired"
HEALTHY = "healthy"
SKIPPED = "skipped"  # nothing it can or should do: no driver/NVML, no checkpoint file
NOT_REPAIRED = "not-repaired"  # findings left as they are (refused, Policy=report, dry run)
FAILED = "failed"  # it tried and failed (bad configuration or input, kubelet still up, ...)


@dataclass(frozen=True)
class HookResult:
    token: str  # the caller's token from REQUEST, "" when nobody asked
    outcome: str
    detail: str
    before_sha256: str  # of the checkpoint when the hook started ("" when absent)
    after_sha256: str  # when it ended
    time: float
    exit_code: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True) + "\n"


def new_token() -> str:
    import secrets  # only the caller that restarts kubelet needs one

    return secrets.token_hex(16)


def file_sha256(path: Path) -> str:
    """sha256 of a regular file's bytes; "" when it is absent or unreadable."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return ""


def _ensure_dir(root: Root, host_path: str) -> Path:
    path = root.path(host_path)
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    return path


def write_request(root: Root, token: str) -> None:
    doc = {"token": token, "time": time.time()}
    write_new(_ensure_dir(root, REQUEST), (json.dumps(doc) + "\n").encode(), mode=0o600)


def clear_request(root: Root) -> None:
    root.path(REQUEST).unlink(missing_ok=True)


def read_request_token(root: Root) -> str:
    """The token a caller left for this run; "" without one (a plain kubelet start)."""
    try:
        doc = json.loads(root.path(REQUEST).read_text())
        token = doc["token"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return token if isinstance(token, str) else ""


def write_result(root: Root, result: HookResult) -> None:
    write_new(_ensure_dir(root, RESULT), result.to_json().encode(), mode=0o644)


def read_result(root: Root) -> Optional[HookResult]:
    try:
        doc = json.loads(root.path(RESULT).read_text())
        return HookResult(
            token=str(doc["token"]),
            outcome=str(doc["outcome"]),
            detail=str(doc["detail"]),
            before_sha256=str(doc["before_sha256"]),
            after_sha256=str(doc["after_sha256"]),
            time=float(doc["time"]),
            exit_code=int(doc["exit_code"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class Verdict:
    verified: bool
    detail: str  # one line: what was verified, or why the repair is not


def judge(
    token: str,
    result: Optional[HookResult],
    *,
    stale_after: Optional[int],
    reread_error: str,
    current_sha256: str,
) -> Verdict:
    """Pure: does what the hook recorded, plus the checkpoint re-analysed after the
    restart (`stale_after` stale IDs/entries; None with `reread_error` when it could
    not be read), prove this restart repaired the file?"""
    if result is None or result.token != token:
        return Verdict(
            False,
            "kubelet's pre-start hook left no result for this restart (it did not run, "
            "timed out or was killed); see `journalctl -u kubelet`",
        )
    if result.outcome not in (REPAIRED, HEALTHY):
        return Verdict(
            False,
            f"kubelet's pre-start hook {result.outcome} (exit {result.exit_code}): {result.detail}",
        )
    if stale_after is None:
        return Verdict(False, f"the checkpoint cannot be re-read after the restart: {reread_error}")
    if stale_after:
        return Verdict(
            False,
            f"the checkpoint still names {stale_after} stale device ID(s) or pod entries "
            "after the restart",
        )
    how = (
        "the file is the one the hook wrote"
        if current_sha256 == result.after_sha256
        else "kubelet has rewritten it since, still without stale devices"
    )
    return Verdict(
        True,
        f"verified: the pre-start hook {result.outcome} it (sha256 "
        f"{result.before_sha256[:12] or '-'} -> {result.after_sha256[:12] or '-'}), "
        f"re-read after the restart: no stale device; {how}",
    )


def verify(
    root: Root,
    token: str,
    checkpoint_path: str,
    inventory: Inventory,
    resources: Sequence[str],
    policy: str,
) -> Verdict:
    """Read the hook's result and re-analyse the checkpoint as it is after the restart,
    with the inventory the repair was planned with."""
    from gpuguard.checkpoint import read_checkpoint
    from gpuguard.errors import BadInputError
    from gpuguard.steps.checkpoint import reconcile as ckpt

    path = root.path(checkpoint_path)
    stale: Optional[int] = 0
    error = ""
    current = ""
    if path.exists() or path.is_symlink():
        try:
            cp, raw, _st = read_checkpoint(path)
        except BadInputError as e:
            stale, error = None, e.message
        else:
            a = ckpt.analyse(cp, inventory, resources)
            stale, current = len(a.stale_registered) + len(a.stale_entries), ckpt.sha256(raw)
    elif policy != "delete":
        stale, error = None, f"{path} is gone"
    return judge(
        token, read_result(root), stale_after=stale, reread_error=error, current_sha256=current
    )


class HookRun:
    """One run of `gpuguard check --kubelet-stopped`: the result it leaves in RESULT,
    with the token of the caller that restarted kubelet (if one did)."""

    def __init__(self, root: Root) -> None:
        self.root = root
        self.token = read_request_token(root)
        self.checkpoint: Optional[Path] = None
        self.before = ""

    def start(self, checkpoint: Path) -> None:
        self.checkpoint = checkpoint
        self.before = file_sha256(checkpoint)

    def finish(self, outcome: str, detail: str, exit_code: int) -> int:
        after = file_sha256(self.checkpoint) if self.checkpoint is not None else ""
        result = HookResult(self.token, outcome, detail, self.before, after, time.time(), exit_code)
        # A read-only /run: the caller then finds no result and reports exactly that.
        with contextlib.suppress(OSError):
            write_result(self.root, result)
        return exit_code

    def skipped(self, log: EventLog, why: str) -> int:
        """Nothing it can or should do: exit 0 (kubelet's status shows no failing
        ExecStartPre=), said in the journal once per state rather than at every start."""
        last = read_result(self.root)
        repeated = last is not None and last.outcome == SKIPPED and last.detail == why
        log.event(
            "kubelet-hook-skipped",
            f"kubelet pre-start: {why}; nothing to do",
            level="debug" if repeated else "notice",
            fields={"GPUGUARD_RECONCILER": CHECKPOINT},
        )
        return self.finish(SKIPPED, why, 0)
