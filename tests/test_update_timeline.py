"""Issue 18's measurements, on a real reference server: the per-phase timeline of one update on
both sides (trainer stamps in ``PublishResult.stamps``, server stamps as ``at_*`` timings of the
``done`` event) and the engine's apply floor (``POST /bench/apply_floor``); and the bench's
figures computed from them. No timing is asserted, only order, signs and what is served."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from test_server_integration import publish

from pipelinerl_sdk.bench.timeline import ORIGIN, median_timeline, timeline, to_ms
from pipelinerl_sdk.bench.weight_update import TARGETS, _meets, floor_ratios
from pipelinerl_sdk.contracts import TokenBatch
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.protocol import SERVER_PHASES, UpdateEvent
from pipelinerl_sdk.reference.trainer import ReferenceTrainer
from pipelinerl_sdk.rl.objectives import CompletionNLL
from pipelinerl_sdk.weights.publisher import TRAINER_PHASES, WeightPublisher

PROMPT = [{"role": "user", "content": "12+7="}]


def _in_order(tl: dict[str, float], side: str, phases: Sequence[str]) -> list[str]:
    """The phases of ``side`` present in ``tl``, checked to come in ``phases``' order."""
    present = [p for p in phases if f"{side}.{p}" in tl]
    times = [tl[f"{side}.{p}"] for p in present]
    assert times == sorted(times), (side, dict(zip(present, times, strict=True)))
    return present


def server_order(mode: str) -> list[str]:
    """:data:`SERVER_PHASES` in the order an update of ``mode`` goes through them: ``direct``
    holds generation once the first bucket is in, before the last."""
    if mode == "staged":
        return list(SERVER_PHASES)
    held = ["pause_request", "pause_start"]
    rest = [p for p in SERVER_PHASES if p not in held]
    at = rest.index("last_bucket")
    return rest[:at] + held + rest[at:]


