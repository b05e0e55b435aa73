"""Streamed chat, the same for every engine: an engine gives each sample's tokens as they come
(:class:`TokenStep`), the kit turns them into vLLM 0.32's ``chat.completion.chunk`` events, with
the request's stop strings honoured (text that may begin one is held back until it cannot) and
every token's logprobs, id and weight version in the chunk that carries it."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from pipelinerl_sdk.kit.inference.chat import ChatPlan, FinishReason, StopRule
from pipelinerl_sdk.kit.inference.completion import completion_logprobs
from pipelinerl_sdk.kit.inference.tools import ToolCallStream
from pipelinerl_sdk.logprobs import choice_logprobs
from pipelinerl_sdk.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    ChunkDelta,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionRequest,
    SamplingRequest,
    Usage,
)

__all__ = ["TextStream", "TokenStep", "chat_chunks", "completion_chunks", "held_back", "merge_samples", "released"]


@dataclass(frozen=True, slots=True)
class TokenStep:
    """The tokens one sample produced since its last step (ids, raw logprobs, weight versions,
    top alternatives ``(id, logprob)`` best first or empty), and on its last step the finish
    reason (that step may carry no token). An engine's sample stream ends with such a step."""

    token_ids: Sequence[int]
    logprobs: Sequence[float]
    versions: Sequence[int]
    top_logprobs: Sequence[Sequence[tuple[int, float]]] = ()
    finish_reason: FinishReason | None = None


def _borders(s: str) -> list[int]:
    """KMP's prefix function of ``s``: ``out[i]`` is the longest proper prefix of ``s[: i + 1]``
    that is also its suffix."""
    out = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = out[k - 1]
        if s[i] == s[k]:
            k += 1
        out[i] = k
    return out


class StopBorders:
    """For each stop string, the longest end of a growing text that begins it, kept by a KMP
    automaton fed only the characters the text gained since the last call: a step costs its new
    characters, not the stop strings' lengths squared (16 stop strings of 10,000 characters made
    every streamed token cost seconds). Text that was fed must still begin the text, else the
    automata start over (a tokenizer's clean-up may rewrite earlier characters)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [(stop, _borders(stop)) for stop in stops if stop]
        self._states = [0] * len(self._stops)
        self._fed = ""

    def held(self, text: str) -> int:
        """How many characters at the end of ``text`` must wait: a trailing partial UTF-8
        character (U+FFFD until its last byte arrives) and, before it, the longest end that begins
        a stop string (it may complete into one)."""
        stable = text.rstrip("\ufffd")
        if not stable.startswith(self._fed):
            self._states, self._fed = [0] * len(self._stops), ""
        new = stable[len(self._fed) :]
        longest = 0
        for i, (stop, borders) in enumerate(self._stops):
            k = self._states[i]
            for c in new:
                if k == len(stop):
                    k = borders[k - 1]
                while k and stop[k] != c:
                    k = borders[k - 1]
                if stop[k] == c:
                    k += 1
            self._states[i] = k
            longest = max(longest, borders[k - 1] if k == len(stop) else k)
        self._fed = stable
        return longest + len(text) - len(stable)


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of ``text`` must wait (:meth:`StopBorders.held` of the
    whole text at once)."""
    return StopBorders(stops).held(text)


class TextStream:
    """One sample's text as released so far. Every released text is a prefix of the text the
    non-streamed request gives (:meth:`StopRule.finish` on the same ids): nothing past a stop
    string, nothing that may still become one."""

    def __init__(self, rule: StopRule, stop_ids: frozenset[int]) -> None:
        self.rule, self.stop_ids = rule, stop_ids
        self.ids: list[int] = []
        self.sent = ""
        self._borders = StopBorders(rule.stops)

    def step(self, step: TokenStep) -> tuple[str, str | int | None]:
        """(the text ``step`` releases, the stop reason once finished)."""
        self.ids.extend(int(t) for t in step.token_ids)
        stop_reason: str | int | None = None
        if step.finish_reason is not None:
            visible, stop_reason = self.rule.finish(self.ids, step.finish_reason, self.stop_ids)
        else:
            text = self.rule.decode(self.ids)
            visible, hit = self.rule.cut(text, self.rule.floor(self.ids))
            if hit is None:
                visible = text[: len(text) - self._borders.held(text)]
        if len(visible) <= len(self.sent) or not visible.startswith(self.sent):
            return "", stop_reason  # nothing new (text already sent is never taken back)
        delta, self.sent = visible[len(self.sent) :], visible
        return delta, stop_reason


