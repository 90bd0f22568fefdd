"""Operator hooks: executables in /etc/gpuguard/hooks.d/ run after a pass that found or
changed something (to page someone, drain the node, push a metric...).

gpuguard runs as root, so a hook is root code: `plan_hooks` only admits files that
nobody but root (or the user gpuguard runs as, in a simulation) could have written,
and says why it refused the others so the caller can log it. `run_hooks` runs them one
at a time in lexical order (run-parts semantics, so "10-page" can rely on "05-collect"
having run), never through a shell, with the pass as JSON on stdin, a bounded capture
of their output, and a timeout that kills the hook's whole process group. A failing
hook is reported in its HookResult and never raised: it must not break the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import stat
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Mapping, Sequence, Tuple

from gpuguard.engine.executor import Mode
from gpuguard.host.paths import HOOKS_DIR, Root
from gpuguard.model import Finding, Outcome

OUTPUT_LIMIT = 64 * 1024  # bytes of each of stdout/stderr kept (the tail)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# What systemd hands the daemon for itself. A hook that inherited NOTIFY_SOCKET could
# send READY=1/WATCHDOG=1 in gpuguard's name (or trip NotifyAccess= warnings), and a
# hook that inherited LISTEN_FDS would think it was socket-activated.
_DAEMON_ONLY = frozenset(
    {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"}
)
# After a kill, pipes close when the group's last member dies; one that escaped with
# setsid() could hold them open, so reading what is left gets only this long.
_DRAIN_AFTER_KILL = 1.0


@dataclass(frozen=True)
class HookResult:
    """What one hook did. `returncode` is None when it could not be started (see
    `error`) and negative (-signal) when it was killed."""

    path: Path
    returncode: int | None
    timed_out: bool
    stdout_tail: str
    stderr_tail: str
    duration: float  # seconds
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def describe(self) -> str:
        """One line for the journal."""
        took = f"{self.duration:.2f}s"
        if self.error:
            return f"hook {self.path} could not run: {self.error}"
        if self.timed_out:
            what = f"hook {self.path} was killed after {took} (HookTimeout)"
        elif self.returncode == 0:
            return f"hook {self.path} succeeded in {took}"
        elif self.returncode is not None and self.returncode < 0:
            what = f"hook {self.path} was killed by signal {-self.returncode} after {took}"
        else:
            what = f"hook {self.path} failed with exit status {self.returncode} after {took}"
        last = (
            self.stderr_tail.strip().splitlines()[-1:] or self.stdout_tail.strip().splitlines()[-1:]
        )
        return f"{what}: {last[0]}" if last else what


# ----------------------------------------------------------------------------- planning


def _ignored_name(name: str) -> str | None:
    if name.startswith("."):
        return "hidden file (names starting with '.' are not run)"
    if name.endswith("~") or ".dpkg-" in name or ".rpm" in name or ".ucf-" in name:
        return "backup or package manager leftover (*~, *.dpkg-*, *.rpm*, *.ucf-*) is not run"
    return None


def _unsafe(st: os.stat_result) -> str | None:
    """Why a file or directory with this stat could have been written by someone else."""
    if st.st_uid not in (0, os.geteuid()):
        return f"owned by uid {st.st_uid}, not root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _refusal(path: Path) -> str | None:
    ignored = _ignored_name(path.name)
    if ignored:
        return ignored
    try:
        st = path.stat()  # follows a symlink: its target is what would run
    except OSError as e:
        return f"cannot stat: {e.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    unsafe = _unsafe(st)
    if unsafe:
        return f"{unsafe}; chown root:root and chmod go-w it to enable it"
    if path.is_symlink():
        # The link is safe only if the target's directory is: else its owner could
        # swap the target for another file.
        target_dir = path.resolve().parent
        try:
            unsafe = _unsafe(target_dir.stat())
        except OSError as e:
            return f"cannot stat the link target's directory {target_dir}: {e.strerror}"
        if unsafe:
            return f"the link target's directory {target_dir} is {unsafe}"
    if not st.st_mode & stat.S_IXUSR:
        # The usual way to disable a hook, so the hint is how to enable it.
        return "not executable; chmod +x it to enable it"
    return None


def plan_hooks(root: Root, directory: str = HOOKS_DIR) -> Tuple[List[Path], List[Tuple[Path, str]]]:
    """The hooks to run, in lexical order, and the files refused with the reason why.

    A missing directory means no hooks. Owners other than root are accepted only when
    they are the user gpuguard runs as (a simulation as non-root); in production that
    is root as well.
    """
    hooks_dir = root.path(directory)
    try:
        names = sorted(os.listdir(hooks_dir))
        dir_problem = _unsafe(hooks_dir.stat())
    except FileNotFoundError:
        return [], []
    except OSError as e:
        return [], [(hooks_dir, f"cannot list the hooks directory: {e.strerror}")]
    runnable: List[Path] = []
    refused: List[Tuple[Path, str]] = []
    for name in names:
        path = hooks_dir / name
        if dir_problem:
            # Whoever can write the directory can replace any file in it.
            refused.append((path, f"the hooks directory {hooks_dir} is {dir_problem}"))
            continue
        reason = _refusal(path)
        if reason:
            refused.append((path, reason))
        else:
            runnable.append(path)
    return runnable, refused


# ------------------------------------------------------------------------------ running


def hook_environment(
    env_base: Mapping[str, str],
    *,
    event: str,
    findings: Sequence[Finding],
    outcomes: Sequence[Outcome],
    mode: Mode,
) -> Dict[str, str]:
    """`env_base` minus the daemon's own systemd variables, plus GPUGUARD_*."""
    env = {k: v for k, v in env_base.items() if k not in _DAEMON_ONLY}
    env.setdefault("PATH", DEFAULT_PATH)
    kinds = sorted({f.kind for f in findings} | {o.action.kind for o in outcomes})
    env.update(
        GPUGUARD_EVENT=event,
        GPUGUARD_FINDINGS=str(len(findings)),
        GPUGUARD_ACTIONS=str(len(outcomes)),
        GPUGUARD_KINDS=" ".join(kinds),
        GPUGUARD_DRY_RUN="1" if mode == "observe" else "0",
    )
    return env


