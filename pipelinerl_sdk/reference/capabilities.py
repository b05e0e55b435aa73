"""Declarations of the reference backends (no torch import: the plugin module reads these)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

from pipelinerl_sdk.contracts import LOGPROBS_MODES, TrainerCapabilities
from pipelinerl_sdk.kit.inference.card import EngineCard, full_capabilities

#: Structured output where xgrammar is installed (the ``structured`` extra).
INFERENCE = replace(
    full_capabilities("direct", "staged"),
    streaming=True,
    completions=True,
    structured_outputs=importlib.util.find_spec("xgrammar") is not None,
    logprobs_modes=frozenset(LOGPROBS_MODES),
    pause_generation=True,
)

INFERENCE_CARD = EngineCard(
    "reference",
    "pipelinerl_sdk.reference.backend:ReferenceInferenceBackend",
    INFERENCE,
    "torch + transformers, continuous batching with a KV cache; staged and direct receive",
    options={
        "max_batch_size": "max concurrent sequences (default 32)",
        "max_model_len": "context length (default 2048)",
        "threads": "torch intra-op threads (default torch's)",
    },
)

TRAINER = TrainerCapabilities(
    sharded=False,
    group_backends=frozenset({"gloo", "nccl"}),
    dtypes=frozenset({"float32", "bfloat16"}),
)
