"""The processes Dynamo runs for one server: its frontend and N vLLM workers, on loopback, with
file discovery in a directory of their own. Each process stays in the server's
process group, ends when the server process dies (``PR_SET_PDEATHSIG``), logs to a file, and is
stopped with what it started (vLLM's engine core).

Start-up never hangs: :meth:`DynamoCluster.wait_ready` raises :class:`PluginError` with the last
log lines of a process that exited, or of the slowest one when the deadline passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx

from pipelinerl_sdk.errors import PluginError
from pipelinerl_sdk.kit.inference.procs import idle_descendants, idle_process

WORKER_EXTENSION = "pipelinerl_sdk_vllm.transfer.PipelineRLWorkerExtension"
#: Everything Dynamo binds or advertises stays on loopback (it uses the machine's address otherwise).
LOOPBACK_ENV = ("DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST", "DYN_TCP_RESPONSE_STREAM_HOST")
LOG_TAIL = 40
SYSTEM_PORT_LIMIT = 32768


def free_port(host: str = "127.0.0.1", *, below: int | None = None) -> int:
    """A port free now on ``host``; ``below``: one under that bound (Dynamo 1.6 reads
    ``DYN_SYSTEM_PORT`` as a signed 16-bit number, so a system port must be under 32768)."""
    for _ in range(200):
        port = 0 if below is None else random.randrange(20000, below)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise PluginError(f"no free port on {host} below {below}")


def log_tail(path: Path, lines: int = LOG_TAIL) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def error_line(path: Path) -> str:
    """The log's most telling line: the last one naming an error, else the last line."""
    tail = log_tail(path, 200).splitlines()
    for line in reversed(tail):
        if any(k in line for k in ("Error", "error:", "Exception", "Traceback", "FAILED", "failed")):
            return line.strip()
    return tail[-1].strip() if tail else "(empty log)"


@dataclass
class Proc:
    """One started process: its role, log and (for a worker) its system port."""

    role: str
    popen: subprocess.Popen[bytes]
    log: Path
    system_port: int | None = None

    @property
    def pid(self) -> int:
        return int(self.popen.pid)

    def exited(self) -> int | None:
        return self.popen.poll()

    def death(self) -> str:
        """Why it is dead: exit status and the telling log line."""
        return f"{self.role} (pid {self.pid}) exited with status {self.popen.returncode}: {error_line(self.log)}"

    def stop(self, grace_s: float) -> None:
        """SIGTERM, SIGKILL after ``grace_s``; then SIGKILL whatever it started that is left
        (vLLM's engine core)."""
        import psutil

        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            children = []
        if self.exited() is None:
            with _suppress_lookup():
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                with _suppress_lookup():
                    os.kill(self.pid, signal.SIGKILL)
                self.popen.wait()
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux ``PR_SET_PDEATHSIG``)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _preexec(nice: int) -> Any:
    """What a child runs before exec: :func:`_die_with_parent`, then ``nice`` (inherited by
    every process and thread it starts: vLLM's engine core and its receive threads)."""

    def run() -> None:
        _die_with_parent()
        if nice:
            os.nice(nice)

    return run


class _suppress_lookup:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, *_: object) -> bool:
        return kind is ProcessLookupError or kind is PermissionError


@dataclass
class ClusterConfig:
    """What to start: ``workers`` Dynamo vLLM workers of ``model`` and one frontend."""

    model: str
    workers: int
    dtype: str
    max_model_len: int
    max_num_seqs: int
    kv_cache_gib: str
    enforce_eager: bool = True
    prefix_caching: bool = False
    vllm_args: Sequence[str] = ()
    python: str = sys.executable
    env: Mapping[str, str] = field(default_factory=dict)
    #: The workers' niceness (their engine cores inherit it); the frontend keeps the server's.
    worker_nice: int = 0


