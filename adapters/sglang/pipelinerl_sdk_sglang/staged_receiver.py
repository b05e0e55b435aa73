"""A staged receive *inside SGLang's scheduler process*: the update's bytes arrive while SGLang
keeps generating, and only the apply holds generation.

SGLang's own ``update_weights_from_distributed`` receives on the scheduler thread, so generation
waits for the whole broadcast. This module receives on a thread of its own in the same process,
on SGLang's own weight-update group (the one ``init_weights_update_group`` formed, found by name
in torch's registry), into one staging buffer kept across updates of the same size; the apply
(:func:`~pipelinerl_sdk_sglang.scheduler_hooks.apply_staged`) then loads the staged tensors with
SGLang's ``model.load_weights`` inside an update session, with generation paused.

The gateway drives it over a UNIX stream socket in a private directory (mode 0700) that
:func:`~pipelinerl_sdk_sglang.scheduler_hooks.serve_staged` binds, one per TP rank
(``PATH.RANK``). One connection is one receive: the gateway sends one JSON line, sent only after
the trainer's ``go`` and ``sending`` mark (this side never reads the store)::

    {"group": NAME, "params": [{"name", "dtype", "shape"}, ...], "bucket_bytes": N, "timeout_s": S}

and reads JSON lines back: ``{"event": "first_bucket", "t"}`` once the first bucket arrived,
then exactly one of ``{"event": "received", "seconds", "t"}`` (every bucket staged and finite)
or ``{"event": "error", "kind", "message"}``, where ``kind`` is ``group`` (the broadcast failed:
a lost peer, a timeout; the group is unusable), ``non_finite`` (a param holds NaN or infinity; the
group is fine) or ``request`` (the command was unreadable: nothing was received). Nothing here
writes the model: a failed or abandoned receive leaves the served weights as they were.

The plan is the SDK's own :class:`~pipelinerl_sdk.weights.buckets.BucketPlan`, built from the
same specs and bucket size as the trainer's, so the staged layout is the trainer's.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
from typing import Any

import torch

log = logging.getLogger(__name__)

#: Largest command line read (a param spec is well under 1 KB; a 100k-param model fits).
MAX_COMMAND_BYTES = 64 << 20


class StagedReceiver:
    """One scheduler's staged receiver, listening on ``path`` (a UNIX socket it binds; an old
    file there is replaced) from a daemon thread. One receive at a time: the gateway holds its
    update lock across a receive and its apply, so nothing overwrites the staging buffer between
    them. :meth:`take` hands the last receive's tensors to the apply."""

    def __init__(self, path: str, device: torch.device) -> None:
        self.path = path
        self.device = device
        self._buffer: torch.Tensor | None = None
        #: (name, typed view into the buffer) of the last successful receive, until taken.
        self._staged: tuple[tuple[str, torch.Tensor], ...] | None = None
        self._lock = threading.Lock()
        if os.path.exists(path):
            os.unlink(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o600)
        self._sock.listen(4)
        self._thread = threading.Thread(target=self._serve, name="pipelinerl-staged-receiver", daemon=True)
        self._thread.start()

    def take(self) -> tuple[tuple[str, torch.Tensor], ...]:
        """The tensors of the last successful receive (views into the staging buffer), once:
        RuntimeError if no receive succeeded since the last take."""
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is None:
            raise RuntimeError("no staged update to apply: the last receive did not succeed")
        return staged

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            with conn:
                try:
                    self._handle(conn)
                except Exception as e:  # never let the thread die: the next update needs it
                    log.error("pipelinerl staged receiver: %s: %s", type(e).__name__, e)

    def _handle(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")

        def send(event: dict[str, Any]) -> None:
            conn.sendall(json.dumps(event).encode() + b"\n")

        try:
            line = reader.readline(MAX_COMMAND_BYTES)
            command = json.loads(line)
            group = _group(str(command["group"]))
            plan = _plan(command["params"], int(command["bucket_bytes"]))
            timeout = datetime.timedelta(seconds=float(command["timeout_s"]))
        except Exception as e:
            send({"event": "error", "kind": "request", "message": f"{type(e).__name__}: {e}"})
            return
        with self._lock:
            self._staged = None  # the buffer is about to change: an older receive is void
        try:
            staged, seconds = self._receive(
                plan, group, timeout, lambda: send({"event": "first_bucket", "t": time.time()})
            )
        except _NonFinite as e:
            send({"event": "error", "kind": "non_finite", "message": str(e)})
            return
        except Exception as e:
            send({"event": "error", "kind": "group", "message": f"{type(e).__name__}: {e}"})
            return
        with self._lock:
            self._staged = staged
        send({"event": "received", "seconds": seconds, "t": time.time()})

    def _receive(
        self, plan: Any, group: Any, timeout: datetime.timedelta, on_first_bucket: Any
    ) -> tuple[tuple[tuple[str, torch.Tensor], ...], float]:
        """Every bucket of ``plan`` into the staging buffer, each checked finite while the next
        one streams in (the SDK's receiver's order); the views and the receive seconds."""
        from pipelinerl_sdk.weights.receive import first_non_finite, staging_views

        if self._buffer is None or self._buffer.numel() != plan.total_bytes:
            self._buffer = None  # free the old one first
            self._buffer = torch.empty(plan.total_bytes, dtype=torch.uint8, device=self.device)
        buf = self._buffer
        views = staging_views(plan, buf)
        t0 = time.perf_counter()
        bad: str | None = None
        start, last = 0, views[:0]
        for b in plan.buckets:
            work = torch.distributed.broadcast(buf[b.offset : b.offset + b.nbytes], src=0, group=group, async_op=True)
            bad = bad or first_non_finite(iter(last))
            work.wait(timeout)
            if b.index == 0:
                on_first_bucket()
            last, start = views[start : start + len(b.entries)], start + len(b.entries)
        bad = bad or first_non_finite(iter(last))
        if buf.is_cuda:  # the apply runs on the scheduler's stream: the bytes must have landed
            torch.cuda.synchronize(buf.device)
        if bad is not None:
            raise _NonFinite(f"param {bad!r} holds NaN or infinity: update refused")
        return views, time.perf_counter() - t0


class _NonFinite(Exception):
    pass


def _group(name: str) -> Any:
    """SGLang's weight-update group called ``name`` in this process (torch's registry)."""
    from torch.distributed.distributed_c10d import _world

    for pg, pg_name in _world.pg_names.items():
        if str(pg_name) == name:
            return pg
    raise RuntimeError(f"no weight-update group {name!r} in this SGLang process")


def _plan(params: Any, bucket_bytes: int) -> Any:
    from pipelinerl_sdk.protocol import ParamSpec
    from pipelinerl_sdk.weights.buckets import BucketPlan

    return BucketPlan.build([ParamSpec.model_validate(p) for p in params], bucket_bytes)


__all__ = ["MAX_COMMAND_BYTES", "StagedReceiver"]
