"""The inference contract as one FastAPI router any engine can mount, and its error handlers.

Routes (control routes need ``Authorization: Bearer <control token>``; 401 without it, 403 with
a wrong one; every token is checked before the body is read):

- ``GET /health`` (open: status and weight version only);
- ``GET /info``, ``GET /openapi.json`` (read-only; the API key when one is set, or the control
  token);
- ``POST /init_process_group`` (control);
- ``POST /request_weight_update`` (control): validated first (4xx with a message, nothing
  received); then ``200`` with an NDJSON stream: ``accepted`` once the receive is armed, then
  ``done`` or ``error``;
- ``POST /probe_broadcast`` (control): one flat broadcast, for link checks and benchmarks;
- ``POST /bench/apply_floor`` (control, benchmarks only): the engine's own apply of the served
  weights, timed with no transfer (``InferenceBackend.apply_floor``; 501 where not offered);
- vLLM 0.32's RL routes (``/init_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``... control; ``/weight_info``, ``/get_world_size``
  read) for a backend that declares ``vllm_rl_api``: :mod:`pipelinerl_sdk.http.vllm_rl`, onto the
  same update path and control slot (:mod:`pipelinerl_sdk.http.update_door`);
- ``POST /v1/chat/completions``, ``GET /v1/models`` (``api_key`` when configured; a missing or
  wrong key is 401, as OpenAI answers); ``stream=true`` chat is server-sent events
  (:class:`EventStream`) for a backend that declares ``streaming``, else a 400 naming ``stream``;
  a non-zero ``min_tokens`` is a 400 naming it unless the backend declares ``min_tokens``;
  ``POST /v1/completions`` (the same key) only for a backend that declares ``completions`` (an
  engine-owned app keeps its own route otherwise: vLLM's, without weight versions).

At most one control operation runs at a time; a second is refused with 409, never queued.

Every error is a JSON body in OpenAI's shape (``ErrorBody``): SDK errors map to a status
through :data:`ERROR_STATUS` (the one table from exception types to statuses), a malformed body
is a 400 naming the field, anything unexpected is a 500 ``internal_error``. Serving (binding,
lifespan, signals, the ready file) is :mod:`pipelinerl_sdk.kit.inference.serve`'s business.

One exception to the single control slot: ``/init_process_group`` ends an update that still waits
for its (replaced) trainer's decision, when the backend can (``cancel_waiting_update``), instead
of waiting for its timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import AbstractContextManager, ExitStack
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, Literal

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipelinerl_sdk.contracts import InferenceBackend, capabilities_to_dict, check_group_id

if TYPE_CHECKING:
    from pipelinerl_sdk.http.pipelinerl_trainer import PipelineRLGroupConfig
from pipelinerl_sdk.errors import (
    DecisionTimeout,
    GroupError,
    InvalidRequest,
    Overloaded,
    PipelineRLError,
    RequestTooLarge,
    UpdateFailed,
    UpdateRejected,
)
from pipelinerl_sdk.http.admission import UNKNOWN_CONTEXT_BUDGET, Admission, Limits, chat_cost, cost_field
from pipelinerl_sdk.http.echo import complete_with_echo
from pipelinerl_sdk.http.update_door import ControlRefused, UpdateDoor
from pipelinerl_sdk.http.update_door import trainer_host_allowed as trainer_host_allowed  # re-exported (its old home)
from pipelinerl_sdk.http.vllm_rl import ROUTES as VLLM_RL_ROUTES
from pipelinerl_sdk.http.vllm_rl import VLLMRLFront, serve_vllm_rl
from pipelinerl_sdk.protocol import (
    ApplyFloorRequest,
    ApplyFloorResponse,
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    InitProcessGroupRequest,
    ProbeBroadcastRequest,
    ServerInfo,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UpdateEvent,
    WeightUpdateRequest,
)

log = logging.getLogger("pipelinerl_sdk.server")

#: Every path :func:`build_router` serves, and who may call it: ``open`` (anyone), ``read`` (the
#: API key when one is set, or the control token), ``control`` (the control token), ``openai``
#: (the API key when one is set). An engine-owned app may serve more routes of its own (vLLM's):
#: these are the contract's.
ROUTES: dict[str, Literal["open", "read", "control", "openai"]] = {
    "/health": "open",
    "/info": "read",
    "/openapi.json": "read",
    "/init_process_group": "control",
    "/request_weight_update": "control",
    "/probe_broadcast": "control",
    "/bench/apply_floor": "control",
    "/v1/models": "openai",
    "/v1/chat/completions": "openai",
    "/v1/completions": "openai",
    "/tokenize": "openai",
    "/detokenize": "openai",
}


class HTTPError(Exception):
    """Raised inside a route: answered as ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request", field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.field = status, message, kind, field


