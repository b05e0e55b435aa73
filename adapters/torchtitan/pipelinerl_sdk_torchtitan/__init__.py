"""pipelinerl-sdk trainer backend ``torchtitan``. Importing this package imports neither torch nor torchtitan."""

from __future__ import annotations

__all__ = ["TorchTitanTrainer"]


def __getattr__(name: str) -> object:
    if name == "TorchTitanTrainer":
        from pipelinerl_sdk_torchtitan.trainer import TorchTitanTrainer

        return TorchTitanTrainer
    raise AttributeError(name)
