"""Capabilities of the TorchTitan trainer (no torch import: the plugin module reads these)."""

from __future__ import annotations

from pipelinerl_sdk.contracts import TrainerCapabilities

CAPABILITIES = TrainerCapabilities(
    sharded=True,
    max_world_size=None,
    group_backends=frozenset({"gloo", "nccl"}),
    # fp32 parameters (the master weights); bf16 compute is the option mixed_precision="bf16".
    dtypes=frozenset({"float32"}),
)
