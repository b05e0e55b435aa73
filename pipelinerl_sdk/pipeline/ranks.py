"""Trainer ranks for the pipeline: rank 0 runs the loop (actors, HTTP, publishing) and mirrors
every trainer call to ranks 1..N-1, which only follow. Works the same under
:func:`pipelinerl_sdk.trainer_group.run_ranks` (spawn) and ``torchrun``.

Each optimizer batch is split into ``world_size`` contiguous shards of sequences; every rank runs
``backward`` on its own shard with the objective built for the *whole* batch (its normaliser is
the global sequence count), so the summed gradient is the batch's, whatever the world size.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipelinerl_sdk.contracts import Objective, StepMetrics, TokenBatch, TrainerBackend, TrainerSpec, WeightSink
from pipelinerl_sdk.protocol import ParamSpec


def shard(batch: TokenBatch, world_size: int) -> list[TokenBatch]:
    """Contiguous, near-equal shards; ValueError when a rank would get no sequence (sharded
    trainers must all run every forward)."""
    n = len(batch)
    if n < world_size:
        raise ValueError(f"batch: {n} sequences cannot feed {world_size} trainer ranks")
    bounds = [n * r // world_size for r in range(world_size + 1)]

    def part(seq: Sequence[Any], lo: int, hi: int) -> Sequence[Any]:
        return list(seq[lo:hi]) if seq else ()

    return [
        TokenBatch(
            input_ids=part(batch.input_ids, lo, hi),
            completion_start=part(batch.completion_start, lo, hi),
            advantages=part(batch.advantages, lo, hi),
            behaviour_logprobs=part(batch.behaviour_logprobs, lo, hi),
            ref_logprobs=part(batch.ref_logprobs, lo, hi),
        )
        for lo, hi in itertools.pairwise(bounds)
    ]


def _send(command: tuple[Any, ...]) -> None:
    dist.broadcast_object_list([command], src=0)


def _receive() -> tuple[Any, ...]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    command: tuple[Any, ...] = box[0]
    return command


class LeaderTrainer(TrainerBackend):
    """Rank 0's view: a :class:`TrainerBackend` whose every call also runs on the followers."""

    def __init__(self, local: TrainerBackend) -> None:
        self.local = local
        self.capabilities = local.capabilities
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1

    def init(self, spec: TrainerSpec) -> None:
        if self.world_size > 1:
            _send(("init", spec))
        self.local.init(spec)

    def param_specs(self) -> list[ParamSpec]:
        return self.local.param_specs()

    def forward(self, batch: TokenBatch) -> list[torch.Tensor]:
        return self.local.forward(batch)

    def backward(self, batch: TokenBatch, objective: Objective) -> dict[str, float]:
        if self.world_size == 1:
            return self.local.backward(batch, objective)
        shards = shard(batch, self.world_size)
        _send(("backward", shards, objective))
        return self.local.backward(shards[0], objective)

    def step(self) -> StepMetrics:
        if self.world_size > 1:
            _send(("step",))
        return self.local.step()

    def gather_and_broadcast(self, sink: WeightSink | None) -> None:
        if self.world_size > 1:
            _send(("gather",))
        self.local.gather_and_broadcast(sink)

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        if self.world_size > 1:
            _send(("state_dict",))
        return self.local.state_dict_hf()

    def close(self) -> None:
        if self.world_size > 1:
            _send(("stop",))
        self.local.close()


def follow(trainer: TrainerBackend) -> int:
    """Ranks 1..N-1: execute rank 0's calls until it says stop; returns the steps taken."""
    rank = dist.get_rank()
    steps = 0
    while True:
        command = _receive()
        match command[0]:
            case "init":
                trainer.init(command[1])
            case "backward":
                trainer.backward(command[1][rank], command[2])
            case "step":
                trainer.step()
                steps += 1
            case "gather":
                trainer.gather_and_broadcast(None)
            case "state_dict":
                trainer.state_dict_hf()
            case "stop":
                trainer.close()
                return steps
            case other:
                raise RuntimeError(f"rank {rank}: unknown command {other!r} from rank 0")
