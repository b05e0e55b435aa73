"""Async client of the inference contract (httpx), used by trainers and actors alike.

Every failure raises :class:`~pipelinerl_sdk.errors.ServerError` naming the server's URL, with
the HTTP status and the server's own message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx

from pipelinerl_sdk.errors import ServerError
from pipelinerl_sdk.protocol import (
    ApplyFloorRequest,
    ApplyFloorResponse,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    InitProcessGroupRequest,
    InitProcessGroupResponse,
    ProbeBroadcastRequest,
    ServerInfo,
    UpdateEvent,
    WeightUpdateRequest,
)


def _describe(e: BaseException) -> str:
    """``Type: message``, or ``Type`` alone when the message is empty (httpx.ReadError has none)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text}" if text else f"{type(e).__name__} (connection lost or refused)"


def _message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        err = body.get("error", body)
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    except (json.JSONDecodeError, ValueError, AttributeError):
        return resp.text[:500]


class UpdateCall:
    """One in-progress ``/request_weight_update``: :attr:`accepted` resolves when the server armed
    its receive (or raises if it refused), :attr:`final` when it reports ``done``/``error``."""

    def __init__(self, client: InferenceClient, req: WeightUpdateRequest, after: UpdateCall | None = None) -> None:
        self.url = client.url
        loop = asyncio.get_running_loop()
        self.accepted: asyncio.Future[UpdateEvent] = loop.create_future()
        self.final: asyncio.Future[UpdateEvent] = loop.create_future()
        self._task = asyncio.create_task(self._run(client, req, after))

    async def settled(self) -> None:
        """Once the final event is in, wait (up to :data:`DRAIN_WAIT_S`) for the stream's end,
        which follows it at once: a request sent meanwhile would open a new connection."""
        if self.final.done() and not self._task.done():
            await asyncio.wait([self._task], timeout=DRAIN_WAIT_S)

    async def _run(self, client: InferenceClient, req: WeightUpdateRequest, after: UpdateCall | None) -> None:
        if after is not None:
            await after.settled()
        try:
            async with client._http.stream(
                "POST",
                "/request_weight_update",
                json=req.model_dump(mode="json"),
                headers=client._control_headers(),
                timeout=httpx.Timeout(30.0, read=req.timeout_s + 60.0),
            ) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise ServerError(self.url, _message(resp), status=resp.status_code)
                final: UpdateEvent | None = None
                async for line in resp.aiter_lines():
                    if final is not None or not line.strip():
                        continue  # past the final event the server only ends the stream
                    event = UpdateEvent.model_validate_json(line)
                    self._resolve(self.accepted, event)
                    if event.event == "error":
                        final = event
                        detail = f"update to version {req.version} failed: {event.detail}"
                        self._fail(ServerError(self.url, detail, status=200))
                    elif event.event != "accepted":
                        final = event
                        self._resolve(self.final, event)
                # Read to the end even after the final event: a response closed half-read cannot
                # return its connection to the pool, and every update then paid for a new TCP
                # connection (about 3 ms on loopback, more on a loaded host).
                if final is None:
                    raise ServerError(self.url, "update stream ended without a final event", status=200)
        except ServerError as e:
            self._fail(e)
        except Exception as e:  # httpx errors, a malformed event, anything else: never leave a future pending
            self._fail(ServerError(self.url, _describe(e)))
        except asyncio.CancelledError:
            self._fail(ServerError(self.url, "update call cancelled"))
            raise

    @staticmethod
    def _resolve(fut: asyncio.Future[UpdateEvent], event: UpdateEvent) -> None:
        if not fut.done():
            fut.set_result(event)

    def _fail(self, e: ServerError) -> None:
        for fut in (self.accepted, self.final):
            if not fut.done():
                fut.set_exception(e)
        # Mark retrieved: the owner may only ever await one of the two.
        for fut in (self.accepted, self.final):
            fut.exception()

    async def cancel(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


#: How long a new update call waits for the previous one's stream to end (normally well under
#: a millisecond after its final event) so that it can reuse that connection.
DRAIN_WAIT_S = 1.0
#: Idle connections are dropped well before uvicorn's default keep-alive (5 s, which vLLM and
#: SGLang keep) closes them on the server side; reusing one at that moment reads a closed socket
#: (a ReadError with nothing answered). The margin covers a busy client or server event loop: at
#: 4 s (1 s of margin) it was seen twice in a day on a loaded 2-core machine.
KEEPALIVE_EXPIRY_S = 2.0
#: New connections are retried this many times on a connect error (a refused or reset SYN).
CONNECT_RETRIES = 2


class InferenceClient:
    """One server. ``control_token`` for control routes, ``api_key`` for the OpenAI ones."""

    def __init__(
        self,
        url: str,
        *,
        control_token: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        max_connections: int = 256,
    ) -> None:
        self.url = url.rstrip("/")
        self._last_update: UpdateCall | None = None
        self._control_token = control_token
        self._api_key = api_key
        limits = httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        )
        self._http = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            # Connection attempts only (nothing was sent): safe for every route.
            transport=httpx.AsyncHTTPTransport(limits=limits, retries=CONNECT_RETRIES),
        )

    def _control_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._control_token}"} if self._control_token else {}

    def _api_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    def _read_headers(self) -> dict[str, str]:
        """``/info`` takes the API key (when the server has one) or the control token: a trainer
        that holds only the control token reads it too."""
        return self._api_headers() or self._control_headers()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        control: bool,
        body: Any = None,
        timeout: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        if headers is None:
            headers = self._control_headers() if control else self._api_headers()
        if self._last_update is not None:
            await self._last_update.settled()
        try:
            resp = await self._http.request(
                method,
                path,
                json=body,
                headers=headers,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.HTTPError as e:
            raise ServerError(self.url, f"{method} {path}: {_describe(e)}") from e
        if resp.status_code >= 400:
            raise ServerError(self.url, f"{method} {path}: {_message(resp)}", status=resp.status_code)
        return resp.json()

    async def health(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", "/health", control=False)
        return result

    async def info(self) -> ServerInfo:
        return ServerInfo.model_validate(await self._call("GET", "/info", control=False, headers=self._read_headers()))

    async def init_process_group(self, req: InitProcessGroupRequest) -> InitProcessGroupResponse:
        body = await self._call(
            "POST",
            "/init_process_group",
            control=True,
            body=req.model_dump(mode="json"),
            timeout=req.timeout_s + 30,
        )
        return InitProcessGroupResponse.model_validate(body)

    def request_weight_update(self, req: WeightUpdateRequest) -> UpdateCall:
        """Start an update call; await ``.accepted`` before broadcasting, then ``.final``. Like
        every request of this client, it first lets an ended update's stream finish
        (:meth:`UpdateCall.settled`), so it reuses that connection."""
        call = UpdateCall(self, req, self._last_update)
        self._last_update = call
        return call

    async def probe_broadcast(self, req: ProbeBroadcastRequest) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(
            "POST",
            "/probe_broadcast",
            control=True,
            body=req.model_dump(mode="json"),
            timeout=req.timeout_s + 30,
        )
        return result

    async def apply_floor(self, repeats: int = 3) -> ApplyFloorResponse:
        """``POST /bench/apply_floor``: the engine's own apply of the served weights, timed with no
        transfer (benchmarks only; ServerError 501 where the backend does not offer it)."""
        body = ApplyFloorRequest(repeats=repeats).model_dump(mode="json")
        return ApplyFloorResponse.model_validate(
            await self._call("POST", "/bench/apply_floor", control=True, body=body, timeout=60.0 + 10.0 * repeats)
        )

    async def chat(self, req: ChatCompletionRequest | Mapping[str, Any]) -> ChatCompletionResponse:
        body = req.model_dump(mode="json", exclude_none=True) if isinstance(req, ChatCompletionRequest) else dict(req)
        return ChatCompletionResponse.model_validate(
            await self._call("POST", "/v1/chat/completions", control=False, body=body)
        )

    async def completion(self, req: CompletionRequest | Mapping[str, Any]) -> CompletionResponse:
        """``/v1/completions`` (a backend that declares ``completions``)."""
        body = req.model_dump(mode="json", exclude_none=True) if isinstance(req, CompletionRequest) else dict(req)
        return CompletionResponse.model_validate(await self._call("POST", "/v1/completions", control=False, body=body))

    async def chat_stream(self, req: ChatCompletionRequest | Mapping[str, Any]) -> AsyncIterator[ChatCompletionChunk]:
        """A ``stream=true`` chat: its chunks as they come (server-sent events, up to
        ``data: [DONE]``). ServerError with the server's message on a refusal, on an error
        event in the stream, or on a stream that ends without ``[DONE]``."""
        body = req.model_dump(mode="json", exclude_none=True) if isinstance(req, ChatCompletionRequest) else dict(req)
        body["stream"] = True
        if self._last_update is not None:
            await self._last_update.settled()
        path = "/v1/chat/completions"
        try:
            async with self._http.stream("POST", path, json=body, headers=self._api_headers()) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise ServerError(self.url, f"POST {path}: {_message(resp)}", status=resp.status_code)
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        return
                    if data.startswith('{"error"'):
                        err = json.loads(data)["error"]
                        raise ServerError(self.url, f"POST {path}: {err.get('message')}", status=err.get("code"))
                    yield ChatCompletionChunk.model_validate_json(data)
        except httpx.HTTPError as e:
            raise ServerError(self.url, f"POST {path}: {_describe(e)}") from e
        raise ServerError(self.url, f"POST {path}: the stream ended without data: [DONE]")

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
