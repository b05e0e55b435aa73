"""Entry point of the ``torchtitan`` trainer backend. Thin: imports neither torch nor torchtitan."""

from __future__ import annotations

from pipelinerl_sdk.plugins import BackendRegistry, hookimpl
from pipelinerl_sdk_torchtitan.capabilities import CAPABILITIES


@hookimpl
def register_backends(registry: BackendRegistry) -> None:
    registry.register_trainer_backend(
        "torchtitan",
        "pipelinerl_sdk_torchtitan.trainer:TorchTitanTrainer",
        CAPABILITIES,
        "TorchTitan 0.3.0 (llama3, qwen3): its model registry, FSDP2 parallelize, optimizer container, "
        "HF state-dict adapter",
    )
