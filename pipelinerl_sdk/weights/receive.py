"""Server side: receive one update into a staging buffer, then apply it in one local copy.

A receiver never writes model weights while receiving. Whatever happens during the receive
(timeout, lost trainer, abort), the model is untouched; only :func:`apply_staged`, which runs
after every byte has arrived, writes them. The two receive modes differ only in *when* the
engine is paused: ``direct`` pauses for the receive (once the trainer said ``go``: a called-off
update never pauses), ``staged`` only around the apply.

Two steps, so a server can act between them: :meth:`WeightReceiver.await_go` (the trainer's
decision, no collective) and :meth:`WeightReceiver.receive_decided` (the broadcast itself);
:meth:`WeightReceiver.receive` runs both.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from pipelinerl_sdk.errors import GroupError, UpdateFailed
from pipelinerl_sdk.protocol import update_key
from pipelinerl_sdk.weights.buckets import BucketPlan
from pipelinerl_sdk.weights.group import WeightSyncGroup
from pipelinerl_sdk.weights.tensors import from_bytes


def staging_views(plan: BucketPlan, buffer: torch.Tensor) -> tuple[tuple[str, torch.Tensor], ...]:
    """(name, typed view) of every param of ``plan`` in a staging ``buffer`` of its layout."""
    return tuple(
        (e.spec.name, from_bytes(buffer[b.offset + e.offset : b.offset + e.offset + e.spec.nbytes], e.spec))
        for b in plan.buckets
        for e in b.entries
    )


@dataclass(frozen=True, slots=True)
class StagedWeights:
    """Every param of one update, received and not yet applied. Views into the receiver's
    staging buffer: valid until the receiver's next :meth:`WeightReceiver.receive`. ``views``
    (built from the plan if not given) are ready before the apply, which then builds none."""

    plan: BucketPlan
    buffer: torch.Tensor
    receive_s: float
    views: tuple[tuple[str, torch.Tensor], ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.views is None:
            object.__setattr__(self, "views", staging_views(self.plan, self.buffer))

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        assert self.views is not None
        return iter(self.views)


class NonFiniteWeights(UpdateFailed):
    """A received param holds NaN or infinity: the update is refused after its last bucket (the
    group stays healthy, the old weights keep serving). The message names the param."""


def first_non_finite(tensors: Iterator[tuple[str, torch.Tensor]]) -> str | None:
    """Name of the first floating-point tensor holding a NaN or an infinity, or None. Cheap: one
    sum per tensor (NaN and inf propagate through it); only a non-finite sum is confirmed
    element-wise (a sum of finite values may overflow)."""
    for name, t in tensors:
        if not t.is_floating_point() or t.numel() == 0:
            continue
        total = t.sum(dtype=torch.float32) if t.dtype == torch.float16 else t.sum()
        if not bool(torch.isfinite(total)) and not bool(torch.isfinite(t).all()):
            return name
    return None


class WeightReceiver:
    """One receiving worker. Owns a staging buffer of the plan's total size, kept across
    updates of the same size. Not thread-safe: one receive at a time (the server's update lock)."""

    def __init__(self, group: WeightSyncGroup) -> None:
        self.group = group
        self._buffer: torch.Tensor | None = None
        # The views of the last plan in the (at most two) buffers it was received into: building
        # them costs ~0.3 ms of Python holding the GIL, right when the server answers "accepted".
        self._cached_plan: BucketPlan | None = None
        self._cached_views: dict[int, tuple[tuple[str, torch.Tensor], ...]] = {}

    def _views(self, plan: BucketPlan, buf: torch.Tensor) -> tuple[tuple[str, torch.Tensor], ...]:
        if plan != self._cached_plan or (len(self._cached_views) >= 2 and buf.data_ptr() not in self._cached_views):
            self._cached_plan, self._cached_views = plan, {}  # (the views hold their buffers: no stale pointer)
        views = self._cached_views.get(buf.data_ptr())
        if views is None:
            views = self._cached_views[buf.data_ptr()] = staging_views(plan, buf)
        return views

    def _staging(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() != nbytes:
            self._buffer = None  # free the old one before allocating
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        return self._buffer

    def await_go(self, key: str, timeout_s: float) -> None:
        """Wait (no collective) for the trainer's decision on ``key``. Raises
        :class:`~pipelinerl_sdk.errors.UpdateAborted` if the trainer called it off (the group stays
        healthy), :class:`GroupError` on a timeout or a lost store: the group is then marked
        broken, since the trainer may still enter the broadcast this member will not join."""
        try:
            self.group.await_decision(key, timeout_s)
        except GroupError as e:
            self.group.mark_broken(str(e))
            raise

    def receive(
        self, plan: BucketPlan, key: str, *, decision_timeout_s: float, into: torch.Tensor | None = None
    ) -> StagedWeights:
        """:meth:`prepare`, :meth:`await_go` on ``key``, then :meth:`receive_decided`."""
        buf = self.prepare(plan, into=into)
        self.await_go(key, decision_timeout_s)
        return self.receive_decided(plan, into=buf)

    def prepare(self, plan: BucketPlan, *, into: torch.Tensor | None = None) -> torch.Tensor:
        """Build (and cache) the views of ``plan`` in its target buffer before the decision, so
        nothing holds the GIL once bytes flow; returns that buffer. Optional: the receive builds
        what is missing."""
        buf = self._target(plan, into)
        self._views(plan, buf)
        return buf

    def receive_decided(
        self, plan: BucketPlan, *, into: torch.Tensor | None = None, on_first_bucket: Callable[[], None] | None = None
    ) -> StagedWeights:
        """Receive every bucket of ``plan`` (the trainer said ``go``) into the receiver's staging
        buffer, or into ``into`` (a uint8 buffer of ``plan.total_bytes`` on the group's device that
        the caller owns, e.g. :meth:`DoubleBuffer.spare
        <pipelinerl_sdk.weights.swap.DoubleBuffer.spare>`). Raises :class:`GroupError` on a lost
        peer or a timeout (the group is then broken), :class:`NonFiniteWeights` once every bucket
        arrived if a param holds NaN or infinity (checked per bucket while the next one streams
        in; the group stays healthy). ``on_first_bucket`` is called (on this thread) once the
        first bucket has arrived: bytes flow, the trainer is not stuck before sending."""
        buf = self._target(plan, into)
        views = self._views(plan, buf)
        t0 = time.perf_counter()
        bad: str | None = None
        start = 0  # index in ``views`` of the first param of the bucket being received
        last: tuple[tuple[str, torch.Tensor], ...] = ()  # the params of the bucket received last
        for b in plan.buckets:
            work = self.group.broadcast_async(buf[b.offset : b.offset + b.nbytes], 0)
            bad = bad or first_non_finite(iter(last))  # checked while this bucket streams in
            self.group.wait(work, f"receive of bucket {b.index}")
            if on_first_bucket is not None and b.index == 0:
                on_first_bucket()
            last, start = views[start : start + len(b.entries)], start + len(b.entries)
        bad = bad or first_non_finite(iter(last))
        if bad is not None:
            raise NonFiniteWeights(f"param {bad!r} holds NaN or infinity: update refused")
        return StagedWeights(plan, buf, time.perf_counter() - t0, views)

    def _target(self, plan: BucketPlan, into: torch.Tensor | None) -> torch.Tensor:
        if into is None:
            return self._staging(plan.total_bytes)
        if into.dtype != torch.uint8 or into.numel() != plan.total_bytes:
            raise ValueError(f"into: need a uint8 buffer of {plan.total_bytes} bytes, got {into.dtype} {into.numel()}")
        return into

    def receive_flat(self, nbytes: int, key: str, *, decision_timeout_s: float) -> float:
        """The probe: :meth:`await_go` on ``key``, then receive one flat broadcast of ``nbytes``
        and discard it; returns the receive seconds."""
        self.await_go(key, decision_timeout_s)
        buf = self._staging(nbytes)  # reused: first-touch page faults would inflate the baseline
        t0 = time.perf_counter()
        self.group.broadcast(buf, 0, what="probe receive")
        return time.perf_counter() - t0


@torch.no_grad()
def apply_staged(staged: StagedWeights, params: Mapping[str, torch.Tensor]) -> int:
    """Copy every staged tensor into ``params`` (name -> the live tensor); returns bytes copied.

    Callers validate names and shapes before the receive, so a missing name here is a bug:
    it raises KeyError before anything is written."""
    pairs = [(params[name], t) for name, t in staged.tensors()]
    copied = 0
    for dst, src in pairs:
        dst.copy_(src)
        copied += src.numel() * src.element_size()
    return copied


__all__ = ["GroupError", "NonFiniteWeights", "StagedWeights", "WeightReceiver", "apply_staged", "update_key"]
