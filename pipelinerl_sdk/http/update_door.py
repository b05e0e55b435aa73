"""The server side of joining the weight group and of one update, shared by every door onto it:
the contract's own routes (``/init_process_group``, ``/request_weight_update``) and vLLM's RL API
(:mod:`pipelinerl_sdk.http.vllm_rl`). Whichever door a trainer uses, the same checks run and the
same single control slot is held, so the two doors cannot interleave."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import time
from dataclasses import dataclass, field
from typing import Any

from pipelinerl_sdk.contracts import InferenceBackend, UpdateReport
from pipelinerl_sdk.errors import GroupError, InvalidRequest, PipelineRLError
from pipelinerl_sdk.protocol import (
    InitProcessGroupRequest,
    InitProcessGroupResponse,
    ReceiveMode,
    WeightUpdateRequest,
    parse_init_method,
)

__all__ = ["ControlRefused", "ControlSlot", "UpdateDoor", "UpdateRun", "trainer_host_allowed"]


#: How long :func:`store_answers` waits for the trainer's store (at most the request's timeout).
STORE_PROBE_S = 5.0


async def store_answers(init_method: str, timeout_s: float) -> None:
    """Return once the TCP store ``init_method`` names accepts a connection; GroupError (502)
    naming ``init_method`` if it does not within ``timeout_s`` (the wire type admits only
    ``tcp://HOST:PORT``)."""
    host, port = parse_init_method(init_method)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, TimeoutError) as e:
        raise GroupError(
            f"init_method {init_method!r}: the trainer's store does not answer ({type(e).__name__}: {e}); "
            "the group this server holds, and an update pending on it, are left as they were"
        ) from None
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


class ControlRefused(PipelineRLError):
    """A control call this server will not run: ``status`` (403, 409 or 501) and ``kind`` say why."""

    def __init__(self, status: int, message: str, *, kind: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.field = status, kind, field


class ControlSlot:
    """One control operation at a time; a second caller is refused (409), not queued."""

    def __init__(self) -> None:
        self.busy: str | None = None
        #: The update holding the slot, if one does.
        self.update: asyncio.Task[Any] | None = None

    def take(self, what: str) -> None:
        if self.busy is not None:
            raise ControlRefused(
                409, f"another control operation is running ({self.busy}); retry after it", kind="conflict"
            )
        self.busy = what

    def release(self) -> None:
        self.busy, self.update = None, None


def trainer_host_allowed(init_method: str, allowed: tuple[str, ...]) -> bool:
    """Whether a server may join a store at ``init_method``: loopback, or a host in ``allowed``."""
    host, _ = parse_init_method(init_method)
    if host.lower() == "localhost" or host in allowed:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class UpdateRun:
    """One update started by :meth:`UpdateDoor.start`: ``task`` runs it to its end (its result is
    the backend's report; it raises what the update raised) whoever waits on it."""

    version: int
    mode: ReceiveMode
    task: asyncio.Task[UpdateReport]
    accepted: asyncio.Event
    started: float = field(default_factory=time.perf_counter)
    #: The router's phases (``protocol.SERVER_PHASES``) as ``time.time()`` stamps.
    at: dict[str, float] = field(default_factory=dict)

    async def wait_accepted(self) -> bool:
        """True once the receive is armed; False if the update ended first (it was refused or
        failed: ``task`` holds why)."""
        waiter = asyncio.create_task(self.accepted.wait())
        try:
            await asyncio.wait({waiter, self.task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if self.accepted.is_set():
            self.at.setdefault("at_accepted", time.time())
            return True
        return False


class UpdateDoor:
    """Joining the group and starting updates on ``backend``, under one :class:`ControlSlot`."""

    def __init__(self, backend: InferenceBackend, *, trainer_hosts: tuple[str, ...] = ()) -> None:
        self.backend = backend
        self.trainer_hosts = trainer_hosts
        self.slot = ControlSlot()

    async def join(self, req: InitProcessGroupRequest) -> InitProcessGroupResponse:
        """Join the group ``req`` names, after the checks every door makes (the trainer's host,
        the ranks, signing): ControlRefused or InvalidRequest naming the field otherwise. Ends an
        update still waiting for a replaced trainer's decision where the backend can."""
        backend = self.backend
        if not trainer_host_allowed(req.init_method, self.trainer_hosts):
            raise ControlRefused(
                403,
                f"init_method {req.init_method!r}: not a trainer host this server may join (loopback, or a host "
                "named at start-up with --allow-trainer-host)",
                kind="permission_error",
                field="init_method",
            )
        if req.rank_offset + backend.receiving_workers > req.world_size:
            raise InvalidRequest(
                f"rank_offset {req.rank_offset} + this server's {backend.receiving_workers} receiving worker(s) "
                f"is past world_size {req.world_size}",
                field="rank_offset",
            )
        if req.signed_rendezvous and not backend.signs_rendezvous:
            raise InvalidRequest(
                f"signed_rendezvous: this {backend.name} server's engine forms the group with its own code, "
                "which cannot sign the rendezvous",
                field="signed_rendezvous",
            )
        pending = self.slot.update
        if pending is not None and not pending.done():
            # a new group replaces the old one only if it can form: a trainer's store that does
            # not answer leaves the group and its pending update alone
            await store_answers(req.init_method, min(req.timeout_s, STORE_PROBE_S))
        if pending is not None and backend.cancel_waiting_update("a new /init_process_group replaced the group"):
            await asyncio.wait({pending}, timeout=30)  # it ends at once: it never entered a receive
        self.slot.take("init_process_group")
        try:
            return await backend.init_process_group(req)
        finally:
            self.slot.release()

    def start(self, req: WeightUpdateRequest) -> UpdateRun:
        """Validate ``req`` (raising before anything is received) and start the update as its
        own task: a caller that goes away cannot cancel a receive half-way. The slot is held
        until the update has really ended."""
        at = {"at_request": time.time()}
        self.slot.take(f"weight update to version {req.version}")
        try:
            self.backend.validate_update(req)
        except BaseException:
            self.slot.release()
            raise
        at["at_validated"] = time.time()
        mode = req.mode or self.backend.default_mode
        loop = asyncio.get_running_loop()
        accepted = asyncio.Event()

        def on_accepted() -> None:
            loop.call_soon_threadsafe(accepted.set)

        task = asyncio.create_task(self.backend.update_weights(req, mode, on_accepted))
        self.slot.update = task
        task.add_done_callback(lambda _: self.slot.release())
        return UpdateRun(req.version, mode, task, accepted, at=at)
