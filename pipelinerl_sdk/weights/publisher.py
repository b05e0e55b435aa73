"""Trainer rank 0: form the weight-update group with a fleet of servers and publish updates.

One update, end to end::

    async with publisher.update(version, trainer.param_specs()) as sink:
        await asyncio.to_thread(trainer.gather_and_broadcast, sink)

1. every server gets ``/request_weight_update`` and validates it (4xx: nothing received);
2. once *all* servers accepted, rank 0 posts ``go`` in the store; if any refused, it posts
   ``abort`` so the others return at once, and raises :class:`FanOutError` naming each server;
3. the body streams tensors through the bucket plan; as the first param is handed over, rank 0
   posts its ``sending`` mark (:func:`~pipelinerl_sdk.protocol.sending_key`: an engine that
   receives in place holds generation only from then on), or ``abort`` on it if the body fails
   before; on exit the publisher waits for the last broadcast and for every server's ``done``;
   any failure raises, naming the server. If the body raises after the mark, the publisher
   closes the group: the servers' receives end at once and they keep their old weights (the
   next update needs :meth:`WeightPublisher.connect`).

Every wait on a server is bounded by ``timeout_s``: a server that stopped answering (SIGSTOP, a
hung process) is reported as such, naming it, within the update's timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import socket
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch

from pipelinerl_sdk.errors import FanOutError, GroupError, PipelineRLError, ServerError
from pipelinerl_sdk.protocol import (
    GroupBackend,
    InitProcessGroupRequest,
    ParamSpec,
    ProbeBroadcastRequest,
    ReceiveMode,
    ServerInfo,
    UpdateEvent,
    WeightUpdateRequest,
    probe_key,
    sending_key,
    update_key,
)
from pipelinerl_sdk.weights.auth import group_id, new_group_secret
from pipelinerl_sdk.weights.buckets import DEFAULT_BUCKET_BYTES, BucketPlan
from pipelinerl_sdk.weights.group import GroupConfig, WeightSyncGroup, listen_socket
from pipelinerl_sdk.weights.send import SendStats, WeightSender, broadcast_flat


class PendingUpdate(Protocol):
    """One server's side of an update in progress (``http.client.UpdateCall``): ``accepted``
    resolves once the server armed its receive (raises if it refused), ``final`` with its ``done``
    event (raises on its error)."""

    url: str
    accepted: asyncio.Future[UpdateEvent]

    @property
    def final(self) -> asyncio.Future[UpdateEvent]: ...

    async def cancel(self) -> None:
        """Give up on the call (close its stream)."""


class ServerLink(Protocol):
    """What the publisher needs of one inference server: ``http.client.InferenceClient`` is one.
    Declared here so the weight-sync layer does not depend on the HTTP layer."""

    url: str

    async def info(self) -> ServerInfo: ...

    async def init_process_group(self, req: InitProcessGroupRequest) -> Any: ...

    def request_weight_update(self, req: WeightUpdateRequest) -> PendingUpdate: ...

    async def probe_broadcast(self, req: ProbeBroadcastRequest) -> Any: ...


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


#: After a failed send, the least the publisher waits for the servers' answers (a live one answers
#: once the group's connections close) when the send itself used up the update's ``timeout_s``.
FAILED_SEND_GRACE_S = 0.25

#: The trainer's phases of one update (:attr:`PublishResult.stamps`), in order.
TRAINER_PHASES: tuple[str, ...] = (
    "request_sent",  # the requests are handed to the clients
    "accepted",  # every server's ``accepted`` line is in
    "decision_posted",  # ``go`` is in the store
    "first_bucket_sent",  # the first bucket's broadcast was issued
    "last_bucket_sent",  # the last broadcast completed on the sender
    "done",  # every server's ``done`` line is in
)


@dataclass(frozen=True, slots=True)
class PublishResult:
    version: int
    send: SendStats
    #: Per server URL, its ``done`` event (timings: pause_s, receive_s, apply_s, total_s, and the
    #: server's phases as ``at_*`` stamps where it records them).
    events: dict[str, UpdateEvent]
    wall_s: float
    #: The trainer's phases (:data:`TRAINER_PHASES`): ``time.time()`` stamps, the clock a server
    #: on the same machine stamps its own with.
    stamps: dict[str, float] = field(default_factory=dict)


class WeightPublisher:
    """Owns the trainer's side of the group and the fan-out to ``clients``."""

    def __init__(
        self,
        clients: Sequence[ServerLink],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        mode: ReceiveMode | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        if not clients:
            raise ValueError("clients: at least one inference server is required")
        self.clients = list(clients)
        self.bucket_bytes = bucket_bytes
        self.mode = mode
        self.timeout_s = timeout_s
        self.group: WeightSyncGroup | None = None
        #: The last successful update's figures.
        self.last: PublishResult | None = None
        self._probe_ids = itertools.count()
        #: The sender's two bucket buffers, kept across updates (see WeightSender).
        self._buffers: list[torch.Tensor] | None = None

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the sender's bucket buffers held between updates (0 until an update needed
        them: one whose every bucket was lent in place needs none)."""
        return sum(b.numel() * b.element_size() for b in self._buffers or [])

    async def connect(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        backend: GroupBackend = "gloo",
        group_name: str = "pipelinerl-weights",
    ) -> None:
        """Form the group: rank 0 here, each server's workers at consecutive ranks after it.
        The group's store listens on ``host`` only. Each server gets a fresh secret for this group
        (see :mod:`~pipelinerl_sdk.weights.auth`), and every rendezvous value is signed with it
        where every server's ``/info`` says ``signed_rendezvous``. Raises FanOutError naming every
        server that failed to join."""
        infos = cast(list[ServerInfo], await _fan_out([c.info() for c in self.clients], self.clients))
        world = 1 + sum(i.receiving_workers for i in infos)
        # bound now and held until the store takes it: a port picked by the system and released
        # could be taken by another process before the group's store binds it
        listener = listen_socket(host, port)
        port = listener.getsockname()[1]
        init_method = f"tcp://{host}:{port}"
        offsets = list(itertools.accumulate([1] + [i.receiving_workers for i in infos]))[:-1]
        secret = new_group_secret()
        # signed rendezvous only where every server's workers can verify it
        signed = all(i.signed_rendezvous for i in infos)
        cfg = GroupConfig(init_method, 0, world, backend, group_name, self.timeout_s, secret, signed)
        own = asyncio.create_task(asyncio.to_thread(functools.partial(WeightSyncGroup, cfg, listener=listener)))
        joins = [c.init_process_group(cfg.invitation(off)) for c, off in zip(self.clients, offsets, strict=True)]
        results = await asyncio.gather(*joins, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        errors += [
            ServerError(c.url, f"joined group {r.group_id!r}, expected {group_id(secret)!r}")
            for c, r in zip(self.clients, results, strict=True)
            if not isinstance(r, BaseException) and r.group_id != group_id(secret)
        ]
        try:
            group = await own
        except GroupError as e:
            errors.append(ServerError(init_method, f"trainer side of the group: {e}"))
            group = None
        if errors:
            if group is not None:
                group.close()
            raise FanOutError([e if isinstance(e, ServerError) else ServerError("?", str(e)) for e in errors])
        if self.group is not None:
            self.group.close()
        self.group = group
        self._buffers = None  # a failed update's broadcasts may still hold the old ones

    def _require_group(self) -> WeightSyncGroup:
        if self.group is None:
            raise GroupError("not connected: call connect() first")
        if self.group.broken:
            raise GroupError(f"group broken ({self.group.broken}); call connect() again")
        return self.group

    @asynccontextmanager
    async def update(self, version: int, params: Sequence[ParamSpec]) -> AsyncIterator[WeightSender]:
        """Publish ``version``: yields the sender once every server accepted (see module doc)."""
        group = self._require_group()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        plan = BucketPlan.build(params, self.bucket_bytes)
        req = WeightUpdateRequest(
            version=version,
            params=list(params),
            bucket_bytes=self.bucket_bytes,
            plan_digest=plan.digest(),
            mode=self.mode,
            timeout_s=self.timeout_s,
            group_id=group.group_id,
        )
        key = update_key(version)
        # A stale decision for this version (an earlier, failed try) must not be read.
        group.clear_decision(key)
        group.clear_decision(sending_key(version))
        stamps = {"request_sent": time.time()}
        calls = [c.request_weight_update(req) for c in self.clients]
        accepted = await self._bounded(calls, "accepted")
        stamps["accepted"] = time.time()
        refused = [r for r in accepted if isinstance(r, BaseException)]
        if refused:
            group.post_decision(key, go=False, reason="; ".join(str(r) for r in refused))
            await self._bounded(calls, "final")
            group.clear_decision(key)
            raise FanOutError(
                [_as_server_error(r, c) for r, c in zip(accepted, calls, strict=True) if isinstance(r, BaseException)]
            )
        stamps["decision_posted"] = time.time()  # taken first: a server may read the go before a later stamp
        group.post_decision(key, go=True)
        started = sending_key(version)

        def on_start() -> None:
            group.post_decision(started, go=True)
            stamps["sending_posted"] = time.time()

        sender = WeightSender(group, plan, self._buffers, on_start=on_start)
        send_began = loop.time()
        try:
            yield sender
            stats = await asyncio.to_thread(sender.finish)
            self._buffers = sender.buffers or self._buffers
        except BaseException as e:
            # Receivers still waiting for the sending mark end at once; those mid-broadcast end
            # once the group's connections close, which closing the group does here (a thread:
            # gloo may first finish a broadcast in flight). Their old weights keep serving;
            # report both sides.
            if "sending_posted" not in stamps:
                with contextlib.suppress(Exception):  # a lost store: the receivers' timeout ends them
                    group.post_decision(started, go=False, reason=f"the trainer failed before sending: {e}")
            group.mark_broken(f"sender failed: {e}")
            sender.abandon()
            await asyncio.to_thread(group.close)
            # a live server ends its receive once the group's connections close; the whole
            # update, send included, is bounded by timeout_s (a send stuck on a stopped server
            # already took it: then only a moment more)
            left = send_began + self.timeout_s - loop.time()
            finals = await self._bounded(calls, "final", timeout_s=max(FAILED_SEND_GRACE_S, left))
            server_errors = [
                _as_server_error(r, c) for r, c in zip(finals, calls, strict=True) if isinstance(r, BaseException)
            ]
            if isinstance(e, PipelineRLError | ValueError) and server_errors:
                raise FanOutError(server_errors) from e
            raise
        finally:
            group.clear_decision(key)
            group.clear_decision(started)
        finals = await self._bounded(calls, "final")
        stamps["done"] = time.time()
        failures = [_as_server_error(r, c) for r, c in zip(finals, calls, strict=True) if isinstance(r, BaseException)]
        if failures:
            raise FanOutError(failures)
        if stats.first_bucket_at is not None and stats.last_bucket_at is not None:
            stamps["first_bucket_sent"], stamps["last_bucket_sent"] = stats.first_bucket_at, stats.last_bucket_at
        self.last = PublishResult(
            version,
            stats,
            {c.url: r for c, r in zip(calls, finals, strict=True) if isinstance(r, UpdateEvent)},
            loop.time() - t0,
            dict(sorted(stamps.items(), key=lambda kv: kv[1])),
        )

    async def _bounded(
        self, calls: Sequence[PendingUpdate], what: str, *, timeout_s: float | None = None
    ) -> list[UpdateEvent | BaseException]:
        """Every call's ``accepted`` or ``final`` event (or its error), waiting at most
        ``timeout_s`` (default the update's): a server silent that long is reported as stopped or
        hung, and its call dropped."""
        futures = [c.accepted if what == "accepted" else c.final for c in calls]
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        waited = f"the update's timeout_s={self.timeout_s:g}"
        if timeout_s != self.timeout_s:
            waited = f"{timeout_s:.2g} s after the send failed (the update's timeout_s={self.timeout_s:g})"
        await asyncio.wait(futures, timeout=timeout_s)
        out: list[UpdateEvent | BaseException] = []
        for call, fut in zip(calls, futures, strict=True):
            if fut.done():
                out.append(fut.exception() or fut.result())
                continue
            await call.cancel()
            out.append(
                ServerError(
                    call.url,
                    f"server did not answer within {waited} (no '{what}' event; stopped or hung?)",
                )
            )
        return out

    async def probe(self, nbytes: int) -> tuple[float, dict[str, float]]:
        """One flat broadcast of ``nbytes`` to every server: (send seconds, receive seconds by
        server). The baseline for ``update_over_flat_broadcast``."""
        group = self._require_group()
        probe_id = next(self._probe_ids)
        key = probe_key(probe_id)
        req = ProbeBroadcastRequest(nbytes=nbytes, probe_id=probe_id, timeout_s=self.timeout_s, group_id=group.group_id)
        receives = [asyncio.create_task(c.probe_broadcast(req)) for c in self.clients]
        await asyncio.sleep(0)
        group.post_decision(key, go=True)
        try:
            send_s = await asyncio.to_thread(broadcast_flat, group, nbytes)
            results = await _fan_out(receives, self.clients)
        finally:
            group.clear_decision(key)
        by_url = {c.url: cast(dict[str, float], r)["receive_s"] for c, r in zip(self.clients, results, strict=True)}
        return send_s, by_url

    async def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self._buffers = None


def _as_server_error(r: BaseException, call: PendingUpdate) -> ServerError:
    return r if isinstance(r, ServerError) else ServerError(call.url, f"{type(r).__name__}: {r}")


async def _fan_out(aws: Sequence[object], clients: Sequence[ServerLink]) -> list[object]:
    results = await asyncio.gather(*aws, return_exceptions=True)  # type: ignore[call-overload]
    errors = [
        r if isinstance(r, ServerError) else ServerError(c.url, f"{type(r).__name__}: {r}")
        for r, c in zip(results, clients, strict=True)
        if isinstance(r, BaseException)
    ]
    if errors:
        raise FanOutError(errors)
    return list(results)
