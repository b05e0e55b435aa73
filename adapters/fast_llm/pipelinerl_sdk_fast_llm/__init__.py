"""pipelinerl-sdk trainer backend ``fast-llm``: ServiceNow's Fast-LLM. Importing this package imports no torch."""

from __future__ import annotations

__all__ = ["FastLLMTrainer"]


def __getattr__(name: str) -> object:
    if name == "FastLLMTrainer":
        from pipelinerl_sdk_fast_llm.trainer import FastLLMTrainer

        return FastLLMTrainer
    raise AttributeError(name)
