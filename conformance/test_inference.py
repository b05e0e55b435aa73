"""The inference contract, on every inference backend selected with --backend."""

from pipelinerl_sdk.conformance.inference import InferenceContractTests


class TestInferenceContract(InferenceContractTests):
    pass
