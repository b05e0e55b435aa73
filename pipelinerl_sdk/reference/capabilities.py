"""Capabilities of the reference backends (no torch import: the plugin module reads these)."""

from __future__ import annotations

from pipelinerl_sdk.contracts import InferenceCapabilities, TrainerCapabilities

INFERENCE = InferenceCapabilities(
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

TRAINER = TrainerCapabilities(
    sharded=False,
    group_backends=frozenset({"gloo", "nccl"}),
    dtypes=frozenset({"float32", "bfloat16"}),
)
