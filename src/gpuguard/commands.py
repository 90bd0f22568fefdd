"""Every external command gpuguard runs goes through run(): one place for timeouts,
a fixed environment and no shell."""

from __future__ import annotations

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
