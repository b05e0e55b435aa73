"""One weight update, in the order and with the failure semantics the contract requires; the
engine supplies only its steps.

:func:`run_update` is the body of ``InferenceBackend.update_weights`` for every backend::

    arm -> on_accepted() -> await_go -> [pause] receive [pause] -> apply (paused) -> version

``direct`` holds generation for the receive and the apply, ``staged`` for the apply only; either
way generation is never held before the trainer said ``go`` (a called-off update never pauses)
and a failure at any step calls ``abandon`` (inside the pause when one is held) and leaves the
old weights serving. Errors come out normalised (:func:`normalise_update_error`) the same for
every engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pipelinerl_sdk.contracts import UpdateReport
from pipelinerl_sdk.errors import GroupError, UpdateFailed
from pipelinerl_sdk.kit.inference.book import GroupBook
from pipelinerl_sdk.protocol import ReceiveMode, WeightUpdateRequest, update_key

if TYPE_CHECKING:
    import torch

    from pipelinerl_sdk.weights.receive import StagedWeights, WeightReceiver
    from pipelinerl_sdk.weights.swap import DoubleBuffer


async def _nothing() -> None:
    return None


@dataclass(frozen=True, slots=True)
class UpdateSteps:
    """The engine-specific steps of one update, each awaited once at most, in this order:

    - ``arm``: get ready to receive (buffers, the engine's update session); the trainer may
      broadcast once it returns;
    - ``await_go``: the trainer's decision; raises UpdateAborted (called off) or GroupError;
    - ``receive``: every byte of the update arrives, staged, not live; returns receive seconds;
    - ``apply``: inside the pause, make the staged weights live (and tag the engine's version);
    - ``abandon``: after a failure at any step, put the engine back as it was (old weights
      serving, session closed); raise only if old weights cannot be guaranteed;
    - ``paused``: a context holding generation between two engine steps; its value may carry
      ``held_s`` (seconds held, as measured by the engine), else the kit times it."""

    await_go: Callable[[], Awaitable[None]]
    receive: Callable[[], Awaitable[float]]
    apply: Callable[[], Awaitable[None]]
    paused: Callable[[], AbstractAsyncContextManager[Any]]
    arm: Callable[[], Awaitable[None]] = _nothing
    abandon: Callable[[], Awaitable[None]] = _nothing


def normalise_update_error(e: BaseException, book: GroupBook) -> BaseException:
    """The one mapping of a failed update's error: a :class:`GroupError` (timeout, lost peer)
    marks the group broken and becomes :class:`UpdateFailed` naming the version still served;
    UpdateAborted/UpdateFailed/UpdateRejected and anything else pass unchanged."""
    if isinstance(e, GroupError):
        book.mark_broken(str(e))
        return UpdateFailed(f"receive failed, version {book.version} still serving: {e}")
    return e


async def run_update(
    book: GroupBook, req: WeightUpdateRequest, mode: ReceiveMode, on_accepted: Callable[[], None], steps: UpdateSteps
) -> UpdateReport:
    """Run one update (see the module doc); on success ``book.version`` is ``req.version``."""
    t0 = time.perf_counter()
    abandoned = False
    pause_s = receive_s = apply_s = 0.0

    async def abandon() -> None:
        nonlocal abandoned
        if not abandoned:
            abandoned = True
            await steps.abandon()

    async def hold(body: Callable[[], Awaitable[None]]) -> float:
        async with steps.paused() as handle:
            entered = time.perf_counter()
            try:
                await body()
            except BaseException:
                await abandon()  # while still paused: nothing half-done is ever served
                raise
        held = getattr(handle, "held_s", None)
        return float(held) if held is not None else time.perf_counter() - entered

    async def receive() -> None:
        nonlocal receive_s
        receive_s = await steps.receive()

    async def apply() -> None:
        nonlocal apply_s
        t_apply = time.perf_counter()
        await steps.apply()
        apply_s = time.perf_counter() - t_apply

    async def receive_and_apply() -> None:
        await receive()
        await apply()

    try:
        await steps.arm()
        on_accepted()
        await steps.await_go()
        if mode == "direct":
            pause_s = await hold(receive_and_apply)
        else:
            await receive()
            pause_s = await hold(apply)
    except BaseException as e:
        await abandon()
        err = normalise_update_error(e, book)
        if err is e:
            raise
        raise err from e
    book.version = req.version
    return UpdateReport(req.version, mode, pause_s, receive_s, apply_s, time.perf_counter() - t0)


class Gate(Protocol):
    """What :func:`local_steps` needs of an engine loop: hold it between steps, tag its version
    (:class:`~pipelinerl_sdk.kit.inference.gate.StepGate`, or an engine that wraps one)."""

    def paused(self) -> AbstractAsyncContextManager[Any]: ...

    def set_version(self, v: int) -> None: ...


def local_steps(
    receiver: WeightReceiver,
    weights: DoubleBuffer,
    params: Mapping[str, torch.Tensor],
    req: WeightUpdateRequest,
    gate: Gate,
) -> UpdateSteps:
    """The steps of an engine whose server process holds the model (plain torch params) and is
    itself the receiving worker: receive on a worker thread into ``weights``' spare buffer, then
    make it live by re-pointing ``params`` (no copy in the pause) and tag ``gate``'s version."""
    from pipelinerl_sdk.weights.buckets import BucketPlan

    plan = BucketPlan.build(req.params, req.bucket_bytes)
    into = weights.spare(plan.total_bytes, receiver.group.device)
    staged: list[StagedWeights] = []

    async def arm() -> None:
        receiver.prepare(plan, into=into)

    async def await_go() -> None:
        await asyncio.to_thread(receiver.await_go, update_key(req.version), req.timeout_s)

    async def receive() -> float:
        staged.append(await asyncio.to_thread(receiver.receive_decided, plan, into=into))
        return staged[0].receive_s

    async def apply() -> None:
        weights.apply(staged[0], params)
        gate.set_version(req.version)

    return UpdateSteps(await_go=await_go, receive=receive, apply=apply, paused=gate.paused, arm=arm)
