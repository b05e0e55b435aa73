"""Fixtures of the Fast-LLM adapter's tests: tiny Qwen2 and Llama checkpoints built offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest.importorskip("fast_llm", reason="Fast-LLM is not installed: run these tests in scripts/setup-fast-llm's env")
pytest.importorskip("pipelinerl_sdk_fast_llm", reason="adapters/fast_llm is not installed")


@pytest.fixture(scope="session")
def qwen2_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SDK's tiny Qwen2 (hidden 128, 2 layers, q/k/v biases), fp32."""
    from pipelinerl_sdk.reference.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "qwen2", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def llama_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same sizes as a Llama (no biases), fp32."""
    from pipelinerl_sdk.reference.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "llama", preset="tiny", seed=1, arch="llama")
