"""Chat preparation and response assembly, the same for every engine: the chat template and the
context check before generation; the OpenAI response with the contract's extensions (token ids,
raw logprobs, one weight version per completion token) after it."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pipelinerl_sdk.errors import InvalidRequest, PromptTooLong
from pipelinerl_sdk.logprobs import choice_logprobs
from pipelinerl_sdk.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Usage,
)

#: The token budget of a request that names none (capped by the room left in the context).
DEFAULT_MAX_TOKENS = 256

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """What to generate for one request: the templated prompt's ids, the token budget (fits the
    context), and how many top alternatives to report (0: none)."""

    prompt_ids: list[int]
    max_tokens: int
    top: int


def prepare_chat(
    tokenizer: Any, req: ChatCompletionRequest, max_model_len: int, *, default_max_tokens: int = DEFAULT_MAX_TOKENS
) -> ChatPlan:
    """Apply the chat template and check the request against the context. Raises
    :class:`InvalidRequest` (``top_logprobs`` without ``logprobs``) or :class:`PromptTooLong`
    (prompt plus budget past ``max_model_len``), each naming the field; the router answers 400."""
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs=true", field="top_logprobs")
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
    return ChatPlan(prompt_ids, max_tokens, top)


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
