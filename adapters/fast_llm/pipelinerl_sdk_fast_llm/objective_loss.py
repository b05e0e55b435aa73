"""The SDK's objective as a Fast-LLM language-model loss (Fast-LLM's own loss registry, no patch).

Fast-LLM's head computes the gradient of its losses with respect to the logits itself, then runs its
own backward through the stages. Its GRPO loss clips the importance weight and divides by the number
of labelled tokens in the batch; the SDK's objectives (any :class:`~pipelinerl_sdk.contracts.Objective`,
simplified GRPO among them) take per-token logprobs and are summed, not averaged. So the adapter
registers this loss type, ``pipelinerl_sdk_objective``, in Fast-LLM's config registry and puts it in the
head: it turns the head's logits into each sequence's token logprobs, calls the objective the trainer
installed for the current ``backward`` (:meth:`SDKObjectiveLoss.install`), and hands Fast-LLM
``d(objective)/d(logits)`` times Fast-LLM's ``grad_output`` (its data-parallel pre-scaling, undone by its
averaging reduction: the accumulated gradient is the objective summed over ranks). With nothing installed
(a rank with an empty batch joining the collectives) the loss is zero with a zero gradient.

Imports Fast-LLM and torch: load it only inside the Fast-LLM environment.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from fast_llm.config import config_class
from fast_llm.layers.language_model.loss.config import LanguageModelLossConfig
from fast_llm.layers.language_model.loss.loss import SingleLoss, loss_forward_backward

#: The loss type name in Fast-LLM's registry (``head.losses.<name>.type``).
LOSS_TYPE = "pipelinerl_sdk_objective"


@dataclass(slots=True)
class PendingObjective:
    """What one ``backward`` asks of the loss: ``fn(per_sequence_logprobs) -> (loss, metrics)`` and the
    token count of each sequence in the packed micro-batch, in order (a trailing padding document of
    one token is not listed)."""

    fn: Callable[[list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]
    lengths: Sequence[int]
    loss: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    calls: int = 0


def split_logprobs(token_logprobs: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Per sequence, the logprobs of its tokens after the first: position ``p`` of the packed stream
    holds the logprob of token ``p + 1``, so sequence ``i`` starting at ``b`` owns ``[b, b + L - 1)``."""
    out, begin = [], 0
    for length in lengths:
        out.append(token_logprobs[begin : begin + length - 1])
        begin += length
    return out


@config_class(dynamic_type={LanguageModelLossConfig: LOSS_TYPE})
class SDKObjectiveLossConfig(LanguageModelLossConfig):
    """Fast-LLM config of :class:`SDKObjectiveLoss` (no fields: the objective comes per ``backward``)."""

    _abstract: typing.ClassVar[bool] = False

    @property
    def loss_class(self) -> type[SDKObjectiveLoss[Any]]:
        return SDKObjectiveLoss


#: Fast-LLM finds a configurable's config class from a type variable named ``ConfigType`` bound to it
#: (written ``class X[ConfigType: C](...)`` in its own 3.12 syntax; the SDK's tooling targets 3.11).
ConfigType = typing.TypeVar("ConfigType", bound=SDKObjectiveLossConfig)


class SDKObjectiveLoss(SingleLoss[ConfigType]):
    """Fast-LLM loss layer that evaluates the installed SDK objective on the head's logits."""

    _pending: PendingObjective | None = None

    def install(self, pending: PendingObjective | None) -> None:
        """Use ``pending`` for the next forward-backward of the head (None: a zero loss)."""
        self._pending = pending

    def _forward_backward(
        self,
        logits: torch.Tensor,
        kwargs: dict[str, typing.Any],
        losses: dict[str, typing.Any] | None = None,
        split_index: int = 0,
        grad_logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._vocab_parallel or self._sequence_parallel or self._num_splits != 1:
            raise NotImplementedError("the SDK objective loss needs whole logits (no tensor parallel, no splits)")
        pending = self._pending
        grad_output = self._get_grad_output(kwargs)
        labels = self._get_labels(kwargs, split_index).flatten()
        scale = self._logits_scale_factor

        def objective(logits_: torch.Tensor) -> torch.Tensor:
            if pending is None:
                return (logits_.float() * 0.0).sum()
            logprobs = torch.log_softmax(logits_.flatten(0, -2).float() * scale, dim=-1)
            token_logprobs = logprobs.gather(-1, labels.clamp_min(0)[:, None])[:, 0]
            loss, metrics = pending.fn(split_logprobs(token_logprobs, pending.lengths))
            pending.loss += float(loss.detach())
            pending.metrics = metrics
            pending.calls += 1
            return loss

        loss, grad = loss_forward_backward(grad_output, objective, logits)
        if grad is not None:
            grad = grad.to(logits.dtype)
            if grad_logits is not None:
                grad = grad_logits.add_(grad)
        return loss, grad
