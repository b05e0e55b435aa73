"""The trainer contract, on every trainer backend selected with --backend."""

from pipelinerl_sdk.conformance.trainer import TrainerContractTests


class TestTrainerContract(TrainerContractTests):
    pass