class _Tail:
    """The last `limit` bytes written, so a chatty hook cannot fill the daemon's memory."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        excess = len(self.data) - self.limit
        if excess > 0:
            del self.data[:excess]
            self.dropped += excess

    def text(self) -> str:
        body = self.data.decode("utf-8", "replace")
        return f"[{self.dropped} bytes dropped]\n{body}" if self.dropped else body


async def _drain(stream: asyncio.StreamReader | None, tail: _Tail) -> None:
    if stream is None:
        return
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return
        tail.add(chunk)


async def _feed(stdin: asyncio.StreamWriter | None, payload: bytes) -> None:
    if stdin is None:
        return
    # A hook need not read its stdin: a closed pipe is not an error. No await in a
    # `finally` here: on a timeout this coroutine is cancelled, and waiting for a pipe
    # that a stuck hook never drains would keep wait_for() from ever returning.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        stdin.write(payload)
        await stdin.drain()
    await _close_stdin(stdin)


async def _close_stdin(stdin: asyncio.StreamWriter) -> None:
    stdin.close()
    # wait_closed() also collects the pipe's close status: asyncio keeps a
    # BrokenPipeError there and, left unretrieved, logs "Future exception was never
    # retrieved" when it is garbage collected.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        await stdin.wait_closed()


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the whole group is gone already
        os.killpg(pgid, signal.SIGKILL)


async def _kill_and_reap(
    proc: asyncio.subprocess.Process, readers: Sequence[asyncio.Future[None]]
) -> None:
    _kill_group(proc.pid)
    # SIGKILL cannot be caught, so the wait is short; the bound only guards against a
    # process stuck in the kernel (D state), which must not hang the daemon.
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(proc.wait(), _DRAIN_AFTER_KILL)
        if proc.stdin is not None:  # the timeout may have struck while feeding stdin
            await asyncio.wait_for(_close_stdin(proc.stdin), _DRAIN_AFTER_KILL)
    _, pending = await asyncio.wait(readers, timeout=_DRAIN_AFTER_KILL)
    for task in pending:
        task.cancel()


async def _run_one(
    path: Path, payload: bytes, env: Mapping[str, str], timeout: float
) -> HookResult:
    start = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            str(path),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=dict(env),
            cwd="/",
            # Its own session and process group, so a timeout can kill what the hook
            # started too, and a signal sent to gpuguard's group does not reach it.
            start_new_session=True,
        )
    except OSError as e:  # ENOEXEC (no #! line), EACCES, removed since planning
        return HookResult(path, None, False, "", "", time.monotonic() - start, f"{e.strerror or e}")
    out, err = _Tail(OUTPUT_LIMIT), _Tail(OUTPUT_LIMIT)
    # Separate tasks so a hook that writes a lot before reading stdin cannot deadlock
    # against our write of the payload.
    readers = [
        asyncio.ensure_future(_drain(proc.stdout, out)),
        asyncio.ensure_future(_drain(proc.stderr, err)),
    ]

    async def finish() -> None:
        await _feed(proc.stdin, payload)
        # asyncio.wait, not gather: a timeout must not cancel the readers, which still
        # collect what the hook wrote until it is killed.
        await asyncio.wait(readers)
        await proc.wait()

    timed_out = False
    try:
        await asyncio.wait_for(finish(), timeout)
    except asyncio.TimeoutError:
        timed_out = True
        await _kill_and_reap(proc, readers)
    except asyncio.CancelledError:
        # gpuguard is stopping: leave no hook behind, and reap it so its transport is
        # closed before the loop is.
        await _kill_and_reap(proc, readers)
        raise
    return HookResult(
        path=path,
        returncode=proc.returncode,
        timed_out=timed_out,
        stdout_tail=out.text(),
        stderr_tail=err.text(),
        duration=time.monotonic() - start,
    )


async def run_hooks(
    hooks: Sequence[Path],
    *,
    event: str,
    findings: Sequence[Finding],
    outcomes: Sequence[Outcome],
    timeout: float,
    env_base: Mapping[str, str],
    mode: Mode = "repair",
    host: str | None = None,
) -> List[HookResult]:
    """Run `hooks` one after another and return what each did; never raises for a hook.

    stdin gets one JSON document: {"event", "findings", "actions", "time", "host",
    "dry_run"}; "actions" are the pass's outcomes (action plus status), "dry_run" true
    in the observe `mode` (engine/executor.py). `env_base` is
    the environment to start from (gpuguard's own, usually); see hook_environment().
    """
    if not hooks:
        return []
    document = {
        "event": event,
        "findings": [f.to_json() for f in findings],
        "actions": [o.to_json() for o in outcomes],
        "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        "host": host if host is not None else socket.gethostname(),
        "dry_run": mode == "observe",
    }
    payload = json.dumps(document, sort_keys=True).encode() + b"\n"
    env = hook_environment(env_base, event=event, findings=findings, outcomes=outcomes, mode=mode)
    return [await _run_one(hook, payload, env, timeout) for hook in hooks]
