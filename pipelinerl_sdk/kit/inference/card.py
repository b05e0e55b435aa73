"""An inference engine's card: what its adapter declares about itself, written once.

The plugin module registers the card (:meth:`EngineCard.register`) and the backend class reads
it (``card = CARD`` on a :class:`~pipelinerl_sdk.kit.inference.backend.KitBackend`: its name,
capabilities, ``--option`` names and the engine it needs), so registration and class cannot
disagree. Imports no torch and no engine: plugin modules import it when backends are listed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from pipelinerl_sdk.contracts import InferenceCapabilities
from pipelinerl_sdk.protocol import ReceiveMode

__all__ = ["EngineCard", "full_capabilities"]


class _Registry(Protocol):
    def register_inference_backend(
        self,
        name: str,
        factory: str,
        capabilities: InferenceCapabilities,
        description: str,
        *,
        bench_anchor: str | None,
    ) -> None: ...


def full_capabilities(*receive_modes: ReceiveMode) -> InferenceCapabilities:
    """The capabilities of an engine that serves the whole protocol: gloo and NCCL groups,
    in-flight updates, prompt and top logprobs, float32 and bfloat16, stop strings, ``min_tokens``, ``logit_bias``,
    the penalties, ``top_k`` and ``min_p``, and per-request seeds; only the ``receive_modes``
    (``direct``, ``staged``) differ between such engines. Declare less where the engine does less
    (``dataclasses.replace``)."""
    return InferenceCapabilities(
        receive_modes=frozenset(receive_modes),
        group_backends=frozenset({"gloo", "nccl"}),
        prompt_logprobs=True,
        top_logprobs=True,
        stop_strings=True,
        min_tokens=True,
        logit_bias=True,
        penalties=True,
        sampling_filters=True,
        seeds=True,
    )


@dataclass(frozen=True)
class EngineCard:
    """One inference backend, declared once.

    ``factory``: ``"module:Class"`` of the backend, imported only when a server creates it.
    ``options``: the ``--option`` names and their help (the backend refuses any other).
    ``engine``: ``(import name, what is needed and how to install it)``: a backend created where
    that module cannot be found raises PluginError "the NAME backend needs ..." before loading
    anything. ``bench_anchor``: ``"module:attr"`` of the engine's own update flow
    (:mod:`pipelinerl_sdk.bench.anchor`), or None."""

    name: str
    factory: str
    capabilities: InferenceCapabilities
    description: str
    options: Mapping[str, str] = field(default_factory=dict)
    engine: tuple[str, str] | None = None
    bench_anchor: str | None = None

    def register(self, registry: _Registry) -> None:
        """Register this backend (call it from the plugin's ``register_backends``)."""
        registry.register_inference_backend(
            self.name, self.factory, self.capabilities, self.description, bench_anchor=self.bench_anchor
        )
