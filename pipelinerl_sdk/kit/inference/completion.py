"""``/v1/completions``, the same for every engine: the prompts (text tokenized as vLLM does, or
token ids taken as they are: token-in, token-out) checked against the context before generation;
the OpenAI response with the contract's extensions (token ids, raw logprobs, prompt logprobs, one
weight version per token) after it. Generation itself reuses the chat path's
:class:`~pipelinerl_sdk.kit.inference.chat.ChatPlan`, :func:`~.chat.sampling_args` and
:class:`~.chat.StopRule`."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from typing import Any

from pipelinerl_sdk.errors import InvalidRequest, PromptTooLong
from pipelinerl_sdk.kit.inference.chat import ChatPlan, FinishReason, sampling_temperature
from pipelinerl_sdk.logprobs import token_text
from pipelinerl_sdk.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
    Usage,
)

__all__ = [
    "assemble_completion",
    "completion_choice",
    "completion_logprobs",
    "plan_completion",
    "prepare_completion",
    "vocabulary_bound",
]


def vocabulary_bound(tokenizer: Any, vocab_size: int | None) -> int:
    """One past the largest token id a prompt may carry: the model's ``vocab_size`` (its
    embedding rows, which may outnumber the tokenizer's tokens: padding a model can sample) or
    the tokenizer's size, whichever is larger (a tokenizer may have placeholder tokens past the
    model's)."""
    return max(len(tokenizer), vocab_size or 0)


def _prompt_ids(tokenizer: Any, prompt: str | list[int], field: str, vocab_size: int | None) -> list[int]:
    if isinstance(prompt, list):
        ids = [int(t) for t in prompt]
        bound = vocabulary_bound(tokenizer, vocab_size)
        bad = [t for t in ids if not 0 <= t < bound]
        if bad:
            raise InvalidRequest(f"{field}: token ids {bad[:5]} outside the vocabulary [0, {bound})", field=field)
        return ids
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{field}: not valid Unicode at character {e.start} ({e.reason})", field=field) from None
    ids = [int(t) for t in tokenizer(prompt, add_special_tokens=True)["input_ids"]]
    if not ids:
        raise InvalidRequest(f"{field}: the prompt has no tokens", field=field)
    return ids


def prepare_completion(
    tokenizer: Any, req: CompletionRequest, max_model_len: int, vocab_size: int | None = None
) -> list[ChatPlan]:
    """One plan per prompt of ``req``: its ids (text tokenized with the model's special tokens,
    as vLLM; token ids as given, each in the vocabulary: :func:`vocabulary_bound` of the model's
    ``vocab_size``, else an InvalidRequest naming the prompt), the token budget (16 by default,
    as vLLM; ``null``: the rest of the context), the logprob alternatives (``logprobs`` N), the
    stop rule and sampling values. InvalidRequest naming the field for what is not served
    (``suffix``, prompt logprobs in a stream; ``echo``, which the router serves) and PromptTooLong naming ``prompt`` or
    ``max_tokens`` past ``max_model_len``. Whether a backend streams is the router's check
    (capability ``streaming``)."""
    if req.echo:  # the router answers echo (pipelinerl_sdk.http.echo), asking without it
        raise InvalidRequest("echo: served by the router, not by the backend", field="echo")
    if req.max_tokens == 0:  # echo's scoring form reaches a backend as max_tokens 1
        raise InvalidRequest("max_tokens: at least 1 (0 only with echo, which the router serves)", field="max_tokens")
    if req.suffix is not None:
        raise InvalidRequest("suffix: not served (no fill-in-the-middle)", field="suffix")
    if req.stream and req.prompt_top is not None:
        raise InvalidRequest("prompt_logprobs: not available with stream=true (as in vLLM)", field="prompt_logprobs")
    prompts = req.prompts()
    plans = []
    for p, prompt in enumerate(prompts):
        field = "prompt" if len(prompts) == 1 else f"prompt.{p}"
        ids = _prompt_ids(tokenizer, prompt, field, vocab_size)
        room = max_model_len - len(ids)
        if room < 1:
            raise PromptTooLong(
                f"{field} ({len(ids)} tokens) leaves no room to generate in the context ({max_model_len})", field=field
            )
        budget = req.max_tokens or room
        if budget > room:
            raise PromptTooLong(
                f"{field} ({len(ids)} tokens) + max_tokens ({budget}) exceeds the context ({max_model_len})",
                field="max_tokens",
            )
        plans.append(
            ChatPlan(
                ids,
                budget,
                req.logprobs or 0,
                req.stop_strings,
                tuple(req.stop_token_ids or ()),
                sampling_temperature(req.temperature),
                req.top_p,
            )
        )
    return plans


