"""Checks of vLLM's own trainer-side code against any server with vLLM's RL routes, for the
adapters' tests (needs vLLM and transformers; imported only by tests)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import torch

if TYPE_CHECKING:
    from pipelinerl_sdk.conformance.mirror import Mirror

__all__ = ["served_logprob_gap", "vllm_trainer_updates_while_requests_run"]

PROMPT = [{"role": "user", "content": "Count: 1 2 3 4 5 6 7 8 9"}]


def served_logprob_gap(url: str, mirror: Mirror, version: int | None) -> float:
    """Max |served - mirror| greedy logprob over 8 tokens; the tags are ``version`` where given."""
    body = {"messages": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": True, "return_token_ids": True}
    out = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    choice = out["choices"][0]
    want = mirror.logprobs(out["prompt_token_ids"] + choice["token_ids"])[-len(choice["token_ids"]) :]
    got = torch.tensor([t["logprob"] for t in choice["logprobs"]["content"]])
    if version is not None:
        assert set(choice["weight_versions"]) == {version}, choice["weight_versions"]
    return float((got - want.float()).abs().max())


def _long_call(url: str, seed: int) -> list[int]:
    body = {"messages": PROMPT, "max_tokens": 200, "temperature": 1.0, "ignore_eos": True, "seed": seed}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["weight_versions"])


def vllm_trainer_updates_while_requests_run(url: str, control_token: str, model_dir: Path, *, updates: int = 3) -> None:
    """vLLM's ``WeightTransferTrainerFactory.trainer_init`` and ``send_weights``, unchanged, with
    the ``pipelinerl`` trainer engine, publish ``updates`` steps of a trainer (a perturbed copy of
    the model) to the SDK server at ``url`` while 6 long requests run: every call's version tags
    never go back, some call crosses an update, the server then serves the last step's weights
    (fp32 logprobs within 1e-4) tagged with its version, and ``/weight_info`` names it. Every
    param is sent, so the server may have been updated before (the versions go on from its own)."""
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from pipelinerl_sdk.conformance.mirror import Mirror
    from pipelinerl_sdk.http.vllm_flow import ControlTokenClient
    from pipelinerl_sdk_vllm.trainer_engine import PipelineRLTrainerInitInfo

    headers = {"Authorization": f"Bearer {control_token}"}
    start = int(httpx.get(f"{url}/health", timeout=10).json()["version"])
    world = int(httpx.get(f"{url}/get_world_size", headers=headers, timeout=10).json()["world_size"])
    mirror = Mirror(model_dir, "float32")
    client = ControlTokenClient(url, control_token)
    engine = WeightTransferTrainerFactory.trainer_init(
        PipelineRLTrainerInitInfo(
            world_size=1 + world, rank=0, bucket_bytes=1 << 20, timeout_s=120, first_version=start + 1
        ),
        client=client,
        source=ModuleSource(mirror.model),
    )
    try:
        if start == 0:  # a fresh server: the trainer starts from the weights it serves
            assert served_logprob_gap(url, mirror, start) < 1e-4
        versions = set(range(start, start + updates + 1))
        with ThreadPoolExecutor(6) as pool:
            calls = [pool.submit(_long_call, url, seed) for seed in range(6)]
            for step in range(updates):
                mirror.perturb(seed=100 + step, scale=0.05)
                engine.send_weights()
            tags = [c.result() for c in calls]
        assert all(t == sorted(t) and set(t) <= versions for t in tags), tags
        assert any(len(set(t)) > 1 for t in tags), f"no call crossed an update: {[sorted(set(t)) for t in tags]}"
        last = start + updates
        assert served_logprob_gap(url, mirror, last) < 1e-4
        assert httpx.get(f"{url}/weight_info", headers=headers, timeout=10).json() == {"weight_version": str(last)}
    finally:
        engine.shutdown()
        client.close()
