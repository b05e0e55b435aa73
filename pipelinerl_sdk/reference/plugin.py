"""Entry point of the built-in backends: registered exactly like a third-party plugin.

Thin on purpose: it imports no torch; factories are dotted paths resolved on creation.
"""

from __future__ import annotations

from pipelinerl_sdk.plugins import BackendRegistry, hookimpl
from pipelinerl_sdk.reference import capabilities


@hookimpl
def register_backends(registry: BackendRegistry) -> None:
    capabilities.INFERENCE_CARD.register(registry)
    registry.register_trainer_backend(
        "reference",
        "pipelinerl_sdk.reference.trainer:ReferenceTrainer",
        capabilities.TRAINER,
        "plain torch, replicated weights (all-reduced gradients over gloo), AdamW",
    )
