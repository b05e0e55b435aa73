"""merge_samples: closing the merged stream cancels each sample once and lets its cleanup finish,
even when the close comes from a cancelled anyio scope (as the HTTP server's EventStream does when
a client leaves): a cleanup cut short leaves the engine's connection open and its request running
(seen on SGLang: n=8 streams left unread, the next weight update waited on them for ever)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import anyio
import pytest

from pipelinerl_sdk.kit.inference.stream import TokenStep, merge_samples

#: A sample's cleanup awaits this long (an engine connection's close, an abort request).
CLEANUP_S = 0.05


async def _sample(i: int, cleaned: list[int]) -> AsyncIterator[TokenStep]:
    try:
        while True:
            await asyncio.sleep(0.001)
            yield TokenStep([i], [0.0], [0], (), None)
    finally:
        await asyncio.sleep(CLEANUP_S)  # cut short if the sample is cancelled again meanwhile
        cleaned.append(i)


@pytest.mark.parametrize("n", [2, 8])
def test_a_cancelled_scope_closing_the_merge_lets_every_sample_clean_up(n: int) -> None:
    cleaned: list[int] = []

    async def main() -> None:
        merged = merge_samples([_sample(i, cleaned) for i in range(n)])
        read = 0
        try:
            async with anyio.create_task_group() as group:

                async def consume() -> None:
                    nonlocal read
                    async for _ in merged:
                        read += 1

                async def leave() -> None:  # the client disconnects
                    while read < 20:
                        await asyncio.sleep(0.001)
                    group.cancel_scope.cancel()

                group.start_soon(consume)
                group.start_soon(leave)
        finally:
            with anyio.CancelScope(shield=True):
                await merged.aclose()
        await asyncio.sleep(2 * CLEANUP_S)  # a sample left to finish on its own has by now

    asyncio.run(main())
    assert sorted(cleaned) == list(range(n))


def test_an_error_in_one_sample_closes_the_others_after_their_cleanup() -> None:
    cleaned: list[int] = []

    async def failing() -> AsyncIterator[TokenStep]:
        await asyncio.sleep(0.01)
        raise RuntimeError("engine lost")
        yield  # pragma: no cover

    async def main() -> None:
        with pytest.raises(RuntimeError, match="engine lost"):
            async for _ in merge_samples([_sample(0, cleaned), failing(), _sample(2, cleaned)]):
                pass

    asyncio.run(main())
    assert sorted(cleaned) == [0, 2]
