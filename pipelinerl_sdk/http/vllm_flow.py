"""The trainer side of vLLM's weight-transfer flow over the SDK's group: what vLLM's trainer-side
engines do (``init_weight_transfer_engine``, then per update ``start_weight_update``,
``update_weights`` beside the broadcast, ``finish_weight_update``), with the SDK's sender and its
guarantees (the trainer's signed ``go`` only once every server armed its receive, so a refusal
costs no byte; buckets; a failed send leaves the old weights serving).

It drives any object with the four methods of vLLM's ``VLLMWeightSyncClient`` protocol
(:class:`WeightSyncClient`): vLLM's own ``HTTPVLLMWeightSyncClient`` against vLLM's server (its
routes are open there), or :class:`ControlTokenClient` against an SDK server, whose vLLM routes
(:mod:`pipelinerl_sdk.http.vllm_rl`) need the control token. The vllm adapter wraps it as vLLM's
trainer engine ``pipelinerl`` (``pipelinerl_sdk_vllm.trainer_engine``), so trainers written for
vLLM's ``WeightTransferTrainerFactory`` use it unchanged.

One update, as the server sees it: ``start_weight_update``; ``update_weights {"op": "receive"}``
(answers once armed, or refuses); the trainer posts ``go`` and broadcasts; ``update_weights
{"op": "await"}`` (answers once the weights are live, or with the failure);
``finish_weight_update {"weight_version": str(version)}``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import httpx
import torch

from pipelinerl_sdk.errors import ServerError
from pipelinerl_sdk.protocol import (
    GroupBackend,
    InitProcessGroupRequest,
    InitProcessGroupResponse,
    ParamSpec,
    ProbeBroadcastRequest,
    ServerInfo,
    UpdateEvent,
    WeightUpdateRequest,
)
from pipelinerl_sdk.weights.auth import group_id
from pipelinerl_sdk.weights.buckets import DEFAULT_BUCKET_BYTES
from pipelinerl_sdk.weights.publisher import PublishResult, WeightPublisher

__all__ = ["ControlTokenClient", "VLLMFlowLink", "VLLMFlowPublisher", "WeightSyncClient", "receive_update_info"]


class WeightSyncClient(Protocol):
    """vLLM 0.32's ``VLLMWeightSyncClient``: the inference side's weight-sync control plane, four
    synchronous calls taking plain dicts (raising on failure)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class ControlTokenClient:
    """:class:`WeightSyncClient` over HTTP with the server's control token (vLLM's own
    ``HTTPVLLMWeightSyncClient`` sends none). A 4xx/5xx raises :class:`ServerError` with the
    server's message and status."""

    def __init__(self, base_url: str, control_token: str, *, timeout_s: float = 300.0) -> None:
        self.url = base_url.rstrip("/")
        #: The JSON body of the last call's answer (an SDK server's ``await`` carries the update's
        #: ``timings`` there).
        self.last_answer: dict[str, Any] = {}
        self._http = httpx.Client(
            base_url=self.url, timeout=timeout_s, headers={"Authorization": f"Bearer {control_token}"}
        )

    def _post(self, path: str, body: dict[str, Any] | None = None) -> None:
        r = self._http.post(path, json=body)
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:500]
            raise ServerError(self.url, f"POST {path}: {r.status_code} {message}", status=r.status_code)
        try:
            self.last_answer = r.json()
        except ValueError:
            self.last_answer = {}

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("/start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("/finish_weight_update", {"weight_version": weight_version} if weight_version is not None else None)

    def close(self) -> None:
        self._http.close()


def receive_update_info(req: WeightUpdateRequest) -> dict[str, Any]:
    """The ``update_info`` (op ``receive``) of the SDK update ``req``: what the vllm adapter's
    worker engine and :mod:`pipelinerl_sdk.http.vllm_rl` both read."""
    info: dict[str, Any] = {
        "op": "receive",
        "version": req.version,
        "params": [[p.name, p.dtype, list(p.shape)] for p in req.params],
        "bucket_bytes": req.bucket_bytes,
        "timeout_s": req.timeout_s,
        "group_id": req.group_id,
        "plan_digest": req.plan_digest,
    }
    if req.mode is not None:
        info["mode"] = req.mode
    return info


class _FlowCall:
    """One server's side of one update (the publisher's ``PendingUpdate``): ``accepted`` once
    ``start_weight_update`` and the receive's ``update_weights`` answered; ``final`` runs the
    ``await`` and ``finish_weight_update`` calls, started when the publisher first asks for it
    (after its broadcast, or at once after a refusal)."""

    def __init__(self, client: WeightSyncClient, url: str, req: WeightUpdateRequest) -> None:
        self.url, self._client, self._req = url, client, req
        self.accepted: asyncio.Future[UpdateEvent] = asyncio.get_running_loop().create_future()
        self._final: asyncio.Future[UpdateEvent] | None = None
        self._arm = asyncio.ensure_future(self._do_arm())

    def _error(self, e: BaseException, what: str) -> ServerError:
        if isinstance(e, ServerError):
            return e
        return ServerError(self.url, f"{what}: {type(e).__name__}: {e}")

    async def _do_arm(self) -> None:
        try:
            await asyncio.to_thread(self._client.start_weight_update)
            await asyncio.to_thread(self._client.update_weights, receive_update_info(self._req))
        except Exception as e:
            self.accepted.set_exception(self._error(e, "update_weights (receive)"))
            return
        self.accepted.set_result(UpdateEvent(event="accepted", version=self._req.version))

    @property
    def final(self) -> asyncio.Future[UpdateEvent]:
        if self._final is None:
            self._final = asyncio.ensure_future(self._do_final())
        return self._final

    async def _do_final(self) -> UpdateEvent:
        await self._arm
        exc = self.accepted.exception()
        if exc is not None:
            raise exc  # refused: the server closed its session (as vLLM's worker does)
        version = self._req.version
        try:
            await asyncio.to_thread(self._client.update_weights, {"op": "await", "version": version})
        except Exception as e:  # the update failed; its session is closed
            raise self._error(e, "update_weights (await)") from e
        answer = getattr(self._client, "last_answer", None)  # ControlTokenClient keeps it
        answer = answer if isinstance(answer, dict) else {}
        timings, mode = answer.get("timings"), answer.get("mode")
        try:
            await asyncio.to_thread(self._client.finish_weight_update, str(version))
        except Exception as e:
            raise self._error(e, "finish_weight_update") from e
        return UpdateEvent(event="done", version=version, timings=timings or {}, mode=mode)

    async def cancel(self) -> None:
        """Nothing to close: each call is one request, which ends by itself."""


class VLLMFlowLink:
    """A :class:`~pipelinerl_sdk.weights.publisher.ServerLink` over a :class:`WeightSyncClient`.
    vLLM's protocol has no ``/info``: what the publisher needs of it (the workers joining, the
    signing) comes from the caller."""

    def __init__(
        self, client: WeightSyncClient, *, receiving_workers: int, signed_rendezvous: bool = False, url: str = ""
    ) -> None:
        if receiving_workers < 1:
            raise ValueError(f"receiving_workers: at least 1, got {receiving_workers}")
        self.client = client
        self.url = url or str(getattr(client, "url", "") or getattr(client, "base_url", "") or "vllm-client")
        self.receiving_workers = receiving_workers
        self.signed_rendezvous = signed_rendezvous

    async def info(self) -> ServerInfo:
        return ServerInfo(
            backend="vllm-rl-api",
            model="",
            version=0,
            receiving_workers=self.receiving_workers,
            receive_modes=["staged"],
            default_mode="staged",
            group=None,
            updating=False,
            params=[],
            signed_rendezvous=self.signed_rendezvous,
        )

    async def init_process_group(self, req: InitProcessGroupRequest) -> Any:
        try:
            await asyncio.to_thread(self.client.init_weight_transfer_engine, {"request": req.model_dump()})
        except Exception as e:
            raise ServerError(self.url, f"init_weight_transfer_engine: {type(e).__name__}: {e}") from e
        ranks = list(range(req.rank_offset, req.rank_offset + self.receiving_workers))
        return InitProcessGroupResponse(
            group_name=req.group_name,
            group_id=group_id(req.group_secret),
            ranks=ranks,
            world_size=req.world_size,
            backend=req.backend,
        )

    def request_weight_update(self, req: WeightUpdateRequest) -> _FlowCall:
        return _FlowCall(self.client, self.url, req)

    async def probe_broadcast(self, req: ProbeBroadcastRequest) -> Any:
        raise ServerError(self.url, "probe_broadcast: not part of vLLM's weight-transfer flow")


class VLLMFlowPublisher:
    """The SDK's :class:`~pipelinerl_sdk.weights.publisher.WeightPublisher` driven through vLLM's
    flow, as synchronous calls (vLLM's trainer engines are synchronous): :meth:`connect` once,
    :meth:`publish` per update, :meth:`close`. Owns an event loop; not thread-safe."""

    def __init__(
        self,
        links: Sequence[VLLMFlowLink],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 120.0,
    ) -> None:
        self._runner = asyncio.Runner()
        self.publisher = WeightPublisher(list(links), bucket_bytes=bucket_bytes, timeout_s=timeout_s)

    def connect(self, *, host: str = "127.0.0.1", port: int = 0, backend: GroupBackend = "gloo") -> None:
        """Form the group (the trainer is rank 0; every link's workers after it)."""
        self._runner.run(self.publisher.connect(host=host, port=port, backend=backend))

    def publish(self, version: int, params: Sequence[ParamSpec], tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Update every server to ``version``: ``tensors`` yields every param of ``params`` in
        order. Raises FanOutError naming the servers that refused or failed (their old weights
        keep serving)."""

        async def run() -> PublishResult | None:
            async with self.publisher.update(version, params) as sender:
                for name, tensor in tensors:
                    await asyncio.to_thread(sender.send, name, tensor)
            return self.publisher.last

        self._runner.run(run())

    def close(self) -> None:
        self._runner.run(self.publisher.close())
        self._runner.close()
