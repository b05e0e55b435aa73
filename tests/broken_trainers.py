"""Deliberately broken trainer backends: the trainer conformance checks must report each of them.

A test-only plugin, never installed: load it with ``PIPELINERL_EXTRA_PLUGINS=tests.broken_trainers``
(and the repository root on ``PYTHONPATH``); then ``pytest conformance/test_trainer.py
--backend=broken-...`` finds these backends, in the suite's process and in the ranks it spawns.

Each backend is the reference trainer wrong in exactly ONE way; its docstring names the standard
check that must catch it (:data:`CAUGHT_BY`). ``tests/test_conformance_catches_broken_trainers.py``
runs that check against each backend and asserts it fails with a message naming the problem.

Importing this module imports torch (the classes subclass the reference trainer); the plugin hook
itself registers dotted paths only.
"""

from __future__ import annotations

import dataclasses

import torch

from pipelinerl_sdk.contracts import StepMetrics, WeightSink
from pipelinerl_sdk.plugins import BackendRegistry, hookimpl
from pipelinerl_sdk.reference.capabilities import TRAINER
from pipelinerl_sdk.reference.trainer import ReferenceTrainer


class _StripModelPrefix:
    def __init__(self, inner: WeightSink) -> None:
        self.inner = inner

    def send(self, name: str, tensor: torch.Tensor) -> None:
        self.inner.send(name.removeprefix("model."), tensor)


class WrongNamesTrainer(ReferenceTrainer):
    """Gathers under the names of the inner ``Qwen2Model`` (``model.`` prefix stripped: the classic
    bug of gathering from ``model.model`` or a wrapped module), while ``param_specs()`` still reports
    HF names. Caught by ``test_gather_yields_hf_names_in_param_specs_order`` (and by
    ``test_init_loads_the_checkpoint_exactly``: the names are not the checkpoint's)."""

    def gather_and_broadcast(self, sink: WeightSink | None) -> None:
        super().gather_and_broadcast(_StripModelPrefix(sink) if sink is not None else None)


class DivergingStepTrainer(ReferenceTrainer):
    """Steps with twice the spec's learning rate but reports the spec's: it trains, the loss goes
    down, nothing looks wrong until the weights are compared. Caught by
    ``test_step_equals_plain_adamw``."""

    def step(self) -> StepMetrics:
        _, optimizer, spec = self._require()
        for group in optimizer.param_groups:
            group["lr"] = 2 * spec.lr
        try:
            metrics = super().step()
        finally:
            for group in optimizer.param_groups:
                group["lr"] = spec.lr
        return dataclasses.replace(metrics, lr=spec.lr)


class LocalGradsTrainer(ReferenceTrainer):
    """Never reduces gradients across ranks: each rank steps on its own micro-batch's gradient (a
    forgotten all-reduce, or a DDP wrapper bypassed). Identical to the reference at world size 1.
    Caught by ``test_world_size_2_step_equals_world_size_1``."""

    @property
    def world_size(self) -> int:
        return 1


class WholeModelGatherTrainer(ReferenceTrainer):
    """Gathers the whole model first (a full state dict copy, the easy way to "gather then
    broadcast") and only then hands the tensors over: right names, right values, and a peak of a
    whole model instead of one layer. Caught by ``test_gather_peak_memory_is_one_layer``."""

    def gather_and_broadcast(self, sink: WeightSink | None) -> None:
        full = {name: p.detach().clone() for name, p in self._require()[0].named_parameters()}
        if sink is not None:
            for name, tensor in full.items():
                sink.send(name, tensor)


#: Backend -> (the check that must fail, text its failure message must contain).
CAUGHT_BY: dict[str, tuple[str, str]] = {
    "broken-wrong-names": (
        "test_gather_yields_hf_names_in_param_specs_order",
        "gather_and_broadcast order/names differ from param_specs(): first difference at #0: "
        "sent 'embed_tokens.weight', spec 'model.embed_tokens.weight'",
    ),
    "broken-diverging-step": (
        "test_step_equals_plain_adamw",
        "params after two steps vs torch AdamW: max |diff|",
    ),
    "broken-local-grads": (
        "test_world_size_2_step_equals_world_size_1",
        "world size 2 vs world size 1 after one step: max |diff|",
    ),
    "broken-whole-model-gather": (
        "test_gather_peak_memory_is_one_layer",
        "the gather holds more than one layer at a time",
    ),
}

_FACTORIES = {
    "broken-wrong-names": (WrongNamesTrainer, "gathers under names without the 'model.' prefix"),
    "broken-diverging-step": (DivergingStepTrainer, "AdamW at twice the spec's lr (reports the spec's)"),
    "broken-local-grads": (LocalGradsTrainer, "no gradient all-reduce across ranks"),
    "broken-whole-model-gather": (WholeModelGatherTrainer, "copies the whole model before sending any of it"),
}


@hookimpl
def register_backends(registry: BackendRegistry) -> None:
    for name, (cls, description) in _FACTORIES.items():
        registry.register_trainer_backend(
            name, f"{__name__}:{cls.__name__}", TRAINER, f"BROKEN on purpose: {description}"
        )
