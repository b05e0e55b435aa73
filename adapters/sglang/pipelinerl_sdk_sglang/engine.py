"""The SGLang server the adapter runs and talks to: its process and its native HTTP routes.

:class:`SGLangProcess` starts ``python -m sglang.launch_server`` on a private loopback port as a
child of the gateway (same process group, so ``pipelinerl serve``'s launcher stops both; the
child also dies with the gateway through ``PR_SET_PDEATHSIG``), waits until it answers and
stops it. :class:`SGLangClient` calls SGLang's own routes: generation and the RL control routes
(``/pause_generation``, ``/init_weights_update_group``, ``/update_weights_from_distributed``...),
guarded by an internal API key only the gateway holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from pipelinerl_sdk.errors import PipelineRLError, PluginError
from pipelinerl_sdk.http.client import KEEPALIVE_EXPIRY_S
from pipelinerl_sdk.launch import log_tail
from pipelinerl_sdk_sglang import scheduler_hooks


class SGLangError(PipelineRLError):
    """SGLang answered a control call with ``success: false`` or an HTTP error."""


class SGLangRefused(SGLangError):
    """SGLang answered ``/generate`` with 400: it refused the request as invalid (the gateway
    answers 400 with SGLang's message, not a 500)."""


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def launch_args(
    model: str, *, dtype: str, port: int, api_key: str, device: str, context_length: int, options: Mapping[str, str]
) -> list[str]:
    """``sglang.launch_server`` arguments: the model, a private port, version label ``0``, the
    scheduler hooks, no prefix cache (a cached prefix would serve KV of older weights) and no
    overlap scheduler: with it, SGLang 0.5.23 launches batch k+1 before it appends batch k's
    tokens, so an in-place pause lands with one batch computed by the old weights but not yet
    appended, and ``record_weight_version_change`` (which counts appended tokens) tags those
    tokens, and a prefill then in flight, with the new version (measured: each such token's
    logprob is the old weights' to 1e-6; the version-tag check fails on it)."""
    args = [
        "--model-path", model,
        "--served-model-name", model,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", dtype,
        "--device", device,
        f"--api-key={api_key}",  # one token: a key may start with "-" (token_urlsafe), which
        # argparse would take for a flag after a separate "--api-key" (SGLang then refused to start)
        "--weight-version", "0",
        "--context-length", str(context_length),
        "--disable-radix-cache",
        "--disable-overlap-schedule",
        "--log-level", options.get("log_level", "warning"),
        "--custom-weight-loader", *(scheduler_hooks.qualified(h) for h in scheduler_hooks.HOOKS),
    ]  # fmt: skip
    if device == "cpu":
        # SGLang's CPU engine sizes its KV pool from these; the defaults assume a large host.
        args += ["--max-total-tokens", options.get("max_total_tokens", "8192")]
        args += ["--mem-fraction-static", options.get("mem_fraction_static", "0.05")]
    elif "mem_fraction_static" in options:
        args += ["--mem-fraction-static", options["mem_fraction_static"]]
    if options.get("sleep_on_idle", "1" if device == "cpu" else "0") == "1":
        # An idle scheduler polls its sockets without pause: one core at 100% (on a CPU host, a
        # core taken from decoding, the gateway and the trainer). Asleep it wakes on the next
        # message on those sockets, which every request and every hook call of the gateway is.
        args += ["--sleep-on-idle"]
    if "tp" in options:
        args += ["--tp-size", options["tp"]]
    args += options.get("sglang_args", "").split()
    return args


def default_cpu_threads() -> int:
    """Half the cores this process may run on, at least one: on a CPU host SGLang shares the
    cores with the gateway and, in a PipelineRL run, the trainer. Torch's threads past the cores
    left free wait for each other at every parallel region (measured on 2 cores beside one busy
    process: 600 decoded tokens took 7.3 s with SGLang's default 2 threads, 2.8 s with 1;
    idle, 2.4 and 1.6 s)."""
    return max(1, len(os.sched_getaffinity(0)) // 2)


def launch_env(device: str, options: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for SGLang: raw model logprobs (before temperature, as the contract reports
    them); non-finite logits made finite before sampling (SGLang's ``SGLANG_SANITIZE_NAN_LOGITS``,
    unless the operator set it: without it one request's NaN probabilities raise in the batched
    sampler, which ends SGLang's scheduler and so every request, seen once in fuzzing); and on
    ``device == "cpu"`` SGLang's own switch for its CPU engine and its torch threads
    (``OMP_NUM_THREADS``, :func:`cpu_threads`)."""
    options = options or {}
    env = {
        "SGLANG_RETURN_ORIGINAL_LOGPROB": "1",
        "SGLANG_SANITIZE_NAN_LOGITS": os.environ.get("SGLANG_SANITIZE_NAN_LOGITS", "1"),
    }
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["OMP_NUM_THREADS"] = cpu_threads(options)
    return env


def cpu_threads(options: Mapping[str, str]) -> str:
    """SGLang's torch threads on cpu: option ``cpu_threads`` (a positive integer, else
    ValueError naming it), else the operator's ``OMP_NUM_THREADS``, else
    :func:`default_cpu_threads`."""
    threads = options.get("cpu_threads")
    if threads is not None and (not threads.isdigit() or int(threads) < 1):
        raise ValueError(f"cpu_threads: a positive number of threads, got {threads!r}")
    return threads or os.environ.get("OMP_NUM_THREADS") or str(default_cpu_threads())


class SGLangProcess:
    """One ``sglang.launch_server`` child on 127.0.0.1:``port``. Its output goes to a log file
    (``log_path``) whose tail is quoted in start-up errors."""

    def __init__(self, args: Sequence[str], *, port: int, env: Mapping[str, str]) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._dir = tempfile.mkdtemp(prefix="pipelinerl-sglang-")
        self.log_path = Path(self._dir, "sglang.log")
        self.cmd = [sys.executable, "-m", "sglang.launch_server", *args]
        self.env = {**os.environ, **env}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, preexec_fn=_die_with_parent
            )

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n)

    def check_alive(self) -> None:
        """Raises PluginError (with the log tail) if SGLang has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise PluginError(
                f"SGLang exited with code {self.proc.returncode} (log {self.log_path}):\n{self.log_tail()}"
            )

    async def wait_ready(self, client: SGLangClient, timeout_s: float) -> None:
        """Until ``/model_info`` answers; PluginError naming the cause if SGLang exits or is not
        ready within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            with contextlib.suppress(httpx.HTTPError):
                r = await client.http.get("/model_info", timeout=5)
                if r.status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise PluginError(f"SGLang not ready after {timeout_s:.0f}s (log {self.log_path}):\n{self.log_tail()}")
            await asyncio.sleep(0.25)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM SGLang, SIGKILL it and every process it started after ``timeout_s``."""
        proc = self.proc
        if proc is None:
            return
        import psutil

        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            children = []
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
        psutil.wait_procs(children, timeout=10)


class SGLangClient:
    """SGLang's native routes over one pooled HTTP client. Control calls return SGLang's message
    and raise :class:`SGLangError` on ``success: false`` or an HTTP error."""

    def __init__(self, url: str, api_key: str) -> None:
        self.http = httpx.AsyncClient(
            base_url=url,
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=httpx.Timeout(None),
            # idle connections dropped before SGLang's uvicorn (5 s keep-alive) closes them
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=256, keepalive_expiry=KEEPALIVE_EXPIRY_S
            ),
        )

    async def close(self) -> None:
        await self.http.aclose()

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        r = await self.http.post("/generate", json=body)
        if r.status_code != 200:
            kind = SGLangRefused if r.status_code == 400 else SGLangError
            raise kind(f"SGLang /generate answered {r.status_code}: {r.text[:500]}")
        out: dict[str, Any] = r.json()
        return out

    async def generate_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """SGLang's streamed ``/generate`` (``body`` with ``stream: true``): each ``data:`` event
        until ``[DONE]``; SGLangError for an HTTP error or an ``error`` event. Closing the
        iterator closes the connection (the caller aborts the request: :meth:`abort`)."""
        async with self.http.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                kind = SGLangRefused if r.status_code == 400 else SGLangError
                raise kind(f"SGLang /generate answered {r.status_code}: {(await r.aread())[:500]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                event: dict[str, Any] = json.loads(data)
                if "error" in event:
                    raise SGLangError(f"SGLang /generate stream error: {event['error']}")
                yield event

    async def abort(self, rid: str) -> None:
        """SGLang's ``/abort_request`` for request ``rid`` (nothing if it already ended)."""
        await self.control("/abort_request", {"rid": rid})

    async def control(self, route: str, body: dict[str, Any] | None = None) -> str:
        """POST ``route``; returns SGLang's message."""
        r = await self.http.post(route, json=body or {})
        try:
            data = r.json()
        except ValueError:
            data = {"message": r.text[:500]}
        ok = r.status_code == 200 and (not isinstance(data, dict) or data.get("success", True) is not False)
        message = str(data.get("message", "")) if isinstance(data, dict) else str(data)
        if not ok:
            raise SGLangError(f"SGLang {route} failed ({r.status_code}): {message or r.text[:500]}")
        return message

    async def call_hook(
        self, hook: str, *args: object, tp_size: int = 1, weight_version: str | None = None
    ) -> list[dict[str, Any]]:
        """Run a :mod:`.scheduler_hooks` function inside SGLang's scheduler (through
        ``update_weights_from_tensor``; needs an open weight-update session) with ``args``;
        returns each TP rank's result. SGLangError if SGLang refused the call, a rank reported
        an error, or a rank wrote no result. ``weight_version``: SGLang records it as the
        served version once the call returns (its own ``weight_version`` of the call), whatever
        the hook reported: a caller whose hook failed puts the old one back."""
        from sglang.srt.utils import MultiprocessingSerializer

        with tempfile.TemporaryDirectory(prefix="pipelinerl-sglang-hook-") as tmp:
            out = Path(tmp, hook)
            request = scheduler_hooks.hook_request("|".join(str(a) for a in args), str(out))
            body = {
                "serialized_named_tensors": [MultiprocessingSerializer.serialize(request, output_str=True)] * tp_size,
                "load_format": scheduler_hooks.qualified(hook),
                "flush_cache": False,
            }
            if weight_version is not None:
                body["weight_version"] = weight_version
            await self.control("/update_weights_from_tensor", body)
            results = [json.loads(f.read_text()) for f in sorted(Path(tmp).glob(f"{hook}.*"))]
        errors = [str(r["error"]) for r in results if "error" in r]
        if errors or len(results) != tp_size:
            why = errors[0] if errors else f"{len(results)} of {tp_size} ranks answered"
            raise SGLangError(f"SGLang scheduler hook {hook} failed: {why}")
        return results


def new_api_key() -> str:
    return secrets.token_urlsafe(24)
