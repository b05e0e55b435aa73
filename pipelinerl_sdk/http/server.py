"""The inference contract as one FastAPI router any engine can mount, and a uvicorn runner.

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
- ``POST /v1/chat/completions``, ``GET /v1/models`` (``api_key`` when configured).

At most one control operation runs at a time; a second is refused with 409, never queued. One
exception: ``/init_process_group`` ends an update that still waits for its (replaced) trainer's
decision, when the backend can (``cancel_waiting_update``), instead of waiting for its timeout.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import PurePath
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute

from pipelinerl_sdk.contracts import InferenceBackend, ServeConfig, capabilities_to_dict, check_group_id
from pipelinerl_sdk.errors import GroupError, PipelineRLError, UpdateRejected
from pipelinerl_sdk.protocol import (
    ChatCompletionRequest,
    InitProcessGroupRequest,
    ProbeBroadcastRequest,
    ServerInfo,
    UpdateEvent,
    WeightUpdateRequest,
    parse_init_method,
)

log = logging.getLogger("pipelinerl_sdk.server")


class HTTPError(Exception):
    """Raised inside a route: answered as ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request", field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.field = status, message, kind, field


def error_response(status: int, message: str, *, kind: str, field: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message, "field": field}}, status_code=status)


Guard = Callable[[Request], Awaitable[None]]


def _bearer_guard(tokens: tuple[str, ...], what: str) -> Guard:
    """Accept any of ``tokens`` (none: open)."""

    async def guard(request: Request) -> None:
        if not tokens:
            return
        header = request.headers.get("authorization", "")
        if not header.lower().startswith("bearer "):
            raise HTTPError(401, f"missing bearer token for {what}", kind="authentication_error")
        given = header[7:].strip().encode()
        if not any([secrets.compare_digest(given, t.encode()) for t in tokens]):  # every one compared
            raise HTTPError(403, f"wrong bearer token for {what}", kind="permission_error")

    return guard


def _guarded_route(guards: dict[str, Guard]) -> type[APIRoute]:
    """A route class that runs its path's guard *before* FastAPI reads and parses the body (a
    dependency runs after): an unauthenticated client gets its 401 without sending the body."""

    class GuardedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()
            guard = guards[self.path]

            async def guarded(request: Request) -> Response:
                await guard(request)
                return await handler(request)

            return guarded

    return GuardedRoute


def trainer_host_allowed(init_method: str, allowed: tuple[str, ...]) -> bool:
    """Whether a server may join a store at ``init_method``: loopback, or a host in ``allowed``."""
    host, _ = parse_init_method(init_method)
    if host.lower() == "localhost" or host in allowed:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def served_model_name(model: str) -> str:
    """The name a server shows for its model: the last component of a path, never the path."""
    return PurePath(model).name or model


class _ControlSlot:
    """One control operation at a time; a second caller is refused (409), not queued."""

    def __init__(self) -> None:
        self.busy: str | None = None
        #: The update holding the slot, if one does.
        self.update: asyncio.Task[Any] | None = None

    def take(self, what: str) -> None:
        if self.busy is not None:
            raise HTTPError(
                409,
                f"another control operation is running ({self.busy}); retry after it",
                kind="conflict",
            )
        self.busy = what

    def release(self) -> None:
        self.busy, self.update = None, None


