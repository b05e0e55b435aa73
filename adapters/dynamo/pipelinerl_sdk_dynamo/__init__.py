"""NVIDIA Dynamo 1.6 adapter for pipelinerl-sdk.

Importing this package imports no engine: Dynamo and vLLM run in the processes the backend starts
(:mod:`.worker` in each Dynamo vLLM worker, ``dynamo.frontend`` for routing).
"""

__version__ = "0.1.0"