async def plan_completion(
    tokenizer: Any, req: CompletionRequest, max_model_len: int, vocab_size: int | None = None
) -> list[ChatPlan]:
    """:func:`prepare_completion` on a worker thread (tokenizing is CPU work)."""
    return await asyncio.to_thread(prepare_completion, tokenizer, req, max_model_len, vocab_size)


def completion_logprobs(
    tokenizer: Any,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top_logprobs: Sequence[Sequence[tuple[int, float]]] | None,
    *,
    as_ids: bool,
    start: int = 0,
) -> CompletionLogprobs:
    """OpenAI's completions logprobs: each token's text, raw logprob, character offset (of the
    tokens' texts laid end to end, from ``start``) and, with ``top_logprobs``, its alternatives
    and itself (as vLLM) as text -> logprob."""
    tokens = [token_text(tokenizer, int(t), as_ids=as_ids) for t in token_ids]
    offsets, at = [], start
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    tops: list[dict[str, float] | None] | None = None
    if top_logprobs is not None:
        tops = [
            {
                **{token_text(tokenizer, int(t), as_ids=as_ids): float(v) for t, v in alts},
                tok: float(lp),
            }
            for tok, lp, alts in zip(tokens, logprobs, top_logprobs, strict=True)
        ]
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=[float(x) for x in logprobs], top_logprobs=tops, text_offset=offsets
    )


def completion_choice(
    tokenizer: Any,
    index: int,
    req: CompletionRequest,
    plan: ChatPlan,
    *,
    text: str,
    token_ids: Sequence[int],
    versions: Sequence[int],
    finish_reason: FinishReason,
    logprobs: Sequence[float] = (),
    top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None,
    stop_reason: str | int | None = None,
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None,
) -> CompletionChoice:
    """One choice: logprobs if ``req.logprobs`` is set (alternatives when it is above 0), token
    ids and prompt ids with ``return_token_ids``, prompt logprobs if asked; weight versions
    always (RuntimeError unless one per token)."""
    if len(versions) != len(token_ids):
        raise RuntimeError(f"{len(versions)} weight versions for {len(token_ids)} tokens")
    return CompletionChoice(
        index=index,
        text=text,
        logprobs=completion_logprobs(
            tokenizer,
            token_ids,
            logprobs,
            top_logprobs if plan.top else None,
            as_ids=req.return_tokens_as_token_ids,
        )
        if req.logprobs is not None
        else None,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        token_ids=list(token_ids) if req.return_token_ids else None,
        prompt_token_ids=list(plan.prompt_ids) if req.return_token_ids else None,
        prompt_logprobs=prompt_logprobs if req.prompt_top is not None else None,
        weight_versions=list(versions),
    )


def assemble_completion(
    model: str, plans: Sequence[ChatPlan], choices: Sequence[CompletionChoice], *, completion_tokens: int
) -> CompletionResponse:
    """The response: usage counts every prompt once and every choice's tokens."""
    prompt = sum(len(p.prompt_ids) for p in plans)
    return CompletionResponse(
        id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=model,
        choices=list(choices),
        usage=Usage(prompt_tokens=prompt, completion_tokens=completion_tokens, total_tokens=prompt + completion_tokens),
    )