class DynamoCluster:
    """The frontend and workers of one server. Not thread-safe; one owner (the backend)."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.dir = Path(tempfile.mkdtemp(prefix="pipelinerl-dynamo-"))
        self.frontend: Proc | None = None
        self.workers: list[Proc] = []
        self.frontend_port = 0

    # --- start ------------------------------------------------------------------------------------

    def _env(self, extra: Mapping[str, str]) -> dict[str, str]:
        env = {**os.environ, **self.cfg.env, "DYN_FILE_KV": str(self.dir / "discovery"), **extra}
        for name in LOOPBACK_ENV:
            env[name] = "127.0.0.1"
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _spawn(
        self, role: str, argv: list[str], env: Mapping[str, str], system_port: int | None = None, nice: int = 0
    ) -> Proc:
        log = self.dir / f"{role}.log"
        with open(log, "wb") as out:
            # In the server's process group (a launcher that kills the group ends them too), and
            # told to end when the server process dies, however it dies.
            popen = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env),
                preexec_fn=_preexec(nice),
            )
        return Proc(role, popen, log, system_port)

    def worker_argv(self) -> list[str]:
        c = self.cfg
        argv = [
            c.python, "-m", "pipelinerl_sdk_dynamo.worker",
            "--model", c.model,
            "--served-model-name", c.model,
            "--discovery-backend", "file",
            "--dtype", c.dtype,
            "--max-model-len", str(c.max_model_len),
            "--max-num-seqs", str(c.max_num_seqs),
            "--generation-config", "vllm",
            "--weight-transfer-config", json.dumps({"backend": "pipelinerl"}),
            "--worker-extension-cls", WORKER_EXTENSION,
        ]  # fmt: skip
        if c.enforce_eager:
            argv.append("--enforce-eager")
        if not c.prefix_caching:  # a cached prefix would serve KV computed by old weights
            argv.append("--no-enable-prefix-caching")
        return argv + list(c.vllm_args)

    def start(self) -> None:
        """Start the workers, then the frontend (returns at once; see :meth:`wait_ready`)."""
        cpus = sorted(os.sched_getaffinity(0))
        for i in range(self.cfg.workers):
            port = free_port(below=SYSTEM_PORT_LIMIT)
            extra = {"DYN_SYSTEM_PORT": str(port)}
            if "VLLM_CPU_OMP_THREADS_BIND" not in self.cfg.env and len(cpus) > 1:
                # vLLM on CPU binds every engine to the same first core otherwise
                share = max(1, len(cpus) // self.cfg.workers)
                mine = cpus[(i * share) % len(cpus) :][:share]
                extra["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in mine)
            self.workers.append(
                self._spawn(f"worker{i}", self.worker_argv(), self._env(extra), port, nice=self.cfg.worker_nice)
            )
        self.frontend_port = free_port()
        argv = [
            self.cfg.python, "-m", "dynamo.frontend",
            "--http-host", "127.0.0.1",
            "--http-port", str(self.frontend_port),
            "--discovery-backend", "file",
            "--router-mode", "round-robin",
        ]  # fmt: skip
        self.frontend = self._spawn("frontend", argv, self._env({}))

    @property
    def frontend_url(self) -> str:
        return f"http://127.0.0.1:{self.frontend_port}"

    def worker_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.workers[i].system_port}"

    def procs(self) -> list[Proc]:
        return [*self.workers, *([self.frontend] if self.frontend is not None else [])]

    def check_alive(self) -> None:
        """PluginError naming the first process that exited, with its log line and tail."""
        for p in self.procs():
            if p.exited() is not None:
                raise PluginError(f"dynamo backend: {p.death()}\n--- {p.log} (last lines) ---\n{log_tail(p.log)}")

    def idle_workers(self) -> int:
        """Every thread of the workers and the engine cores they started under ``SCHED_IDLE``
        (:mod:`pipelinerl_sdk.kit.inference.procs`; once they are up: a start-up under it would
        wait for every other process on a busy CPU). Returns how many threads were set."""
        n = 0
        for w in self.workers:
            n += idle_process(w.popen.pid) + idle_descendants(w.popen.pid)
        return n

    async def wait_ready(self, timeout_s: float) -> None:
        """Every worker answers on its ``pipelinerl`` route and the frontend routes to all of them.
        PluginError (with the log) when a process exits or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        pending = set(range(len(self.workers)))
        async with httpx.AsyncClient(timeout=5.0) as http:
            while True:
                self.check_alive()
                for i in sorted(pending):
                    try:
                        r = await http.post(f"{self.worker_url(i)}/engine/pipelinerl", json={"op": "status"})
                        if r.status_code == 200 and r.json().get("status") == "ok":
                            pending.discard(i)
                    except httpx.HTTPError:
                        pass
                if not pending and await self._frontend_sees_all(http):
                    return
                if time.monotonic() > deadline:
                    slow = self.workers[min(pending)] if pending else self.frontend
                    assert slow is not None
                    raise PluginError(
                        f"dynamo backend: not ready after {timeout_s:.0f}s ({slow.role}: {error_line(slow.log)})\n"
                        f"--- {slow.log} (last lines) ---\n{log_tail(slow.log)}"
                    )
                await asyncio.sleep(0.5)

    async def _frontend_sees_all(self, http: httpx.AsyncClient) -> bool:
        """The frontend lists the model once a worker registered; the discovery directory holds
        one generate instance per worker."""
        try:
            r = await http.get(f"{self.frontend_url}/v1/models")
        except httpx.HTTPError:
            return False
        if r.status_code != 200 or not any(m.get("id") == self.cfg.model for m in r.json().get("data", [])):
            return False
        return self.registered_instances() >= len(self.workers)

    def registered_instances(self) -> int:
        """Generate endpoints registered in file discovery (one per live worker)."""
        root = self.dir / "discovery"
        names = [unquote(str(p.relative_to(root))) for p in root.rglob("*") if p.is_file()]
        return sum(1 for n in names if {"instances", "generate"} <= set(n.split("/")))

    # --- stop -------------------------------------------------------------------------------------

    def stop(self, grace_s: float = 10.0) -> None:
        """End every process Dynamo started (frontend first; SIGKILL after ``grace_s``, within
        the 20 s a launcher gives the server), then remove the directory."""
        procs = [*([self.frontend] if self.frontend is not None else []), *self.workers]
        for p in procs:
            if p.exited() is None:
                with _suppress_lookup():
                    os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in procs:
            p.stop(max(0.1, deadline - time.monotonic()))
        shutil.rmtree(self.dir, ignore_errors=True)

    def describe(self) -> dict[str, Any]:
        return {
            "dir": str(self.dir),
            "frontend": self.frontend_url,
            "workers": [self.worker_url(i) for i in range(len(self.workers))],
        }
