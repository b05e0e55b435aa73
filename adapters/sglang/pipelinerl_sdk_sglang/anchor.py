"""The benchmark anchor: SGLang's own documented weight-update flow, without the SDK.

``pipelinerl bench weight-update --backend sglang`` calls :func:`native_update_anchor` (the
``bench_anchor`` the sglang backend registers) after its own server is stopped: it starts a plain
``sglang.launch_server`` on the same model, forms the group through SGLang's
``/init_weights_update_group``, and times SGLang's plain sequence per update, as its docs give
it: ``/begin_weight_update`` -> ``/update_weights_from_distributed`` (every param named, one
broadcast per tensor from the trainer) -> ``/end_weight_update``, on an idle server. The
trainer side is rank 0 of a plain torch group (the SDK's :class:`WeightSyncGroup`, whose store
layout is torch's own), broadcasting each tensor as it comes.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from pipelinerl_sdk_sglang.engine import SGLangClient, SGLangProcess, free_port, launch_args, launch_env, new_api_key

GROUP = "sglang-native-anchor"


def native_update_anchor(model: str | Path, *, dtype: str = "float32", updates: int = 5) -> dict[str, Any]:
    """Median seconds of SGLang's plain distributed update of every param of ``model`` (after one
    warm-up), plus its spread; a JSON-ready dict."""
    return asyncio.run(_anchor(str(model), dtype, updates))


async def _anchor(model: str, dtype: str, updates: int) -> dict[str, Any]:
    from pipelinerl_sdk.reference.tiny import load_model
    from pipelinerl_sdk.weights.group import GroupConfig, WeightSyncGroup

    device = "cuda" if torch.cuda.is_available() else "cpu"
    key, port = new_api_key(), free_port()
    args = launch_args(model, dtype=dtype, port=port, api_key=key, device=device, context_length=2048, options={})
    proc = SGLangProcess(args, port=port, env=launch_env(device))
    sgl = SGLangClient(proc.url, key)
    proc.start()
    group: WeightSyncGroup | None = None
    try:
        await proc.wait_ready(sgl, 600)
        hf, _ = load_model(model, dtype)
        params = [(n, p.detach().contiguous()) for n, p in hf.named_parameters()]
        store_port = free_port()
        init = f"tcp://127.0.0.1:{store_port}"
        holder: dict[str, WeightSyncGroup] = {}
        former = threading.Thread(
            target=lambda: holder.setdefault("g", WeightSyncGroup(GroupConfig(init, 0, 2, "gloo", GROUP, 120)))
        )
        former.start()
        body = {
            "master_address": "127.0.0.1", "master_port": store_port, "rank_offset": 1, "world_size": 2,
            "group_name": GROUP, "backend": "gloo" if device == "cpu" else "nccl",
        }  # fmt: skip
        await sgl.control("/init_weights_update_group", body)
        await asyncio.to_thread(former.join)
        group = holder["g"]
        names = [n for n, _ in params]
        update = {
            "names": names,
            "dtypes": [str(p.dtype).removeprefix("torch.") for _, p in params],
            "shapes": [list(p.shape) for _, p in params],
            "group_name": GROUP,
            "flush_cache": True,
        }

        def send() -> None:
            for _, p in params:
                group.broadcast(p, 0)

        walls = []
        for i in range(updates + 1):
            t0 = time.perf_counter()
            await sgl.control("/begin_weight_update", {})
            sender = asyncio.create_task(asyncio.to_thread(send))
            await sgl.control("/update_weights_from_distributed", {**update, "weight_version": str(i + 1)})
            await sender
            await sgl.control("/end_weight_update", {})
            if i:  # the first one is the warm-up
                walls.append(time.perf_counter() - t0)
        return {
            "flow": "begin_weight_update -> update_weights_from_distributed (one broadcast per tensor) -> "
            "end_weight_update, idle server",
            "update_wall_s": statistics.median(walls),
            "update_wall_s_samples": walls,
            "tensors": len(params),
            "model_bytes": sum(p.numel() * p.element_size() for _, p in params),
        }
    finally:
        if group is not None:
            group.close()
        await sgl.close()
        await asyncio.to_thread(proc.stop)
