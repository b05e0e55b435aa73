"""Trainer side: stream named tensors through the bucket plan into the group.

Three ways to hand over a param, in plan order:

- :meth:`WeightSender.send` copies the tensor into one of two bucket buffers before it returns, so
  the caller may free or reuse it at once (a gathered layer, say). Packing bucket k+1 overlaps the
  broadcast of bucket k.
- :meth:`WeightSender.slot` gives the place in those buffers where a param still to send goes (the
  bucket being filled or the next one): a trainer that makes the full tensor itself (a gather
  writing its output there) fills it, then hands that same tensor to :meth:`~WeightSender.send`,
  which then copies nothing.
- :meth:`WeightSender.lend` promises the tensor stays alive and unchanged until :meth:`finish`
  returns. When every param of a bucket is lent and they lie in one storage at the plan's
  offsets (a trainer that keeps its params in one buffer in the :func:`~pipelinerl_sdk.weights.
  buckets.flat_layout`), the bucket is broadcast straight from that storage: no copy at all.
  Otherwise the lent tensors are packed like sent ones.

``on_start`` is called once, when the first param is handed over or its slot asked for: the
publisher posts its ``sending`` mark there (:func:`~pipelinerl_sdk.protocol.sending_key`).

Memory: the two bucket buffers of ``plan.max_bucket_bytes``, allocated on the first bucket that
needs packing (never, for a trainer whose every bucket is lent in place).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipelinerl_sdk.errors import PipelineRLError
from pipelinerl_sdk.weights.buckets import Bucket, BucketEntry, BucketPlan
from pipelinerl_sdk.weights.group import WeightSyncGroup
from pipelinerl_sdk.weights.tensors import TORCH_DTYPES, as_bytes


class SendOrderError(PipelineRLError, ValueError):
    """A tensor handed to the sender is not the one the plan expects next (name, dtype, shape)."""


@dataclass(frozen=True, slots=True)
class SendStats:
    bytes_sent: int
    buckets: int
    seconds: float
    #: Buckets broadcast straight from lent tensors' storage (no packing copy).
    in_place_buckets: int = 0
    #: ``time.time()`` when the first bucket's broadcast was issued (None: no bucket), and when
    #: the last broadcast had completed (``finish``).
    first_bucket_at: float | None = None
    last_bucket_at: float | None = None


class WeightSender:
    """Rank 0 of the group. Call :meth:`send` or :meth:`lend` once per param, in plan order, then
    :meth:`finish`. Any error leaves the group broken for the receivers' timeout to notice; the
    sender itself never retries."""

    def __init__(
        self,
        group: WeightSyncGroup,
        plan: BucketPlan,
        buffers: list[torch.Tensor] | None = None,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        """``buffers``: two uint8 tensors of at least ``plan.max_bucket_bytes`` on the group's
        device to reuse (fresh pages cost a first-touch fault on every update); allocated when
        first needed if None. ``on_start``: see the module doc."""
        if group.rank != 0:
            raise PipelineRLError("only rank 0 of the weight-update group sends")
        self._group = group
        self._plan = plan
        self._order = [(b, e) for b in plan.buckets for e in b.entries]
        self._position = {e.spec.name: i for i, (_, e) in enumerate(self._order)}
        self._next = 0
        size = plan.max_bucket_bytes
        if buffers is not None and (len(buffers) != 2 or any(b.numel() < size for b in buffers)):
            buffers = None
        self._buffers = buffers
        self._pending: list[dist.Work | None] = [None, None]
        # The bucket being filled: lent tensors not yet packed, and where the bucket would start
        # in their storage (None once it is being packed).
        self._lent: list[tuple[BucketEntry, torch.Tensor]] = []
        self._in_place: tuple[int, int] | None = None  # (storage data_ptr, byte offset of the bucket)
        self._packing = False
        self._opened = -1  # index of the bucket being filled (its buffer slot drained)
        self._slotted: set[int] = set()  # buckets a slot was handed out in: packed, never lent in place
        self._started = time.perf_counter()
        self._sent = 0
        self._in_place_count = 0
        self._first_at: float | None = None
        self._on_start = on_start

    @property
    def buffers(self) -> list[torch.Tensor] | None:
        """The two bucket buffers, once allocated (a publisher keeps them for the next update)."""
        return self._buffers

    @property
    def expected(self) -> str | None:
        """Name of the next param the plan expects, or None when all were sent."""
        return self._order[self._next][1].spec.name if self._next < len(self._order) else None

    def send(self, name: str, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` into its bucket (nothing to copy when it is this param's :meth:`slot`);
        the caller may reuse it as soon as this returns."""
        bucket, entry = self._take(name, tensor)
        self._pack_lent(bucket)
        self._copy(bucket, entry, tensor)
        self._close_if_full(bucket, entry)

    def slot(self, name: str) -> torch.Tensor | None:
        """Where param ``name``, still to send, goes: a writable tensor of its dtype and shape in
        its bucket's buffer, or None when that bucket lies beyond the one after the bucket being
        filled (only two buffers). Fill it, then :meth:`send` it in its turn (no copy is made).
        Valid until that ``send``. The buffer's previous broadcast has completed when this
        returns (it may wait for it). SendOrderError if ``name`` is not a param still to send."""
        i = self._position.get(name, -1)
        if i < self._next:
            raise SendOrderError(f"{name!r}: not a param of the plan still to send")
        self._start()
        bucket, entry = self._order[i]
        filling = self._order[self._next][0]
        if bucket.index > filling.index + 1:
            return None
        if bucket is filling:
            self._open(bucket)
            self._pack_lent(bucket)
            self._packing = True
        else:  # the next bucket: its buffer's last broadcast (two buckets back) must be over
            self._drain(bucket.index % 2)
        self._slotted.add(bucket.index)
        spec = entry.spec
        raw = self._buffer(bucket)[entry.offset : entry.offset + spec.nbytes]
        return raw.view(TORCH_DTYPES[spec.dtype]).view(spec.shape)

    def lend(self, name: str, tensor: torch.Tensor) -> None:
        """Hand over ``tensor`` without a copy where the layout allows (see the module doc). The
        caller must keep it alive and unchanged until :meth:`finish` returns."""
        bucket, entry = self._take(name, tensor)
        if not self._packing:
            here = _location(tensor, self._group.device)
            start = None if here is None else (here[0], here[1] - entry.offset)
            if start is not None and ((self._in_place is None and entry.offset == 0) or start == self._in_place):
                self._in_place = start
                self._lent.append((entry, tensor))
                self._close_if_full(bucket, entry)
                return
            self._pack_lent(bucket)
        self._copy(bucket, entry, tensor)
        self._close_if_full(bucket, entry)

    def finish(self) -> SendStats:
        """Wait for the last broadcasts; SendOrderError if params are missing."""
        if self._next != len(self._order):
            raise SendOrderError(f"update incomplete: next expected param is {self.expected!r}")
        self._drain(0)
        self._drain(1)
        seconds = time.perf_counter() - self._started
        return SendStats(
            self._sent, len(self._plan.buckets), seconds, self._in_place_count, self._first_at, time.time()
        )

    # --- internals ------------------------------------------------------------------------------

    def _expect(self, name: str) -> tuple[Bucket, BucketEntry]:
        """The next param's place; SendOrderError unless it is ``name``."""
        if self._next >= len(self._order):
            raise SendOrderError(f"{name!r}: every param of the plan was already sent")
        bucket, entry = self._order[self._next]
        if name != entry.spec.name:
            raise SendOrderError(f"expected param {entry.spec.name!r} next, got {name!r}")
        return bucket, entry

    def _open(self, bucket: Bucket) -> None:
        """Start filling ``bucket`` (once): wait for the broadcast that last used its buffer."""
        if self._opened != bucket.index:
            self._start()
            self._opened = bucket.index
            self._drain(bucket.index % 2)  # at most two broadcasts in flight; the slot's buffer is free
            self._lent, self._in_place, self._packing = [], None, bucket.index in self._slotted

    def _start(self) -> None:
        """Call ``on_start`` (once)."""
        on_start, self._on_start = self._on_start, None
        if on_start is not None:
            on_start()

    def _take(self, name: str, tensor: torch.Tensor) -> tuple[Bucket, BucketEntry]:
        """Check ``tensor`` is the param the plan expects next and advance; a new bucket waits
        for the broadcast that last used its slot."""
        bucket, entry = self._expect(name)
        spec = entry.spec
        if tuple(tensor.shape) != spec.shape or tensor.dtype != TORCH_DTYPES[spec.dtype]:
            raise SendOrderError(
                f"{name!r}: got {tensor.dtype} {tuple(tensor.shape)}, plan says {spec.dtype} {spec.shape}"
            )
        self._next += 1
        self._open(bucket)
        return bucket, entry

    def _buffer(self, bucket: Bucket) -> torch.Tensor:
        if self._buffers is None:
            size = self._plan.max_bucket_bytes
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=self._group.device) for _ in range(2)]
        return self._buffers[bucket.index % 2]

    def _copy(self, bucket: Bucket, entry: BucketEntry, tensor: torch.Tensor) -> None:
        self._packing = True
        dst = self._buffer(bucket)[entry.offset : entry.offset + entry.spec.nbytes]
        src = as_bytes(tensor)
        if src.data_ptr() != dst.data_ptr():  # else it was written in its slot
            dst.copy_(src)

    def _pack_lent(self, bucket: Bucket) -> None:
        """The bucket cannot go out in place: copy what was lent to it so far."""
        lent, self._lent, self._in_place = self._lent, [], None
        for entry, tensor in lent:
            self._copy(bucket, entry, tensor)

    def _close_if_full(self, bucket: Bucket, entry: BucketEntry) -> None:
        if entry is not bucket.entries[-1]:
            return
        slot = bucket.index % 2
        in_place = None if self._packing else self._storage_slice(bucket)
        if in_place is not None:
            payload = in_place
            self._in_place_count += 1
        else:  # packed, or the bucket's padding would run past the lent storage's end
            self._pack_lent(bucket)
            payload = self._buffer(bucket)[: bucket.nbytes]
        self._lent = []
        if self._first_at is None:
            self._first_at = time.time()
        self._pending[slot] = self._group.broadcast_async(payload, 0)
        self._sent += bucket.nbytes

    def _storage_slice(self, bucket: Bucket) -> torch.Tensor | None:
        """The bucket's bytes, read in place from the storage its lent tensors share."""
        assert self._in_place is not None and self._lent
        storage = self._lent[0][1].untyped_storage()
        start = self._in_place[1]
        if start < 0 or start + bucket.nbytes > storage.nbytes():
            return None
        out = torch.empty(0, dtype=torch.uint8, device=self._group.device)
        return out.set_(storage, start, (bucket.nbytes,), (1,))

    def abandon(self) -> None:
        """After a failure: forget the broadcasts in flight without waiting for them. A
        collective's handle keeps its group's connections open; once dropped, closing the group
        closes them (its members' receives then end at once). The sender is unusable after."""
        self._pending = [None, None]
        self._lent.clear()

    def _drain(self, slot: int) -> None:
        work = self._pending[slot]
        if work is not None:
            self._pending[slot] = None
            self._group.wait(work, "weight broadcast")


def _location(tensor: torch.Tensor, device: torch.device) -> tuple[int, int] | None:
    """(storage data_ptr, byte offset in it) of a contiguous, non-empty tensor on ``device``."""
    if tensor.device != device or not tensor.is_contiguous() or tensor.numel() == 0:
        return None
    return tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()) * tensor.element_size()


def broadcast_flat(group: WeightSyncGroup, nbytes: int) -> float:
    """Rank 0: one broadcast of a single flat buffer of ``nbytes``; returns its seconds (the
    baseline an update is compared with)."""
    buf = torch.ones(nbytes, dtype=torch.uint8, device=group.device)  # written: pages are resident
    t0 = time.perf_counter()
    group.broadcast(buf, 0, what="probe broadcast")
    return time.perf_counter() - t0
