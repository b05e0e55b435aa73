"""vLLM's own documented weight-update flow, for ``pipelinerl bench weight-update --backend vllm``
(the anchor, see :mod:`pipelinerl_sdk.bench.anchor`). Imports neither torch-heavy vLLM nor the
backend: it speaks HTTP to vLLM's RL routes.

The flow vLLM 0.32 documents for RL with an HTTP server (``vllm/entrypoints/rl/online``, routes
only under ``VLLM_SERVER_DEV_MODE=1``), trainer side:

1. ``POST /pause?mode=keep``: freeze requests in place;
2. ``POST /start_weight_update``;
3. ``POST /update_weights {"update_info": ...}`` while the trainer broadcasts; it answers once
   the workers received everything (the built-in engines receive on the engine's RPC thread);
4. ``POST /finish_weight_update {"weight_version": ...}``;
5. ``POST /resume``.

vLLM's built-in transports (``nccl``, ``ipc``) need CUDA; on CPU the flow runs over the adapter's
registered engine (``pipelinerl``, gloo) with ``blocking: true``, which receives on the RPC thread
as the built-ins do. The SDK's own update differs in exactly what the benchmark compares: it
receives off the engine loop and pauses only for the apply.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from pipelinerl_sdk.bench.anchor import NativeUpdate
from pipelinerl_sdk.errors import ServerError
from pipelinerl_sdk.protocol import ParamSpec
from pipelinerl_sdk.weights.buckets import BucketPlan
from pipelinerl_sdk.weights.publisher import WeightPublisher
from pipelinerl_sdk.weights.receive import update_key
from pipelinerl_sdk.weights.send import WeightSender

__all__ = ["FLOW", "VLLMNativeFlow"]


@dataclass(frozen=True)
class VLLMNativeFlow:
    description: str = (
        "vLLM 0.32 RL routes: /pause?mode=keep, /start_weight_update, /update_weights (blocking receive), "
        "/finish_weight_update {weight_version}, /resume"
    )
    server_env: dict[str, str] = field(default_factory=lambda: {"VLLM_SERVER_DEV_MODE": "1"})
    timeout_s: float = 120.0
    #: The sender's two bucket buffers, reused across updates as the SDK's publisher reuses its own.
    buffers: dict[int, list[Any]] = field(default_factory=dict)

    async def update(
        self,
        server_url: str,
        publisher: WeightPublisher,
        send: Callable[[WeightSender], None],
        specs: Sequence[ParamSpec],
        version: int,
    ) -> NativeUpdate:
        group = publisher.group
        if group is None:
            raise RuntimeError("the publisher is not connected: the native flow reuses its group")
        plan = BucketPlan.build(specs, publisher.bucket_bytes)
        key = update_key(version)
        info: dict[str, Any] = {
            "op": "receive",
            "version": version,
            "params": [[p.name, p.dtype, list(p.shape)] for p in specs],
            "bucket_bytes": publisher.bucket_bytes,
            "timeout_s": self.timeout_s,
            "blocking": True,
        }
        async with httpx.AsyncClient(base_url=server_url, timeout=self.timeout_s + 30) as http:

            async def post(path: str, **kwargs: Any) -> None:
                r = await http.post(path, **kwargs)
                if r.status_code >= 400:
                    raise ServerError(server_url, f"POST {path}: {r.status_code} {r.text[:500]}", status=r.status_code)

            t0 = time.perf_counter()
            await post("/pause", params={"mode": "keep"})
            paused = time.perf_counter()
            await post("/start_weight_update")
            group.clear_decision(key)
            group.post_decision(key, go=True)
            try:
                receiving = asyncio.create_task(post("/update_weights", json={"update_info": info}))
                sender = WeightSender(group, plan, self.buffers.get(plan.max_bucket_bytes))

                def broadcast() -> float:
                    send(sender)
                    seconds = sender.finish().seconds
                    if sender.buffers is not None:
                        self.buffers[plan.max_bucket_bytes] = sender.buffers
                    return seconds

                send_s = await asyncio.to_thread(broadcast)
                await receiving
            finally:
                group.clear_decision(key)
            await post("/finish_weight_update", json={"weight_version": str(version)})
            await post("/resume")
            done = time.perf_counter()
        return NativeUpdate(version=version, wall_s=done - t0, pause_s=done - paused, send_s=send_s)


#: The ``bench_anchor`` the vllm backend registers.
FLOW = VLLMNativeFlow()
