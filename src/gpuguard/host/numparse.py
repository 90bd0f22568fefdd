"""The one parser for decimal integers read from files.

Python's int() takes Unicode digits ("٣" is 3), underscores and spaces, and refuses
numbers past 4,300 digits with a ValueError whose text no operator should see. Every
number gpuguard reads from a file (checkpoint checksum and NUMA keys, device ID
suffixes, inventory indices and minors, /proc/devices majors, cgroup.procs PIDs,
configuration integers and time spans) goes through parse_decimal(): ASCII digits
only, a length bound checked before any conversion, then a range check.
"""

from __future__ import annotations

from typing import Optional

# The bounded, escaped echoes live in host/echo.py; re-exported for the parsers' callers.
from gpuguard.host.echo import MAX_ECHO as MAX_ECHO
from gpuguard.host.echo import clip as clip
from gpuguard.host.echo import cut as cut


def _digits(text: str) -> bool:
    return bool(text) and text.isascii() and text.isdigit()


def parse_decimal(
    text: str, *, lo: int = 0, hi: int = 2**64 - 1, signed: bool = False
) -> Optional[int]:
    """`text` as an integer in [lo, hi], or None when it is not one.

    ASCII digits only (with `signed`, one leading + or -); no spaces, underscores or
    other digits. The length is bounded by `hi`/`lo` before int() runs, so no input can
    reach Python's conversion limit."""
    sign = text[:1] if signed and text[:1] in ("+", "-") else ""
    body = text[len(sign) :]
    if not _digits(body):
        return None
    bound = max(len(str(abs(lo))), len(str(abs(hi))))
    stripped = body.lstrip("0") or "0"
    if len(stripped) > bound:
        return None
    value = -int(stripped) if sign == "-" else int(stripped)
    return value if lo <= value <= hi else None
