"""Declarations of the reference backends (no torch import: the plugin module reads these)."""

from __future__ import annotations

from dataclasses import replace

from pipelinerl_sdk.contracts import TrainerCapabilities
from pipelinerl_sdk.kit.inference.card import EngineCard, full_capabilities

INFERENCE = replace(full_capabilities("direct", "staged"), streaming=True, completions=True)

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
