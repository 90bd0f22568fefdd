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
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from gpuguard.actuate.statefile import write_state
from gpuguard.errors import BadInputError
from gpuguard.host import safeio
from gpuguard.host.echo import cut
from gpuguard.host.paths import Root
from gpuguard.host.statefile import Obj, SchemaError, StateFile, load

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


OUTCOMES = (REPAIRED, HEALTHY, SKIPPED, NOT_REPAIRED, FAILED)
_HEX = re.compile(r"[0-9a-f]{0,64}")
RECORD_MAX = 64 * 1024  # a request or result is a few hundred bytes


@dataclass(frozen=True)
class HookResult:
    token: str  # the caller's token from REQUEST, "" when nobody asked
    outcome: str
    detail: str
    before_sha256: str  # of the checkpoint when the hook started ("" when absent)
    after_sha256: str  # when it ended
    time: float
    exit_code: int


def _hex(o: Obj, key: str) -> str:
    v = o.text(key, max_len=64)
    if not _HEX.fullmatch(v):
        raise SchemaError(f"{key}: not a hex digest or token")
    return v


def _parse_result(o: Obj) -> HookResult:
    outcome = o.text("outcome", max_len=32)
    if outcome not in OUTCOMES:
        raise SchemaError(f"outcome: not one of {', '.join(OUTCOMES)}")
    return HookResult(
        token=_hex(o, "token"),
        outcome=outcome,
        detail=o.text("detail", max_len=8192),
        before_sha256=_hex(o, "before_sha256"),
        after_sha256=_hex(o, "after_sha256"),
        time=o.real("time"),
        exit_code=o.integer("exit_code", hi=255),
    )


def _render_result(r: HookResult) -> dict[str, Any]:
    return {
        "token": r.token,
        "outcome": r.outcome,
        "detail": r.detail[:8192],
        "before_sha256": r.before_sha256,
        "after_sha256": r.after_sha256,
        "time": r.time,
        "exit_code": r.exit_code,
    }


@dataclass(frozen=True)
class HookRequest:
    token: str
    time: float


REQUEST_SPEC: StateFile[HookRequest] = StateFile(
    path=REQUEST,
    what="kubelet hook request",
    version=1,
    parse=lambda o: HookRequest(_hex(o, "token"), o.real("time")),
    render=lambda r: {"token": r.token, "time": r.time},
    max_bytes=RECORD_MAX,
    mode=0o600,
    dir_mode=0o755,
)
RESULT_SPEC: StateFile[HookResult] = StateFile(
    path=RESULT,
    what="kubelet hook result",
    version=1,
    parse=_parse_result,
    render=_render_result,
    max_bytes=RECORD_MAX,
    mode=0o644,
    dir_mode=0o755,
)


def new_token() -> str:
    import secrets  # only the caller that restarts kubelet needs one

    return secrets.token_hex(16)


def file_sha256(path: Path) -> str:
    """sha256 of a regular file's bytes (safeio: a FIFO, /dev/zero or a link there is
    refused at once, never read); "" when it is absent, unsafe or unreadable."""
    try:
        raw, _st = safeio.read_bytes(path, what="checkpoint", max_bytes=safeio.CHECKPOINT_MAX)
    except BadInputError:
        return ""
    return hashlib.sha256(raw).hexdigest()


def write_request(root: Root, token: str) -> None:
    write_state(root.path(REQUEST), REQUEST_SPEC, HookRequest(token, time.time()))


def clear_request(root: Root) -> None:
    root.path(REQUEST).unlink(missing_ok=True)


def read_request_token(root: Root) -> tuple[str, str]:
    """The token a caller left for this run; "" without one (a plain kubelet start) or
    when the record is unusable (a FIFO, /dev/zero, garbage: never waited on), with
    why in the second place ("" when it was fine or absent)."""
    got = load(root.path(REQUEST), REQUEST_SPEC)
    if got.value is None:
        return "", "" if got.absent else got.why
    return got.value.token, ""


def write_result(root: Root, result: HookResult) -> None:
    write_state(root.path(RESULT), RESULT_SPEC, result)


