"""``pipelinerl bench generate``'s accounting: a round counts every token of every request its
workers finished, whatever their interleaving (a ``tokens += await call()`` reads the total
before the await and loses the other workers' tokens: the first version did)."""

from __future__ import annotations

import asyncio

from pipelinerl_sdk.bench.generate import _round


def test_a_round_counts_every_token_of_every_worker() -> None:
    async def call(worker: int) -> int:
        await asyncio.sleep(0.001 * (worker + 1))  # workers interleave
        return worker + 1

    tokens, seconds, requests = asyncio.run(_round(call, concurrency=4, seconds=0.05))
    assert requests >= 4 and seconds >= 0.05
    # each worker w finished k_w requests of w + 1 tokens; the total is their sum, never less
    assert tokens >= requests  # every request gives at least one token
    per_worker: dict[int, int] = {}

    async def counted(worker: int) -> int:
        per_worker[worker] = per_worker.get(worker, 0) + 1
        return await call(worker)

    tokens, _, requests = asyncio.run(_round(counted, concurrency=4, seconds=0.05))
    assert requests == sum(per_worker.values())
    assert tokens == sum((w + 1) * k for w, k in per_worker.items())
