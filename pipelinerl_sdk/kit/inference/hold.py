"""A client's hold on generation (vLLM's ``POST /pause?mode=keep`` ... ``POST /resume``), over the
engine's own pause, which the engine's updates share.

The engine's pause (``paused``: the context an update holds generation with, between two engine
steps) is taken for as long as the client holds: requests in flight stay, frozen; new ones wait.
An update made meanwhile (through any door) runs inside that hold: its own pause enters at once,
it tags later steps with its version, and generation stays held after it. Resuming waits for
such an update's pause to end. Outside a hold, pauses pass straight to the engine's, one at a
time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

__all__ = ["EnginePause", "GenerationHold"]

#: An engine's pause: a context that holds generation between two engine steps.
EnginePause = Callable[[], AbstractAsyncContextManager[Any]]


class _Holding:
    """One client hold: its task (the engine's pause, taken until ``release`` is set)."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.task: asyncio.Task[None] | None = None


class GenerationHold:
    """The client's hold and the updates' pauses over one engine pause primitive ``paused``.
    Use from one event loop."""

    def __init__(self, paused: EnginePause) -> None:
        self._engine_paused = paused
        self._lock = asyncio.Lock()
        self._current: _Holding | None = None
        self._inside = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def held(self) -> bool:
        """Whether a client holds generation now (False once its release began)."""
        h = self._current
        return h is not None and h.entered.is_set() and not h.release.is_set()

    def around(self, paused: EnginePause) -> EnginePause:
        """An update's pause ``paused`` (the engine's, as the update's steps hold it), made to
        share the hold: inside a hold it enters at once (generation is held already); else it is
        ``paused``, serialised with holds."""
        return lambda: self._paused(paused)

    @asynccontextmanager
    async def _paused(self, paused: EnginePause) -> AsyncIterator[Any]:
        if self.held:
            self._inside += 1
            self._idle.clear()
            try:
                yield None
            finally:
                self._inside -= 1
                if self._inside == 0:
                    self._idle.set()
            return
        async with self._lock, paused() as handle:
            yield handle

    async def hold(self) -> None:
        """Hold generation; returns once held (at once if held already). Raises what the
        engine's pause raised."""
        h = self._current
        if h is None:
            h = self._current = _Holding()
            h.task = asyncio.create_task(self._run(h))
        assert h.task is not None
        waiting = asyncio.create_task(h.entered.wait())
        try:
            await asyncio.wait({waiting, h.task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
        if not h.entered.is_set():
            if self._current is h:
                self._current = None
            await h.task  # raises why the pause failed
            raise RuntimeError("the hold ended before generation was held")

    async def _run(self, h: _Holding) -> None:
        async with self._lock, self._engine_paused():
            h.entered.set()
            await h.release.wait()
            await self._idle.wait()  # an update inside the hold ends first

    async def release(self) -> None:
        """Let generation go on (nothing to do if not held); returns once it runs again."""
        h, self._current = self._current, None
        if h is None:
            return
        h.release.set()
        assert h.task is not None
        await h.task