def read_result(root: Root) -> Optional[HookResult]:
    return load(root.path(RESULT), RESULT_SPEC).value


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
            f"kubelet's pre-start hook {result.outcome} (exit {result.exit_code}): "
            f"{cut(result.detail, 300)}",
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


DEADLINE = 10.0  # seconds: kubelet's start waits no longer for its pre-start hook
DEADLINE_EXIT = 5  # exitcodes.KUBELET: the hook gave up, kubelet starts as it is
BACKSTOP = 5  # seconds after the deadline: the kernel ends what Python could not


class HookRun:
    """One run of `gpuguard check --kubelet-stopped`: the result it leaves in RESULT,
    with the token of the caller that restarted kubelet (if one did).

    `arm()` gives the run an overall deadline: kubelet's start must proceed within
    seconds whatever is on disk or however NVML behaves (the drop-in's `-` ignores a
    failure, not a hang). A timer thread writes the result (`failed`, with why) and
    ends the process at the deadline; a SIGALRM left at its default action (the kernel
    terminates the process) is the backstop should Python itself be stuck. Every write
    of the checkpoint is atomic, so ending at any point leaves the old file or the new
    one."""

    def __init__(self, root: Root) -> None:
        self.root = root
        self.token, why = read_request_token(root)
        # state files it could not use, each said once in the journal by the run
        self.unusable: list[str] = [why] if why else []
        self.checkpoint: Optional[Path] = None
        self.before = ""
        self._lock = threading.Lock()
        self._finished = False
        self._timer: Optional[threading.Timer] = None
        self._alarm = False

    def arm(self, seconds: float, on_expiry: Optional[Any] = None) -> None:
        """Start the deadline; `on_expiry(message, exit code)` replaces the process's
        end (tests)."""
        import signal

        self._timer = threading.Timer(seconds, self._expired, (seconds, on_expiry))
        self._timer.daemon = True
        self._timer.start()
        if on_expiry is None and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL:
            signal.alarm(int(seconds) + BACKSTOP)
            self._alarm = True

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._alarm:
            import signal

            signal.alarm(0)
            self._alarm = False

    def _expired(self, seconds: float, on_expiry: Optional[Any]) -> None:
        import os
        import sys

        why = (
            f"stopped at its {seconds:g} s deadline (NVML or the checkpoint took too long); "
            "kubelet starts with the checkpoint as it is — run `gpuguard check` once it is up"
        )
        with self._lock:
            if self._finished:
                return
            self._finished = True
        result = HookResult(self.token, FAILED, why, self.before, "", time.time(), DEADLINE_EXIT)
        with contextlib.suppress(OSError, BadInputError):
            write_result(self.root, result)
        message = f"gpuguard: kubelet pre-start hook {why}"
        if on_expiry is not None:
            on_expiry(message, DEADLINE_EXIT)
            return
        with contextlib.suppress(OSError):
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
        os._exit(DEADLINE_EXIT)

    def start(self, checkpoint: Path) -> None:
        self.checkpoint = checkpoint
        self.before = file_sha256(checkpoint)

    def finish(self, outcome: str, detail: str, exit_code: int) -> int:
        with self._lock:
            if self._finished:
                return exit_code
            self._finished = True
        self.disarm()
        after = file_sha256(self.checkpoint) if self.checkpoint is not None else ""
        result = HookResult(self.token, outcome, detail, self.before, after, time.time(), exit_code)
        # A read-only /run, an unsafe directory: the caller then finds no result and
        # reports exactly that.
        with contextlib.suppress(OSError, BadInputError):
            write_result(self.root, result)
        return exit_code

    def skipped(self, log: EventLog, why: str) -> int:
        """Nothing it can or should do: exit 0 (kubelet's status shows no failing
        ExecStartPre=), said in the journal once per state rather than at every start."""
        from gpuguard.steps.registry import CHECKPOINT  # the step table: not on a healthy path

        last = read_result(self.root)
        repeated = last is not None and last.outcome == SKIPPED and last.detail == why
        log.event(
            "kubelet-hook-skipped",
            f"kubelet pre-start: {why}; nothing to do",
            level="debug" if repeated else "notice",
            fields={"GPUGUARD_RECONCILER": CHECKPOINT},
        )
        return self.finish(SKIPPED, why, 0)
