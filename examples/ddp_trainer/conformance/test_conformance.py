"""The SDK's conformance suite on this adapter: `pytest conformance --backend=ddp-example`
(add `--backend=reference` for the cross check against the SDK's reference server)."""

from pipelinerl_sdk.conformance.cross import CrossCheckTests
from pipelinerl_sdk.conformance.trainer import TrainerContractTests


class TestTrainer(TrainerContractTests): ...


class TestCross(CrossCheckTests): ...
