"""One update's phases on both sides, for ``pipelinerl bench weight-update``'s JSON.

The trainer stamps its phases (:data:`~pipelinerl_sdk.weights.publisher.TRAINER_PHASES`, in
:attr:`PublishResult.stamps <pipelinerl_sdk.weights.publisher.PublishResult.stamps>`) and a server
its own (:data:`~pipelinerl_sdk.protocol.SERVER_PHASES`, plus an engine's ``worker_*`` ones, as
``at_*`` keys of its ``done`` event's timings), all with ``time.time()``: one clock when trainer and
server share a machine, as in the benchmark. A timeline here is phase -> seconds since the
trainer's ``request_sent``, ordered by time; phases are named ``trainer.<phase>`` and
``server.<phase>``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from pipelinerl_sdk.protocol import UpdateEvent

__all__ = ["ORIGIN", "median_timeline", "timeline", "to_ms"]

#: The phase every offset is measured from.
ORIGIN = "trainer.request_sent"


def timeline(trainer: Mapping[str, float], event: UpdateEvent | None = None) -> dict[str, float]:
    """Seconds since :data:`ORIGIN` of every phase stamped by the trainer (``trainer``: phase ->
    ``time.time()``) and by the server in ``event`` (its ``at_*`` timings), sorted by time. Empty
    when the trainer did not stamp ``request_sent``."""
    origin = trainer.get(ORIGIN.removeprefix("trainer."))
    if origin is None:
        return {}
    stamps = {f"trainer.{k}": v for k, v in trainer.items()}
    if event is not None:
        stamps |= {f"server.{k.removeprefix('at_')}": v for k, v in event.timings.items() if k.startswith("at_")}
    return {k: v - origin for k, v in sorted(stamps.items(), key=lambda kv: kv[1])}


def median_timeline(timelines: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per phase, the median offset over ``timelines`` (phases present in every one), sorted by
    it. Where a phase precedes another in every timeline, its median does too."""
    if not timelines:
        return {}
    common = set(timelines[0]).intersection(*timelines[1:])
    medians = {k: statistics.median(t[k] for t in timelines) for k in common}
    return dict(sorted(medians.items(), key=lambda kv: kv[1]))


def to_ms(offsets: Mapping[str, float]) -> dict[str, float]:
    """``offsets`` (seconds) in milliseconds, rounded to 0.01 ms, order kept."""
    return {k: round(1e3 * v, 2) for k, v in offsets.items()}
