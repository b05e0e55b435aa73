"""The conformance suite: standard checks any backend must pass.

Run it from this repository with ``pytest conformance --backend=NAME``, or from any project that
installs the SDK by subclassing the standard test classes (see ``conformance/README.md``)::

    from pipelinerl_sdk.conformance.inference import InferenceContractTests

    class TestMyEngine(InferenceContractTests):
        pass

The pytest plugin (``pipelinerl_sdk.conformance.plugin``, entry point ``pytest11``) adds
``--backend`` and the fixtures; importing this package imports nothing heavy.
"""
