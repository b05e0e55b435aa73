"""``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every process it starts
(API server, engine core, workers), so the SDK's weight-transfer engine can be created wherever
vLLM builds one. Idempotent and light: the engine module is imported only when vLLM creates it."""

from __future__ import annotations

BACKEND_NAME = "pipelinerl"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND_NAME in WeightTransferEngineFactory._registry:
        return
    WeightTransferEngineFactory.register_engine(
        BACKEND_NAME, "pipelinerl_sdk_vllm.transfer", "PipelineRLWeightTransferEngine"
    )
