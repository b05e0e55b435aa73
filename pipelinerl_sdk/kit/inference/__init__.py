"""The inference kit: what every inference adapter would otherwise write out again.

- :class:`~.card.EngineCard`: what an engine declares once (name, capabilities, options, the
  engine it needs), registered by its plugin and read by its backend class;
  :func:`~.card.full_capabilities`;
- :class:`~.backend.KitBackend`: identity, options, version and group bookkeeping
  (:class:`~.book.GroupBook`), the update template;
- :func:`~.update.run_update` / :class:`~.update.UpdateSteps`: receive-and-apply in the
  contract's order (arm, accepted, the trainer's ``go``, receive, pause, apply, report), abandon
  on failure, one normalisation of update errors; :func:`~.update.local_steps` for an engine
  whose server process holds plain torch params;
- :class:`~.gate.StepGate`: the step boundary of a Python-loop engine (hold/release, the
  version of each step);
- :mod:`~.chat`: chat preparation (template, context check with typed errors) and response
  assembly (version spans to per-token versions);
- :mod:`~.serve`: serving the SDK's app or an engine-owned FastAPI app (router, error handlers,
  port 0, lifespan, SIGTERM, ready file).

Submodules import what they need lazily enough that ``import pipelinerl_sdk.kit.inference``
imports no torch and no engine; :mod:`~.serve` imports FastAPI.
"""

from pipelinerl_sdk.kit.inference.backend import KitBackend
from pipelinerl_sdk.kit.inference.book import GroupBook
from pipelinerl_sdk.kit.inference.card import EngineCard, full_capabilities
from pipelinerl_sdk.kit.inference.chat import (
    ChatPlan,
    assemble_choice,
    assemble_response,
    plan_chat,
    prepare_chat,
    versions_from_spans,
)
from pipelinerl_sdk.kit.inference.gate import PauseHandle, StepGate
from pipelinerl_sdk.kit.inference.update import UpdateSteps, local_steps, normalise_update_error, run_update

__all__ = [
    "ChatPlan",
    "EngineCard",
    "GroupBook",
    "KitBackend",
    "PauseHandle",
    "StepGate",
    "UpdateSteps",
    "assemble_choice",
    "assemble_response",
    "full_capabilities",
    "local_steps",
    "normalise_update_error",
    "plan_chat",
    "prepare_chat",
    "run_update",
    "versions_from_spans",
]
