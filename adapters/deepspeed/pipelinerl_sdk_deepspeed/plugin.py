"""Entry point of the DeepSpeed trainer backends. Thin: imports neither torch nor deepspeed.

``deepspeed`` takes the ZeRO stage from ``TrainerSpec.options["zero_stage"]`` (default 3);
``deepspeed-zero1``/``-zero2``/``-zero3`` fix it, so a suite can select each stage by name."""

from __future__ import annotations

from pipelinerl_sdk.plugins import BackendRegistry, hookimpl
from pipelinerl_sdk_deepspeed.capabilities import CAPABILITIES, ZERO1, ZERO2, ZERO3

_MODULE = "pipelinerl_sdk_deepspeed.trainer"


@hookimpl
def register_backends(registry: BackendRegistry) -> None:
    registry.register_trainer_backend(
        "deepspeed",
        f"{_MODULE}:DeepSpeedTrainer",
        CAPABILITIES,
        "DeepSpeed ZeRO (stage from options.zero_stage, default 3), torch AdamW, no JIT-built ops",
    )
    for stage, caps in ((1, ZERO1), (2, ZERO2), (3, ZERO3)):
        registry.register_trainer_backend(
            f"deepspeed-zero{stage}",
            f"{_MODULE}:DeepSpeedZero{stage}Trainer",
            caps,
            f"DeepSpeed ZeRO-{stage}, torch AdamW, no JIT-built ops",
        )
