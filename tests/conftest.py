"""Shared fixtures: a tiny model built offline once per session, real server processes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_addoption(parser: pytest.Parser) -> None:
    # Here, not in tests/reliability/conftest.py: pytest reads options only from the conftests it
    # loads at start-up, and `pytest tests` loads that one only once it collects the directory.
    parser.addoption(
        "--reliability-backend",
        default="reference",
        metavar="NAME",
        help="the inference backend every server of tests/reliability is started with "
        "(reference, vllm, sglang: tests/reliability/conftest.py's ENGINES; default reference)",
    )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 (hidden 128, 2 layers, head_dim 64) and its offline tokenizer, fp32."""
    from pipelinerl_sdk.reference.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", dtype="float32", seed=0)


@pytest.fixture(scope="session")
def tiny_model_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipelinerl_sdk.reference.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-bf16", preset="tiny", dtype="bfloat16", seed=0)


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[object]:
    """A real reference server child process (staged receive by default), stopped by PID."""
    from pipelinerl_sdk.launch import ServerProcess

    proc = ServerProcess("reference", tiny_model, startup_timeout_s=120, options={"threads": 1})
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def trainer(tiny_model: Path) -> Iterator[object]:
    """A reference trainer on the tiny model (lr 3e-3, no clipping), closed after the module."""
    from pipelinerl_sdk.contracts import TrainerSpec
    from pipelinerl_sdk.reference.trainer import ReferenceTrainer

    t = ReferenceTrainer()
    t.init(TrainerSpec(model=str(tiny_model), lr=3e-3, grad_clip=None))
    yield t
    t.close()
