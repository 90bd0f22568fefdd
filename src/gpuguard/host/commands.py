"""Every external command gpuguard runs goes through run() or run_async(): one place for
timeouts, a fixed environment and no shell. (Operator hooks are the one exception:
they get their own environment and JSON on stdin, see engine/hooks.py.)"""

from __future__ import annotations

import asyncio
import subprocess
from typing import Sequence

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
