"""Dynamo's own documented RL weight-update flow, for ``pipelinerl bench weight-update --backend
dynamo`` (the anchor, see :mod:`pipelinerl_sdk.bench.anchor`). Speaks HTTP to Dynamo's RL routes on
every worker's system port (``/info``'s ``workers[].url``); imports neither Dynamo nor vLLM.

Dynamo 1.6's RL flow, per worker, trainer side (``dynamo/vllm/handlers.py``: the update routes
refuse unless the worker is paused):

1. ``POST /engine/pause_generation {"mode": "keep"}``;
2. ``POST /engine/update_weights_from_distributed {"engine_rpc": ...}`` which runs vLLM's
   ``collective_rpc(engine_rpc, kwargs)`` and drops its answer: here ``start_weight_update``, then
   ``update_weights`` with a *blocking* receive while the trainer broadcasts (the answer comes once
   every byte arrived: the only receive these routes can drive), then ``finish_weight_update``
   with ``weight_version`` (Dynamo's label);
3. ``POST /engine/resume_generation``.

On CPU the receive runs over the SDK's registered vLLM engine (``pipelinerl``, gloo), blocking on
the worker's RPC thread as vLLM's built-in engines do. Every worker goes through each step
together (the group's collectives need every rank). The SDK's own update differs in what the
benchmark compares: it receives off the engine loop and pauses only for the apply (staged).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

from pipelinerl_sdk.bench.anchor import FlowSettings, FlowTarget, NativeUpdate
from pipelinerl_sdk.errors import ServerError

__all__ = ["FLOW", "DynamoNativeFlow"]


@dataclass(frozen=True)
class DynamoNativeFlow(FlowSettings):
    """The engine's documented RL flow (:class:`~pipelinerl_sdk.bench.anchor.FlowSettings`)."""

    async def update(self, target: FlowTarget, version: int) -> NativeUpdate:
        client = next((c for c in target.publisher.clients if c.url == target.url.rstrip("/")), None)
        if client is None:
            raise RuntimeError(f"{target.url} is not one of the publisher's servers")
        info = await client.info()
        urls = [w.url for w in info.workers or [] if w.url]
        if not urls or len(urls) != info.receiving_workers:
            raise RuntimeError(f"{target.url}: /info does not list every worker's url: {info.workers}")
        from pipelinerl_sdk_vllm.jobs import receive_info  # the vLLM adapter's engine runs in every worker

        update_info = receive_info(version, target.specs, target.publisher.bucket_bytes, self.timeout_s, blocking=True)
        async with httpx.AsyncClient(timeout=self.timeout_s + 30) as http:

            async def post(url: str, route: str, body: dict[str, Any]) -> None:
                r = await http.post(f"{url}/engine/{route}", json=body)
                try:
                    answer = r.json()  # Dynamo's system server answers JSON as text/plain
                except ValueError:
                    answer = {}
                if r.status_code >= 400 or answer.get("status") != "ok":
                    msg = f"POST /engine/{route}: {r.status_code} {r.text[:500]}"
                    raise ServerError(url, msg, status=r.status_code)

            async def every(route: str, body: dict[str, Any]) -> None:
                await asyncio.gather(*(post(u, route, body) for u in urls))

            rpc = "update_weights_from_distributed"
            return await self.keep_pause_flow(
                target,
                version,
                pause=lambda: every("pause_generation", {"mode": "keep"}),
                start=lambda: every(rpc, {"engine_rpc": "start_weight_update", "reset_prefix_cache": False}),
                receive=lambda: every(rpc, {"engine_rpc": "update_weights", "update_info": update_info}),
                finish=lambda: every(rpc, {"engine_rpc": "finish_weight_update", "weight_version": str(version)}),
                resume=lambda: every("resume_generation", {}),
            )


#: The ``bench_anchor`` the dynamo backend registers.
FLOW = DynamoNativeFlow(
    description=(
        "Dynamo 1.6 RL routes on every worker: /engine/pause_generation {mode: keep}, "
        "/engine/update_weights_from_distributed (start_weight_update, update_weights: blocking receive, "
        "finish_weight_update + weight_version), /engine/resume_generation"
    ),
)
