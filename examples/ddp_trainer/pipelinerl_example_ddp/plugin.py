"""Entry point: registers the ``ddp-example`` trainer by dotted path (imports no torch)."""

from __future__ import annotations

from pipelinerl_sdk import BackendRegistry, TrainerCapabilities, hookimpl

CAPABILITIES = TrainerCapabilities(
    sharded=False, max_world_size=None, group_backends=frozenset({"gloo", "nccl"}), dtypes=frozenset({"float32"})
)


@hookimpl
def register_backends(registry: BackendRegistry) -> None:
    registry.register_trainer_backend(
        "ddp-example",
        "pipelinerl_example_ddp.trainer:DDPTrainer",
        CAPABILITIES,
        "example: torch DDP on the trainer kit",
    )
