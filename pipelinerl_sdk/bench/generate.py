"""``pipelinerl bench generate``: what streaming and ``/v1/completions`` cost against plain chat,
on one server, under the same load, in one run; and, where the backend's engine can serve its
own generation routes beside the SDK's (its bench anchor's
:class:`~pipelinerl_sdk.bench.anchor.NativeGeneration`: vLLM's), what the SDK's routes cost
against the engine's own on the same engine.

Modes serve the same work: ``concurrency`` workers, each sending one request at a time of the
same prompt tokens (worker ``i``'s chat prompt; completions get its token ids, so nothing
differs but the route) for exactly ``max_tokens`` tokens (``ignore_eos``):

- ``chat``: non-streamed ``/v1/chat/completions``;
- ``stream``: the same, ``stream=true`` (``stream_options.include_usage``), every event read
  and parsed;
- ``completions``: ``/v1/completions`` with the prompt's token ids;
- with the engine's own routes, ``native-chat``, ``native-stream``, ``native-completions``: the
  same requests to them.

Every mode's client does the same work (one HTTP request, every body or event parsed as JSON,
tokens counted from ``usage``), so the ratios compare the servers' routes, not client code.
Modes alternate in rounds of ``seconds`` each (A B C ..., then ... C B A) so a drift of the
machine (another process, thermal) weighs on all alike; a mode's tokens/s is its tokens over
its time summed over its rounds. Reported: each mode's tokens/s, ``stream / chat`` and
``completions / chat`` (targets: at least 0.95), and with the engine's own routes each of ours
over the engine's (``chat_over_native``, ...; target: at least 0.95).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from pipelinerl_sdk.bench.anchor import NativeGeneration, load_anchor
from pipelinerl_sdk.bench.model import bench_model
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.launch import ServerProcess

MODES = ("chat", "stream", "completions")

Call = Callable[[int], Awaitable[int]]

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"


def _calls(
    http: httpx.AsyncClient, prompts: list[list[int]], max_tokens: int, chat_path: str, completions_path: str
) -> dict[str, Call]:
    """Per mode (``chat``, ``stream``, ``completions``) on the given routes: send worker
    ``w``'s request, return its completion tokens (from ``usage``)."""

    def chat_body(w: int) -> dict[str, Any]:
        return {
            "messages": [{"role": "user", "content": f"Worker {w}: tell me a long story about the sea."}],
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
        }

    async def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = await http.post(path, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"POST {path}: {r.status_code} {r.text[:300]}")
        out: dict[str, Any] = json.loads(r.content)
        return out

    async def chat(w: int) -> int:
        return int((await post(chat_path, chat_body(w)))["usage"]["completion_tokens"])

    async def stream(w: int) -> int:
        body = {**chat_body(w), "stream": True, "stream_options": {"include_usage": True}}
        n = -1
        async with http.stream("POST", chat_path, json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"POST {chat_path} (stream): {r.status_code} {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        n = int(event["usage"]["completion_tokens"])
        if n < 0:
            raise RuntimeError(f"POST {chat_path} (stream): no usage event")
        return n

    async def completions(w: int) -> int:
        body = {"prompt": prompts[w], "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}
        return int((await post(completions_path, body))["usage"]["completion_tokens"])

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
    server: ServerProcess,
    *,
    seconds: float,
    rounds: int,
    concurrency: int,
    max_tokens: int,
    native: NativeGeneration | None = None,
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
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=600, limits=limits) as http:
        calls = _calls(http, prompts, max_tokens, CHAT_PATH, COMPLETIONS_PATH)
        if native is not None:
            theirs = _calls(http, prompts, max_tokens, native.chat, native.completions)
            calls.update({f"native-{m}": c for m, c in theirs.items()})
        modes = tuple(calls)
        for mode in modes:  # warm-up: one request each
            await calls[mode](0)
        totals = {m: [0, 0.0, 0] for m in modes}
        for r in range(rounds):
            for mode in modes if r % 2 == 0 else tuple(reversed(modes)):
                tokens, took, requests = await _round(calls[mode], concurrency, seconds)
                t = totals[mode]
                t[0], t[1], t[2] = t[0] + tokens, t[1] + took, t[2] + requests
    rate = {m: totals[m][0] / totals[m][1] for m in modes}
    figures: dict[str, Any] = {
        "tokens_per_s": {m: round(v, 2) for m, v in rate.items()},
        "requests": {m: totals[m][2] for m in modes},
        "stream_over_chat": round(rate["stream"] / rate["chat"], 4),
        "completions_over_chat": round(rate["completions"] / rate["chat"], 4),
    }
    if native is not None:
        for m in MODES:
            figures[f"{m}_over_native"] = round(rate[m] / rate[f"native-{m}"], 4)
        figures["native_routes"] = {"chat": native.chat, "completions": native.completions}
    return figures


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
        anchor = load_anchor(backend)
        native = getattr(anchor.flow, "generation", None) if anchor is not None else None
        if not isinstance(native, NativeGeneration):
            native = None
        else:
            options.update(native.options)
        with ServerProcess(backend, path, options=options, api_key="bench-generate-key") as server:
            figures = asyncio.run(
                _bench(
                    server,
                    seconds=seconds,
                    rounds=rounds,
                    concurrency=concurrency,
                    max_tokens=max_tokens,
                    native=native,
                )
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
