"""Reading the workers' receive status (``PipelineRLWorkerExtension.pipelinerl_status``, one dict
per worker), shared by every server that drives the SDK's vLLM weight-transfer engine: this
adapter's, and the Dynamo adapter's (which reads it over each Dynamo worker's system port).
Imports no engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipelinerl_sdk.errors import GroupError, UpdateAborted, UpdateFailed


def settled(statuses: Sequence[dict[str, Any]], key: str, *, received: bool, engine: str = "vLLM") -> float | None:
    """Where the receive job ``key`` stands on every worker: the slowest receive time once every
    worker has the trainer's ``go`` (or, with ``received``, holds every byte); None while some
    still wait. Raises UpdateAborted (the trainer called it off), GroupError (a worker's receive
    failed or timed out: the group is broken), UpdateFailed (a worker lost the job)."""
    done = {"received"} if received else {"receiving", "received"}
    jobs = [s.get("job") or {} for s in statuses]
    broken = next((s["group_broken"] for s in statuses if s.get("group_broken")), None)
    failed = [j for j in jobs if j.get("key") == key and j.get("state") == "failed"]
    if failed:
        if all(j.get("aborted") for j in failed):
            raise UpdateAborted(failed[0]["error"])
        raise GroupError(broken or failed[0]["error"])
    if all(j.get("key") == key and j.get("state") in done for j in jobs):
        return max(float(j.get("receive_s", 0.0)) for j in jobs)
    if any(j.get("key") != key for j in jobs):
        raise UpdateFailed(f"a {engine} worker lost the receive job {key!r}: {jobs}")
    return None
