"""Random interleavings of generation, updates, bad requests and interrupted updates."""

from pipelinerl_sdk.conformance.stateful import StatefulContractTests


class TestStatefulContract(StatefulContractTests):
    pass
