"""An outsider's view of a weight-update group's store, for tests that the trainer's decisions
cannot be forged (the SDK's own security tests and an inference adapter's)."""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from pipelinerl_sdk.protocol import parse_init_method
from pipelinerl_sdk.weights.publisher import WeightPublisher

__all__ = ["forge", "outsider"]


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
