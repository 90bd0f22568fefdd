"""asyncio primitives that a constructor may make before the event loop runs.

On Python 3.9 an ``asyncio.Event`` or ``Semaphore`` binds, when it is made, to the loop
current then, and fails where there is none (after an ``asyncio.run()``); from 3.10 on
it binds to the loop that first uses it. gpuguard's objects are built in main before
``asyncio.run`` starts the loop, so these make the real primitive at first use."""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Optional, Type


class Event:
    """``asyncio.Event``'s set/clear/is_set/wait, the event made at first wait."""

    def __init__(self) -> None:
        self._event: Optional[asyncio.Event] = None
        self._flag = False

    def _made(self) -> asyncio.Event:
        if self._event is None:
            self._event = asyncio.Event()
            if self._flag:
                self._event.set()
        return self._event

    def is_set(self) -> bool:
        return self._flag if self._event is None else self._event.is_set()

    def set(self) -> None:
        if self._event is None:
            self._flag = True
        else:
            self._event.set()

    def clear(self) -> None:
        if self._event is None:
            self._flag = False
        else:
            self._event.clear()

    async def wait(self) -> bool:
        return await self._made().wait()


class Semaphore:
    """``async with``-only ``asyncio.Semaphore``, made at first use."""

    def __init__(self, value: int) -> None:
        self._value = value
        self._sem: Optional[asyncio.Semaphore] = None

    def _made(self) -> asyncio.Semaphore:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self._value)
        return self._sem

    async def __aenter__(self) -> None:
        await self._made().acquire()

    async def __aexit__(
        self,
        typ: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self._made().release()
