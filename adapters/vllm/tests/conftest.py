"""Fixtures of the vLLM adapter's tests, run from ``adapters/vllm`` (``pytest tests``) in the
environment ``scripts/setup-vllm`` prints: the SDK's tiny model, built offline once per session."""

from __future__ import annotations

import os

from pipelinerl_sdk.testing.fixtures import tiny_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

__all__ = ["tiny_model"]
