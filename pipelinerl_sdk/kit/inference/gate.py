"""The step boundary of a Python-loop engine: where an in-flight weight update gets in.

An engine whose generation loop runs on a thread of its own (one forward per step over the
running batch) gives every step the version of the weights it runs with, and lets an update in
only *between* steps. :class:`StepGate` is that mechanism, shared by the loop thread and the
event loop:

- loop side, holding the gate's condition at each step boundary: :meth:`StepGate.park` (True:
  park, ``cond.wait()`` and ask again; False: run the next step, tagged :attr:`StepGate.version`);
  :attr:`StepGate.requested` lets a long step (prefills) stop early for a pending pause;
- event-loop side: ``async with gate.paused()`` waits until the loop is parked (no forward
  running) and holds it; inside, swap the weights and :meth:`StepGate.set_version`; on exit the
  loop resumes. Requests in flight are kept (their KV from the old weights), so later tokens carry
  the new version: per-token versions come from this.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from dataclasses import dataclass


@dataclass(slots=True)
class PauseHandle:
    """Yielded by :meth:`StepGate.paused`; ``held_s`` is set on exit: seconds the loop stayed
    parked (from the step boundary it parked at to the release)."""

    held_s: float = 0.0


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class StepGate:
    """Hold/release an engine loop at step boundaries, and the weight version of each step.

    ``cond`` is the condition the loop thread waits on for work (the gate notifies it when a
    pause is requested or released); ``loop_alive`` says whether the loop thread runs (a pause of
    a loop that does not run holds at once). Concurrent pauses from other tasks are serialised;
    a pause nested in the task that holds one enters at once. :attr:`holds` counts the holds."""

    def __init__(self, cond: threading.Condition, loop_alive: Callable[[], bool], *, version: int = 0) -> None:
        self._cond = cond
        self._loop_alive = loop_alive
        self._version = version
        self._requested = False
        self._held = False
        self._parked_at: float | None = None
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None
        self._lock = asyncio.Lock()
        self._owner: asyncio.Task[object] | None = None
        self.holds = 0

    # --- loop thread (callers hold ``cond``) ----------------------------------------------------

    @property
    def requested(self) -> bool:
        """A pause is pending or held: stop starting new work, reach the boundary."""
        return self._requested

    @property
    def version(self) -> int:
        """The weight version of the step about to run (read it at the step's start)."""
        return self._version

    def park(self) -> bool:
        """At a step boundary: True while a pause is requested (the loop then waits on ``cond``
        and calls again), False when the next step may run."""
        if self._requested:
            if self._parked_at is None:
                self._parked_at = time.monotonic()
                self.release_waiter()
            return True
        self._parked_at = None
        return False

    def release_waiter(self) -> None:
        """Wake the coroutine waiting in :meth:`paused`, if any (also when the loop ends)."""
        if self._waiter is not None:
            loop, fut = self._waiter
            self._waiter = None
            with suppress(RuntimeError):  # event loop closed: nobody is waiting any more
                loop.call_soon_threadsafe(_wake, fut)

    # --- event loop -----------------------------------------------------------------------------

    @property
    def held_now(self) -> bool:
        """Whether a pause holds the loop; callers hold ``cond`` (or take a racy look)."""
        return self._held

    def set_version(self, v: int) -> None:
        """Tag later steps with ``v``; only inside :meth:`paused` (else RuntimeError)."""
        with self._cond:
            if not self._held:
                raise RuntimeError("set_version is only allowed while the engine is paused")
            self._version = v

    def paused(self) -> AbstractAsyncContextManager[PauseHandle]:
        """Hold the loop: entering waits until it is parked between steps; exiting resumes."""
        return self._paused()

    @asynccontextmanager
    async def _paused(self) -> AsyncIterator[PauseHandle]:
        handle = PauseHandle()
        task = asyncio.current_task()
        if task is not None and task is self._owner:  # nested in the holder: already parked
            entered = time.monotonic()
            try:
                yield handle
            finally:
                handle.held_s = time.monotonic() - entered
            return
        async with self._lock:
            loop = asyncio.get_running_loop()
            parked: asyncio.Future[None] = loop.create_future()
            with self._cond:
                self._requested = True
                if not self._loop_alive() or self._parked_at is not None:
                    self._parked_at = self._parked_at if self._parked_at is not None else time.monotonic()
                    parked.set_result(None)
                else:
                    self._waiter = (loop, parked)
                self._cond.notify_all()
            try:
                await parked
                with self._cond:
                    self._held = True
                    self.holds += 1
                self._owner = task
                yield handle
            finally:
                self._owner = None
                with self._cond:
                    parked_at = self._parked_at
                    self._held = False
                    self._requested = False
                    self._waiter = None
                    self._parked_at = None
                    self._cond.notify_all()
                if parked_at is not None:
                    handle.held_s = time.monotonic() - parked_at
