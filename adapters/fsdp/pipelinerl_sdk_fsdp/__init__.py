"""pipelinerl-sdk trainer backend ``fsdp``: torch FSDP2. Importing this package imports no torch."""

from __future__ import annotations

__all__ = ["FSDPTrainer"]


def __getattr__(name: str) -> object:
    if name == "FSDPTrainer":
        from pipelinerl_sdk_fsdp.trainer import FSDPTrainer

        return FSDPTrainer
    raise AttributeError(name)
