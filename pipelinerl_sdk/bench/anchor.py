"""The benchmark's anchor: an engine's own documented weight-update flow, driven over the engine's
own API as its documentation shows, so ``pipelinerl bench weight-update`` can put the SDK's
update next to what a user of the engine would do without the SDK.

An inference backend offers one where it registers (the one extension point)::

    registry.register_inference_backend("myengine", ..., bench_anchor="pkg.module:ANCHOR")

imported only by the benchmark, guarded like a backend's factory. ``ANCHOR`` has one of two shapes:

- a :class:`NativeUpdateFlow` (it has ``update``): it reuses the SDK's own server and the
  weight-update group the SDK's publisher already formed (the transport that works on this
  machine), so the two differ only in what each drives over HTTP and when each pauses; measured
  as mode ``native`` (vLLM's). The trainer's side of it is engine-independent: a
  :class:`FlowTarget` gives the flow the group, the bucket plan, the trainer's ``go`` and the
  broadcast, so a flow writes only the engine's HTTP calls;
- a :data:`StandaloneAnchor` callable ``anchor(model_dir, *, dtype, updates) -> dict`` with at least
  ``update_wall_s`` (median seconds of one update): it starts its own plain engine server and group,
  after the SDK's server has stopped (SGLang's).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from pipelinerl_sdk.errors import PluginError
from pipelinerl_sdk.plugins import BackendRegistry, load_registry
from pipelinerl_sdk.protocol import ParamSpec, update_key
from pipelinerl_sdk.weights.buckets import BucketPlan
from pipelinerl_sdk.weights.group import WeightSyncGroup
from pipelinerl_sdk.weights.publisher import WeightPublisher
from pipelinerl_sdk.weights.send import WeightSender

__all__ = [
    "BenchAnchor",
    "FlowSettings",
    "FlowTarget",
    "NativeGeneration",
    "NativeUpdate",
    "NativeUpdateFlow",
    "StandaloneAnchor",
    "load_anchor",
]

#: ``anchor(model_dir, *, dtype, updates) -> dict`` with at least ``update_wall_s``.
StandaloneAnchor = Callable[..., dict[str, Any]]


@dataclass(frozen=True, slots=True)
class NativeUpdate:
    """One update done the engine's way. ``pause_s``: generation held (from the pause call's
    answer to the resume call's answer); ``wall_s``: the whole flow, first call to last answer;
    ``send_s``: the trainer's broadcast of every bucket; ``stamps``: the flow's phases as the
    trainer saw them (``time.time()``; ``request_sent`` is the first call)."""

    version: int
    wall_s: float
    pause_s: float
    send_s: float
    stamps: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class FlowTarget:
    """What a native flow publishes to, and the trainer's side of it: the SDK's server at ``url``,
    ``publisher`` (its group connected: the flow reuses it), ``send`` (hands every param to a
    sender: the trainer's gather) and the ``specs`` of the update."""

    url: str
    publisher: WeightPublisher
    send: Callable[[WeightSender], None]
    specs: Sequence[ParamSpec]
    #: The server's control token: an engine's own RL routes on an SDK server need it.
    control_token: str | None = None

    @property
    def group(self) -> WeightSyncGroup:
        """The publisher's group; RuntimeError if it is not connected."""
        if self.publisher.group is None:
            raise RuntimeError("the publisher is not connected: the native flow reuses its group")
        return self.publisher.group

    def plan(self) -> BucketPlan:
        """The buckets of the update, at the publisher's bucket size."""
        return BucketPlan.build(self.specs, self.publisher.bucket_bytes)

    @contextmanager
    def go(self, version: int) -> Iterator[None]:
        """The trainer's ``go`` for ``version`` is posted in the group's store for the block (a
        receiver waits for it before any collective), and cleared after it."""
        key = update_key(version)
        self.group.clear_decision(key)
        self.group.post_decision(key, go=True)
        try:
            yield
        finally:
            self.group.clear_decision(key)

    def broadcast(self, buffers: dict[int, list[Any]]) -> float:
        """Broadcast every param in :meth:`plan`'s buckets (blocking: run it on a thread);
        returns the sender's seconds. ``buffers`` keeps the sender's bucket buffers by bucket size
        across updates, as the SDK's publisher keeps its own."""
        plan = self.plan()
        sender = WeightSender(self.group, plan, buffers.get(plan.max_bucket_bytes))
        self.send(sender)
        seconds = sender.finish().seconds
        if sender.buffers is not None:
            buffers[plan.max_bucket_bytes] = sender.buffers
        return seconds


class NativeUpdateFlow(Protocol):
    """An engine's documented update flow. ``server_env``: environment the server must start with
    for the engine to expose the routes the flow calls."""

    description: str
    server_env: Mapping[str, str]

    async def update(self, target: FlowTarget, version: int) -> NativeUpdate:
        """Publish ``version`` to ``target`` through the engine's own routes. Raises on any
        failure; the weights then served are the engine's business (as without the SDK)."""
        ...


@dataclass(frozen=True, slots=True)
class NativeGeneration:
    """Where a server of the backend, started with ``options``, also serves the engine's own
    generation routes (its own handlers on the same engine, beside the SDK's): the anchor of
    ``pipelinerl bench generate``. ``chat`` and ``completions`` are their paths."""

    options: Mapping[str, str]
    chat: str
    completions: str


@dataclass(frozen=True)
class FlowSettings:
    """What a :class:`NativeUpdateFlow` dataclass keeps besides its ``update``: its
    ``description`` and ``server_env`` (override the defaults), the seconds each of its HTTP
    calls may take, the sender's bucket buffers, reused across updates as the SDK's publisher
    reuses its own (pass them to :meth:`FlowTarget.broadcast`), and where the engine's own
    generation routes can be served (:class:`NativeGeneration`, or None)."""

    description: str = ""
    server_env: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 120.0
    buffers: dict[int, list[Any]] = field(default_factory=dict)
    generation: NativeGeneration | None = None

    async def keep_pause_flow(
        self,
        target: FlowTarget,
        version: int,
        *,
        pause: Callable[[], Awaitable[None]],
        start: Callable[[], Awaitable[None]],
        receive: Callable[[], Coroutine[Any, Any, None]],
        finish: Callable[[], Awaitable[None]],
        resume: Callable[[], Awaitable[None]],
    ) -> NativeUpdate:
        """The flow vLLM-style RL routes document, timed: ``pause`` (keep), ``start``, then
        ``receive`` (the engine's blocking receive) while the trainer posts its ``go`` and
        broadcasts, ``finish`` (apply and version), ``resume``. The pause is measured from the
        moment ``pause`` answered to the moment ``resume`` did. Stamps: ``request_sent`` (the
        pause call), ``paused``, ``session_started``, ``decision_posted``, ``last_bucket_sent``,
        ``received`` (the receive call answered), ``applied`` (finish answered), ``done``."""
        stamps = {"request_sent": time.time()}
        t0 = time.perf_counter()
        await pause()
        paused = time.perf_counter()
        stamps["paused"] = time.time()
        await start()
        stamps["session_started"] = time.time()
        with target.go(version):
            stamps["decision_posted"] = time.time()
            receiving = asyncio.create_task(receive())
            send_s = await asyncio.to_thread(target.broadcast, self.buffers)
            stamps["last_bucket_sent"] = time.time()
            await receiving
            stamps["received"] = time.time()
        await finish()
        stamps["applied"] = time.time()
        await resume()
        done = time.perf_counter()
        stamps["done"] = time.time()
        return NativeUpdate(version=version, wall_s=done - t0, pause_s=done - paused, send_s=send_s, stamps=stamps)


@dataclass(frozen=True, slots=True)
class BenchAnchor:
    """A backend's registered anchor, by shape: exactly one field is set."""

    flow: NativeUpdateFlow | None = None
    standalone: StandaloneAnchor | None = None


def load_anchor(backend: str, registry: BackendRegistry | None = None) -> BenchAnchor | None:
    """The anchor the inference backend ``backend`` registered (``bench_anchor``), or None;
    PluginError when it cannot be imported or has neither shape."""
    obj = (registry or load_registry()).bench_anchor(backend)
    if obj is None:
        return None
    if callable(getattr(obj, "update", None)):
        return BenchAnchor(flow=cast(NativeUpdateFlow, obj))
    if callable(obj):
        return BenchAnchor(standalone=cast(StandaloneAnchor, obj))
    raise PluginError(f"{backend}: bench_anchor {obj!r} is neither a NativeUpdateFlow nor a callable")
