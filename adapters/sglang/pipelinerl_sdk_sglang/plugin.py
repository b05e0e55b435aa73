"""Entry point of the SGLang backend (group ``pipelinerl_sdk.backends``).

Thin on purpose: importing it imports neither torch nor SGLang; the factory is a dotted path
resolved only when ``pipelinerl serve --backend sglang`` creates the backend.
"""

from __future__ import annotations

from dataclasses import replace

from pipelinerl_sdk.kit.inference.card import EngineCard, full_capabilities
from pipelinerl_sdk.plugins import BackendRegistry, hookimpl

#: What the adapter really does on SGLang 0.5.23 (checked by the conformance suite):
#: - ``staged`` (the default) and ``direct`` receive: ``staged`` receives on a thread of
#:   SGLang's scheduler process (:mod:`.staged_receiver`) while SGLang keeps generating and
#:   pauses (``pause_generation(mode="in_place")``) only for SGLang's ``load_weights`` of the
#:   staged tensors; ``direct`` is SGLang's own ``update_weights_from_distributed`` per bucket,
#:   paused for the whole receive (no staging buffer: a model's size less memory);
#: - gloo (CPU) and NCCL (GPU) groups, formed by SGLang's own ``init_weights_update_group``;
#: - per-token versions are SGLang's own ``weight_versions`` spans;
#: - prompt and top logprobs come from SGLang (``SGLANG_RETURN_ORIGINAL_LOGPROB=1``: raw logprobs);
#: - streaming (chat and completions) over SGLang's streamed ``/generate``, ``/v1/completions``,
#:   and structured output through SGLang's grammar backend (xgrammar: ``json_schema``, ``regex``,
#:   ``ebnf``);
#: - no ``logit_bias``: SGLang's native sampling parameters have none (a 400 naming it);
#: - no ``penalties`` with vLLM's rules: presence and frequency penalties are vLLM's (the suite's
#:   cases for them pass), but SGLang's repetition penalty counts the generated tokens only
#:   (vLLM's counts the prompt's too: the suite's repetition case differs from token 2 on), and
#:   SGLang applies its penalizers in the iteration order of a set. Passed on as SGLang's own;
#: - no per-request ``seeds``: SGLang takes ``sampling_seed`` but uses it only with
#:   ``--enable-deterministic-inference``, which needs a GPU attention backend, so on CPU a seeded
#:   request does not replay (its streams are checked greedy). Declared on a GPU build once checked.
#: - no ``min_tokens`` (the SDK's router answers it with a 400 naming it): SGLang's
#:   ``min_new_tokens`` masks the stop and end-of-sequence ids as vLLM does, but its stop strings
#:   still end a request inside the first ``min_new_tokens`` tokens (vLLM counts only those that
#:   end past their text).
CAPABILITIES = replace(
    full_capabilities("staged", "direct"),
    min_tokens=False,
    logit_bias=False,
    penalties=False,
    seeds=False,
    streaming=True,
    completions=True,
    structured_outputs=True,
    pause_generation=True,
)

CARD = EngineCard(
    "sglang",
    "pipelinerl_sdk_sglang.backend:SGLangInferenceBackend",
    CAPABILITIES,
    "SGLang 0.5.23 server behind the SDK's routes (gateway process); updates via SGLang's "
    "init_weights_update_group; staged: a receive thread in SGLang's scheduler, load_weights in the pause; "
    "direct: update_weights_from_distributed (flattened buckets); pause in_place",
    options={
        "context_length": "context length, prompt + completion (default 2048)",
        "device": "cuda or cpu (default: cuda when torch sees a GPU)",
        "tp": "tensor-parallel size (default 1)",
        "max_total_tokens": "KV pool size in tokens on CPU (default 8192)",
        "mem_fraction_static": "SGLang's static memory fraction (CPU default 0.05)",
        "sleep_on_idle": "1: SGLang's scheduler sleeps while idle instead of polling a core at 100% "
        "(default 1 on cpu, 0 on cuda)",
        "cpu_threads": "SGLang's torch threads on cpu (default: OMP_NUM_THREADS if set, else half the "
        "cores, at least 1: more than the cores left free wait on each other)",
        "atomic": "1 (default): snapshot the weights before a multi-bucket update, restore on failure",
        "startup_timeout_s": "seconds SGLang may take to start (default 600)",
        "log_level": "SGLang's log level (default warning)",
        "sglang_args": "extra sglang.launch_server arguments, space-separated",
        "sglang_url": "attach to this running SGLang server instead of starting one (benchmarks; not stopped)",
        "sglang_api_key": "the attached server's --api-key",
    },
    engine=(
        "sglang",
        "SGLang 0.5.23 in this environment: pip install 'pipelinerl-sdk-sglang[gpu]' on a GPU host, "
        "or run scripts/setup-sglang (CPU test harness)",
    ),
    bench_anchor="pipelinerl_sdk_sglang.anchor:native_update_anchor",  # SGLang's own update flow
)


@hookimpl
def register_backends(registry: BackendRegistry) -> None:
    CARD.register(registry)
