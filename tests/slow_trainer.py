"""A test-only trainer plugin: the reference trainer, slowed down (a trainer that cannot keep up
with generation is what the lag bound is for). Loaded through PIPELINERL_EXTRA_PLUGINS."""

from __future__ import annotations

import time

from pipelinerl_sdk.contracts import StepMetrics
from pipelinerl_sdk.plugins import BackendRegistry, hookimpl
from pipelinerl_sdk.reference import capabilities
from pipelinerl_sdk.reference.trainer import ReferenceTrainer

STEP_DELAY_S = 0.6


class SlowTrainer(ReferenceTrainer):
    def step(self) -> StepMetrics:
        time.sleep(STEP_DELAY_S)
        return super().step()


@hookimpl
def register_backends(registry: BackendRegistry) -> None:
    registry.register_trainer_backend("slow-reference", "tests.slow_trainer:SlowTrainer", capabilities.TRAINER)
