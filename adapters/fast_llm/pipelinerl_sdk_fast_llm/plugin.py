"""Entry point of the ``fast-llm`` trainer backend. Thin: imports no torch; the factory is a dotted path."""

from __future__ import annotations

from pipelinerl_sdk.plugins import BackendRegistry, hookimpl
from pipelinerl_sdk_fast_llm.capabilities import CAPABILITIES


@hookimpl
def register_backends(registry: BackendRegistry) -> None:
    registry.register_trainer_backend(
        "fast-llm",
        "pipelinerl_sdk_fast_llm.trainer:FastLLMTrainer",
        CAPABILITIES,
        "ServiceNow Fast-LLM (HF converters, ZeRO stages, its AdamW), gloo on CPU, NCCL on GPU",
    )
