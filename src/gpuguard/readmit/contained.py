"""Errors the bridge keeps inside its loop: it never exits while kubelet holds its
streams (their end would drop the real plugin, readmit/ended.py).

A configuration that cannot be read again (re-read every REFRESH seconds and at each
kubelet start) leaves the last good one in use, journaled once per distinct error as
``readmit-config-error`` and written to the state file; ``readmit-config-ok`` says when
it reads again. Any other exception of the loop is journaled once per distinct text
(kind ``error``) and the loop goes on; the loop's own wait bounds how often it comes.
"""

from __future__ import annotations

from gpuguard.errors import GpuguardError
from gpuguard.host.echo import cut
from gpuguard.journal.log import EventLog

K_CONFIG_ERROR = "readmit-config-error"
K_CONFIG_OK = "readmit-config-ok"
MAX_TOLD = 64  # distinct loop errors remembered (then told again)


def one_line(e: BaseException) -> str:
    """An exception as one bounded, escaped line: a GpuguardError's message (it names
    the path and the next step), else its type and first line."""
    if isinstance(e, GpuguardError):
        return cut(e.message, 380)
    first = str(e).splitlines()[0] if str(e) else ""
    return cut(f"{type(e).__name__}: {first}", 380)


class Contained:
    """What the loop has said, so that each distinct error is journaled once."""

    def __init__(self, elog: EventLog) -> None:
        self.elog = elog
        self.config_error = ""  # the error now: "" while the configuration reads
        self.told: set[str] = set()

    def config_failed(self, e: BaseException) -> str:
        """The configuration could not be read: the last good one stays (returned: the
        line, for the state file)."""
        line = one_line(e)
        if line != self.config_error:
            self.config_error = line
            self.elog.event(
                K_CONFIG_ERROR,
                f"gpuguard's configuration cannot be read again; the re-admission bridge "
                f"keeps the last good one: {line}",
                level="error",
            )
        return line

    def config_read(self) -> bool:
        """The configuration read again: True when an error is thereby over."""
        if not self.config_error:
            return False
        self.config_error = ""
        self.elog.event(
            K_CONFIG_OK, "gpuguard's configuration reads again: the re-admission bridge uses it"
        )
        return True

    def loop_failed(self, what: str, e: BaseException) -> None:
        line = f"{what}: {one_line(e)}"
        if line in self.told:
            return
        if len(self.told) >= MAX_TOLD:
            self.told.clear()
        self.told.add(line)
        self.elog.event(
            "error",
            f"the re-admission bridge kept running after an error ({line}); "
            "report it with `journalctl -u gpuguard-readmit`",
            level="error",
        )
