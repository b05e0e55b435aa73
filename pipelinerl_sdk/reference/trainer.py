"""The reference trainer: plain torch, replicated weights (DDP semantics), AdamW, on the trainer kit.

One rank or several: with ``torch.distributed`` initialised (gloo, by ``torchrun`` or
:func:`pipelinerl_sdk.trainer_group.run_ranks`), ``step`` sums the gradients of all ranks in one
flat all-reduce, so the update equals the gradient of the objective summed over every rank's
micro-batches (the :class:`~pipelinerl_sdk.contracts.Objective` contract). Without a group it runs
as world size 1 (it creates none). Every rank holds the full model, so ``gather_and_broadcast``
needs no gather: rank 0 lends each parameter to the sink. The params live in one buffer in the
weight-sync staging layout (:func:`~pipelinerl_sdk.weights.tensors.flatten_params`), so the SDK's
sender broadcasts every bucket straight from the trainer's memory, without packing a copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from pipelinerl_sdk.contracts import TrainerSpec
from pipelinerl_sdk.hf import load_model, pad_batch, token_logprobs
from pipelinerl_sdk.kit.trainer import KitTrainer
from pipelinerl_sdk.reference import capabilities
from pipelinerl_sdk.weights.tensors import TORCH_DTYPES, flatten_params

CAPABILITIES = capabilities.TRAINER


class ReferenceTrainer(KitTrainer):
    capabilities = CAPABILITIES
    needs_process_group = False
    lends_params = True

    def __init__(self) -> None:
        super().__init__()
        self._flat: torch.Tensor | None = None

    @property
    def world_size(self) -> int:
        """Ranks whose gradients ``step`` sums: the default group's, or 1 with the option
        ``local=True`` (a trainer used inside one rank only, e.g. to prepare a model)."""
        if self.spec is not None and self.spec.options.get("local"):
            return 1
        return super().world_size

    def build_model(self, spec: TrainerSpec) -> torch.nn.Module:
        model, _ = load_model(spec.model, dtype=spec.dtype, device=self.device)
        model.train()
        self._flat = flatten_params(list(model.named_parameters()))
        return model

    def reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        if self.world_size > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p))  # type: ignore[union-attr]
                offset += n

    def release(self) -> None:
        self._flat = None


__all__ = ["TORCH_DTYPES", "ReferenceTrainer", "pad_batch", "token_logprobs"]
