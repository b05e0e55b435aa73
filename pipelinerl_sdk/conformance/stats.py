"""Exact statistics for the sampling checks: each test has a stated false-failure rate that holds
for any sample size (no asymptotics), so a correct engine fails with probability at most
``alpha`` whatever its random number generator.

- :func:`sampling_distribution`: what a token must be drawn from, given the model's logits, the
  temperature, ``min_p``, ``top_k`` and ``top_p`` (vLLM's semantics: temperature first, then
  min-p, top-k, and the smallest set of most likely tokens whose mass reaches ``top_p``).
- :func:`randomized_pit`: the randomized probability integral transform of a drawn token. If every
  token of a completion is drawn from its distribution, the transforms of all its tokens (and of
  all independent completions) are i.i.d. uniform on [0, 1], in whatever order they were drawn.
- :func:`dkw_uniformity`: the Dvoretzky-Kiefer-Wolfowitz-Massart bound
  ``P(sup |F_n - U| > eps) <= 2 exp(-2 n eps^2)``, valid for every n.
- :func:`all_equal_bound`: Bonferroni over groups of draws that came out identical.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def _filtered(logits: torch.Tensor, temperature: float, top_k: int, min_p: float) -> torch.Tensor:
    """softmax(logits / temperature), then min-p (tokens under ``min_p`` times the best token's
    probability dropped) and top-k (tokens below the k-th probability dropped, ties kept),
    renormalised: vLLM's order, every cut after the temperature."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    if 0 < top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k, dim=-1).values[..., -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def sampling_distribution(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, *, top_k: int = 0, min_p: float = 0.0
) -> torch.Tensor:
    """Rows of probabilities a correct sampler draws from (``logits``: ``[..., vocab]``, fp32 or
    fp64), in vLLM's order: the temperature first, then min-p, top-k (``<= 0``: off) and top-p.
    ``top_p`` keeps token k iff the mass of the tokens more likely than k is below ``top_p`` (at
    least the most likely token survives), then renormalises."""
    probs = _filtered(logits, temperature, top_k, min_p)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def nucleus_is_ambiguous(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    slack: float,
    *,
    top_k: int = 0,
    min_p: float = 0.0,
    logit_slack: float = 0.0,
) -> torch.Tensor:
    """Per row: whether numerics of the server's dtype may put some token on either side of a
    cut: its preceding mass within ``slack`` of ``top_p``; its logit within ``logit_slack`` of the
    min-p threshold's (``max + temperature * log(min_p)``); or the k-th and (k+1)-th logits within
    ``logit_slack`` of each other."""
    out = torch.zeros(logits.shape[:-1], dtype=torch.bool)
    x = logits.double()
    if min_p > 0:
        threshold = x.amax(dim=-1, keepdim=True) + temperature * math.log(min_p)
        out |= ((x - threshold).abs() < logit_slack).any(dim=-1)
    if 0 < top_k < x.shape[-1]:
        top = torch.topk(x, top_k + 1, dim=-1).values
        out |= (top[..., -2] - top[..., -1]) < logit_slack
    if top_p < 1.0:
        probs = _filtered(logits, temperature, top_k, min_p)
        sorted_probs, _ = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        out |= ((before - top_p).abs() < slack).any(dim=-1)
    return out


def randomized_pit(probs: torch.Tensor, token: int, v: float) -> float | None:
    """``F(token-) + v * p(token)`` with the vocabulary ordered most likely first (ties by id);
    ``None`` when ``p(token) == 0`` (a token the distribution cannot produce). ``v`` is a uniform
    draw of the suite's own, independent of the server."""
    p = probs.double()
    pt = float(p[token])
    if pt <= 0.0:
        return None
    ids = torch.arange(p.numel())
    ahead = (p > pt) | ((p == pt) & (ids < token))
    return float(p[ahead].sum()) + v * pt


@dataclass(frozen=True, slots=True)
class Uniformity:
    """Kolmogorov distance ``d`` of ``n`` points from the uniform law; ``p_bound`` bounds the
    probability of a distance at least ``d`` under uniformity; ``critical`` is the distance at
    which the bound reaches ``alpha``."""

    n: int
    d: float
    p_bound: float
    critical: float
    alpha: float

    @property
    def rejected(self) -> bool:
        return self.d > self.critical

    def describe(self) -> str:
        return (
            f"Kolmogorov distance {self.d:.3f} over {self.n} tokens, critical {self.critical:.3f} at false-failure "
            f"rate {self.alpha:g} (P <= {self.p_bound:.2g})"
        )


def dkw_uniformity(points: Sequence[float], alpha: float) -> Uniformity:
    """Distance of the empirical CDF of ``points`` from U[0, 1], with Massart's bound."""
    n = len(points)
    if n == 0:
        raise ValueError("no points")
    xs = sorted(points)
    d = max(max((i + 1) / n - x, x - i / n) for i, x in enumerate(xs))
    return Uniformity(
        n=n,
        d=d,
        p_bound=min(1.0, 2 * math.exp(-2 * n * d * d)),
        critical=math.sqrt(math.log(2 / alpha) / (2 * n)),
        alpha=alpha,
    )


def all_equal_bound(n_groups: int, alpha: float) -> float:
    """A group of k independent draws all equal to its first one, ``x``, has conditional
    probability ``P(x)^(k-1)``; flagging a group only when that is below ``alpha / n_groups``
    fails a correct sampler with probability at most ``alpha`` (Bonferroni over groups)."""
    return alpha / n_groups
