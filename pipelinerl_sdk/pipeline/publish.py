"""One weight update from a trainer to its servers: what ``pipelinerl run`` does after every step,
and what the conformance cross check calls, so the check takes the loop's path (the publisher's
sender, with its zero-copy ``lend``, its bucket size and fan-out)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from pipelinerl_sdk.contracts import TrainerBackend, WeightSink
from pipelinerl_sdk.protocol import ParamSpec
from pipelinerl_sdk.weights.publisher import WeightPublisher
from pipelinerl_sdk.weights.tensors import TORCH_DTYPES


class CastingSink:
    """Hands every tensor on to ``inner`` in the dtype the server expects for it (``specs``: the
    wire specs, by name). A float32 trainer updating a bfloat16 server sends bfloat16 tensors;
    the cast is the only thing between trainer and server, and it is what the server would do
    itself on load (round to nearest). A cast tensor is new memory: it is sent, never lent."""

    def __init__(self, inner: WeightSink, specs: Sequence[ParamSpec]) -> None:
        self.inner = inner
        self.dtypes = {s.name: TORCH_DTYPES[s.dtype] for s in specs}

    def send(self, name: str, tensor: torch.Tensor) -> None:
        want = self.dtypes.get(name)
        if want is None:
            raise AssertionError(f"the trainer sent {name!r}, which is not in param_specs()")
        self.inner.send(name, tensor if tensor.dtype == want else tensor.to(want))


async def publish_weights(
    trainer: TrainerBackend, publisher: WeightPublisher, version: int, specs: Sequence[ParamSpec]
) -> None:
    """Publish the trainer's current weights as ``version`` (a collective over the trainer's
    ranks: with several, the caller is rank 0's :class:`~pipelinerl_sdk.pipeline.ranks.LeaderTrainer`).
    ``specs``: the update's wire specs in the trainer's order; where their dtypes are the
    trainer's own, ``gather_and_broadcast`` gets the publisher's sender itself (a trainer may
    lend its params to it), else a :class:`CastingSink` in front of it."""
    own = {s.name: s.dtype for s in trainer.param_specs()}
    cast = any(own.get(s.name) != s.dtype for s in specs)
    async with publisher.update(version, specs) as sender:
        sink: WeightSink = CastingSink(sender, specs) if cast else sender
        await asyncio.to_thread(trainer.gather_and_broadcast, sink)
