"""Helpers every inference check shares: an event loop per check, the standard prompt, greedy
requests, the comparison with the mirror, and the suite's publisher."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from pipelinerl_sdk.conformance.doors import VLLMDoorLink
from pipelinerl_sdk.conformance.mirror import Mirror, compare
from pipelinerl_sdk.conformance.targets import ServerUnderTest
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.protocol import ChatCompletionResponse
from pipelinerl_sdk.weights.publisher import ServerLink, WeightPublisher

T = TypeVar("T")
PROMPT = [{"role": "user", "content": "What is 12+7? Answer with digits."}]


def arun(fn: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await fn()

    return asyncio.run(main())


async def greedy(client: InferenceClient, *, prompt_logprobs: bool, max_tokens: int = 12) -> ChatCompletionResponse:
    body: dict[str, Any] = {
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "return_token_ids": True,
    }
    if prompt_logprobs:
        body["prompt_logprobs"] = True
    return await client.chat(body)


def check_against_mirror(resp: ChatCompletionResponse, mirror: Mirror, *, prompt: bool) -> None:
    """The server's logprobs of its own tokens equal the mirror's (tolerance by dtype)."""
    choice = resp.choices[0]
    assert resp.prompt_token_ids, "return_token_ids: prompt_token_ids missing"
    assert choice.token_ids is not None, "return_token_ids: choices[].token_ids missing"
    assert choice.logprobs is not None, "logprobs requested but missing"
    seq = resp.prompt_token_ids + choice.token_ids
    ref = mirror.logprobs(seq)
    n_prompt = len(resp.prompt_token_ids)
    ok, msg = compare([t.logprob for t in choice.logprobs.content], ref[n_prompt - 1 :], mirror.dtype)
    assert ok, f"completion logprobs differ from the weights the server should hold: {msg}"
    if prompt:
        assert resp.prompt_logprobs is not None and len(resp.prompt_logprobs) == n_prompt
        assert resp.prompt_logprobs[0] is None
        ok, msg = compare(
            [x for x in resp.prompt_token_logprobs()[1:] if x is not None], ref[: n_prompt - 1], mirror.dtype
        )
        assert ok, f"prompt logprobs differ from the weights the server should hold: {msg}"


async def connect(
    sut: ServerUnderTest, client: InferenceClient, *, door: str = "sdk", **kwargs: Any
) -> WeightPublisher:
    """The suite's trainer, joined to ``sut``'s group through ``door`` (``sdk``: the SDK's
    routes; ``vllm_rl``: vLLM's RL API, :mod:`pipelinerl_sdk.conformance.doors`)."""
    links: list[ServerLink]
    if door == "sdk":
        links = [client]
    elif door == "vllm_rl":
        links = [VLLMDoorLink(sut, client, await client.info())]
    else:
        raise ValueError(f"door: 'sdk' or 'vllm_rl', got {door!r}")
    publisher = WeightPublisher(links, bucket_bytes=kwargs.pop("bucket_bytes", 64 << 10), **kwargs)
    await publisher.connect()
    return publisher


async def open_connections(client: InferenceClient, k: int) -> None:
    """Leave ``k`` open keep-alive connections in ``client``'s pool: ``k`` one-token chats at once."""
    await asyncio.gather(*(client.chat({"messages": PROMPT, "max_tokens": 1}) for _ in range(k)))


def openai_headers(sut: ServerUnderTest) -> dict[str, str]:
    """What a plain HTTP client sends to the server's OpenAI routes (its API key, if any)."""
    return {"Authorization": f"Bearer {sut.api_key}"} if sut.api_key else {}


#: Attempts an inconclusive in-flight check makes at the most tokens the context allows, after
#: doubling up to it: on a loaded machine a run can stall for seconds while requests decode.
TRIES_AT_ROOM = 3


def retry_budgets(first: int, room: int) -> Iterator[int]:
    """The token budgets an in-flight check tries in turn until one is conclusive: ``first``,
    then twice the last, up to ``room``, then ``room`` again, :data:`TRIES_AT_ROOM` times in all."""
    budget, at_room = min(first, room), 0
    while at_room < TRIES_AT_ROOM:
        at_room += budget >= room
        yield budget
        budget = min(room, 2 * budget)


class Timeline:
    """Named moments of one check in seconds from its start: what an inconclusive check reports,
    so a run on a loaded machine says where its time went."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self.marks: list[tuple[str, float]] = []

    def mark(self, what: str) -> float:
        t = time.perf_counter() - self._t0
        self.marks.append((what, t))
        return t

    def __str__(self) -> str:
        return ", ".join(f"{what} {t:.2f} s" for what, t in self.marks)
