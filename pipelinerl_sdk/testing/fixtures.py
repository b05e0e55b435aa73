"""Pytest fixtures for adapters' tests; a conftest imports the ones it uses
(``from pipelinerl_sdk.testing.fixtures import tiny_model``)."""

from __future__ import annotations

from pathlib import Path

import pytest

__all__ = ["tiny_model"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 (hidden 128, 2 layers, head_dim 64) and its offline tokenizer, fp32, built once
    per session (``pipelinerl_sdk.reference.tiny``, seed 0: the SDK's own tests use the same)."""
    from pipelinerl_sdk.reference.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", dtype="float32", seed=0)
