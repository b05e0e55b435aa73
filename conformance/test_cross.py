"""Trainer and inference server together (the central check), on the backends selected with
--backend. A module of its own: the update it makes changes the served weights."""

from pipelinerl_sdk.conformance.cross import CrossCheckTests


class TestCrossCheck(CrossCheckTests):
    pass
