"""The benchmark's anchor: an engine's own documented weight-update flow, driven over the engine's
own API as its documentation shows, so ``pipelinerl bench weight-update`` can put the SDK's
update next to what a user of the engine would do without the SDK.

An inference backend offers one by naming a :class:`NativeUpdateFlow` in its class attribute
``InferenceBackend.native_update_flow`` (``"module:attr"``, imported only by the benchmark). The
flow reuses the weight-update group the SDK's publisher already formed (the transport that works
on this machine), so the two differ only in what each drives over HTTP and when each pauses.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from pipelinerl_sdk.errors import PluginError
from pipelinerl_sdk.protocol import ParamSpec
from pipelinerl_sdk.weights.publisher import WeightPublisher
from pipelinerl_sdk.weights.send import WeightSender

__all__ = ["NativeUpdate", "NativeUpdateFlow", "load_native_flow"]


@dataclass(frozen=True, slots=True)
class NativeUpdate:
    """One update done the engine's way. ``pause_s``: generation held (from the pause call's
    answer to the resume call's answer); ``wall_s``: the whole flow, first call to last answer;
    ``send_s``: the trainer's broadcast of every bucket."""

    version: int
    wall_s: float
    pause_s: float
    send_s: float


class NativeUpdateFlow(Protocol):
    """An engine's documented update flow. ``server_env``: environment the server must start with
    for the engine to expose the routes the flow calls."""

    description: str
    server_env: Mapping[str, str]

    async def update(
        self,
        server_url: str,
        publisher: WeightPublisher,
        send: Callable[[WeightSender], None],
        specs: Sequence[ParamSpec],
        version: int,
    ) -> NativeUpdate:
        """Publish ``version`` through the engine's own routes over ``publisher``'s connected
        group; ``send`` hands every param to the sender (the trainer's gather). Raises on any
        failure; the weights then served are the engine's business (as without the SDK)."""
        ...


def load_native_flow(backend_factory: object) -> NativeUpdateFlow | None:
    """The flow named by the backend class's ``native_update_flow``, or None if it names none."""
    path: str | None = getattr(backend_factory, "native_update_flow", None)
    if not path:
        return None
    module, _, attr = path.partition(":")
    try:
        flow: NativeUpdateFlow = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise PluginError(f"{backend_factory!r}.native_update_flow = {path!r} cannot be imported: {e}") from e
    return flow
