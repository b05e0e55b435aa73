"""pipelinerl-sdk: asynchronous RL with in-flight weight updates, for any inference engine and
any trainer.

Importing this package imports neither torch nor any engine. The public API:

- contracts: :class:`InferenceBackend`, :class:`TrainerBackend` and their capabilities;
- wire types: :mod:`pipelinerl_sdk.protocol`;
- plugins: :func:`load_registry`, :data:`hookimpl`;
- the weight-sync protocol (imports torch): :mod:`pipelinerl_sdk.weights`;
- the HTTP client (``pipelinerl_sdk.http.client.InferenceClient``) and router.
"""

from pipelinerl_sdk.contracts import (
    InferenceBackend,
    InferenceCapabilities,
    Objective,
    ServeConfig,
    StepMetrics,
    TokenBatch,
    TrainerBackend,
    TrainerCapabilities,
    TrainerSpec,
    UpdateReport,
    WeightSink,
    lend,
)
from pipelinerl_sdk.errors import (
    FanOutError,
    GroupError,
    PipelineRLError,
    PluginError,
    ServerError,
    UpdateAborted,
    UpdateFailed,
    UpdateRejected,
)
from pipelinerl_sdk.plugins import BackendRegistry, hookimpl, load_registry
from pipelinerl_sdk.protocol import ParamSpec, WeightUpdateRequest

__version__ = "0.1.0"

__all__ = [
    "BackendRegistry",
    "FanOutError",
    "GroupError",
    "InferenceBackend",
    "InferenceCapabilities",
    "Objective",
    "ParamSpec",
    "PipelineRLError",
    "PluginError",
    "ServeConfig",
    "ServerError",
    "StepMetrics",
    "TokenBatch",
    "TrainerBackend",
    "TrainerCapabilities",
    "TrainerSpec",
    "UpdateAborted",
    "UpdateFailed",
    "UpdateRejected",
    "UpdateReport",
    "WeightSink",
    "WeightUpdateRequest",
    "__version__",
    "hookimpl",
    "lend",
    "load_registry",
]
