"""The ``logprobs`` block of a chat choice, built the same way by every inference backend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipelinerl_sdk.protocol import ChoiceLogprobs, TokenLogprob, TopLogprob


def choice_logprobs(
    tokenizer: Any,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None,
) -> ChoiceLogprobs:
    """One entry per completion token: its text, the logprob of the sampled token and, if given,
    the alternatives ``(token id, logprob)`` of ``top_logprobs[i]``, best first, already cut to
    the request's ``top_logprobs``. ValueError if the lengths differ (an engine that returned
    logprobs for some tokens only)."""
    tops: Sequence[Sequence[tuple[int, float]]] = top_logprobs if top_logprobs is not None else [() for _ in token_ids]
    tokens = tokenizer.convert_ids_to_tokens(list(token_ids))
    return ChoiceLogprobs(
        content=[
            TokenLogprob(
                token=str(tok),
                logprob=float(lp),
                top_logprobs=[
                    TopLogprob(token=str(tokenizer.convert_ids_to_tokens(int(t))), logprob=float(tlp))
                    for t, tlp in alts
                ],
            )
            for tok, lp, alts in zip(tokens, logprobs, tops, strict=True)
        ]
    )
