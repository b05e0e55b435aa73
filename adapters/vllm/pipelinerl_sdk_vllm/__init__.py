"""vLLM 0.32 adapter for pipelinerl-sdk.

Importing this package imports no engine: vLLM is imported only when the backend is created.
"""

__version__ = "0.1.0"
