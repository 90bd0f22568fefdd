"""The one way a value from outside gpuguard appears in a message: cut and escaped.

File contents, configuration values, command output and the environment are echoed in
errors, findings, the journal and reports. Whatever they hold, the message stays one
readable line of bounded length: control characters (newlines, ESC, NUL, C1), line and
paragraph separators, format characters (a right-to-left override) and lone
surrogates are written as escapes (``\\n``, ``\\x1b``, ``\\u202e``), and the text is cut
at `limit` characters with an ellipsis (every character str.isprintable() refuses is
escaped, a no-break space too). Only the head of a long value is looked at, so
echoing a megabyte costs what echoing 80 characters does.
"""

from __future__ import annotations

MAX_ECHO = 80  # characters of a value echoed in a message
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(c: str) -> str:
    named = _NAMED.get(c)
    if named is not None:
        return named
    if c.isprintable():
        return c
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def escape(text: str) -> str:
    """`text` with every character that could break a line or a terminal escaped."""
    return "".join(_escape_char(c) for c in text)


def cut(text: str, limit: int = MAX_ECHO) -> str:
    """`text` itself (no quotes), escaped and cut to `limit` characters with an ellipsis."""
    if len(text) <= limit and text.isprintable():  # C speed: almost every message
        return text
    head = escape(text[: limit + 1])
    if len(head) <= limit and len(text) <= limit:
        return head
    return head[: max(0, limit - 1)] + "…"


def clip(value: object, limit: int = MAX_ECHO) -> str:
    """A value quoted as repr() quotes it (strings in quotes, so an empty or blank
    value shows), escaped and cut to `limit` characters: an error message must stay
    one readable line whatever the input held."""
    if isinstance(value, str):
        body = cut(value, max(1, limit - 2))
        return f"'{body}'"
    if isinstance(value, (bytes, bytearray)):
        return cut(repr(bytes(value[: limit + 1])), limit)
    if isinstance(value, int) and not isinstance(value, bool):
        # str() of a 5,000-digit int raises past Python's conversion limit: its length
        # is what an operator needs
        bits = value.bit_length()
        if bits > 256:
            return f"<a {bits}-bit integer>"
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        return f"<{type(value).__name__}>"
    return cut(text, limit)
