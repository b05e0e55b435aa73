"""Entry point of the SGLang backend (group ``pipelinerl_sdk.backends``).

Thin on purpose: importing it imports neither torch nor SGLang; the factory is a dotted path
resolved only when ``pipelinerl serve --backend sglang`` creates the backend.
"""

from __future__ import annotations

from pipelinerl_sdk.contracts import InferenceCapabilities
from pipelinerl_sdk.plugins import BackendRegistry, hookimpl

#: What the adapter really does on SGLang 0.5.23 (checked by the conformance suite):
#: - ``direct`` receive only: SGLang receives each bucket on its scheduler thread, so generation
#:   is paused (``pause_generation(mode="in_place")``) for the whole receive; there is no way to
#:   receive while SGLang keeps generating;
#: - gloo (CPU) and NCCL (GPU) groups, formed by SGLang's own ``init_weights_update_group``;
#: - per-token versions are SGLang's own ``weight_versions`` spans;
#: - prompt and top logprobs come from SGLang (``SGLANG_RETURN_ORIGINAL_LOGPROB=1``: raw logprobs).
CAPABILITIES = InferenceCapabilities(
    receive_modes=frozenset({"direct"}),
    group_backends=frozenset({"gloo", "nccl"}),
    in_flight_updates=True,
    per_token_versions=True,
    prompt_logprobs=True,
    top_logprobs=True,
    dtypes=frozenset({"float32", "bfloat16"}),
    stop_strings=True,
    penalties=True,
)


@hookimpl
def register_backends(registry: BackendRegistry) -> None:
    registry.register_inference_backend(
        "sglang",
        "pipelinerl_sdk_sglang.backend:SGLangInferenceBackend",
        CAPABILITIES,
        "SGLang 0.5.23 server behind the SDK's routes (gateway process); updates via SGLang's "
        "init_weights_update_group / update_weights_from_distributed (flattened buckets), pause in_place",
        bench_anchor="pipelinerl_sdk_sglang.anchor:native_update_anchor",  # SGLang's own update flow
    )
