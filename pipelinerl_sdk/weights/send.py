"""Trainer side: stream named tensors through the bucket plan into the group.

Ownership: the sender owns two bucket buffers of ``plan.max_bucket_bytes`` each (the only extra
memory it needs, whatever the model size). A tensor handed to :meth:`WeightSender.send` is copied
before the call returns, so the caller may free or reuse it at once (gathered layers, say).
Packing bucket k+1 overlaps the broadcast of bucket k.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipelinerl_sdk.errors import PipelineRLError
from pipelinerl_sdk.weights.buckets import BucketPlan
from pipelinerl_sdk.weights.group import WeightSyncGroup
from pipelinerl_sdk.weights.tensors import TORCH_DTYPES, as_bytes


class SendOrderError(PipelineRLError, ValueError):
    """A tensor handed to the sender is not the one the plan expects next (name, dtype, shape)."""


@dataclass(frozen=True, slots=True)
class SendStats:
    bytes_sent: int
    buckets: int
    seconds: float


class WeightSender:
    """Rank 0 of the group. Call :meth:`send` once per param, in plan order, then
    :meth:`finish`. Any error leaves the group broken for the receivers' timeout to notice;
    the sender itself never retries."""

    def __init__(self, group: WeightSyncGroup, plan: BucketPlan, buffers: list[torch.Tensor] | None = None) -> None:
        """``buffers``: two uint8 tensors of at least ``plan.max_bucket_bytes`` on the group's
        device to reuse (fresh pages cost a first-touch fault on every update); allocated if None."""
        if group.rank != 0:
            raise PipelineRLError("only rank 0 of the weight-update group sends")
        self._group = group
        self._plan = plan
        self._order = [(b.index, e) for b in plan.buckets for e in b.entries]
        self._next = 0
        size = plan.max_bucket_bytes
        if buffers is None or len(buffers) != 2 or any(b.numel() < size for b in buffers):
            buffers = [torch.empty(size, dtype=torch.uint8, device=group.device) for _ in range(2)]
        self.buffers = buffers
        self._buffers = buffers
        self._pending: list[dist.Work | None] = [None, None]
        self._started = time.perf_counter()
        self._sent = 0

    @property
    def expected(self) -> str | None:
        """Name of the next param the plan expects, or None when all were sent."""
        return self._order[self._next][1].spec.name if self._next < len(self._order) else None

    def send(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._order):
            raise SendOrderError(f"{name!r}: every param of the plan was already sent")
        bucket_index, entry = self._order[self._next]
        spec = entry.spec
        if name != spec.name:
            raise SendOrderError(f"expected param {spec.name!r} next, got {name!r}")
        if tuple(tensor.shape) != spec.shape or tensor.dtype != TORCH_DTYPES[spec.dtype]:
            raise SendOrderError(
                f"{name!r}: got {tensor.dtype} {tuple(tensor.shape)}, plan says {spec.dtype} {spec.shape}"
            )
        slot = bucket_index % 2
        if entry.offset == 0:
            self._drain(slot)  # the buffer is reused: its previous broadcast must be done
        buf = self._buffers[slot]
        buf[entry.offset : entry.offset + spec.nbytes].copy_(as_bytes(tensor))
        self._next += 1
        bucket = self._plan.buckets[bucket_index]
        if entry is bucket.entries[-1]:
            self._pending[slot] = self._group.broadcast_async(buf[: bucket.nbytes], 0)
            self._sent += bucket.nbytes

    def _drain(self, slot: int) -> None:
        work = self._pending[slot]
        if work is not None:
            self._pending[slot] = None
            self._group.wait(work, "weight broadcast")

    def finish(self) -> SendStats:
        """Wait for the last broadcasts; SendOrderError if params are missing."""
        if self._next != len(self._order):
            raise SendOrderError(f"update incomplete: next expected param is {self.expected!r}")
        self._drain(0)
        self._drain(1)
        return SendStats(self._sent, len(self._plan.buckets), time.perf_counter() - self._started)


def broadcast_flat(group: WeightSyncGroup, nbytes: int) -> float:
    """Rank 0: one broadcast of a single flat buffer of ``nbytes``; returns its seconds (the
    baseline an update is compared with)."""
    buf = torch.ones(nbytes, dtype=torch.uint8, device=group.device)  # written: pages are resident
    t0 = time.perf_counter()
    group.broadcast(buf, 0, what="probe broadcast")
    return time.perf_counter() - t0
