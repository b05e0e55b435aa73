"""An outsider's view of a weight-update group's store, for tests that the trainer's decisions
cannot be forged (the SDK's own security tests and an inference adapter's)."""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import torch.distributed as dist

from pipelinerl_sdk.errors import ServerError
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.protocol import WeightUpdateRequest, parse_init_method
from pipelinerl_sdk.weights.publisher import WeightPublisher

__all__ = ["forge", "outsider", "replace_a_waiting_trainer"]


def outsider(pub: WeightPublisher) -> Any:
    """A client of the trainer's store, as anyone who reaches its port can open."""
    assert pub.group is not None
    host, port = parse_init_method(pub.group.config.init_method)
    return dist.TCPStore(host, port, world_size=None, is_master=False, timeout=datetime.timedelta(seconds=10))  # type: ignore[attr-defined]


def forge(store: Any, key: str, value: str) -> list[str]:
    """Write ``value`` as the decision on ``key`` under every name an outsider can find: the
    default group name's, and every key prefix the store lists. Returns the names written."""
    prefixes = {"pipelinerl-weights"} | {k.lstrip("/").split("/", 1)[0] for k in store.list_keys()}
    names = sorted(f"{p}/sig/{key}" for p in prefixes if p)
    for name in names:
        store.set(name, value)
    return names


async def replace_a_waiting_trainer(
    old_client: InferenceClient, new_client: InferenceClient, *, bucket_bytes: int
) -> tuple[WeightPublisher, WeightPublisher, str]:
    """The old trainer asks for an update (120 s timeout) and never decides; a new trainer then
    connects. Returns (old publisher, new publisher, the stale update's error); AssertionError
    if the stale update did not end with one within 30 s of the new trainer's connect."""
    from pipelinerl_sdk.conformance.inference import update_body

    old = WeightPublisher([old_client], bucket_bytes=bucket_bytes, timeout_s=30)
    await old.connect()
    info = await old_client.info()
    body = update_body(info, info.version + 1, bucket_bytes=bucket_bytes, timeout_s=120)
    call = old_client.request_weight_update(WeightUpdateRequest.model_validate(body))
    await asyncio.wait_for(call.accepted, 60)  # waiting for a decision that never comes
    new = WeightPublisher([new_client], bucket_bytes=bucket_bytes, timeout_s=60)
    await new.connect()
    try:
        await asyncio.wait_for(call.final, 30)
    except ServerError as e:
        return old, new, str(e)
    raise AssertionError("the stale update was applied")
