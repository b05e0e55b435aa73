"""``echo`` on ``/v1/completions``, as vLLM 0.32 answers it, for every backend that completes.

The backend is asked without ``echo`` (prompt logprobs and token ids asked as echo needs them);
each choice then gets its prompt in front, as vLLM's completion server builds it: ``text`` is the
prompt's text and the completion's; with ``logprobs`` N, ``logprobs`` covers the prompt tokens
first (the first has no logprob: ``null``, as do its alternatives), each with its N best
alternatives, then the completion's. ``max_tokens: 0`` with ``echo`` scores the prompt only: one
token is generated (vLLM does the same; it stays in ``token_ids``, ``weight_versions`` and the
usage, with finish reason ``length``) and ``text`` and ``logprobs`` are the prompt's alone. Not
with ``stream``: a 400 naming ``echo``. vLLM's quirk of an empty prompt text when
``return_token_ids`` is set is not copied: the prompt's text is always there."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from pipelinerl_sdk.errors import InvalidRequest
from pipelinerl_sdk.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    PromptLogprob,
)

__all__ = ["complete_with_echo"]


async def complete_with_echo(
    req: CompletionRequest,
    complete: Callable[[CompletionRequest], Awaitable[CompletionResponse]],
    detokenize: Callable[[DetokenizeRequest], Awaitable[DetokenizeResponse]],
) -> CompletionResponse:
    """``req`` (with ``echo``) answered through ``complete`` (the backend's, asked without echo)
    and ``detokenize`` (the text of a token-id prompt)."""
    if req.stream:
        raise InvalidRequest("echo: not served with stream=true; send stream=false", field="echo")
    scoring = req.max_tokens == 0
    top = req.logprobs
    inner = req.model_copy(
        update={
            "echo": False,
            "max_tokens": 1 if scoring else req.max_tokens,
            "prompt_logprobs": top if top is not None and req.prompt_top is None else req.prompt_logprobs,
            "return_token_ids": True,
        }
    )
    try:
        resp = await complete(inner)
    except InvalidRequest as e:
        if e.field != "prompt_logprobs" or req.prompt_top is not None:
            raise
        raise InvalidRequest(f"echo: with logprobs {top} it needs the prompt's logprobs, and: {e}", field="echo") from e
    texts: dict[int, tuple[str, str]] = {}  # by prompt: its text, its first token's text
    choices = []
    for choice in resp.choices:
        p = choice.index // req.n
        if p not in texts:
            ids, given = list(choice.prompt_token_ids or []), req.prompts()[p]
            text = given if isinstance(given, str) else (await detokenize(DetokenizeRequest(tokens=ids))).prompt
            first = (await detokenize(DetokenizeRequest(tokens=ids[:1]))).prompt
            texts[p] = text, first
        choices.append(_echoed(req, choice, *texts[p], scoring))
    return resp.model_copy(update={"choices": choices})


def _echoed(
    req: CompletionRequest, choice: CompletionChoice, prompt_text: str, first_text: str, scoring: bool
) -> CompletionChoice:
    prompt_ids = list(choice.prompt_token_ids or [])
    logprobs = None
    if req.logprobs is not None:
        entries = choice.prompt_logprobs
        if entries is None or len(entries) != len(prompt_ids):
            raise RuntimeError(f"echo needs one prompt logprob entry per prompt token, got {entries!r:.200}")
        logprobs = _prompt_part(req, prompt_ids, entries, choice.logprobs, first_text)
        if not scoring and choice.logprobs is not None:
            logprobs = _joined(logprobs, choice.logprobs)
    return choice.model_copy(
        update={
            "text": prompt_text if scoring else prompt_text + choice.text,
            "logprobs": logprobs,
            "token_ids": choice.token_ids if req.return_token_ids else None,
            "prompt_token_ids": choice.prompt_token_ids if req.return_token_ids else None,
        }
    )


def _prompt_part(
    req: CompletionRequest,
    ids: list[int],
    entries: list[dict[int, PromptLogprob] | None],
    completion: CompletionLogprobs | None,
    first_text: str,
) -> CompletionLogprobs:
    """The prompt tokens' part of ``logprobs``: each token's text (its entry's decoded token, or
    ``token_id:N``), logprob (None for the first) and alternatives (the ``req.logprobs`` best and
    itself; None for the first; none at all where the completion's carry none)."""
    as_ids = req.return_tokens_as_token_ids

    def text(tid: int, lp: PromptLogprob | None) -> str:
        if as_ids or lp is None or lp.decoded_token is None:
            return f"token_id:{tid}"
        return lp.decoded_token

    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for j, (tid, entry) in enumerate(zip(ids, entries, strict=True)):
        own = entry.get(tid) if entry else None
        tokens.append((f"token_id:{tid}" if as_ids else first_text) if j == 0 else text(tid, own))
        values.append(own.logprob if own is not None else None)
        if entry is None or own is None:
            tops.append(None)
            continue
        ranked = sorted(((t, e) for t, e in entry.items() if t != tid), key=lambda te: -te[1].logprob)
        best = {text(t, e): e.logprob for t, e in ranked[: req.logprobs or 0]}
        tops.append({**best, tokens[-1]: own.logprob})
    wants_tops = completion is None or completion.top_logprobs is not None
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=values, top_logprobs=tops if wants_tops else None, text_offset=offsets
    )


def _joined(prompt: CompletionLogprobs, completion: CompletionLogprobs) -> CompletionLogprobs:
    """``prompt`` then ``completion``, offsets running on over the prompt tokens' texts."""
    shift = sum(len(t) for t in prompt.tokens)
    base = completion.text_offset[0] if completion.text_offset else 0
    tops = None
    if prompt.top_logprobs is not None and completion.top_logprobs is not None:
        tops = [*prompt.top_logprobs, *completion.top_logprobs]
    return CompletionLogprobs(
        tokens=[*prompt.tokens, *completion.tokens],
        token_logprobs=[*prompt.token_logprobs, *completion.token_logprobs],
        top_logprobs=tops,
        text_offset=[*prompt.text_offset, *(o - base + shift for o in completion.text_offset)],
    )
