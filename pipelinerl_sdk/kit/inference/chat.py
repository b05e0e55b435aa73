"""Chat preparation and response assembly, the same for every engine: the chat template and the
context check before generation; the OpenAI response with the contract's extensions (token ids,
raw logprobs, one weight version per completion token) after it."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pipelinerl_sdk.errors import InvalidRequest, PromptTooLong
from pipelinerl_sdk.logprobs import choice_logprobs
from pipelinerl_sdk.protocol import (
    DEFAULT_MAX_TOKENS,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Usage,
)

FinishReason = Literal["stop", "length", "abort"]


#: The smallest positive temperature sampled as asked; a smaller one is raised to it, as vLLM does
#: (its ``_MAX_TEMP``): ``logits / 1e-40`` overflows float32 and leaves no distribution to sample.
MIN_TEMPERATURE = 1e-2


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """What to generate for one request: the templated prompt's ids, the token budget (fits the
    context), how many top alternatives to report (0: none), and the sampling values the engine
    computes with (``temperature`` 0 or at least :data:`MIN_TEMPERATURE`; ``top_p`` as asked:
    an engine's top-p keeps at least the most likely token, however small it is)."""

    prompt_ids: list[int]
    max_tokens: int
    top: int
    temperature: float = 1.0
    top_p: float = 1.0


def sampling_temperature(temperature: float) -> float:
    """The temperature an engine samples with: 0 (greedy) or at least :data:`MIN_TEMPERATURE`."""
    return 0.0 if temperature == 0 else max(temperature, MIN_TEMPERATURE)


def check_text(req: ChatCompletionRequest) -> None:
    """InvalidRequest naming ``messages.I.content`` for text that is not valid Unicode (a lone
    surrogate, which JSON's ``\\ud800`` escape can carry): no tokenizer can encode it."""
    for i, m in enumerate(req.messages):
        try:
            m.content.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequest(
                f"messages.{i}.content: not valid Unicode at character {e.start} ({e.reason})",
                field=f"messages.{i}.content",
            ) from None


def prepare_chat(
    tokenizer: Any, req: ChatCompletionRequest, max_model_len: int, *, default_max_tokens: int = DEFAULT_MAX_TOKENS
) -> ChatPlan:
    """Apply the chat template and check the request against the context. Raises
    :class:`InvalidRequest` (``top_logprobs`` without ``logprobs``) or :class:`PromptTooLong`
    (prompt plus budget past ``max_model_len``), each naming the field, as it does for text
    that is not valid Unicode (:func:`check_text`); the router answers 400. Runs on the caller's
    thread: from a coroutine, use :func:`plan_chat`."""
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs=true", field="top_logprobs")
    check_text(req)
    encoded = tokenizer.apply_chat_template(
        [m.model_dump() for m in req.messages],
        add_generation_prompt=req.add_generation_prompt,
        tokenize=True,
        return_dict=False,
    )
    prompt_ids = [int(t) for t in encoded]
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise PromptTooLong(
            f"prompt ({len(prompt_ids)} tokens) leaves no room to generate in the context ({max_model_len})",
            field="messages",
        )
    max_tokens = req.token_budget or min(default_max_tokens, room)
    if max_tokens > room:
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        raise PromptTooLong(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the context ({max_model_len})",
            field=field,
        )
    return ChatPlan(prompt_ids, max_tokens, top, sampling_temperature(req.temperature), req.top_p)


async def plan_chat(
    tokenizer: Any, req: ChatCompletionRequest, max_model_len: int, *, default_max_tokens: int = DEFAULT_MAX_TOKENS
) -> ChatPlan:
    """:func:`prepare_chat` on a worker thread: the chat template and the tokenizer are CPU work
    that grows with the prompt, and on the event loop they would stall every other request
    (``/health`` included) for as long."""
    return await asyncio.to_thread(prepare_chat, tokenizer, req, max_model_len, default_max_tokens=default_max_tokens)


def versions_from_spans(spans: Iterable[tuple[int, int, int]], n: int, *, engine: str) -> list[int]:
    """One weight version per completion token from an engine's ``(version, start, end)`` spans
    (end exclusive). Never guesses: RuntimeError unless the spans cover exactly ``n`` tokens (a
    version the engine did not report would hide stale tokens)."""
    versions: list[int] = []
    for version, start, end in spans:
        versions.extend([version] * (end - start))
    if len(versions) != n:
        raise RuntimeError(f"{engine} reported weight-version spans for {len(versions)} of {n} tokens")
    return versions


def assemble_choice(
    tokenizer: Any,
    index: int,
    req: ChatCompletionRequest,
    *,
    text: str,
    token_ids: Sequence[int],
    versions: Sequence[int],
    finish_reason: FinishReason,
    logprobs: Sequence[float] = (),
    top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None,
) -> ChatChoice:
    """One choice: ``logprobs`` (raw, one per token) and ``top_logprobs`` (``(id, logprob)`` best
    first, already cut to the request's count) are reported only if the request asked."""
    return ChatChoice(
        index=index,
        message=AssistantMessage(content=text),
        finish_reason=finish_reason,
        logprobs=choice_logprobs(tokenizer, token_ids, logprobs, top_logprobs) if req.logprobs else None,
        token_ids=list(token_ids) if req.return_token_ids else None,
        weight_versions=list(versions),
    )


def assemble_response(
    model: str,
    req: ChatCompletionRequest,
    plan: ChatPlan,
    choices: Sequence[ChatChoice],
    *,
    completion_tokens: int,
    prompt_logprobs: list[float | None] | None = None,
) -> ChatCompletionResponse:
    """The response: usage counted, prompt token ids and prompt logprobs only if asked."""
    prompt = plan.prompt_ids
    return ChatCompletionResponse(
        id=f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=model,
        choices=list(choices),
        usage=Usage(
            prompt_tokens=len(prompt),
            completion_tokens=completion_tokens,
            total_tokens=len(prompt) + completion_tokens,
        ),
        prompt_token_ids=list(prompt) if req.return_token_ids else None,
        prompt_logprobs=prompt_logprobs if req.prompt_logprobs else None,
    )
