"""PipelineRL's trainer side of its weight-update protocol, replayed for tests on CPU.

What PipelineRL's ``finetune_loop.WeightUpdateManager`` does (ServiceNow/PipelineRL 58d3934), with
one difference: the data plane is gloo (``GLOO_PREFIX``) where PipelineRL uses vLLM's
``PyNcclCommunicator`` (CUDA only; its trainer module does not import without CUDA). Rank 0 hosts
the TCPStore at the init method (blocking until every server rank joined); each update posts
PipelineRL's ``WeightUpdateRequest`` JSON without a token and without waiting, broadcasts every
parameter in ``parameters_info`` order, then waits for the answer."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx
import torch
import torch.distributed as dist

from pipelinerl_sdk.http.pipelinerl_trainer import GLOO_PREFIX

__all__ = ["PipelineRLTrainerReplay"]


class PipelineRLTrainerReplay:
    """Rank 0 of PipelineRL's group of ``world_size`` at ``tcp://host:port``."""

    def __init__(self, host: str, port: int, world_size: int = 2, timeout_s: float = 120.0) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, world_size=world_size, is_master=True, timeout=timeout)  # type: ignore[attr-defined]
        self.pg: Any = dist.ProcessGroupGloo(dist.PrefixStore(GLOO_PREFIX, self.store), 0, world_size, timeout)  # type: ignore[attr-defined]

    def update(
        self, urls: Sequence[str], version: int, params: Sequence[tuple[str, torch.Tensor]], timeout_s: float = 300.0
    ) -> list[httpx.Response]:
        """One update: the posts (no token, not awaited), each parameter broadcast in order (in
        its dtype), then every server's answer, in ``urls`` order."""
        info = [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype)} for n, t in params]
        body: dict[str, Any] = {
            "kind": "weight_update_request",
            "version": version,
            "parameters_info": info,
            "timestamp": time.time(),
        }
        answers: dict[int, httpx.Response | BaseException] = {}

        def post(i: int, url: str) -> None:
            try:
                answers[i] = httpx.post(f"{url}/receive_weight_update", json=body, timeout=timeout_s)
            except BaseException as e:  # reported below
                answers[i] = e

        posts = [threading.Thread(target=post, args=(i, u), daemon=True) for i, u in enumerate(urls)]
        for p in posts:
            p.start()
        for _, t in params:
            self.pg.broadcast(t.contiguous(), 0).wait()
        for p in posts:
            p.join(timeout_s)
        out = []
        for i, url in enumerate(urls):
            a = answers.get(i)
            if not isinstance(a, httpx.Response):
                raise RuntimeError(f"{url}/receive_weight_update: no answer ({a!r})")
            out.append(a)
        return out

    def close(self) -> None:
        self.pg.shutdown()
