"""``pipelinerl bench generate``: what streaming and ``/v1/completions`` cost against plain chat,
on one server, under the same load, in one run.

Three modes serve the same work: ``concurrency`` workers, each sending one request at a time
of the same prompt tokens (worker ``i``'s chat prompt; completions get its token ids, so nothing
differs but the route) for exactly ``max_tokens`` tokens (``ignore_eos``):

- ``chat``: non-streamed ``/v1/chat/completions``;
- ``stream``: the same, ``stream=true``, every chunk read and parsed;
- ``completions``: ``/v1/completions`` with the prompt's token ids.

Modes alternate in rounds of ``seconds`` each (A B C, then C B A, ...) so a drift of the machine
(another process, thermal) weighs on all three alike; a mode's tokens/s is its tokens over its
time summed over its rounds. Reported: each mode's tokens/s and the ratios ``stream / chat`` and
``completions / chat`` (the targets: at least 0.95).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pipelinerl_sdk.bench.model import bench_model
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.launch import ServerProcess

MODES = ("chat", "stream", "completions")

Call = Callable[[int], Awaitable[int]]


def _calls(client: InferenceClient, prompts: list[list[int]], max_tokens: int) -> dict[str, Call]:
    """Per mode: send worker ``w``'s request, return its completion tokens."""

    def chat_body(w: int) -> dict[str, Any]:
        return {
            "messages": [{"role": "user", "content": f"Worker {w}: tell me a long story about the sea."}],
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
        }

    async def chat(w: int) -> int:
        return (await client.chat(chat_body(w))).usage.completion_tokens

    async def stream(w: int) -> int:
        n = 0
        async for chunk in client.chat_stream(chat_body(w)):
            n += sum(len(c.weight_versions) for c in chunk.choices)
        return n

    async def completions(w: int) -> int:
        body = {"prompt": prompts[w], "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}
        return (await client.completion(body)).usage.completion_tokens

    return {"chat": chat, "stream": stream, "completions": completions}


async def _round(call: Call, concurrency: int, seconds: float) -> tuple[int, float, int]:
    """(tokens, seconds, requests): every worker loops ``call`` until ``seconds`` have passed;
    the round ends when the last request in flight finishes (all its tokens count)."""
    end = time.perf_counter() + seconds
    tokens, requests = 0, 0

    async def worker(w: int) -> None:
        nonlocal tokens, requests
        while time.perf_counter() < end:
            got = await call(w)  # not `tokens += await ...`: that reads tokens before the await
            tokens += got
            requests += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return tokens, time.perf_counter() - started, requests


async def _bench(
    server: ServerProcess, *, seconds: float, rounds: int, concurrency: int, max_tokens: int
) -> dict[str, Any]:
    async with InferenceClient(server.url, control_token=server.control_token, api_key=server.api_key) as client:
        prompts = []
        for w in range(concurrency):  # each worker's chat prompt as token ids, for completions
            body = {
                "messages": [{"role": "user", "content": f"Worker {w}: tell me a long story about the sea."}],
                "max_tokens": 1,
                "return_token_ids": True,
            }
            ids = (await client.chat(body)).prompt_token_ids
            assert ids is not None
            prompts.append(ids)
        calls = _calls(client, prompts, max_tokens)
        for mode in MODES:  # warm-up: one request each
            await calls[mode](0)
        totals = {m: [0, 0.0, 0] for m in MODES}
        for r in range(rounds):
            for mode in MODES if r % 2 == 0 else tuple(reversed(MODES)):
                tokens, took, requests = await _round(calls[mode], concurrency, seconds)
                t = totals[mode]
                t[0], t[1], t[2] = t[0] + tokens, t[1] + took, t[2] + requests
    rate = {m: totals[m][0] / totals[m][1] for m in MODES}
    return {
        "tokens_per_s": {m: round(v, 2) for m, v in rate.items()},
        "requests": {m: totals[m][2] for m in MODES},
        "stream_over_chat": round(rate["stream"] / rate["chat"], 4),
        "completions_over_chat": round(rate["completions"] / rate["chat"], 4),
    }


def run_generate_bench(
    *,
    backend: str = "reference",
    model: str | None = None,
    seconds: float = 8.0,
    rounds: int = 4,
    concurrency: int = 16,
    max_tokens: int = 64,
    server_threads: int | None = 1,
) -> dict[str, Any]:
    """Run the benchmark (see the module doc) on a server of ``backend`` and return its figures.
    ``model`` None builds the ``bench`` preset into a temporary directory."""
    if seconds <= 0 or rounds < 1 or concurrency < 1 or max_tokens < 1:
        raise ValueError("seconds must be > 0; rounds, concurrency and max_tokens >= 1")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pipelinerl-bench-") as tmp:
        path, label = bench_model(tmp, model)
        options: dict[str, object] = {"threads": server_threads} if backend == "reference" and server_threads else {}
        with ServerProcess(backend, path, options=options, api_key="bench-generate-key") as server:
            figures = asyncio.run(
                _bench(server, seconds=seconds, rounds=rounds, concurrency=concurrency, max_tokens=max_tokens)
            )
    return {
        "bench": "generate",
        "backend": backend,
        "model": label,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "seconds_per_round": seconds,
        **figures,
        "wall_s": round(time.perf_counter() - started, 1),
    }
