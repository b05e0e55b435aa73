"""Start and stop inference servers as child processes (tests, benchmarks, the pipeline).

A server is ``python -m pipelinerl_sdk.cli serve ...`` in a new process session; readiness is the
ready file it writes once it answers HTTP, so no port is ever guessed. The control token travels
in the environment, never on the command line.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from pipelinerl_sdk.errors import PipelineRLError

ENV_CONTROL_TOKEN = "PIPELINERL_CONTROL_TOKEN"
ENV_API_KEY = "PIPELINERL_API_KEY"


def log_tail(path: Path, n: int = 40) -> str:
    """The last ``n`` lines of a process's log file ("" if it does not exist (yet))."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return ""


class ServerStartError(PipelineRLError):
    """The server exited or did not become ready in time; the message carries its output tail."""


class ServerProcess:
    """One server child. Use as a context manager, or call :meth:`start` and :meth:`stop`."""

    def __init__(
        self,
        backend: str,
        model: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        dtype: str = "float32",
        receive_mode: str | None = None,
        options: Mapping[str, object] | None = None,
        control_token: str | None = None,
        api_key: str | None = None,
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 300.0,
        python: str = sys.executable,
        args: Sequence[str] = (),
    ) -> None:
        self.backend = backend
        self.control_token = control_token or secrets.token_urlsafe(24)
        self.api_key = api_key
        self.startup_timeout_s = startup_timeout_s
        self._dir = tempfile.mkdtemp(prefix="pipelinerl-server-")
        self._ready = Path(self._dir, "ready.json")
        self._log_path = Path(self._dir, "server.log")
        self.cmd = [
            python,
            "-m",
            "pipelinerl_sdk.cli",
            "serve",
            "--backend",
            backend,
            "--model",
            str(model),
            "--host",
            host,
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--ready-file",
            str(self._ready),
        ]
        if receive_mode:
            self.cmd += ["--receive-mode", receive_mode]
        for k, v in (options or {}).items():
            self.cmd += ["--option", f"{k}={v}"]
        self.cmd += list(args)  # more `pipelinerl serve` flags (limits: --max-body-bytes, ...)
        self.env = {**os.environ, **(env or {}), ENV_CONTROL_TOKEN: self.control_token}
        if api_key:
            self.env[ENV_API_KEY] = api_key
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.pid = -1

    def start(self) -> ServerProcess:
        log = open(self._log_path, "wb")
        self.proc = subprocess.Popen(
            self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()
        self.pid = self.proc.pid
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._ready.exists():
                info = json.loads(self._ready.read_text())
                self.url = info["url"]
                return self
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"{self.backend} server exited with code {self.proc.returncode} before it was ready:\n"
                    + self.log_tail()
                )
            time.sleep(0.1)
        self.stop()
        raise ServerStartError(
            f"{self.backend} server not ready after {self.startup_timeout_s:.0f}s:\n{self.log_tail()}"
        )

    @property
    def log_path(self) -> Path:
        """The server's combined stdout and stderr (removed by :meth:`stop`)."""
        return self._log_path

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self._log_path, n)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM the server's whole process group, SIGKILL after ``timeout_s``; returns the
        exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        try:  # children left in the group (engine workers)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(self._dir, ignore_errors=True)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
