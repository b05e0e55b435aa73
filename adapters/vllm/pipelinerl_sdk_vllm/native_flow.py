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

from dataclasses import dataclass
from typing import Any

import httpx

from pipelinerl_sdk.bench.anchor import FlowSettings, FlowTarget, NativeGeneration, NativeUpdate
from pipelinerl_sdk.errors import ServerError
from pipelinerl_sdk_vllm.jobs import receive_info
from pipelinerl_sdk_vllm.server import NATIVE_PREFIX

__all__ = ["FLOW", "VLLMNativeFlow"]


@dataclass(frozen=True)
class VLLMNativeFlow(FlowSettings):
    """The engine's documented RL flow (:class:`~pipelinerl_sdk.bench.anchor.FlowSettings`)."""

    async def update(self, target: FlowTarget, version: int) -> NativeUpdate:
        info = receive_info(version, target.specs, target.publisher.bucket_bytes, self.timeout_s, blocking=True)
        token = {"Authorization": f"Bearer {target.control_token}"} if target.control_token else {}
        async with httpx.AsyncClient(base_url=target.url, timeout=self.timeout_s + 30, headers=token) as http:

            async def post(path: str, **kwargs: Any) -> None:
                r = await http.post(path, **kwargs)
                if r.status_code >= 400:
                    raise ServerError(target.url, f"POST {path}: {r.status_code} {r.text[:500]}", status=r.status_code)

            return await self.keep_pause_flow(
                target,
                version,
                pause=lambda: post("/pause", params={"mode": "keep"}),
                start=lambda: post("/start_weight_update"),
                receive=lambda: post("/update_weights", json={"update_info": info}),
                finish=lambda: post("/finish_weight_update", json={"weight_version": str(version)}),
                resume=lambda: post("/resume"),
            )


#: The ``bench_anchor`` the vllm backend registers.
FLOW = VLLMNativeFlow(
    description=(
        "vLLM 0.32 RL routes: /pause?mode=keep, /start_weight_update, /update_weights (blocking receive), "
        "/finish_weight_update {weight_version}, /resume"
    ),
    server_env={"VLLM_SERVER_DEV_MODE": "1"},
    # vLLM's own chat and completions handlers, mounted beside the SDK's
    generation=NativeGeneration(
        options={"native_generation_routes": "1"},
        chat=f"{NATIVE_PREFIX}/chat/completions",
        completions=f"{NATIVE_PREFIX}/completions",
    ),
)
