"""The bucket plan: one deterministic layout of an ordered list of params into byte buckets.

Sender and receiver compute the plan independently from the same ``(params, bucket_bytes)`` and
compare digests, so a bucket is one broadcast of raw bytes with no per-tensor header.

Rules (the whole contract):
- params keep their order; each starts at an offset aligned to :data:`ALIGN` bytes;
- a bucket is closed when the next param would overflow ``bucket_bytes``; a param larger than
  ``bucket_bytes`` gets a bucket of its own, sized to it;
- buckets lie back to back in one staging layout (``Bucket.offset``), so a receiver can stage a
  whole update in one flat buffer of ``plan.total_bytes``.

Because bucket sizes are aligned too, that staging layout does not depend on ``bucket_bytes``:
every param sits at the first aligned offset after the previous one (:func:`flat_layout`). A
trainer that keeps its params in one buffer laid out so can have whole buckets broadcast from it
(:meth:`WeightSender.lend <pipelinerl_sdk.weights.send.WeightSender.lend>`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from pipelinerl_sdk.protocol import ParamSpec

#: Alignment of every param inside a bucket, in bytes (covers every dtype's element size).
ALIGN = 64

#: Default bucket size: large enough that a broadcast runs near link speed, small enough that the
#: sender's two bucket buffers are a rounding error beside the model.
DEFAULT_BUCKET_BYTES = 64 << 20


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def flat_layout(params: Sequence[ParamSpec]) -> tuple[list[int], int]:
    """(byte offset of each param, total bytes) of the staging layout of ``params``: the same for
    every ``bucket_bytes`` (``plan.buckets[i].offset + entry.offset`` and ``plan.total_bytes``)."""
    offsets, end = [], 0
    for spec in params:
        offsets.append(_align(end))
        end = offsets[-1] + spec.nbytes
    return offsets, _align(end)


@dataclass(frozen=True, slots=True)
class BucketEntry:
    """A param's place: ``offset`` bytes from its bucket's start."""

    spec: ParamSpec
    offset: int


@dataclass(frozen=True, slots=True)
class Bucket:
    index: int
    #: Start of the bucket in the staging layout (sum of the sizes of the buckets before it).
    offset: int
    nbytes: int
    entries: tuple[BucketEntry, ...]


@dataclass(frozen=True, slots=True)
class BucketPlan:
    bucket_bytes: int
    buckets: tuple[Bucket, ...]

    @classmethod
    def build(cls, params: Sequence[ParamSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> BucketPlan:
        """Lay ``params`` out in order; raises ValueError on an empty list, a duplicate name or a
        non-positive ``bucket_bytes``."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if not params:
            raise ValueError("params: at least one param is required")
        names = [p.name for p in params]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"params: duplicate name {dup!r}")
        buckets: list[Bucket] = []
        entries: list[BucketEntry] = []
        used = 0
        start = 0

        def close() -> None:
            nonlocal entries, used, start
            if entries:
                size = _align(used)
                buckets.append(Bucket(len(buckets), start, size, tuple(entries)))
                start += size
            entries, used = [], 0

        for spec in params:
            offset = _align(used)
            # Compare the padded end: the bucket's size is aligned, and padding must not push a
            # shared bucket past ``bucket_bytes`` either.
            if entries and _align(offset + spec.nbytes) > bucket_bytes:
                close()
                offset = 0
            entries.append(BucketEntry(spec, offset))
            used = offset + spec.nbytes
        close()
        return cls(bucket_bytes, tuple(buckets))

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def params(self) -> list[ParamSpec]:
        return [e.spec for b in self.buckets for e in b.entries]

    @property
    def max_bucket_bytes(self) -> int:
        return max(b.nbytes for b in self.buckets)

    def digest(self) -> str:
        """SHA-256 of the layout (names, dtypes, shapes, offsets): equal digests mean the sender
        and receiver will slice every broadcast identically."""
        layout = [
            [
                b.offset,
                b.nbytes,
                [[e.spec.name, e.spec.dtype, list(e.spec.shape), e.offset] for e in b.entries],
            ]
            for b in self.buckets
        ]
        blob = json.dumps([ALIGN, self.bucket_bytes, layout], separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()
