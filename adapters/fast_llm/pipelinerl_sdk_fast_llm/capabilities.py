"""Capabilities of the Fast-LLM trainer (no torch import: the plugin module reads these)."""

from __future__ import annotations

from pipelinerl_sdk.contracts import TrainerCapabilities

CAPABILITIES = TrainerCapabilities(
    sharded=True,
    max_world_size=None,
    group_backends=frozenset({"gloo", "nccl"}),
    dtypes=frozenset({"float32", "bfloat16"}),
)
