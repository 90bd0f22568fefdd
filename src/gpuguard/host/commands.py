"""Every external command gpuguard runs goes through run() or run_async(): one place for
timeouts, a fixed environment and no shell; run_as_nobody() for a file gpuguard only
needs to ask (kubelet's --version), without root's privileges. (Operator hooks are the
one exception: they get their own environment and JSON on stdin, see engine/hooks.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from typing import Callable, Sequence

SAFE_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


class CommandError(Exception):
    pass


def run(argv: Sequence[str], *, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=SAFE_ENV,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise CommandError(f"{argv[0]}: no answer in {timeout:.0f}s") from None
    except OSError as e:
        raise CommandError(f"{argv[0]}: {e.strerror}") from None


async def run_async(argv: Sequence[str], *, timeout: float = 30.0) -> tuple[int, str]:
    """(exit status, the last 500 characters of stdout+stderr); 124 on a timeout (the
    command is killed and reaped), 127 when it cannot be started. Never raises."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=SAFE_ENV,
        )
    except OSError as e:
        return 127, f"{argv[0]}: {e.strerror}"
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return 124, f"{' '.join(argv)}: no answer in {timeout:.0f}s"
    return proc.returncode or 0, out.decode(errors="replace").strip()[-500:]


NOBODY = 65534  # the overflow user and group: owns nothing, may do nothing
PR_SET_NO_NEW_PRIVS = 38


def _no_new_privs_hook() -> Callable[[], None]:
    """What the child runs between fork and exec: prctl(PR_SET_NO_NEW_PRIVS), looked
    up here, in the parent (a lookup in the child could wait on the loader's lock)."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def hook() -> None:
        if prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")

    return hook


def run_as_nobody(
    fd: int, args: Sequence[str], *, timeout: float, max_bytes: int
) -> tuple[int, str]:
    """Execute the file open at `fd` (the very file the caller checked: exec'd as
    /proc/self/fd/N) with `args`, as user and group nobody, no supplementary group,
    no new privileges (setuid bits and file capabilities then give nothing), an empty
    environment, "/" as its directory, its own session: (exit status or -9 when killed,
    the first `max_bytes` of stdout+stderr). Killed, its whole session, at the timeout
    or once `max_bytes` are read. CommandError: it could not be started or did not
    finish within `timeout` seconds."""
    import os
    import select
    import signal
    import time

    exe = f"/proc/self/fd/{fd}"
    try:
        proc = subprocess.Popen(
            [exe, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={},
            cwd="/",
            user=NOBODY,
            group=NOBODY,
            extra_groups=[],
            pass_fds=(fd,),
            start_new_session=True,
            preexec_fn=_no_new_privs_hook(),
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise CommandError(
            f"cannot be run as nobody: {getattr(e, 'strerror', None) or e}"
        ) from None
    assert proc.stdout is not None
    out = bytearray()
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while len(out) < max_bytes:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready, _, _ = select.select([proc.stdout], [], [], left)
            if not ready:
                continue
            chunk = os.read(proc.stdout.fileno(), max_bytes - len(out))
            if not chunk:
                break
            out += chunk
        if not timed_out:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = len(out) < max_bytes
    finally:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
    if timed_out:
        raise CommandError(f"no answer in {timeout:g}s")
    return proc.returncode, out.decode(errors="replace")
