"""Peak extra host memory of a piece of code, and the sizes a gather's peak is judged against.

:class:`AllocationPeak` runs torch's profiler with ``profile_memory=True`` and replays every
allocation and free it recorded (CPU and CUDA, in time order) to find the highest point the
running total reached above where it started: the *extra* memory the code needed at its worst
moment. Only torch allocations count (tensors and their storages, which is what a gather
allocates); memory allocated before the window and still held is not extra.

The profiler's raw allocation events are read from its event tree
(``kineto_results.experimental_event_tree()``), the only place that keeps each allocation with its
size and time; the aggregated ``events()`` view attributes memory to ops and loses the peak inside
one. That tree is a private torch API: :class:`AllocationPeak` raises a clear error if it is gone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch

from pipelinerl_sdk.protocol import ParamSpec

__all__ = ["AllocationPeak", "gather_units", "unit_of"]

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def unit_of(name: str) -> str:
    """The gather unit of an HF param name: its decoder layer (``model.layers.3``) for params
    inside one, else the param itself (embeddings, final norm, ``lm_head``)."""
    m = _LAYER.match(name)
    return m.group(1) if m else name


def gather_units(specs: Iterable[ParamSpec]) -> dict[str, int]:
    """Bytes per gather unit (:func:`unit_of`), in first-seen order."""
    units: dict[str, int] = {}
    for s in specs:
        key = unit_of(s.name)
        units[key] = units.get(key, 0) + s.nbytes
    return units


class AllocationPeak:
    """``with AllocationPeak() as peak: ...`` then ``peak.bytes``: the highest running total of
    torch allocations minus frees inside the block (0 if it only freed), and ``peak.allocated``,
    the sum of every allocation in it. Not reentrant; one profiler at a time per process."""

    def __init__(self) -> None:
        self.bytes = 0
        self.allocated = 0
        self._prof: Any = None

    def __enter__(self) -> AllocationPeak:
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        prof, self._prof = self._prof, None
        prof.__exit__(exc_type, exc, tb)
        if exc_type is None:
            self.bytes, self.allocated = _replay(_allocation_events(prof))


def _allocation_events(prof: Any) -> list[tuple[int, int]]:
    """(time ns, signed size) of every allocation (+) and free (-) the profiler recorded."""
    try:
        from torch._C._profiler import _EventType

        roots = list(prof.profiler.kineto_results.experimental_event_tree())
    except (ImportError, AttributeError) as err:  # pragma: no cover - depends on the torch build
        raise RuntimeError(
            f"this torch ({torch.__version__}) has no profiler event tree; cannot measure peak memory"
        ) from err
    events: list[tuple[int, int]] = []
    stack = roots
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.typed[0] == _EventType.Allocation:
            events.append((int(node.start_time_ns), int(node.typed[1].alloc_size)))
    return events


def _replay(events: list[tuple[int, int]]) -> tuple[int, int]:
    """(peak running total, total allocated) of signed allocation events in time order; at equal
    times allocations go first (an over-estimate, never an under-estimate, of the peak)."""
    current = peak = allocated = 0
    for _, size in sorted(events, key=lambda e: (e[0], -e[1])):
        current += size
        peak = max(peak, current)
        if size > 0:
            allocated += size
    return peak, allocated
