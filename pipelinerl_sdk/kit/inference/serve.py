"""Serving a backend: the launcher's side of the contract.

:func:`serve` is what ``pipelinerl serve`` calls: a backend that owns its HTTP server
(:class:`~pipelinerl_sdk.contracts.ServesItself`) serves itself, any other gets the SDK's app.
An engine with a FastAPI app of its own passes it to :func:`serve_app` (or, if the engine runs its
own uvicorn, calls :func:`install_contract` and :func:`announce` itself, as the vLLM adapter
does) and gets everything the launcher relies on:

- the contract's router, mounted *in front of* the app's routes (same path and method: ours wins),
  and the SDK's error handlers (every error a JSON body of the protocol's schema);
- the socket bound before the app starts (port 0 picks a free one);
- a lifespan that starts the backend before the first request and stops it at the end;
- SIGTERM treated like Ctrl-C (a clean shutdown), bounded: requests still running after
  ``config.shutdown_timeout_s`` are cancelled (their work aborted in the engine), and a process
  still alive :data:`EXIT_MARGIN_S` later (a receive stuck in a collective) exits anyway;
- the admission limits of ``config`` (body size, requests and tokens in flight);
- ``config.ready_file``: a JSON file ``{"url", "pid", "port", "backend"}`` written (atomically)
  once the server answers; launchers wait for it instead of polling a guessed port.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from copy import copy
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute

from pipelinerl_sdk.contracts import InferenceBackend, ServeConfig, ServesItself
from pipelinerl_sdk.http.admission import Limits
from pipelinerl_sdk.http.server import bind_socket, build_router, install_error_handlers
from pipelinerl_sdk.http.vllm_rl import VLLMRLFront

if TYPE_CHECKING:
    from pipelinerl_sdk.http.pipelinerl_trainer import PipelineRLGroupConfig

log = logging.getLogger("pipelinerl_sdk.serve")

#: Seconds an idle keep-alive connection stays open on the server: well past the 5 s after which
#: clients (httpx's default, the SDK's own 2 s) drop theirs, so a client never reuses a connection
#: the server is closing at that moment (a ReadError with nothing answered). uvicorn's default, 5 s,
#: equals httpx's: under load that race was seen.
KEEP_ALIVE_S = 30

#: Seconds past ``shutdown_timeout_s`` a SIGTERMed server may take to stop its backend before
#: the process exits without waiting further.
EXIT_MARGIN_S = 5.0


def serve(backend: InferenceBackend, config: ServeConfig) -> None:
    """Serve ``backend`` until SIGTERM/SIGINT: its own ``serve`` if it owns its server, else
    the SDK's app on uvicorn (:func:`serve_app`)."""
    if isinstance(backend, ServesItself):
        backend.serve(config)
        return
    # The OpenAPI schema is the router's guarded /openapi.json; no docs pages.
    app = FastAPI(title=f"pipelinerl-sdk inference ({backend.name})", openapi_url=None, docs_url=None, redoc_url=None)
    run(app, backend, config)


def mount_first(app: FastAPI, router: APIRouter) -> None:
    """Put ``router``'s routes before ``app``'s; the app's routes of the same path and method
    are dropped (others of the same path keep their remaining methods), the rule vLLM applies
    to its endpoint plugins."""
    before = list(app.router.routes)
    app.include_router(router)
    ours = [r for r in app.router.routes if all(r is not b for b in before)]
    kept = []
    for r in before:
        if isinstance(r, APIRoute):
            taken: set[str] = set().union(
                *(o.methods or set() for o in ours if isinstance(o, APIRoute) and o.path == r.path)
            )
            if taken & (r.methods or set()):
                rest = (r.methods or set()) - taken
                if not rest:
                    continue
                r = copy(r)
                r.methods = rest
        kept.append(r)
    app.router.routes[:] = [*ours, *kept]
    app.openapi_schema = None


def install_contract(
    app: FastAPI, backend: InferenceBackend, config: ServeConfig, *, vllm_rl_front: type[VLLMRLFront] = VLLMRLFront
) -> None:
    """Mount the contract's router on ``app`` (ahead of its own routes) and the SDK's error
    handlers. An app whose middleware stack is already built (vLLM's) has it rebuilt, or the
    handlers would not take effect. ``vllm_rl_front``: as :func:`~pipelinerl_sdk.http.server.build_router`'s."""
    router = build_router(
        backend,
        control_token=config.control_token,
        api_key=config.api_key,
        trainer_hosts=config.trainer_hosts,
        limits=Limits.of(config),
        served_model_names=config.served_model_names,
        return_tokens_as_token_ids=config.return_tokens_as_token_ids,
        logprobs_mode=config.logprobs_mode,
        pipelinerl_group=pipelinerl_group(config),
        vllm_rl_front=vllm_rl_front,
    )
    mount_first(app, router)
    install_error_handlers(app)
    if app.middleware_stack is not None:
        app.middleware_stack = app.build_middleware_stack()


