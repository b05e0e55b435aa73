"""Capabilities of the DeepSpeed trainers (no torch import: the plugin module reads these).

Only float32 parameters are declared: bf16 is a mixed-precision *option* (``mixed_precision``)."""

from __future__ import annotations

from pipelinerl_sdk.contracts import TrainerCapabilities

_COMMON: dict[str, object] = {
    "max_world_size": None,
    "group_backends": frozenset({"gloo", "nccl"}),
    "dtypes": frozenset({"float32"}),
}
ZERO1 = TrainerCapabilities(sharded=False, **_COMMON)  # type: ignore[arg-type]
ZERO2 = TrainerCapabilities(sharded=False, **_COMMON)  # type: ignore[arg-type]
ZERO3 = TrainerCapabilities(sharded=True, **_COMMON)  # type: ignore[arg-type]
#: ``deepspeed`` (stage from ``options["zero_stage"]``) declares its default stage, 3.
CAPABILITIES = ZERO3
