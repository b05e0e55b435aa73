"""Entry point of the ``fsdp`` trainer backend. Thin: imports no torch; the factory is a dotted path."""

from __future__ import annotations

from pipelinerl_sdk.plugins import BackendRegistry, hookimpl
from pipelinerl_sdk_fsdp.capabilities import CAPABILITIES


@hookimpl
def register_backends(registry: BackendRegistry) -> None:
    registry.register_trainer_backend(
        "fsdp",
        "pipelinerl_sdk_fsdp.trainer:FSDPTrainer",
        CAPABILITIES,
        "torch FSDP2 (fully_shard per decoder layer, then the root), torch AdamW, optional bf16 mixed precision",
    )
