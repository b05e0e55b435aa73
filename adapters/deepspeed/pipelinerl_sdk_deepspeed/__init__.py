"""pipelinerl-sdk trainer backends ``deepspeed`` and ``deepspeed-zero{1,2,3}``.

Importing this package imports neither torch nor deepspeed."""

from __future__ import annotations

__all__ = ["DeepSpeedTrainer"]


def __getattr__(name: str) -> object:
    if name == "DeepSpeedTrainer":
        from pipelinerl_sdk_deepspeed.trainer import DeepSpeedTrainer

        return DeepSpeedTrainer
    raise AttributeError(name)
