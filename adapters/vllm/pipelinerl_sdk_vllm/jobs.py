"""Driving the SDK's vLLM weight-transfer engine (:mod:`.transfer`) from a server: the receive
job's update info, its deadline, and reading the workers' receive status
(``PipelineRLWorkerExtension.pipelinerl_status``, one dict per worker). Shared by every server that
drives that engine: this adapter's, the Dynamo adapter's (over each Dynamo worker's system port),
and both benchmark anchors. Imports no engine (only the SDK)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from pipelinerl_sdk.errors import DecisionTimeout, GroupError, UpdateAborted, UpdateFailed
from pipelinerl_sdk.protocol import ParamSpec


def receive_info(
    version: int, params: Sequence[ParamSpec], bucket_bytes: int, timeout_s: float, *, blocking: bool = False
) -> dict[str, Any]:
    """The ``update_info`` of a receive of ``version`` (``PipelineRLUpdateInfo``, op ``receive``):
    ``timeout_s`` bounds the wait for the trainer's decision; ``blocking`` receives on the
    engine's RPC thread (only the benchmarks' native flows ask for it)."""
    info: dict[str, Any] = {
        "op": "receive",
        "version": version,
        "params": [[p.name, p.dtype, list(p.shape)] for p in params],
        "bucket_bytes": bucket_bytes,
        "timeout_s": timeout_s,
    }
    if blocking:
        info["blocking"] = True
    return info


def receive_deadline(timeout_s: float, group_timeout_s: float) -> float:
    """When (``time.monotonic``) a server stops polling a receive armed now: the trainer's
    decision (``timeout_s``), then the broadcast, each bucket bounded by the group's own timeout
    (``group_timeout_s``, counted twice), plus 30 s of slack."""
    return time.monotonic() + timeout_s + 2 * group_timeout_s + 30


async def wait_jobs(
    statuses: Callable[[], Awaitable[Sequence[dict[str, Any]]]],
    key: str,
    deadline: float,
    *,
    received: bool,
    poll_s: float,
    engine: str = "vLLM",
    nap: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> float:
    """Poll ``statuses()`` (every worker's) until the job ``key`` has the trainer's ``go`` on all
    (or, with ``received``, holds every byte); returns the slowest receive time. Between two
    polls, ``nap(poll_s)`` (one that returns early, on news, shortens the wait). Raises what
    :func:`settled` raises, and GroupError once ``deadline`` (monotonic) passed."""
    while True:
        waited = settled(await statuses(), key, received=received, engine=engine)
        if waited is not None:
            return waited
        if time.monotonic() > deadline:
            raise GroupError(f"receive of {key} did not finish in time")
        await nap(poll_s)


def settled(statuses: Sequence[dict[str, Any]], key: str, *, received: bool, engine: str = "vLLM") -> float | None:
    """Where the receive job ``key`` stands on every worker: the slowest receive time once every
    worker has the trainer's ``go`` (or, with ``received``, holds every byte); None while some
    still wait. Raises UpdateAborted (the trainer called it off), DecisionTimeout (no decision of
    the trainer's came in time: a 408; the group is broken), GroupError (a worker's receive failed
    or timed out: the group is broken), UpdateFailed (a worker lost the job)."""
    done = {"received"} if received else {"receiving", "received"}
    jobs = [s.get("job") or {} for s in statuses]
    broken = next((s["group_broken"] for s in statuses if s.get("group_broken")), None)
    failed = [j for j in jobs if j.get("key") == key and j.get("state") == "failed"]
    if failed:
        if all(j.get("aborted") for j in failed):
            raise UpdateAborted(failed[0]["error"])
        if all(j.get("timed_out") for j in failed):
            raise DecisionTimeout(failed[0]["error"])
        raise GroupError(broken or failed[0]["error"])
    if all(j.get("key") == key and j.get("state") in done for j in jobs):
        return max(float(j.get("receive_s", 0.0)) for j in jobs)
    if any(j.get("key") != key for j in jobs):
        raise UpdateFailed(f"a {engine} worker lost the receive job {key!r}: {jobs}")
    return None
