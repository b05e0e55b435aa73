"""An outsider's view of a weight-update group's store, for tests that the trainer's decisions
cannot be forged (the SDK's own security tests and an inference adapter's)."""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from pipelinerl_sdk.errors import ServerError
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.protocol import WeightUpdateRequest, parse_init_method
from pipelinerl_sdk.weights.publisher import PendingUpdate, WeightPublisher

__all__ = [
    "forge",
    "outsider",
    "replace_a_waiting_trainer",
    "take_rank_zero",
    "take_rank_zero_while_it_forms",
    "waiting_update",
]


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


async def waiting_update(
    client: InferenceClient, *, bucket_bytes: int, timeout_s: float, publisher_timeout_s: float = 30
) -> tuple[WeightPublisher, WeightUpdateRequest, PendingUpdate]:
    """A trainer connected to ``client``'s server, and an update to the next version the server
    accepted (its receive armed) and that waits for the trainer's decision, which nobody posts:
    (the trainer's publisher, the request, its pending call)."""
    from pipelinerl_sdk.conformance.inference import update_body

    publisher = WeightPublisher([client], bucket_bytes=bucket_bytes, timeout_s=publisher_timeout_s)
    await publisher.connect()
    info = await client.info()
    body = update_body(info, info.version + 1, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
    req = WeightUpdateRequest.model_validate(body)
    call = client.request_weight_update(req)
    await asyncio.wait_for(call.accepted, 60)
    return publisher, req, call


async def replace_a_waiting_trainer(
    old_client: InferenceClient, new_client: InferenceClient, *, bucket_bytes: int
) -> tuple[WeightPublisher, WeightPublisher, str]:
    """The old trainer asks for an update (120 s timeout) and never decides; a new trainer then
    connects. Returns (old publisher, new publisher, the stale update's error); AssertionError
    if the stale update did not end with one within 30 s of the new trainer's connect."""
    old, _, call = await waiting_update(old_client, bucket_bytes=bucket_bytes, timeout_s=120)
    new = WeightPublisher([new_client], bucket_bytes=bucket_bytes, timeout_s=60)
    await new.connect()
    try:
        await asyncio.wait_for(call.final, 30)
    except ServerError as e:
        return old, new, str(e)
    raise AssertionError("the stale update was applied")


def take_rank_zero(init_method: str, fill: float, timeout_s: float = 10.0) -> threading.Thread:
    """An outsider who reaches a forming group's store at ``init_method``: it lists the keys until
    the trainer's rendezvous value appears, forms a gloo group as rank 0 under the same name (its
    address written over the trainer's) and broadcasts one tensor of 4 ``fill`` values to rank 1.
    Returns its thread; ``thread.outcome`` is "sent" or the exception that stopped it."""
    host, port = parse_init_method(init_method)

    def attack() -> None:
        from pipelinerl_sdk.weights.group import torch_group_store

        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                host, port, world_size=None, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
            )
            deadline = time.monotonic() + timeout_s
            while not (keys := [k for k in store.list_keys() if k.endswith("/0")]) and time.monotonic() < deadline:
                time.sleep(0.01)
            name = keys[0].split("/", 1)[0]  # the group's store name, secret namespace and all
            view = torch_group_store(store, name, "gloo")
            pg = dist.ProcessGroupGloo(view, 0, 2, datetime.timedelta(seconds=timeout_s))
            pg.broadcast(torch.full((4,), fill), 0).wait()  # type: ignore[attr-defined]
            thread.outcome = "sent"  # type: ignore[attr-defined]
        except Exception as e:
            thread.outcome = e  # type: ignore[attr-defined]

    thread = threading.Thread(target=attack, name="outsider-rank-0", daemon=True)
    thread.outcome = None  # type: ignore[attr-defined]
    thread.start()
    return thread


def take_rank_zero_while_it_forms(init_method: str, fill: float, timeout_s: float = 10.0) -> threading.Thread:
    """Once the trainer (rank 0 of a group forming at ``init_method``) has written its rendezvous
    value, an outsider (:func:`take_rank_zero`) writes its own address over it; returns once the
    value in the store is the outsider's, with the outsider's thread (AssertionError if either
    write does not come within ``timeout_s``). A member joining from now on reads the outsider's
    address as rank 0's."""
    host, port = parse_init_method(init_method)
    watcher = dist.TCPStore(  # type: ignore[attr-defined]
        host, port, world_size=None, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    deadline = time.monotonic() + timeout_s
    while not (keys := [k for k in watcher.list_keys() if k.endswith("//cpu//0/0")]):
        assert time.monotonic() < deadline, "the trainer never wrote its rendezvous value"
        time.sleep(0.01)
    trainers = bytes(watcher.get(keys[0]))
    attacker = take_rank_zero(init_method, fill=fill, timeout_s=timeout_s)
    while bytes(watcher.get(keys[0])) == trainers:  # until the outsider wrote its address over it
        assert time.monotonic() < deadline, "the outsider never wrote its address"
        time.sleep(0.01)
    return attacker
