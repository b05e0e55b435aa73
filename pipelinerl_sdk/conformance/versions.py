"""Checks that every version tag is true: a token tagged v was computed by the weights of v."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest
import torch

from pipelinerl_sdk.conformance.common import PROMPT, Timeline, arun, connect, open_connections, retry_budgets
from pipelinerl_sdk.conformance.mirror import TOLERANCES, Mirror, compare
from pipelinerl_sdk.conformance.targets import ServerUnderTest
from pipelinerl_sdk.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChoiceLogprobs,
    ChunkChoice,
)

#: The trainer waits this long between the server's ``accepted`` and its broadcast (a trainer
#: that gathers slowly): generation goes on meanwhile (staged) and its tokens must keep the old tag.
RECEIVE_WINDOW_S = 0.5
#: Perturbation of each update (times each tensor's std): versions differ by far more than the
#: float32 tolerance on every token.
SCALE = 0.1
#: The longest completion the check asks for (the replay runs one forward per token).
MAX_BUDGET = 4096
#: Tokens replayed past the last version boundary of a completion.
TAIL = 24


def judge_tags(
    mirror: Mirror,
    prompt: list[int],
    choice: ChatChoice,
    states: dict[int, dict[str, torch.Tensor]],
    what: str,
) -> tuple[bool, str]:
    """(the tags are true, a message naming the first token that is not)."""
    assert choice.token_ids is not None and choice.logprobs is not None, f"{what}: token ids or logprobs missing"
    tags = list(choice.weight_versions)
    if tags != sorted(tags):
        return False, f"{what}: versions go back: {tags}"
    unknown = set(tags) - set(states)
    if unknown:
        return False, f"{what}: versions {sorted(unknown)} were never published (published {sorted(states)})"
    bounds = [j for j in range(1, len(tags)) if tags[j] != tags[j - 1]]
    end = min(len(tags), (bounds[-1] if bounds else 0) + TAIL)
    got = torch.tensor([t.logprob for t in choice.logprobs.content[:end]], dtype=torch.float64)
    kept, fresh = mirror.replay(prompt, choice.token_ids[:end], tags[:end], states)
    kept, fresh = kept.double(), fresh.double()
    best = torch.where((got - kept).abs() <= (got - fresh).abs(), kept, fresh)
    ok, msg = compare(got.tolist(), best, mirror.dtype)
    if ok:
        return True, ""
    j = int((got - best).abs().argmax())
    seq = prompt + choice.token_ids[: j + 1]
    others = []
    current = mirror.state()
    for v in sorted(states):
        mirror.load(states[v])
        others.append(f"weights {v} give {float(mirror.logprobs(seq)[-1]):.4f}")
    mirror.load(current)
    return False, (
        f"{what}: token {j} tagged version {tags[j]} has logprob {float(got[j]):.4f}; the weights of version "
        f"{tags[j]} give {float(kept[j]):.4f} (KV kept across updates) or {float(fresh[j]):.4f} (KV recomputed); "
        f"on the whole sequence ({', '.join(others)}); tags {_spans(tags)}: {msg}"
    )


async def room_left(sut: ServerUnderTest) -> int:
    """Completion tokens the server's context leaves after :data:`PROMPT` (capped at
    :data:`MAX_BUDGET`: the replay runs one forward per token)."""
    async with sut.client() as client:
        info = await client.info()
        probe = await client.chat({"messages": PROMPT, "max_tokens": 1, "return_token_ids": True})
        return min(MAX_BUDGET, (info.max_model_len or MAX_BUDGET) - len(probe.prompt_token_ids or []) - 16)


def _spans(tags: list[int]) -> str:
    out, start = [], 0
    for j in range(1, len(tags) + 1):
        if j == len(tags) or tags[j] != tags[start]:
            out.append(f"v{tags[start]} x{j - start}")
            start = j
    return ", ".join(out)


class VersionTagChecks:
    """Mixed into :class:`~pipelinerl_sdk.conformance.inference.InferenceContractTests`."""

    @pytest.mark.requires("in_flight_updates")
    def test_every_version_tag_is_true(self, server_under_test: ServerUnderTest, mirror: Mirror) -> None:
        """Completions running across two updates, and one sent while an update is being
        received, are replayed token by token against the mirror with the weights of each
        token's tag: every logprob must be what those weights give (tolerance by dtype), either
        on the KV cache as the engine computed it at the time (an engine that keeps its cache
        across updates; see :meth:`Mirror.replay`) or on a recomputed one. A token computed by
        other weights than its tag's (a tag set before the new weights are live, or after)
        fails. The request sent mid-receive is answered (awaited before the second update),
        its tags are the old or the new version, and true.

        No scheduler is assumed: the updates follow the requests at once, with no barrier
        request (a static batch would hold it behind them; a loaded engine's front may too). A
        completion the engine starts after an update begins on the newer version, and its tags
        are judged the same way. Inconclusive runs (no completion crossed an update) retry with
        twice the budget up to what the server's context leaves, then twice more at that."""
        tol = TOLERANCES[mirror.dtype]
        assert tol.max_abs < 1.0
        timelines: list[str] = []

        async def attempt(budget: int) -> tuple[int, list[str]]:
            tl = Timeline()
            async with server_under_test.client() as client, server_under_test.client() as other:
                publisher = await connect(server_under_test, client)
                info = await client.info()
                start = info.version
                states = {start: mirror.state()}
                for k in (1, 2):  # every version's weights are made before the requests start
                    mirror.perturb(seed=start + k, scale=SCALE)
                    states[start + k] = mirror.state()
                req: dict[str, Any] = {
                    "messages": PROMPT, "max_tokens": budget, "ignore_eos": True, "temperature": 1.0,
                    "logprobs": True, "return_token_ids": True,
                }  # fmt: skip
                await open_connections(client, 4)
                await open_connections(other, 1)
                tl.mark("ready")

                async def timed(i: int) -> ChatCompletionResponse:
                    resp = await client.chat({**req, "seed": i})
                    tl.mark(f"request {i} done")
                    return resp

                running = [asyncio.create_task(timed(i)) for i in range(2)]
                await asyncio.sleep(0.02)  # sent before the first update is requested
                mid: asyncio.Task[ChatCompletionResponse] | None = None
                for k in (1, 2):
                    mirror.load(states[start + k])
                    async with publisher.update(start + k, info.params) as sink:
                        tl.mark(f"v{start + k} accepted")
                        if mid is None:  # sent while the server is receiving
                            mid = asyncio.create_task(other.chat({**req, "max_tokens": 16, "seed": 7}))
                        await asyncio.sleep(RECEIVE_WINDOW_S)
                        await asyncio.to_thread(mirror.send_all, sink, info.params)
                    tl.mark(f"v{start + k} live")
                    if k == 1:  # answered before the next version exists: it can only begin with
                        # the old or the new one (a loaded engine may start it after the next update)
                        assert mid is not None
                        mid_resp = await mid
                results = await asyncio.gather(*running)
                await publisher.close()
            timelines.append(f"{budget} tokens: {tl}")
            failures, crossed = [], 0
            for i, resp in enumerate(results):
                assert resp.prompt_token_ids, "return_token_ids: prompt_token_ids missing"
                c = resp.choices[0]
                crossed += len(set(c.weight_versions)) > 1
                ok, msg = judge_tags(mirror, resp.prompt_token_ids, c, states, f"in-flight request {i}")
                if not ok:
                    failures.append(msg)
            c = mid_resp.choices[0]
            assert mid_resp.prompt_token_ids
            if c.weight_versions[:1] not in ([start], [start + 1]):
                failures.append(f"a request sent while version {start + 1} was being received began with "
                                f"version {c.weight_versions[:1]}")  # fmt: skip
            ok, msg = judge_tags(mirror, mid_resp.prompt_token_ids, c, states, "the request sent mid-receive")
            if not ok:
                failures.append(msg)
            return crossed, failures

        room = arun(functools.partial(room_left, server_under_test))
        for budget in retry_budgets(128, room):
            crossed, failures = arun(functools.partial(attempt, budget))
            assert not failures, "a version tag lies: " + " | ".join(failures)
            if crossed:
                return
        pytest.fail("inconclusive: no completion was still running when an update went live; " + "; ".join(timelines))

    @pytest.mark.requires("streaming", "in_flight_updates")
    def test_streamed_version_tags_are_true(self, server_under_test: ServerUnderTest, mirror: Mirror) -> None:
        """A streamed completion running across an update: once its first tokens have arrived
        (the stream itself says it is running, whatever the scheduler), the trainer publishes
        the next version; the chunks' tokens, logprobs and weight versions, put together, are
        replayed against the mirror as in :meth:`test_every_version_tag_is_true` (every tag
        true, versions never going back), and the streamed tokens carry both versions.
        Inconclusive runs (the stream ended before the update was live) retry with twice the
        budget, up to what the context leaves, then twice more at that."""
        timelines: list[str] = []

        async def attempt(budget: int) -> tuple[bool, str]:
            tl = Timeline()
            async with server_under_test.client() as client:
                publisher = await connect(server_under_test, client)
                info = await client.info()
                start = info.version
                states = {start: mirror.state()}
                mirror.perturb(seed=start + 1, scale=SCALE)
                states[start + 1] = mirror.state()
                mirror.load(states[start])  # the update sends start + 1's weights from the states
                await open_connections(client, 2)
                body = {
                    "messages": PROMPT, "max_tokens": budget, "ignore_eos": True, "temperature": 1.0,
                    "seed": 11, "logprobs": True, "return_token_ids": True,
                }  # fmt: skip
                parts: list[ChunkChoice] = []
                prompt: list[int] = []
                update: asyncio.Task[None] | None = None
                tl.mark("ready")
                async for chunk in client.chat_stream(body):
                    prompt = prompt or list(chunk.prompt_token_ids or [])
                    for part in chunk.choices:
                        parts.append(part)
                        if update is None and part.token_ids:
                            tl.mark("first tokens")
                            mirror.load(states[start + 1])
                            update = asyncio.create_task(mirror.publish(publisher, start + 1, info.params))
                tl.mark("stream ended")
                assert update is not None, "the stream carried no token ids (return_token_ids)"
                await update
                tl.mark(f"v{start + 1} live")
                await publisher.close()
            timelines.append(f"{budget} tokens: {tl}")
            assert prompt, "return_token_ids: the first chunk carries no prompt_token_ids"
            choice = ChatChoice(
                index=0,
                message=AssistantMessage(content="".join(p.delta.content or "" for p in parts)),
                finish_reason=parts[-1].finish_reason or "length",
                token_ids=[t for p in parts for t in p.token_ids or []],
                logprobs=ChoiceLogprobs(content=[t for p in parts for t in (p.logprobs.content if p.logprobs else [])]),
                weight_versions=[v for p in parts for v in p.weight_versions],
            )
            assert len(choice.weight_versions) == len(choice.token_ids or []) == budget, (
                f"{len(choice.weight_versions)} streamed versions for {len(choice.token_ids or [])} tokens "
                f"(asked {budget})"
            )
            ok, msg = judge_tags(mirror, prompt, choice, states, "the streamed completion")
            assert ok, "a version tag lies: " + msg
            return len(set(choice.weight_versions)) > 1, ""

        room = arun(functools.partial(room_left, server_under_test))
        for budget in retry_budgets(256, room):
            crossed, _ = arun(functools.partial(attempt, budget))
            if crossed:
                return
        pytest.fail("inconclusive: every stream ended before the update was live; " + "; ".join(timelines))
