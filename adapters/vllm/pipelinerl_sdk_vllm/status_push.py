"""The workers' receive status pushed to the API server the moment it changes (same host).

The API server learns how a receive goes by polling every worker (``collective_rpc
("pipelinerl_status")``, through the engine core, which answers only between two engine steps).
A poll every :data:`~pipelinerl_sdk_vllm.backend.POLL_S` added, in the timeline of one staged
update, a median 7 ms between the worker's last bucket and the server seeing it (12 ms for the
trainer's ``go``). So each worker also sends its status (:meth:`PipelineRLWeightTransferEngine.status
<pipelinerl_sdk_vllm.transfer.PipelineRLWeightTransferEngine.status>`, a snapshot taken after the
change) as one datagram to a UNIX socket the server binds in a private directory (mode 0700), named
to vLLM's processes by :data:`ENV` before they start. The server wakes on it at once; polling
stays as the fallback (a worker on another host, where the path does not exist, never pushes).

Trust: only a process of the same user can reach the socket (one that could as well attach to
the server), and a push is a snapshot as true as a poll's answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Mapping
from typing import Any

__all__ = ["ENV", "StatusInbox", "push"]

#: The socket's path, in the environment of the API server and (inherited) every vLLM process.
ENV = "PIPELINERL_VLLM_STATUS_SOCKET"
#: Largest datagram read (a status is well under 1 KB).
MAX_BYTES = 1 << 16


def push(status: Mapping[str, Any]) -> None:
    """Worker side: send ``status`` (JSON-able, with its ``rank``) to the server's inbox, if
    :data:`ENV` names one; never raises (the server then polls)."""
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(json.dumps(status).encode(), path)
    except (OSError, TypeError, ValueError):
        pass


class StatusInbox:
    """Server side: the socket the workers push to, bound at construction; :meth:`attach` it to
    the running event loop, :meth:`close` it at the end. Not thread-safe (the loop's thread)."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="pipelinerl-vllm-")  # mode 0700
        self.path = os.path.join(self._dir, "status.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.path)
        self._sock.setblocking(False)
        #: The last status each worker pushed since :meth:`clear`, by group rank.
        self.latest: dict[int, dict[str, Any]] = {}
        #: Whether any push ever arrived (the workers can reach this socket).
        self.reached = False
        self._changed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._changed = loop, asyncio.Event()
        loop.add_reader(self._sock.fileno(), self._read)

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                return
            try:
                status = json.loads(data)
                rank = int(status["rank"])
            except (ValueError, KeyError, TypeError):
                continue
            self.latest[rank] = status
            self.reached = True
        if self._changed is not None:
            self._changed.set()

    def clear(self) -> None:
        """Forget what was pushed (before arming a receive: what follows is about it)."""
        self.latest.clear()

    def statuses(self, workers: int) -> list[dict[str, Any]] | None:
        """Every worker's last pushed status, in rank order, once ``workers`` of them pushed."""
        if len(self.latest) < workers:
            return None
        return [self.latest[r] for r in sorted(self.latest)]

    def mark_read(self) -> None:
        """Before reading :meth:`statuses`: a push after it makes :meth:`wait` return at once."""
        if self._changed is not None:
            self._changed.clear()

    async def wait(self, timeout_s: float) -> None:
        """Return at the next push since :meth:`mark_read` (at once if one came), or after
        ``timeout_s``."""
        if self._changed is None:
            await asyncio.sleep(timeout_s)
            return
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except TimeoutError:
            pass

    def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._loop = None
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)