async def _scored(client: InferenceClient) -> list[float]:
    resp = await client.chat(
        {"messages": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": True, "prompt_logprobs": True}
    )
    content = resp.choices[0].logprobs.content if resp.choices[0].logprobs else []
    return [x for x in resp.prompt_token_logprobs() if x is not None] + [t.logprob for t in content]


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_one_updates_phases_are_ordered_on_both_sides(server: Any, trainer: ReferenceTrainer, mode: str) -> None:
    async def body() -> None:
        async with InferenceClient(server.url, control_token=server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=64 << 10, mode=mode)  # type: ignore[arg-type]
            await pub.connect()
            await publish(pub, trainer, (await client.info()).version + 1)
            assert pub.last is not None
            event = next(iter(pub.last.events.values()))
            tl = timeline(pub.last.stamps, event)
            assert tl[ORIGIN] == 0 and all(v >= 0 for v in tl.values()), tl
            assert list(tl.values()) == sorted(tl.values())
            assert _in_order(tl, "trainer", TRAINER_PHASES) == list(TRAINER_PHASES)
            assert _in_order(tl, "server", server_order(mode)) == server_order(mode)  # the reference stamps all
            # causality across the two sides (one clock: same machine)
            for before, after in [
                ("trainer.request_sent", "server.request"),
                ("server.accepted", "trainer.accepted"),
                ("trainer.decision_posted", "server.decision"),
                ("trainer.first_bucket_sent", "server.first_bucket"),
                ("server.done", "trainer.done"),
            ]:
                assert tl[before] <= tl[after], (before, after, tl)
            if mode == "staged":  # paused for the apply only
                assert tl["server.last_bucket"] <= tl["server.pause_start"]
            else:  # paused once bytes flow
                assert tl["server.first_bucket"] <= tl["server.pause_start"]
            assert tl["server.pause_end"] - tl["server.pause_start"] >= event.timings["apply_s"]
            await pub.close()

    asyncio.run(body())


@pytest.mark.integration
def test_apply_floor_is_timed_and_changes_nothing_served(server: Any, trainer: ReferenceTrainer) -> None:
    """The reference server's floor is its own apply (the DoubleBuffer swap) of the weights it
    serves: positive seconds, every logprob bit-identical after it, and the next update still
    serves exactly the trainer's weights."""

    async def body() -> None:
        async with InferenceClient(server.url, control_token=server.control_token) as client:
            before, version = await _scored(client), (await client.info()).version
            got = await client.apply_floor(3)
            assert len(got.seconds) == 3 and all(s > 0 for s in got.seconds)
            assert "swap" in got.detail
            assert await _scored(client) == before and (await client.info()).version == version
            pub = WeightPublisher([client], bucket_bytes=64 << 10)
            await pub.connect()
            ids = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(3)).tolist()
            trainer.backward(TokenBatch(input_ids=ids, completion_start=[6, 6]), CompletionNLL(2))
            trainer.step()
            await publish(pub, trainer, version + 1)
            resp = await client.chat(
                {"messages": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": True, "return_token_ids": True}
            )
            prompt, choice = resp.prompt_token_ids or [], resp.choices[0]
            lp = trainer.forward(
                TokenBatch(input_ids=[prompt + (choice.token_ids or [])], completion_start=[len(prompt)])
            )
            served = torch.tensor([t.logprob for t in (choice.logprobs.content if choice.logprobs else [])])
            assert (served - lp[0][len(prompt) - 1 :]).abs().max() < 1e-5
            assert (await client.apply_floor(1)).seconds[0] > 0  # after a swap, again
            await pub.close()

    asyncio.run(body())


def test_timeline_is_offsets_from_the_trainers_request_sorted_by_time() -> None:
    event = UpdateEvent(
        event="done", version=2, timings={"pause_s": 0.5, "at_request": 10.25, "at_done": 11.0, "at_apply_end": 10.75}
    )
    tl = timeline({"request_sent": 10.0, "done": 11.5, "accepted": 10.5}, event)
    assert tl == {
        "trainer.request_sent": 0.0,
        "server.request": 0.25,
        "trainer.accepted": 0.5,
        "server.apply_end": 0.75,
        "server.done": 1.0,
        "trainer.done": 1.5,
    }
    assert to_ms(tl)["server.request"] == 250.0
    assert timeline({"done": 1.0}, event) == {}  # no origin, no timeline
    med = median_timeline([{"a": 0.0, "b": 1.0, "c": 3.0}, {"a": 0.0, "b": 2.0}, {"a": 0.0, "b": 0.5}])
    assert med == {"a": 0.0, "b": 1.0}  # c is not in every timeline


def test_floor_ratios_and_targets_come_from_the_figures() -> None:
    got = floor_ratios(wall_s=0.3, pause_s=0.11, flat_broadcast_s=0.05, apply_floor_s=0.1)
    assert got["engine_apply_floor_s"] == 0.1
    assert got["update_over_floor"] == pytest.approx(0.3 / 0.15)
    assert got["pause_over_apply_floor"] == pytest.approx(1.1)
    assert floor_ratios(0.3, 0.1, 0.05, None) == {
        "engine_apply_floor_s": None,
        "update_over_floor": None,
        "pause_over_apply_floor": None,
    }
    figures = {
        "pause_over_memcpy": 1.0,
        "update_over_flat_broadcast": 1.0,
        "tokens_per_s_ratio_updating": 0.96,
        **got,
    }
    met = _meets("staged", figures)
    assert met["update_over_floor"] is (got["update_over_floor"] <= TARGETS["update_over_floor"]) is False
    assert met["pause_over_apply_floor"] is True and met["tokens_per_s_ratio_updating"] is True
    assert met["all"] is False
    assert "pause_over_apply_floor" not in _meets("direct", figures)  # staged only
    unmeasured = _meets("staged", {**figures, **floor_ratios(0.3, 0.1, 0.05, None)})
    assert "update_over_floor" not in unmeasured and unmeasured["all"] is True