def error_response(
    status: int, message: str, *, kind: str, field: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``; ``param`` names
    the offending request field, ``code`` is the status (as vLLM sends)."""
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": field, "code": status}},
        status_code=status,
        headers=headers,
    )


def error_headers(e: PipelineRLError) -> dict[str, str] | None:
    """The headers an SDK error's answer carries: ``Retry-After`` for :class:`Overloaded`."""
    return {"Retry-After": str(e.retry_after_s)} if isinstance(e, Overloaded) else None


#: The one table from SDK errors to HTTP status and error type; the first row whose class the
#: error is an instance of wins (most specific first). ``UpdateRejected`` carries its own status.
ERROR_STATUS: tuple[tuple[type[PipelineRLError], int, str], ...] = (
    (UpdateRejected, 422, "update_rejected"),
    (InvalidRequest, 400, "invalid_request"),
    (RequestTooLarge, 413, "request_too_large"),
    (Overloaded, 429, "overloaded"),
    (DecisionTimeout, 408, "decision_timeout"),
    (GroupError, 502, "group_error"),
    (UpdateFailed, 502, "update_failed"),
    (PipelineRLError, 500, "internal_error"),
)


def status_of(e: PipelineRLError) -> tuple[int, str]:
    """(HTTP status, error type) of ``e`` by :data:`ERROR_STATUS` (a :class:`ControlRefused`
    carries its own)."""
    if isinstance(e, ControlRefused):
        return e.status, e.kind
    for cls, status, kind in ERROR_STATUS:
        if isinstance(e, cls):
            return (e.status if isinstance(e, UpdateRejected) else status), kind
    raise AssertionError("unreachable: PipelineRLError is the table's last row")


def as_http_error(e: PipelineRLError) -> HTTPError:
    """``e`` as the HTTPError the table gives it (its ``field`` kept when it has one)."""
    status, kind = status_of(e)
    return HTTPError(status, str(e), kind=kind, field=getattr(e, "field", None))


class _ContractRoute(APIRoute):
    """A contract route: an unexpected exception becomes ``HTTPError(500, internal_error)`` inside
    the route, so the app's exception middleware answers it as JSON and the connection stays up
    (an app-level ``Exception`` handler answers too, but Starlette then re-raises it and the
    server drops the keep-alive connection)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except (HTTPError, PipelineRLError, RequestValidationError, StarletteHTTPException):
                raise
            except Exception as e:
                log.error("%s %s failed", request.method, request.url.path, exc_info=e)
                raise HTTPError(500, f"{type(e).__name__}: {e}", kind="internal_error") from e

        return route


Guard = Callable[[Request], Awaitable[None]]


def _bearer_guard(tokens: tuple[str, ...], what: str, *, wrong: int = 403) -> Guard:
    """Accept any of ``tokens`` (none: open); a missing one is 401, a wrong one ``wrong``."""

    async def guard(request: Request) -> None:
        if not tokens:
            return
        header = request.headers.get("authorization", "")
        if not header.lower().startswith("bearer "):
            raise HTTPError(401, f"missing bearer token for {what}", kind="authentication_error")
        given = header[7:].strip().encode()
        if not any([secrets.compare_digest(given, t.encode()) for t in tokens]):  # every one compared
            kind = "authentication_error" if wrong == 401 else "permission_error"
            raise HTTPError(wrong, f"wrong bearer token for {what}", kind=kind)

    return guard


class _EngineRouteGuard:
    """ASGI middleware: the engine's own routes ``access`` names answer only the credentials the
    SDK's routes of that access take (``control``: the control token; ``read``: the API key or
    the control token where an API key is set, else open); the rest pass untouched."""

    def __init__(self, app: Any, *, access: dict[str, Literal["read", "control"]], guards: dict[str, Guard]) -> None:
        self.app, self.access, self.guards = app, access, guards

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        kind = self.access.get(scope.get("path", "")) if scope["type"] == "http" else None
        if kind is not None:
            try:
                await self.guards[kind](Request(scope))
            except HTTPError as e:
                await error_response(e.status, e.message, kind=e.kind)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def guard_engine_routes(
    app: FastAPI, access: dict[str, Literal["read", "control"]], *, control_token: str, api_key: str | None
) -> None:
    """Put the SDK's credentials in front of routes the engine's own app serves at the paths of
    ``access`` (vLLM's RL routes under ``VLLM_SERVER_DEV_MODE``, which vLLM serves to anyone):
    a control path answers only ``control_token`` (401 without a bearer token, 403 with a wrong
    one), a read path the API key or the control token where ``api_key`` is set. Call before
    the app serves (its middleware stack is rebuilt)."""
    from starlette.middleware import Middleware

    if not control_token:
        raise ValueError("control_token must be set: control routes are never open")
    guards = {
        "control": _bearer_guard((control_token,), "control routes"),
        "read": _bearer_guard((api_key, control_token) if api_key else (), "this route"),
    }
    app.user_middleware.insert(0, Middleware(_EngineRouteGuard, access=access, guards=guards))
    if app.middleware_stack is not None:
        app.middleware_stack = app.build_middleware_stack()


async def read_body(request: Request, limit: int) -> None:
    """Read ``request``'s body (kept for FastAPI to parse), refusing one past ``limit`` bytes with
    :class:`RequestTooLarge`: by its Content-Length before reading anything, and while reading
    (a chunked body, or one longer than it said) before it is parsed."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(f"request body of {declared} bytes is past this server's limit of {limit}", limit=limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge(f"request body past this server's limit of {limit} bytes", limit=limit)
        chunks.append(chunk)
    request._body = b"".join(chunks)  # Request.body() returns it: FastAPI parses what was read here


def _guarded_route(guards: dict[str, Guard], max_body_bytes: int) -> type[APIRoute]:
    """A route class that runs its path's guard *before* FastAPI reads and parses the body (a
    dependency runs after): an unauthenticated client gets its 401 without sending the body; then
    the body is read under ``max_body_bytes`` (413 past it), still before it is parsed."""

    class GuardedRoute(_ContractRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()
            guard = guards[self.path]

            async def guarded(request: Request) -> Response:
                await guard(request)
                if request.method == "POST":
                    await read_body(request, max_body_bytes)
                return await handler(request)

            return guarded

    return GuardedRoute


async def _client_gone(request: Request) -> None:
    """Return once the client of ``request`` (its body read) has disconnected."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def served_model_name(model: str) -> str:
    """The name a server shows for its model: the last component of a path, never the path."""
    return PurePath(model).name or model


def build_router(
    backend: InferenceBackend,
    *,
    control_token: str,
    api_key: str | None,
    trainer_hosts: tuple[str, ...] = (),
    limits: Limits | None = None,
    served_model_names: tuple[str, ...] = (),
    return_tokens_as_token_ids: bool = False,
    logprobs_mode: str = "raw_logprobs",
    pipelinerl_group: PipelineRLGroupConfig | None = None,
    vllm_rl_front: type[VLLMRLFront] = VLLMRLFront,
) -> APIRouter:
    """The contract's routes over ``backend``. ``control_token`` must be non-empty and differ
    from ``api_key``. ``/init_process_group`` joins stores on loopback or ``trainer_hosts`` only.
    ``served_model_names``, ``return_tokens_as_token_ids`` and ``logprobs_mode`` (refused here
    unless the backend declares it): as :class:`~pipelinerl_sdk.contracts.ServeConfig`'s fields.
    ``pipelinerl_group``: PipelineRL's trainer protocol is served too (``/receive_weight_update``,
    :mod:`pipelinerl_sdk.http.pipelinerl_trainer`); the group is joined from now on.
    ``vllm_rl_front``: the class serving vLLM's RL API where the backend declares ``vllm_rl_api``.

    ``limits`` (defaults: :class:`~pipelinerl_sdk.http.admission.Limits`) bound every body (413)
    and the chat requests and tokens admitted at once (429 with Retry-After). A chat request
    whose client disconnects is cancelled: ``backend.chat_completion`` is cancelled, and must
    abort its work in the engine on ``CancelledError``."""
    limits = limits or Limits()
    admission = Admission(limits)

    def admit(req: ChatCompletionRequest | CompletionRequest) -> AbstractContextManager[None]:
        """``req`` under admission: its whole token budget counted (400 if it can never fit)."""
        budget = backend.max_model_len or UNKNOWN_CONTEXT_BUDGET
        cost = chat_cost(req, budget)
        return admission.admit(cost, field=cost_field(req, budget, limits.max_tokens))

    if not control_token:
        raise ValueError("control_token must be set: control routes are never open")
    if api_key is not None and secrets.compare_digest(control_token, api_key):
        raise ValueError("control_token must differ from the OpenAI api_key")
    control = _bearer_guard((control_token,), "control routes")
    openai = _bearer_guard((api_key,) if api_key else (), "the OpenAI routes", wrong=401)  # as OpenAI
    read = _bearer_guard((api_key, control_token) if api_key else (), "this route")
    open_: Guard = _bearer_guard((), "")
    by_access = {"open": open_, "read": read, "control": control, "openai": openai}
    guards = {path: by_access[access] for path, access in {**ROUTES, **VLLM_RL_ROUTES}.items()}
    door = UpdateDoor(backend, trainer_hosts=trainer_hosts)
    slot = door.slot
    router = APIRouter(route_class=_guarded_route(guards, limits.max_body_bytes))
    if logprobs_mode not in backend.capabilities.logprobs_modes:
        raise ValueError(
            f"logprobs_mode: the {backend.name} backend serves {sorted(backend.capabilities.logprobs_modes)} only, "
            f"not {logprobs_mode!r}"
        )
    if any(not name.strip() for name in served_model_names):
        raise ValueError("served_model_names: a served model name must not be empty")
    served = served_model_names[0] if served_model_names else served_model_name(backend.model_name)
    names = served_model_names or (served,)  # what /v1/models lists
    accepted = set(served_model_names) if served_model_names else {served, backend.model_name}
    created = int(time.time())

    @router.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "version": backend.version}

    @router.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> JSONResponse:
        return JSONResponse(request.app.openapi())

    @router.get("/info", response_model=ServerInfo)
    async def info() -> ServerInfo:
        return ServerInfo(
            backend=backend.name,
            model=served,
            version=backend.version,
            receiving_workers=backend.receiving_workers,
            receive_modes=sorted(backend.capabilities.receive_modes),
            default_mode=backend.default_mode,
            group=backend.group_state(),
            updating=slot.busy is not None,
            params=backend.param_specs(),
            max_model_len=backend.max_model_len,
            capabilities=capabilities_to_dict(backend.capabilities),
            requests_in_flight=admission.requests,
            tokens_in_flight=admission.tokens,
            workers=backend.worker_states(),
            signed_rendezvous=backend.signs_rendezvous,
        )

    @router.post("/init_process_group")
    async def init_process_group(req: InitProcessGroupRequest) -> dict[str, Any]:
        return (await door.join(req)).model_dump()

    @router.post("/request_weight_update")
    async def request_weight_update(req: WeightUpdateRequest) -> StreamingResponse:
        run = door.start(req)

        async def events() -> AsyncIterator[bytes]:
            if await run.wait_accepted():
                yield _line(UpdateEvent(event="accepted", version=req.version, mode=run.mode))
            try:
                report = await asyncio.shield(run.task)
            except Exception as e:
                log.warning("weight update to version %d failed: %s", req.version, e)
                yield _line(
                    UpdateEvent(
                        event="error",
                        version=req.version,
                        mode=run.mode,
                        detail=f"{type(e).__name__}: {e}",
                        timings={"total_s": time.perf_counter() - run.started},
                    )
                )
                return
            timings = {**report.timings(), **run.at, "at_done": time.time()}
            yield _line(UpdateEvent(event="done", version=report.version, mode=report.mode, timings=timings))

        return StreamingResponse(events(), media_type="application/x-ndjson")

    @router.post("/bench/apply_floor")
    async def apply_floor(req: ApplyFloorRequest) -> ApplyFloorResponse:
        slot.take("apply_floor")
        try:
            return await backend.apply_floor(req.repeats)
        except NotImplementedError as e:
            raise HTTPError(501, str(e), kind="not_implemented") from e
        finally:
            slot.release()

    @router.post("/probe_broadcast")
    async def probe_broadcast(req: ProbeBroadcastRequest) -> dict[str, Any]:
        check_group_id(req.group_id, backend.group_state())  # UpdateRejected: 409 by the table
        slot.take("probe_broadcast")
        try:
            seconds = await backend.probe_broadcast(req)
        except DecisionTimeout:
            raise  # the caller never decided: 408 by the table
        except UpdateFailed as e:  # a called-off or failed probe is the group's failure
            raise HTTPError(502, str(e), kind="group_error") from e
        finally:
            slot.release()
        return {"receive_s": seconds, "nbytes": req.nbytes}

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": backend.name,
                    "root": served,
                    "max_model_len": backend.max_model_len,
                }
                for name in names
            ],
        }

    async def stream(req: Any, open_stream: Callable[[Any], Awaitable[AsyncIterator[Any]]]) -> Response:
        """``open_stream(req)`` (planned: its 400s before any event) as server-sent events,
        under admission for the stream's whole life."""
        if not backend.capabilities.streaming:
            raise InvalidRequest(
                f"stream: the {backend.name} backend does not stream; send stream=false", field="stream"
            )
        held = ExitStack()
        held.enter_context(admit(req))
        try:
            try:
                chunks = await open_stream(req)
            except PipelineRLError:
                raise  # the table decides
            except ValueError as e:  # an adapter's plain ValueError: the request, not the server
                raise HTTPError(400, str(e)) from e
        except BaseException:
            held.close()
            raise
        return EventStream(_sse(chunks, served), release=held.close)

    async def serve_generation(
        req: ChatCompletionRequest | CompletionRequest,
        request: Request,
        whole: Callable[[Any], Awaitable[Any]],
        streamed: Callable[[Any], Awaitable[AsyncIterator[Any]]],
    ) -> Response:
        check_model(req.model)
        if return_tokens_as_token_ids and not req.return_tokens_as_token_ids:
            req = req.model_copy(update={"return_tokens_as_token_ids": True})
        check_min_tokens(req, backend.capabilities.min_tokens, backend.name)
        return await (stream(req, streamed) if req.stream else generate(req, request, whole))

    def check_model(model: str | None) -> None:
        if model is not None and model not in accepted:
            serving = ", ".join(repr(n) for n in names)
            raise HTTPError(404, f"model {model!r} is not served here (serving {serving})", field="model")

    @router.post("/tokenize")
    async def tokenize(req: TokenizeChatRequest | TokenizeCompletionRequest) -> Response:
        check_model(req.model)
        return JSONResponse((await backend.tokenize(req)).model_dump(exclude_none=True))

    @router.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Response:
        check_model(req.model)
        return JSONResponse((await backend.detokenize(req)).model_dump())

    @router.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await serve_generation(req, request, backend.chat_completion, backend.chat_completion_stream)

    async def completions(req: CompletionRequest, request: Request) -> Response:
        if req.max_tokens == 0 and not req.echo:
            raise InvalidRequest(
                "max_tokens: 0 only with echo=true (to score the prompt); else at least 1", field="max_tokens"
            )
        if req.echo:  # the prompt in front, as vLLM answers (pipelinerl_sdk.http.echo)
            if req.stream:
                raise InvalidRequest("echo: not served with stream=true; send stream=false", field="echo")

            async def echoed(r: CompletionRequest) -> CompletionResponse:
                return await complete_with_echo(r, backend.completion, backend.detokenize)

            return await serve_generation(req, request, echoed, backend.completion_stream)
        return await serve_generation(req, request, backend.completion, backend.completion_stream)

    if backend.capabilities.completions:  # else an engine's own route (vLLM's) stays in place
        router.post("/v1/completions")(completions)

    async def generate(req: Any, request: Request, call: Callable[[Any], Awaitable[Any]]) -> Response:
        """``call(req)`` under admission, cancelled if the client disconnects first; its
        response as JSON with the served model name."""
        try:
            with admit(req):
                work = asyncio.ensure_future(call(req))
                gone = asyncio.ensure_future(_client_gone(request))
                try:
                    await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    gone.cancel()
                    if not work.done():  # the client left, or this route was cancelled (shutdown)
                        work.cancel()
                        await asyncio.wait({work})
                if work.cancelled():
                    log.info("%s request cancelled: its client disconnected", request.url.path)
                    return Response(status_code=499)  # nobody reads it
                resp = work.result()
        except PipelineRLError:
            raise  # the table decides (InvalidRequest/PromptTooLong: 400 naming the field)
        except ValueError as e:  # an adapter's plain ValueError: the request, not the server
            raise HTTPError(400, str(e)) from e
        return JSONResponse({**resp.model_dump(exclude_none=True), "model": served})

    if backend.capabilities.vllm_rl_api:  # vLLM's RL API onto the same update path
        serve_vllm_rl(router, backend, door, front_class=vllm_rl_front)
    if pipelinerl_group is not None:
        _serve_pipelinerl_trainer(router, guards, pipelinerl_group, control_token)
    return router


def _serve_pipelinerl_trainer(
    router: APIRouter, guards: dict[str, Guard], config: PipelineRLGroupConfig, control_token: str
) -> None:
    """``POST /receive_weight_update``: PipelineRL's trainer protocol, relayed onto this server's
    own update routes (:class:`~pipelinerl_sdk.http.pipelinerl_trainer.PipelineRLTrainerBridge`).
    PipelineRL's trainer sends no token: the route answers loopback and the trainer's host only."""
    from pipelinerl_sdk.http.pipelinerl_trainer import PipelineRLTrainerBridge, ReceiveWeightUpdateRequest

    bridge = PipelineRLTrainerBridge(config, control_token, timeout_s=config.timeout_s)

    async def from_the_trainer(request: Request) -> None:
        client = request.client.host if request.client else None
        if not bridge.allowed_source(client):
            raise HTTPError(
                403,
                f"/receive_weight_update answers PipelineRL's trainer host ({config.init_method}) and loopback only, "
                f"not {client}",
                kind="permission_error",
            )

    guards["/receive_weight_update"] = from_the_trainer

    @router.post("/receive_weight_update")
    async def receive_weight_update(request: Request) -> dict[str, Any]:
        try:  # parsed here: the model is imported only where the route is served
            req = ReceiveWeightUpdateRequest.model_validate_json(await request.body())
        except ValidationError as e:
            raise RequestValidationError(e.errors(include_url=False)) from None
        host, port = request.scope["server"]
        own = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        return await bridge.receive(req, own)


def check_min_tokens(req: ChatCompletionRequest | CompletionRequest, declared: bool, backend: str) -> None:
    """InvalidRequest naming ``min_tokens`` when it is set on a backend that does not declare the
    capability, or above the request's token budget (as vLLM refuses it)."""
    if not req.min_tokens:
        return
    if not declared:
        raise InvalidRequest(
            f"min_tokens: the {backend} backend does not hold the end off for a minimum of tokens; send min_tokens=0",
            field="min_tokens",
        )
    budget = req.token_budget
    if budget is not None and req.min_tokens > budget:
        raise InvalidRequest(
            f"min_tokens must be less than or equal to the token budget ({budget}), got {req.min_tokens}",
            field="min_tokens",
        )


class EventStream(StreamingResponse):
    """Server-sent events that end when the client leaves: the body stops being produced (its
    iterator closed, which aborts the engine's work) as soon as the client disconnects, whatever
    ASGI version the server speaks; ``release`` (the admission held) runs once it has ended."""

    def __init__(self, content: AsyncGenerator[bytes, None], *, release: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.events, self.release = content, release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def produce() -> None:
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    log.info("stream cancelled: its client disconnected")
                    group.cancel_scope.cancel()

                group.start_soon(produce)
                group.start_soon(watch)
        finally:
            try:
                with anyio.CancelScope(shield=True):
                    await self.events.aclose()
            finally:
                self.release()


async def _sse(chunks: AsyncIterator[Any], model: str) -> AsyncGenerator[bytes, None]:
    """``chunks`` as server-sent events (``model`` the served name), then ``data: [DONE]``; an
    error after the first event is sent as an error event in OpenAI's shape (as vLLM does)."""
    try:
        async for chunk in chunks:
            yield (
                b"data: "
                + chunk.model_copy(update={"model": model}).model_dump_json(exclude_none=True).encode()
                + b"\n\n"
            )
    except PipelineRLError as e:
        h = as_http_error(e)
        yield _error_event(h.status, h.message, h.kind, h.field)
    except ValueError as e:
        yield _error_event(400, str(e), "invalid_request", None)
    except Exception as e:
        log.error("stream failed", exc_info=e)
        yield _error_event(500, f"{type(e).__name__}: {e}", "internal_error", None)
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
    yield b"data: [DONE]\n\n"


def _error_event(status: int, message: str, kind: str, field: str | None) -> bytes:
    body = {"error": {"message": message, "type": kind, "param": field, "code": status}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _line(event: UpdateEvent) -> bytes:
    return (event.model_dump_json(exclude_none=True) + "\n").encode()


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error in OpenAI's shape (:func:`error_response`): HTTPError as raised, SDK
    errors by :data:`ERROR_STATUS`, body validation as 400 naming the field in ``param`` (as
    OpenAI and vLLM do), an unknown route or method (404/405) likewise, and any other exception
    as a 500 ``internal_error`` (logged with its traceback), never a plain-text body."""

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(_: Request, e: StarletteHTTPException) -> Response:
        kinds = {404: "not_found_error", 405: "method_not_allowed"}
        response = error_response(e.status_code, str(e.detail), kind=kinds.get(e.status_code, "invalid_request"))
        response.headers.update(e.headers or {})
        return response

    @app.exception_handler(HTTPError)
    async def _http_error(_: Request, e: HTTPError) -> JSONResponse:
        return error_response(e.status, e.message, kind=e.kind, field=e.field)

    @app.exception_handler(PipelineRLError)
    async def _sdk_error(_: Request, e: PipelineRLError) -> JSONResponse:
        h = as_http_error(e)
        return error_response(h.status, h.message, kind=h.kind, field=h.field, headers=error_headers(e))

    @app.exception_handler(StarletteHTTPException)
    async def _framework_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own (a body that is not JSON: 400; an unknown path: 404), in our shape
        kind = "invalid_request" if e.status_code < 500 else "internal_error"
        return error_response(e.status_code, str(e.detail), kind=kind, headers=dict(e.headers or {}) or None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return error_response(500, f"{type(e).__name__}: {e}", kind="internal_error")

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid body"}
        field = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()) if p != 'body')}: {err.get('msg')}" for err in errors[:5]
        )
        return error_response(400, message, kind="invalid_request", field=field)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (and listen on) ``host:port``; port 0 picks a free one. OSError names the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only when the
    # socket says TCP. Without it every response after the first on a keep-alive connection
    # waited for the client's delayed ACK (Nagle): ~40 ms per request on Linux.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot bind {host}:{port}: {e.strerror}") from e
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