def build_router(
    backend: InferenceBackend, *, control_token: str, api_key: str | None, trainer_hosts: tuple[str, ...] = ()
) -> APIRouter:
    """The contract's routes over ``backend``. ``control_token`` must be non-empty and differ
    from ``api_key``. ``/init_process_group`` joins stores on loopback or ``trainer_hosts`` only."""
    if not control_token:
        raise ValueError("control_token must be set: control routes are never open")
    if api_key is not None and secrets.compare_digest(control_token, api_key):
        raise ValueError("control_token must differ from the OpenAI api_key")
    control = _bearer_guard((control_token,), "control routes")
    openai = _bearer_guard((api_key,) if api_key else (), "the OpenAI routes")
    read = _bearer_guard((api_key, control_token) if api_key else (), "this route")
    open_: Guard = _bearer_guard((), "")
    guards = {
        "/health": open_,
        "/info": read,
        "/openapi.json": read,
        "/init_process_group": control,
        "/request_weight_update": control,
        "/probe_broadcast": control,
        "/v1/models": openai,
        "/v1/chat/completions": openai,
    }
    slot = _ControlSlot()
    router = APIRouter(route_class=_guarded_route(guards))
    served = served_model_name(backend.model_name)

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
        )

    @router.post("/init_process_group")
    async def init_process_group(req: InitProcessGroupRequest) -> dict[str, Any]:
        if not trainer_host_allowed(req.init_method, trainer_hosts):
            raise HTTPError(
                403,
                f"init_method {req.init_method!r}: not a trainer host this server may join (loopback, or a host "
                "named at start-up with --allow-trainer-host)",
                kind="permission_error",
                field="init_method",
            )
        pending = slot.update
        if pending is not None and backend.cancel_waiting_update("a new /init_process_group replaced the group"):
            await asyncio.wait({pending}, timeout=30)  # it ends at once: it never entered a receive
        slot.take("init_process_group")
        try:
            resp = await backend.init_process_group(req)
        except GroupError as e:
            raise HTTPError(502, str(e), kind="group_error") from e
        finally:
            slot.release()
        return resp.model_dump()

    @router.post("/request_weight_update")
    async def request_weight_update(req: WeightUpdateRequest) -> StreamingResponse:
        slot.take(f"weight update to version {req.version}")
        try:
            backend.validate_update(req)
        except UpdateRejected as e:
            slot.release()
            raise HTTPError(e.status, str(e), kind="update_rejected", field=e.field) from e
        except BaseException:
            slot.release()
            raise
        mode = req.mode or backend.default_mode
        loop = asyncio.get_running_loop()
        accepted = asyncio.Event()
        started = time.perf_counter()

        def on_accepted() -> None:
            loop.call_soon_threadsafe(accepted.set)

        # The update runs as its own task: a client that disconnects cannot cancel a receive
        # half-way. The slot is released only when the update has really ended.
        task = asyncio.create_task(backend.update_weights(req, mode, on_accepted))
        slot.update = task
        task.add_done_callback(lambda _: slot.release())

        async def events() -> AsyncIterator[bytes]:
            waiter = asyncio.create_task(accepted.wait())
            await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if accepted.is_set():
                yield _line(UpdateEvent(event="accepted", version=req.version, mode=mode))
            try:
                report = await asyncio.shield(task)
            except Exception as e:
                log.warning("weight update to version %d failed: %s", req.version, e)
                yield _line(
                    UpdateEvent(
                        event="error",
                        version=req.version,
                        mode=mode,
                        detail=f"{type(e).__name__}: {e}",
                        timings={"total_s": time.perf_counter() - started},
                    )
                )
                return
            yield _line(UpdateEvent(event="done", version=report.version, mode=report.mode, timings=report.timings()))

        return StreamingResponse(events(), media_type="application/x-ndjson")

    @router.post("/probe_broadcast")
    async def probe_broadcast(req: ProbeBroadcastRequest) -> dict[str, Any]:
        try:
            check_group_id(req.group_id, backend.group_state())
        except UpdateRejected as e:
            raise HTTPError(e.status, str(e), kind="conflict", field=e.field) from e
        slot.take("probe_broadcast")
        try:
            seconds = await backend.probe_broadcast(req)
        except PipelineRLError as e:
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
                    "id": served,
                    "object": "model",
                    "owned_by": backend.name,
                    "max_model_len": backend.max_model_len,
                }
            ],
        }

    @router.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest) -> JSONResponse:
        if req.model is not None and req.model not in (served, backend.model_name):
            raise HTTPError(404, f"model {req.model!r} is not served here (serving {served!r})", field="model")
        try:
            resp = await backend.chat_completion(req)
        except ValueError as e:
            raise HTTPError(400, str(e)) from e
        return JSONResponse({**resp.model_dump(exclude_none=True), "model": served})

    return router


def _line(event: UpdateEvent) -> bytes:
    return (event.model_dump_json(exclude_none=True) + "\n").encode()


def create_app(
    backend: InferenceBackend, *, control_token: str, api_key: str | None = None, trainer_hosts: tuple[str, ...] = ()
) -> FastAPI:
    """A FastAPI app serving the contract over ``backend``, which it starts and stops. Its
    OpenAPI schema is the router's guarded ``/openapi.json``; no docs pages."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        try:
            yield
        finally:
            await backend.stop()

    app = FastAPI(
        title=f"pipelinerl-sdk inference ({backend.name})",
        lifespan=lifespan,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.include_router(build_router(backend, control_token=control_token, api_key=api_key, trainer_hosts=trainer_hosts))
    install_error_handlers(app)
    return app


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error as ``{"error": {"type", "message", "field"}}``."""

    @app.exception_handler(HTTPError)
    async def _http_error(_: Request, e: HTTPError) -> JSONResponse:
        return error_response(e.status, e.message, kind=e.kind, field=e.field)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid body"}
        field = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()) if p != 'body')}: {err.get('msg')}" for err in errors[:5]
        )
        return error_response(422, message, kind="invalid_request", field=field)


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


def run_server(backend: InferenceBackend, config: ServeConfig) -> None:
    """Serve ``backend`` until SIGTERM/SIGINT. Writes ``config.ready_file`` (JSON: url, pid,
    port) once the server answers, so a launcher never has to poll a guessed port."""
    import uvicorn

    sock = bind_socket(config.host, config.port)
    port = sock.getsockname()[1]
    app = create_app(
        backend, control_token=config.control_token, api_key=config.api_key, trainer_hosts=config.trainer_hosts
    )
    server = uvicorn.Server(uvicorn.Config(app, log_level=os.environ.get("PIPELINERL_LOG_LEVEL", "warning")))

    async def main() -> None:
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if serving.done():
                await serving  # start-up failed: raise its error
                return
            await asyncio.sleep(0.05)
        host = f"[{config.host}]" if ":" in config.host else config.host
        ready = {
            "url": f"http://{host}:{port}",
            "pid": os.getpid(),
            "port": port,
            "backend": backend.name,
        }
        if config.ready_file:
            tmp = f"{config.ready_file}.tmp"
            with open(tmp, "w") as f:
                json.dump(ready, f)
            os.replace(tmp, config.ready_file)
        print(f"pipelinerl: serving {backend.name} at {ready['url']}", flush=True)
        await serving

    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    asyncio.run(main())
