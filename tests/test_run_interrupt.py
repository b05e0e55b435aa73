"""``pipelinerl run`` stopped by SIGTERM (what a job scheduler or ``kill`` sends) stops the
inference server it started: the server runs in a session of its own, so nothing else would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads Linux's process table")
def test_sigterm_stops_the_server_the_run_started(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipelinerl_sdk.cli", "run", "examples/digit_successor.toml"]
    proc = subprocess.Popen(
        [*cmd, "--set", f"out_dir={out}", "--set", "max_steps=100000"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    server = None
    try:
        deadline = time.monotonic() + 300
        metrics = out / "metrics.jsonl"
        # in the training loop: its server is up and registered for cleanup
        while time.monotonic() < deadline and not (metrics.exists() and metrics.stat().st_size > 0):
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            time.sleep(0.2)
        servers = [c for c in children(proc.pid) if b"serve" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(servers) == 1, servers
        server = servers[0]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 130
        assert proc.stderr is not None and b"run interrupted" in proc.stderr.read()
        deadline = time.monotonic() + 30
        while alive(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(server), f"server {server} outlived the run"
    finally:
        if proc.poll() is None:
            proc.kill()
        if server is not None and alive(server):
            os.kill(server, signal.SIGKILL)
