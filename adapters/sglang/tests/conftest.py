"""Fixtures of the SGLang adapter's tests, run from ``adapters/sglang`` (``pytest tests``) in the
environment ``scripts/setup-sglang`` prints: the SDK's tiny model, built offline once per session."""

from __future__ import annotations

import os

from pipelinerl_sdk.testing.fixtures import tiny_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

__all__ = ["tiny_model"]
