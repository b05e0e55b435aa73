"""Load with updates: 64 concurrent request streams against a real server of the backend under
test (``--reliability-backend``, the suite's shared server) while a real trainer trains and
publishes 20 updates. Every response must be a 200 with its full budget, and every token's
version tag must be true: replayed against the trainer's weights of that version
(``conformance.versions.judge_tags``: kept-KV or recomputed, float32 tolerance). Prints the
issue's figures: requests, 5xx, lost requests, longest ``/health`` stall, tags checked.

The server is shared with earlier tests, which may have published weights of their own: the
trainer first publishes its weights (unrecorded tokens could otherwise be judged against the
wrong ones), then the streams start."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
import torch
from test_server_integration import publish, run, train_step

from pipelinerl_sdk.conformance.common import PROMPT
from pipelinerl_sdk.conformance.mirror import Mirror
from pipelinerl_sdk.conformance.versions import judge_tags
from pipelinerl_sdk.http.client import KEEPALIVE_EXPIRY_S, InferenceClient
from pipelinerl_sdk.launch import ServerProcess
from pipelinerl_sdk.protocol import ChatCompletionResponse
from pipelinerl_sdk.reference.trainer import ReferenceTrainer
from pipelinerl_sdk.weights.publisher import WeightPublisher

pytestmark = pytest.mark.integration
STREAMS, UPDATES, BUDGET = 64, 20, 16


def snapshot(trainer: ReferenceTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.hf_module().named_parameters()}


def test_64_streams_under_20_updates_lose_nothing_and_every_tag_is_true(
    server: ServerProcess, backend: str, trainer: ReferenceTrainer, tiny_model: Path
) -> None:
    loaded = server  # room for 64 sequences at once
    states: dict[int, dict[str, torch.Tensor]] = {}
    responses: list[httpx.Response] = []
    stalls: list[float] = []

    async def body() -> None:
        limits = httpx.Limits(  # idle connections dropped before the server's keep-alive closes them
            max_connections=STREAMS + 8, max_keepalive_connections=STREAMS + 8, keepalive_expiry=KEEPALIVE_EXPIRY_S
        )
        async with (
            InferenceClient(loaded.url, control_token=loaded.control_token) as client,
            httpx.AsyncClient(base_url=loaded.url, timeout=600, limits=limits) as http,
        ):
            pub = WeightPublisher([client], bucket_bytes=64 << 10)
            await pub.connect()
            start = (await client.info()).version + 1
            await publish(pub, trainer, start)  # the server serves this trainer's weights from here
            states[start] = snapshot(trainer)
            stop = asyncio.Event()

            async def stream(i: int) -> None:
                k = 0
                while not stop.is_set():
                    req = {
                        "messages": PROMPT, "max_tokens": BUDGET, "ignore_eos": True, "temperature": 1.0,
                        "seed": 1000 * i + k, "logprobs": True, "return_token_ids": True,
                    }  # fmt: skip
                    responses.append(await http.post("/v1/chat/completions", json=req))
                    k += 1

            async def watch() -> None:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    assert (await http.get("/health")).status_code == 200
                    stalls.append(time.perf_counter() - t0)
                    await asyncio.sleep(0.05)

            tasks = [asyncio.ensure_future(stream(i)) for i in range(STREAMS)] + [asyncio.ensure_future(watch())]
            for u in range(1, UPDATES + 1):
                await asyncio.to_thread(train_step, trainer, 100 + u)
                states[start + u] = snapshot(trainer)
                await publish(pub, trainer, start + u)
                assert (await client.info()).version == start + u
            stop.set()
            await asyncio.gather(*tasks)
            await pub.close()

    run(body)
    lost = [r for r in responses if r.status_code != 200]
    served = [ChatCompletionResponse.model_validate(r.json()) for r in responses if r.status_code == 200]
    mirror = Mirror(tiny_model, "float32")
    failures: list[str] = []
    crossed = tags = 0
    for i, resp in enumerate(served):
        choice = resp.choices[0]
        assert resp.prompt_token_ids and len(choice.weight_versions) == BUDGET
        crossed += len(set(choice.weight_versions)) > 1
        tags += len(choice.weight_versions)
        ok, msg = judge_tags(mirror, resp.prompt_token_ids, choice, states, f"response {i}")
        if not ok:
            failures.append(msg)
    print(
        f"\n[{backend}] load: {len(responses)} requests over {STREAMS} streams, {UPDATES} updates; 5xx seen: "
        f"{sum(r.status_code >= 500 for r in responses)}; lost: {len(lost)}; {crossed} crossed an update; "
        f"{tags} version tags replayed, {len(failures)} false; longest /health stall {max(stalls) * 1000:.0f} ms"
    )
    assert not lost, [r.text[:200] for r in lost[:5]]
    assert not failures, " | ".join(failures[:5])
    assert crossed > 0, "inconclusive: no request was running when an update went live"
    assert len({v for r in served for v in r.choices[0].weight_versions}) > UPDATES // 2