def pipelinerl_group(config: ServeConfig) -> PipelineRLGroupConfig | None:
    """PipelineRL's group as ``config`` names it (None where it names none); ValueError for a
    world size or actor index that cannot hold this server's ranks."""
    if config.pipelinerl_group_init_method is None:
        return None
    from pipelinerl_sdk.http.pipelinerl_trainer import PipelineRLGroupConfig

    return PipelineRLGroupConfig(
        config.pipelinerl_group_init_method,
        config.pipelinerl_group_world_size,
        config.pipelinerl_actor_idx,
        config.pipelinerl_local_ranks,
    )


def with_backend_lifespan(app: FastAPI, backend: InferenceBackend) -> None:
    """Start ``backend`` before ``app``'s own lifespan and stop it after."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        await backend.start()
        try:
            async with inner(a) as state:
                yield state
        finally:
            await backend.stop()

    app.router.lifespan_context = lifespan


def announce(config: ServeConfig, port: int, backend_name: str) -> dict[str, Any]:
    """The server answers: write ``config.ready_file`` (atomically) and say so on stdout."""
    host = f"[{config.host}]" if ":" in config.host else config.host
    ready = {"url": f"http://{host}:{port}", "pid": os.getpid(), "port": port, "backend": backend_name}
    if config.ready_file:
        tmp = f"{config.ready_file}.tmp"
        with open(tmp, "w") as f:
            json.dump(ready, f)
        os.replace(tmp, config.ready_file)
    print(f"pipelinerl: serving {backend_name} at {ready['url']}", flush=True)
    return ready


async def serve_app(
    app: FastAPI,
    backend: InferenceBackend,
    config: ServeConfig,
    sock: socket.socket,
    *,
    vllm_rl_front: type[VLLMRLFront] = VLLMRLFront,
) -> None:
    """Serve ``app`` (with the contract installed, the backend started by its lifespan) on
    ``sock`` until the server exits; announces once it answers. Start-up errors raise."""
    import uvicorn

    install_contract(app, backend, config, vllm_rl_front=vllm_rl_front)
    with_backend_lifespan(app, backend)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level=os.environ.get("PIPELINERL_LOG_LEVEL", "warning"),
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=max(1, round(config.shutdown_timeout_s)),
        )
    )
    bounded_exit(server, config.shutdown_timeout_s + EXIT_MARGIN_S)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if serving.done():
            await serving  # start-up failed: raise its error
            return
        await asyncio.sleep(0.05)
    announce(config, sock.getsockname()[1], backend.name)
    await serving


def exit_after(deadline_s: float) -> threading.Timer:
    """End the process (exit status 1) ``deadline_s`` from now unless it has ended by then: the
    bound on a shutdown that a thread stuck in a collective or a C call could hold for ever."""

    def force() -> None:
        log.error("shutdown still not done %.0f s after the signal: exiting now", deadline_s)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(deadline_s, force)
    timer.daemon = True
    timer.start()
    return timer


def bounded_exit(server: Any, deadline_s: float) -> None:
    """SIGTERM and SIGINT (uvicorn's handler while it serves, ours before) shut uvicorn
    ``server`` down, and end the process ``deadline_s`` after the first if it is still alive
    (:func:`exit_after`)."""
    armed: list[threading.Timer] = []
    uvicorn_handler = server.handle_exit

    def handle_exit(sig: int, frame: Any) -> None:
        uvicorn_handler(sig, frame)
        if not armed:
            armed.append(exit_after(deadline_s))

    server.handle_exit = handle_exit  # uvicorn installs self.handle_exit while it serves
    signal.signal(signal.SIGTERM, handle_exit)


def run(
    app: FastAPI, backend: InferenceBackend, config: ServeConfig, *, vllm_rl_front: type[VLLMRLFront] = VLLMRLFront
) -> None:
    """Bind ``config.host:config.port`` (OSError naming the address if taken) and
    :func:`serve_app` until SIGTERM/SIGINT: the whole of serving an engine-owned FastAPI app.
    ``vllm_rl_front``: the class serving vLLM's RL API (an adapter may extend the SDK's)."""
    sock = bind_socket(config.host, config.port)
    try:
        asyncio.run(serve_app(app, backend, config, sock, vllm_rl_front=vllm_rl_front))
    finally:
        sock.close()
