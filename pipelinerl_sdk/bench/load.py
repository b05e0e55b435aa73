"""A light chat load generator: ``concurrency`` async workers, each looping one chat request at a
time through one :class:`~pipelinerl_sdk.http.client.InferenceClient` (httpx, one event loop).

Every finished request is recorded with its finish time (``loop.time()``) and completion tokens,
so throughput over any window is computed afterwards: :meth:`ChatLoad.window` counts only the
requests that *finish* inside it.

Workers start together, and a continuous-batching engine decodes them in lockstep: left alone they
would all finish at the same instants, and a window would count whole waves of ``concurrency``
requests (a granularity of one wave, 25% of an 8 s window here). So each worker's first request is
a short *phase* request (worker ``i`` asks for ``i * max_tokens // concurrency`` tokens): finishes
then spread evenly over a request's duration, whatever the engine's step time. Windows should
start after :meth:`ChatLoad.wait_phased`.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from pipelinerl_sdk.errors import ServerError
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.protocol import ChatCompletionRequest

#: Whether the wire model carries the ``ignore_eos`` extension (forces exactly ``max_tokens``).
SUPPORTS_IGNORE_EOS = "ignore_eos" in ChatCompletionRequest.model_fields


@dataclass(frozen=True, slots=True)
class Window:
    """Requests that finished in ``[start, end)``."""

    seconds: float
    requests: int
    tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class _Record:
    finished: list[tuple[float, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class ChatLoad:
    """Use as ``async with ChatLoad(client, concurrency=16) as load: ...``; on exit the workers
    stop taking new requests and the ones in flight finish (cancelled after ``drain_s``)."""

    def __init__(
        self,
        client: InferenceClient,
        *,
        concurrency: int,
        max_tokens: int = 32,
        temperature: float = 1.0,
        drain_s: float = 30.0,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.client = client
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.drain_s = drain_s
        self._record = _Record()
        self._stop = asyncio.Event()
        self._phased = 0
        self._all_phased = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def _body(self, worker: int, n: int) -> dict[str, Any]:
        max_tokens = self.max_tokens if n > 0 else max(1, worker * self.max_tokens // self.concurrency)
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": f"Worker {worker} asks question {n}: what is {n} + {worker}?"}],
            "max_tokens": max_tokens,
            "temperature": self.temperature,
        }
        if SUPPORTS_IGNORE_EOS:
            body["ignore_eos"] = True
        return body

    async def _worker(self, worker: int) -> None:
        loop = asyncio.get_running_loop()
        n = 0
        while not self._stop.is_set():
            try:
                resp = await self.client.chat(self._body(worker, n))
            except ServerError as e:
                self._record.errors.append(str(e))
                await asyncio.sleep(0.1)
                continue
            self._record.finished.append((loop.time(), resp.usage.completion_tokens))
            n += 1
            if n == 1:
                self._phased += 1
                if self._phased == self.concurrency:
                    self._all_phased.set()

    async def __aenter__(self) -> ChatLoad:
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.concurrency)]
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if t is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), self.drain_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def wait_phased(self, timeout_s: float = 60.0) -> None:
        """Wait until every worker finished its phase request (TimeoutError after ``timeout_s``)."""
        await asyncio.wait_for(self._all_phased.wait(), timeout_s)

    @property
    def completed(self) -> int:
        return len(self._record.finished)

    @property
    def errors(self) -> list[str]:
        return list(self._record.errors)

    def window(self, start: float, end: float) -> Window:
        """Totals of the requests that finished in ``[start, end)`` (``loop.time()`` clock)."""
        done = [tok for t, tok in self._record.finished if start <= t < end]
        return Window(end - start, len(done), sum(done))
