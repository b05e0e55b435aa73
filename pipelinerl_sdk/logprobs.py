"""The ``logprobs`` block of a chat choice, built the same way by every inference backend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipelinerl_sdk.protocol import ChoiceLogprobs, TokenLogprob, TopLogprob

#: What vLLM reports for a logprob of -inf (a token its sampling filters cut, in a processed
#: ``--logprobs-mode``): JSON has no infinity.
LOGPROB_FLOOR = -9999.0


def token_text(tokenizer: Any, token_id: int, *, as_ids: bool = False) -> str:
    """A logprob entry's ``token`` as vLLM writes it: the token decoded alone (a partial UTF-8
    character decodes to U+FFFD), or ``token_id:N`` with ``as_ids``."""
    return f"token_id:{token_id}" if as_ids else str(tokenizer.decode([token_id]))


def choice_logprobs(
    tokenizer: Any,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None,
    *,
    as_ids: bool = False,
) -> ChoiceLogprobs:
    """One entry per completion token: its text (:func:`token_text`) and UTF-8 ``bytes``, the
    logprob of the sampled token and, if given, the alternatives ``(token id, logprob)`` of
    ``top_logprobs[i]``, best first, already cut to the request's ``top_logprobs``. ValueError if
    the lengths differ (an engine that returned logprobs for some tokens only)."""
    tops: Sequence[Sequence[tuple[int, float]]] = top_logprobs if top_logprobs is not None else [() for _ in token_ids]
    if not len(token_ids) == len(logprobs) == len(tops):
        raise ValueError(f"{len(logprobs)} logprobs and {len(tops)} top lists for {len(token_ids)} tokens")

    def text(t: int) -> str:
        return token_text(tokenizer, int(t), as_ids=as_ids)

    return ChoiceLogprobs(
        content=[
            TokenLogprob(
                token=(tok := text(tid)),
                logprob=float(lp),
                bytes=list(tok.encode("utf-8", errors="replace")),
                top_logprobs=[
                    TopLogprob(
                        token=(alt := text(t)), logprob=float(tlp), bytes=list(alt.encode("utf-8", errors="replace"))
                    )
                    for t, tlp in alts
                ],
            )
            for tid, lp, alts in zip(token_ids, logprobs, tops, strict=True)
        ]
    )
