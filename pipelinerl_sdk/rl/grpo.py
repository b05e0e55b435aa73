"""Simplified GRPO, as PipelineRL trains: group-relative advantages and an unclamped
importance-weighted policy gradient.

What it deliberately leaves out: a value function, a trust-region clamp, overlong-sequence
filtering, reward shaping, and (by default) any KL or entropy term. The loss of a batch is the
sum over every completion token of every sequence, divided by the number of sequences in the
*whole* batch (all micro-batches, all ranks), so every token weighs the same whatever the
micro-batching.

Per completion token t of sequence i, with advantage A_i, behaviour logprob b_t (from the
server that generated it) and new logprob l_t::

    w_t    = exp(l_t - b_t)                     # importance weight, unclamped
    loss  += -w_t * A_i                         # d/dl: -w_t * A_i
    loss  += kl_coef * (exp(r_t - l_t) - (r_t - l_t) - 1)   # optional, r_t = reference logprob
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipelinerl_sdk.contracts import TokenBatch


def group_advantages(
    rewards: Sequence[float], group_size: int, *, normalize_std: bool = False, eps: float = 1e-6
) -> list[float]:
    """Reward minus the mean of its group (consecutive runs of ``group_size`` samples of one
    prompt); divided by the group's standard deviation (population) plus ``eps`` if asked."""
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"rewards: {len(rewards)} values do not split into groups of {group_size}")
    out: list[float] = []
    for g in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[g : g + group_size]]
        mean = sum(group) / group_size
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / group_size)
        out.extend((r - mean) / (std + eps) if normalize_std else r - mean for r in group)
    return out


@dataclass(frozen=True, slots=True)
class GRPOObjective:
    """The :class:`~pipelinerl_sdk.contracts.Objective` of simplified GRPO.

    ``num_sequences`` is the number of sequences in the whole optimizer batch (every micro-batch
    of every rank): the normaliser. ``kl_coef`` > 0 adds the k3 estimator of KL(new || ref)
    against ``batch.ref_logprobs``."""

    num_sequences: int
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.num_sequences < 1:
            raise ValueError(f"num_sequences must be >= 1, got {self.num_sequences}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")

    def __call__(self, logprobs: Sequence[torch.Tensor], batch: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
        if not batch.advantages or not batch.behaviour_logprobs:
            raise ValueError("GRPO needs batch.advantages and batch.behaviour_logprobs")
        if self.kl_coef and not batch.ref_logprobs:
            raise ValueError("kl_coef > 0 needs batch.ref_logprobs")
        terms: list[torch.Tensor] = []
        log_ratios: list[torch.Tensor] = []
        kls: list[torch.Tensor] = []
        for i, lp in enumerate(logprobs):
            new = lp[batch.completion_start[i] - 1 :]
            old = torch.as_tensor(batch.behaviour_logprobs[i], dtype=new.dtype)
            if old.shape != new.shape:
                raise ValueError(f"behaviour_logprobs[{i}]: {old.numel()} values for {new.numel()} completion tokens")
            log_ratio = new - old
            term = -torch.exp(log_ratio) * float(batch.advantages[i])
            if self.kl_coef:
                ref = torch.as_tensor(batch.ref_logprobs[i], dtype=new.dtype)
                d = ref - new
                kl = torch.exp(d) - d - 1
                term = term + self.kl_coef * kl
                kls.append(kl.detach())
            terms.append(term.sum())
            log_ratios.append(log_ratio.detach())
        loss = torch.stack(terms).sum() / self.num_sequences
        metrics = off_policy_metrics(log_ratios)
        if kls:
            metrics["kl_ref"] = float(torch.cat(kls).mean()) if sum(k.numel() for k in kls) else 0.0
        return loss, metrics


def off_policy_metrics(log_ratios: Sequence[torch.Tensor]) -> dict[str, float]:
    """How far the trained policy has moved from the one that generated the tokens.

    ``kl_new_old``: mean of ``w*log w - (w - 1)`` (non-negative estimator of KL(new||old));
    ``mean_abs_log_ratio``; ``ess``: effective sample size of the token weights over their
    count, ``(sum w)^2 / (n sum w^2)``, in (0, 1] (1 = fully on-policy)."""
    flat = torch.cat([r.reshape(-1).double() for r in log_ratios]) if log_ratios else torch.zeros(0)
    if flat.numel() == 0:
        return {"kl_new_old": 0.0, "mean_abs_log_ratio": 0.0, "ess": 1.0}
    w = torch.exp(flat)
    return {
        "kl_new_old": float((w * flat - (w - 1)).mean()),
        "mean_abs_log_ratio": float(flat.abs().mean()),
        "ess": float(w.sum() ** 2 / (flat.numel() * (w**2).sum())),
    }
