"""The reference trainer: plain torch, replicated weights (DDP semantics), AdamW.

One rank or several: with ``torch.distributed`` initialised (gloo, by ``torchrun`` or
:func:`pipelinerl_sdk.trainer_group.run_ranks`), ``step`` sums the gradients of all ranks in one
flat all-reduce, so the update equals the gradient of the objective summed over every rank's
micro-batches (the :class:`~pipelinerl_sdk.contracts.Objective` contract). Every rank holds the
full model, so ``gather_and_broadcast`` needs no gather: rank 0 lends each parameter to the sink.
The params live in one buffer in the weight-sync staging layout
(:func:`~pipelinerl_sdk.weights.tensors.flatten_params`), so the SDK's sender broadcasts every
bucket straight from the trainer's memory, without packing a copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from pipelinerl_sdk.contracts import (
    Objective,
    StepMetrics,
    TokenBatch,
    TrainerBackend,
    TrainerSpec,
    WeightSink,
    lend,
)
from pipelinerl_sdk.protocol import ParamSpec
from pipelinerl_sdk.reference import capabilities
from pipelinerl_sdk.reference.tiny import load_model
from pipelinerl_sdk.weights.tensors import TORCH_DTYPES, flatten_params, spec_of

CAPABILITIES = capabilities.TRAINER


def pad_batch(input_ids: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to a [B, T] tensor and its attention mask."""
    width = max(len(s) for s in input_ids)
    ids = torch.full((len(input_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(input_ids), width), dtype=torch.long)
    for i, s in enumerate(input_ids):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def token_logprobs(model: torch.nn.Module, input_ids: Sequence[Sequence[int]], pad_id: int = 0) -> list[torch.Tensor]:
    """Per sequence, ``log p(tok_t | tok_<t)`` for t >= 1, in float32 (graph kept if grad is on)."""
    ids, mask = pad_batch(input_ids, pad_id)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return [logp[i, : len(s) - 1] for i, s in enumerate(input_ids)]


class ReferenceTrainer(TrainerBackend):
    capabilities = CAPABILITIES

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._spec: TrainerSpec | None = None
        self._steps = 0
        self._pad_id = 0
        self._flat: torch.Tensor | None = None

    def _require(self) -> tuple[torch.nn.Module, torch.optim.Optimizer, TrainerSpec]:
        if self.model is None or self.optimizer is None or self._spec is None:
            raise RuntimeError("call init() first")
        return self.model, self.optimizer, self._spec

    @property
    def world_size(self) -> int:
        """Ranks whose gradients ``step`` sums: the default group's, or 1 with the option
        ``local=True`` (a trainer used inside one rank only, e.g. to prepare a model)."""
        if self._spec is not None and self._spec.options.get("local"):
            return 1
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def init(self, spec: TrainerSpec) -> None:
        if spec.dtype not in self.capabilities.dtypes:
            raise ValueError(f"dtype: {spec.dtype!r} not supported (supported: {sorted(self.capabilities.dtypes)})")
        torch.manual_seed(spec.seed)
        model, tokenizer = load_model(spec.model, dtype=spec.dtype)
        model.train()
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.model = model
        self._flat = flatten_params(list(model.named_parameters()))
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=spec.lr,
            betas=spec.betas,
            eps=spec.eps,
            weight_decay=spec.weight_decay,
            foreach=False,
        )
        self._spec = spec

    def param_specs(self) -> list[ParamSpec]:
        model, _, _ = self._require()
        return [spec_of(n, p) for n, p in model.named_parameters()]

    def forward(self, batch: TokenBatch) -> list[torch.Tensor]:
        model, _, _ = self._require()
        with torch.no_grad():
            return [t.detach() for t in token_logprobs(model, batch.input_ids, self._pad_id)]

    def backward(self, batch: TokenBatch, objective: Objective) -> dict[str, float]:
        model, _, _ = self._require()
        logprobs = token_logprobs(model, batch.input_ids, self._pad_id)
        loss, metrics = objective(logprobs, batch)
        loss.backward()  # type: ignore[no-untyped-call]
        return {"loss": float(loss.detach()), **metrics}

    def step(self) -> StepMetrics:
        model, optimizer, spec = self._require()
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.world_size > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p))  # type: ignore[union-attr]
                offset += n
        max_norm = spec.grad_clip if spec.grad_clip is not None else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self._steps += 1
        return StepMetrics(step=self._steps, grad_norm=float(grad_norm), lr=float(optimizer.param_groups[0]["lr"]))

    def gather_and_broadcast(self, sink: WeightSink | None) -> None:
        model, _, _ = self._require()
        if sink is None:
            return
        with torch.no_grad():
            for name, p in model.named_parameters():
                lend(sink, name, p.detach())  # unchanged until the next step()

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """Full weights under HF names (for tests and checkpoints)."""
        model, _, _ = self._require()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def close(self) -> None:
        self.model = None
        self.optimizer = None
        self._flat = None


__all__ = ["TORCH_DTYPES", "ReferenceTrainer", "pad_batch", "token_logprobs"]
