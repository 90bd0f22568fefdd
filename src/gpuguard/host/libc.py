"""The C library, looked up once per process: every call gpuguard makes into it
(inotify, bpf(2) through syscall(2), prctl, setns, capget/capset, mallopt and
malloc_trim) goes through this module.

`c_library()` is this process's C library (`CDLL(None)`: the symbols already loaded),
with errno kept for `ctypes.get_errno()`; one handle, since a CDLL per call costs more
than the calls themselves (devices/probe.py's bpf(2)). `function()` is one function of
it with its own argument and return types: a fresh function object, so that no caller's
types change another's.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Callable, Optional, Sequence


@functools.lru_cache(maxsize=1)
def c_library() -> ctypes.CDLL:
    """This process's C library (raises OSError where there is none to load)."""
    return ctypes.CDLL(None, use_errno=True)


def function(
    name: str,
    *,
    argtypes: Optional[Sequence[Any]] = None,
    restype: Any = ctypes.c_int,
) -> Optional[Callable[..., Any]]:
    """The C library's `name` with these types; None where the library has no such
    function (musl has no mallopt) or there is no C library to load."""
    try:
        fn = c_library()[name]
    except (OSError, AttributeError):
        return None
    if argtypes is not None:
        fn.argtypes = list(argtypes)
    fn.restype = restype
    return fn
