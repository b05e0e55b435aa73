"""vLLM's async-RL pause on the SDK's servers: ``/pause?mode=keep``, an update through vLLM's
routes while paused, ``/resume`` (the pattern of vLLM 0.32's ``docs/training/async_rl``). Mixed
into :class:`~pipelinerl_sdk.conformance.inference.InferenceContractTests`."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from pipelinerl_sdk.conformance.common import PROMPT, arun, connect, open_connections
from pipelinerl_sdk.conformance.mirror import Mirror
from pipelinerl_sdk.conformance.targets import ServerUnderTest
from pipelinerl_sdk.http.client import InferenceClient

#: Streams the pause check runs; the tokens each must have before the pause, and the most each
#: asks for; how long it waits for tokens in flight to arrive, then how long it holds.
PAUSE_STREAMS, BEFORE_PAUSE, PAUSE_BUDGET, SETTLE_S, HOLD_S = 4, 2, 160, 0.3, 0.6


class PauseChecks:
    """Mixed into :class:`~pipelinerl_sdk.conformance.inference.InferenceContractTests`."""

    @pytest.mark.requires("pause_generation", "vllm_rl_api", "streaming")
    def test_a_keep_pause_holds_generation_and_an_update_inside_it(
        self, server_under_test: ServerUnderTest, mirror: Mirror
    ) -> None:
        """Streams running, ``POST /pause?mode=keep``: ``{"status": "paused"}``, ``/is_paused``
        true, and no token comes while held (after the tokens already in flight arrived); an
        update through vLLM's routes lands inside the pause; ``POST /resume``: every stream
        finishes with all its tokens (none dropped), those before the pause tagged with the old
        version and every one after the resume with the new. ``mode=abort`` (vLLM's default,
        which drops the requests) is a 400 naming ``mode``, and pauses nothing."""
        control = {"Authorization": f"Bearer {server_under_test.control_token}"}

        async def body() -> None:
            async with (
                server_under_test.client() as client,
                httpx.AsyncClient(base_url=server_under_test.url, timeout=120, headers=control) as http,
            ):
                publisher = await connect(server_under_test, client, door="vllm_rl")
                info = await client.info()
                start = info.version
                mirror.perturb(seed=start + 1)
                refused = await http.post("/pause", params={"mode": "abort"})
                assert refused.status_code == 400 and refused.json()["error"].get("param") == "mode", (
                    f"POST /pause?mode=abort: {refused.status_code} {refused.text[:200]}, expected a 400 naming mode"
                )
                assert (await http.get("/is_paused")).json() == {"is_paused": False}
                probe = await client.chat({"messages": PROMPT, "max_tokens": 1, "return_token_ids": True})
                room = (info.max_model_len or 1 << 20) - len(probe.prompt_token_ids or []) - 8
                budget = min(PAUSE_BUDGET, room)
                await open_connections(client, PAUSE_STREAMS)
                seen: list[list[int]] = [[] for _ in range(PAUSE_STREAMS)]
                ends: list[str | None] = [None] * PAUSE_STREAMS
                ready = asyncio.Event()
                streams = [
                    asyncio.create_task(_stream(client, i, budget, seen, ends, ready)) for i in range(PAUSE_STREAMS)
                ]
                await asyncio.wait_for(ready.wait(), 120)
                paused = await http.post("/pause", params={"mode": "keep"})
                assert paused.status_code == 200 and paused.json() == {"status": "paused"}, paused.text[:200]
                assert (await http.get("/is_paused")).json() == {"is_paused": True}
                await asyncio.sleep(SETTLE_S)  # tokens computed before the pause may still be on their way
                held = [len(s) for s in seen]
                await asyncio.sleep(HOLD_S)
                moved = [len(s) - h for s, h in zip(seen, held, strict=True)]
                assert not any(moved), (
                    f"tokens arrived while the server said it was paused: {moved} per stream in {HOLD_S} s "
                    f"(had {held}, budget {budget})"
                )
                t0 = time.perf_counter()
                await mirror.publish(publisher, start + 1, info.params)
                update_s = time.perf_counter() - t0
                assert (await client.info()).version == start + 1
                moved = [len(s) - h for s, h in zip(seen, held, strict=True)]
                assert not any(moved), f"tokens arrived during the update inside the pause: {moved} per stream"
                assert (await http.get("/is_paused")).json() == {"is_paused": True}, "the update ended the pause"
                resumed = await http.post("/resume")
                assert resumed.status_code == 200 and resumed.json() == {"status": "resumed"}, resumed.text[:200]
                assert (await http.get("/is_paused")).json() == {"is_paused": False}
                await asyncio.wait_for(asyncio.gather(*streams), 300)
                await publisher.close()
            for i, (tags, end, before) in enumerate(zip(seen, ends, held, strict=True)):
                assert end == "length" and len(tags) == budget, (
                    f"stream {i} ended {end!r} after {len(tags)} of {budget} tokens: a paused request must be kept"
                )
                want = [start] * before + [start + 1] * (budget - before)
                assert tags == want, (
                    f"stream {i}: versions {_runs(tags)}, expected {_runs(want)}: the tokens before the pause "
                    f"old, every one after the resume new (update {update_s:.2f} s inside the pause)"
                )

        arun(body)


async def _stream(
    client: InferenceClient, i: int, budget: int, seen: list[list[int]], ends: list[str | None], ready: asyncio.Event
) -> None:
    """Stream ``i``: every token's version into ``seen[i]``, its finish reason into ``ends[i]``;
    ``ready`` set once every stream has :data:`BEFORE_PAUSE` tokens."""
    body = {"messages": PROMPT, "max_tokens": budget, "ignore_eos": True, "temperature": 1.0, "seed": i}
    async for chunk in client.chat_stream(body):
        for choice in chunk.choices:
            seen[i].extend(choice.weight_versions)
            if choice.finish_reason is not None:
                ends[i] = choice.finish_reason
        if all(len(s) >= BEFORE_PAUSE for s in seen):
            ready.set()


def _runs(tags: list[int]) -> str:
    """``[0, 0, 0, 1]`` as ``0 x3, 1 x1``."""
    out: list[str] = []
    for t in tags:
        if out and out[-1].startswith(f"{t} x"):
            out[-1] = f"{t} x{int(out[-1].split('x')[1]) + 1}"
        else:
            out.append(f"{t} x1")
    return ", ".join(out)
