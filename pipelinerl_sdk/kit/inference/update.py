"""One weight update, in the order and with the failure semantics the contract requires; the
engine supplies only its steps.

:func:`run_update` is the body of ``InferenceBackend.update_weights`` for every backend::

    arm -> on_accepted() -> await_go -> [pause] receive [pause] -> apply (paused) -> version

``direct`` holds generation for the receive and the apply, ``staged`` for the apply only; either
way generation is never held before the trainer said ``go`` (a called-off update never pauses),
and with a ``first_bytes`` step not before the first bytes arrived (a trainer stuck after its
``go`` holds nothing)
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


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


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
      ``held_s`` (seconds held, as measured by the engine), else the kit times it;
    - ``first_bytes`` (optional): returns once the receive's first bytes arrived. Given, a
      ``direct`` update starts ``receive`` unpaused and holds generation from then on, so the
      receive must write nothing live before it returns (it receives into a buffer of its own);
      None: ``direct`` holds generation from the trainer's ``go``;
    - ``stamps`` (optional, no I/O: it runs before the ``done`` line): called once after a
      successful update, the phases the engine itself observed (``time.time()`` by phase name,
      e.g. ``first_bucket`` or a worker's ``worker_last_bucket``), merged into the report's
      stamps over the kit's own."""

    await_go: Callable[[], Awaitable[None]]
    receive: Callable[[], Awaitable[float]]
    apply: Callable[[], Awaitable[None]]
    paused: Callable[[], AbstractAsyncContextManager[Any]]
    arm: Callable[[], Awaitable[None]] = _nothing
    abandon: Callable[[], Awaitable[None]] = _nothing
    first_bytes: Callable[[], Awaitable[None]] | None = None
    stamps: Callable[[], Mapping[str, float]] | None = None


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
    """Run one update (see the module doc); on success ``book.version`` is ``req.version``.
    The report's stamps (``time.time()``): ``armed``, ``decision``, ``last_bucket`` (the receive
    step returned), ``pause_request`` (the hold asked for), ``pause_start`` (held), ``apply_start``,
    ``apply_end``, ``pause_end``, then the engine's own (``steps.stamps``)."""
    t0 = time.perf_counter()
    abandoned = False
    pause_s = receive_s = apply_s = 0.0
    stamps: dict[str, float] = {}

    def stamp(phase: str) -> None:
        stamps[phase] = time.time()

    async def abandon() -> None:
        nonlocal abandoned
        if not abandoned:
            abandoned = True
            await steps.abandon()

    async def hold(body: Callable[[], Awaitable[None]]) -> float:
        stamp("pause_request")
        async with steps.paused() as handle:
            entered = time.perf_counter()
            stamp("pause_start")
            try:
                await body()
            except BaseException:
                await abandon()  # while still paused: nothing half-done is ever served
                raise
        stamp("pause_end")
        held = getattr(handle, "held_s", None)
        return float(held) if held is not None else time.perf_counter() - entered

    async def receive() -> None:
        nonlocal receive_s
        receive_s = await steps.receive()
        stamp("last_bucket")

    async def apply() -> None:
        nonlocal apply_s
        stamp("apply_start")
        t_apply = time.perf_counter()
        await steps.apply()
        apply_s = time.perf_counter() - t_apply
        stamp("apply_end")

    async def receive_and_apply() -> None:
        await receive()
        await apply()

    async def direct_once_bytes_flow(first_bytes: Callable[[], Awaitable[None]]) -> float:
        receiving = asyncio.ensure_future(receive())
        flowing = asyncio.ensure_future(first_bytes())
        try:
            await asyncio.wait({receiving, flowing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            flowing.cancel()
        if receiving.done():
            receiving.result()  # failed before any byte arrived: nothing was held

        async def rest() -> None:
            await receiving
            await apply()

        return await hold(rest)

    try:
        await steps.arm()
        stamp("armed")
        on_accepted()
        await steps.await_go()
        stamp("decision")
        if mode == "direct" and steps.first_bytes is not None:
            pause_s = await direct_once_bytes_flow(steps.first_bytes)
        elif mode == "direct":
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
    total_s = time.perf_counter() - t0
    if steps.stamps is not None:
        stamps.update(steps.stamps())
    return UpdateReport(req.version, mode, pause_s, receive_s, apply_s, total_s, stamps)


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
    make it live by re-pointing ``params`` (no copy in the pause) and tag ``gate``'s version.
    Nothing live is written before the apply, so ``direct`` holds generation only once the first
    bucket arrived (``first_bytes``)."""
    from pipelinerl_sdk.weights.buckets import BucketPlan

    plan = BucketPlan.build(req.params, req.bucket_bytes)
    into = weights.spare(plan.total_bytes, receiver.group.device)
    staged: list[StagedWeights] = []
    flowing: list[asyncio.Future[None]] = []  # done once the first bucket arrived
    seen: dict[str, float] = {}  # the receive thread's stamps

    def first_bucket() -> asyncio.Future[None]:
        if not flowing:
            flowing.append(asyncio.get_running_loop().create_future())
        return flowing[0]

    async def arm() -> None:
        receiver.prepare(plan, into=into)

    async def await_go() -> None:
        await asyncio.to_thread(receiver.await_go, update_key(req.version), req.timeout_s)

    async def receive() -> float:
        arrived = first_bucket()
        loop = arrived.get_loop()

        def on_first_bucket() -> None:
            seen["first_bucket"] = time.time()
            loop.call_soon_threadsafe(_settle, arrived)

        received = await asyncio.to_thread(receiver.receive_decided, plan, into=into, on_first_bucket=on_first_bucket)
        staged.append(received)
        return staged[0].receive_s

    async def first_bytes() -> None:
        await first_bucket()

    async def apply() -> None:
        weights.apply(staged[0], params)
        gate.set_version(req.version)

    return UpdateSteps(
        await_go=await_go,
        receive=receive,
        apply=apply,
        paused=gate.paused,
        arm=arm,
        first_bytes=first_bytes,
        stamps=lambda: seen,
    )