async def merge_samples(
    samples: Sequence[AsyncIterator[TokenStep]],
) -> AsyncGenerator[tuple[int, TokenStep], None]:
    """The steps of every sample, ``(sample index, step)``, in the order they come. Closing the
    merged iterator (or an error in one sample) cancels every sample still running, once: each
    runs its cleanup to its end (closing it again never interrupts that cleanup)."""
    if len(samples) == 1:
        async with aclosing(samples[0]) as only:  # type: ignore[type-var]
            async for s in only:
                yield 0, s
        return
    queue: asyncio.Queue[tuple[int, TokenStep | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[TokenStep]) -> None:
        try:
            async for s in it:
                queue.put_nowait((i, s))
        except Exception as e:
            queue.put_nowait((i, e))
        else:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(samples)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        # asyncio.wait, not gather: a gather cancelled again (anyio cancels a cancelled scope's
        # task on every loop turn) cancels its tasks again, interrupting the cleanup the first
        # cancellation started (an engine's connection left open, its request running).
        await asyncio.wait(tasks)


async def released(
    tokenizer: object,
    req: SamplingRequest,
    samples: Sequence[AsyncIterator[TokenStep]],
    stop_ids: frozenset[int],
) -> AsyncGenerator[tuple[int, str, str | int | None, TokenStep], None]:
    """``(sample index, text released, stop reason, step)`` for every step of ``samples``
    (:class:`TextStream`; ``stop_ids``: the ids that end a sample). RuntimeError when a step
    reports a version per token other than one, or a sample ends without a finish reason."""
    texts = [TextStream(StopRule(tokenizer, req), stop_ids) for _ in samples]
    finished = [False] * len(samples)
    async with aclosing(merge_samples(samples)) as merged:
        async for i, step in merged:
            if len(step.versions) != len(step.token_ids):
                raise RuntimeError(f"sample {i}: {len(step.versions)} weight versions for {len(step.token_ids)} tokens")
            delta, stop_reason = texts[i].step(step)
            finished[i] = step.finish_reason is not None
            yield i, delta, stop_reason, step
    if not all(finished):
        raise RuntimeError(f"samples {[i for i, f in enumerate(finished) if not f]} ended without a finish reason")


def _usage(prompt: int, completion: int) -> Usage:
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _wants_usage(req: SamplingRequest) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


async def chat_chunks(
    tokenizer: object,
    model: str,
    req: ChatCompletionRequest,
    plan: ChatPlan,
    samples: Sequence[AsyncIterator[TokenStep]],
    stop_ids: frozenset[int],
    tool_parser: str | None = None,
) -> AsyncIterator[ChatCompletionChunk]:
    """The chunks of a streamed chat from its ``req.n`` ``samples``: each choice's role first
    (``prompt_token_ids`` with ``return_token_ids``), then one chunk per step of a sample, the
    text it releases (:func:`released`) as content or tool-call parts
    (:class:`~pipelinerl_sdk.kit.inference.tools.ToolCallStream`, ``tool_parser`` the server's),
    its tokens' logprobs (if asked), ids (if asked) and weight versions, the finish reason on its
    last; with ``stream_options.include_usage`` a last chunk with the usage."""
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(choices: list[ChunkChoice], **kw: object) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=cid, created=created, model=model, choices=choices, **kw)  # type: ignore[arg-type]

    yield chunk(
        [ChunkChoice(index=i, delta=ChunkDelta(role="assistant", content="")) for i in range(len(samples))],
        prompt_token_ids=list(plan.prompt_ids) if req.return_token_ids else None,
    )
    completion_tokens = 0
    calls = [ToolCallStream(req, tool_parser) for _ in samples]
    async with aclosing(released(tokenizer, req, samples, stop_ids)) as steps:
        async for i, delta, stop_reason, step in steps:
            completion_tokens += len(step.token_ids)
            content, parts, finish_reason = calls[i].step(delta, step.finish_reason)
            yield chunk(
                [
                    ChunkChoice(
                        index=i,
                        delta=ChunkDelta(content=content, tool_calls=parts or None),
                        logprobs=choice_logprobs(
                            tokenizer,
                            step.token_ids,
                            step.logprobs,
                            step.top_logprobs if plan.top else None,
                            as_ids=req.return_tokens_as_token_ids,
                        )
                        if req.logprobs
                        else None,
                        finish_reason=finish_reason,  # type: ignore[arg-type]
                        stop_reason=stop_reason,
                        token_ids=list(step.token_ids) if req.return_token_ids else None,
                        weight_versions=list(step.versions),
                    )
                ]
            )
    if _wants_usage(req):
        yield chunk([], usage=_usage(len(plan.prompt_ids), completion_tokens))


async def completion_chunks(
    tokenizer: object,
    model: str,
    req: CompletionRequest,
    plans: Sequence[ChatPlan],
    samples: Sequence[AsyncIterator[TokenStep]],
    stop_ids: frozenset[int],
) -> AsyncIterator[CompletionChunk]:
    """The chunks of a streamed ``/v1/completions`` (vLLM's ``text_completion`` chunks): sample
    ``k`` is choice ``k``, of prompt ``plans[k // n]``; one chunk per step with the text it
    releases, its tokens' logprobs (OpenAI's completions shape, offsets running on through the
    choice), ids and weight versions, ``prompt_token_ids`` on a choice's first chunk (with
    ``return_token_ids``), the finish reason on its last; usage last if asked."""
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    offsets = [0] * len(samples)
    started = [False] * len(samples)
    completion_tokens = 0
    async with aclosing(released(tokenizer, req, samples, stop_ids)) as steps:
        async for k, delta, stop_reason, step in steps:
            completion_tokens += len(step.token_ids)
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(
                    tokenizer,
                    step.token_ids,
                    step.logprobs,
                    step.top_logprobs if req.logprobs else None,
                    as_ids=req.return_tokens_as_token_ids,
                    start=offsets[k],
                )
                offsets[k] += sum(len(t) for t in logprobs.tokens)
            first, started[k] = not started[k], True
            choice = CompletionChunkChoice(
                index=k,
                text=delta,
                logprobs=logprobs,
                finish_reason=step.finish_reason,
                stop_reason=stop_reason,
                token_ids=list(step.token_ids) if req.return_token_ids else None,
                prompt_token_ids=list(plans[k // req.n].prompt_ids) if req.return_token_ids and first else None,
                weight_versions=list(step.versions),
            )
            yield CompletionChunk(id=cid, created=created, model=model, choices=[choice])
    if _wants_usage(req):
        prompt = sum(len(p.prompt_ids) for p in plans)
        yield CompletionChunk(id=cid, created=created, model=model, choices=[], usage=_usage(prompt, completion_tokens))
