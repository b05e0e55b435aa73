"""Objectives other than GRPO: plain supervised likelihood of the completion tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipelinerl_sdk.contracts import TokenBatch


@dataclass(frozen=True, slots=True)
class CompletionNLL:
    """Minus the summed completion logprobs, divided by ``n_sequences`` (the *global* sequence
    count, so that summing it over micro-batches and ranks, as the Objective contract says
    trainers do, gives the mean over the whole batch)."""

    n_sequences: int

    def __call__(self, logprobs: Sequence[torch.Tensor], batch: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
        total = torch.zeros((), dtype=torch.float32)
        tokens = 0
        for lp, start in zip(logprobs, batch.completion_start, strict=True):
            total = total + lp[start - 1 :].float().sum()
            tokens += lp.numel() - (start - 1)
        return -total / self.n_sequences, {"completion_tokens": float(tokens)}
