"""Logits processing and sampling of the reference engine, with vLLM's semantics.

Order (vLLM v1's sampler): ``logit_bias`` added; repetition penalty on every token of the prompt
or the output (positive logits divided, others multiplied); frequency (times the output count)
and presence (once per token seen in the output) penalties subtracted; greedy is the argmax of
these; else temperature, min-p (drop tokens under ``min_p`` times the best probability), top-k,
top-p, and a draw. The reported logprobs are the raw model's unless the server's logprobs mode
says otherwise (:func:`processed_logits`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from pipelinerl_sdk.logprobs import LOGPROB_FLOOR as SHARED_FLOOR


class Penalties(Protocol):
    """The penalties of one request (the engine's ``SamplingParams`` has them)."""

    @property
    def repetition_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...


def process_logits(
    logits: torch.Tensor,
    prompt: Sequence[int],
    output: Sequence[int],
    bias: tuple[torch.Tensor, torch.Tensor] | None,
    penalties: Penalties,
) -> torch.Tensor:
    """``logits`` (one fp32 row) with ``bias`` (ids, values) and the ``penalties`` applied over
    the ``prompt`` and ``output`` tokens (a new tensor)."""
    repetition_penalty = penalties.repetition_penalty
    frequency_penalty, presence_penalty = penalties.frequency_penalty, penalties.presence_penalty
    out = logits.clone()
    if bias is not None:
        ids, values = bias
        out.index_add_(0, ids, values)
    if repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*prompt, *output}), dtype=torch.long, device=out.device)
        vals = out[seen]
        out[seen] = torch.where(vals > 0, vals / repetition_penalty, vals * repetition_penalty)
    if (frequency_penalty or presence_penalty) and output:
        counts = torch.bincount(torch.tensor(output, device=out.device), minlength=out.shape[0]).to(out.dtype)
        out -= frequency_penalty * counts + presence_penalty * (counts > 0).to(out.dtype)
    return out


def sample(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    generator: torch.Generator,
) -> int:
    """One token from processed ``logits``: argmax at temperature 0, else a draw from the
    distribution cut by min-p, top-k (``<= 0``: off) and top-p (each keeps the best token).
    ValueError when the temperature leaves no finite distribution."""
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        raise ValueError(f"temperature {temperature!r} leaves no finite distribution to sample")
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    if 0 < top_k < probs.shape[0]:
        kth = torch.topk(probs, top_k).values[-1]
        probs = probs.masked_fill(probs < kth, 0.0)
    if min_p > 0 or 0 < top_k < probs.shape[0]:
        probs = probs / probs.sum()
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = cumulative - sorted_probs >= top_p
        drop[..., 0] = False  # the most likely token always stays (top_p may underflow float32)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


#: What vLLM reports for a logprob of -inf (:data:`pipelinerl_sdk.logprobs.LOGPROB_FLOOR`).
LOGPROB_FLOOR = SHARED_FLOOR


def processed_logits(
    logits: torch.Tensor, *, temperature: float, top_p: float, top_k: int, min_p: float
) -> torch.Tensor:
    """The logits :func:`sample` draws from, as vLLM's ``processed_logits`` mode reports them:
    processed ``logits`` (bias and penalties applied) divided by the temperature, the tokens min-p,
    top-k and top-p cut at -inf (the same cuts as :func:`sample`); at temperature 0, ``logits``
    unscaled (vLLM's greedy path). ``log_softmax`` of the result is ``processed_logprobs``."""
    if temperature == 0:
        return logits.clone()
    out = logits / temperature
    probs = torch.softmax(out, dim=-1)
    cut = torch.zeros_like(probs, dtype=torch.bool)
    if min_p > 0:
        cut |= probs < min_p * probs.max()
        probs = probs.masked_fill(cut, 0.0)
    if 0 < top_k < probs.shape[0]:
        kth = torch.topk(probs, top_k).values[-1]
        cut |= probs < kth
        probs = probs.masked_fill(cut, 0.0)
    if min_p > 0 or 0 < top_k < probs.shape[0]:
        probs = probs / probs.sum()
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
        drop[..., 0] = False
        cut |= torch.zeros_like(cut).scatter_(-1, order, drop)
    return out.masked_fill(cut, float("-inf"))
