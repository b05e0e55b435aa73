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
from collections.abc import Sequence

import torch
import torch.distributed as dist

from pipelinerl_sdk.contracts import StepMetrics, TrainerSpec, WeightSink, lend
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
    whole model instead of two layers. Caught by ``test_gather_peak_memory_is_two_layers``."""

    def gather_and_broadcast(self, sink: WeightSink | None) -> None:
        full = {name: p.detach().clone() for name, p in self._require()[0].named_parameters()}
        if sink is not None:
            for name, tensor in full.items():
                sink.send(name, tensor)


class IgnoresClipTrainer(ReferenceTrainer):
    """Never clips (``grad_clip`` read as None: a config key lost on the way to the optimizer);
    reports the true pre-clip norm. Caught by ``test_clipped_steps_equal_adamw_with_clip_grad_norm``."""

    def clip_gradients(self, params: Sequence[torch.nn.Parameter], max_norm: float | None) -> float:
        return super().clip_gradients(params, None)


def _norm(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The total 2-norm as ``clip_grad_norm_`` computes it (norm of the per-tensor norms)."""
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in pieces]))


class _Step(ReferenceTrainer):
    """The reference step spelled out on the kit's hooks (reduce, then clip), with the hooks the
    distributed twins below get wrong."""

    def _reduce(self, flat: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the gradient this rank steps on, the global sum it clips by)."""
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        return flat, flat

    def _clip_norm(self, local: list[torch.Tensor], total: list[torch.Tensor]) -> torch.Tensor:
        return _norm(total)

    def reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        sizes = [p.numel() for p in params]
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        use, total = self._reduce(flat.clone(), self.steps + 1) if self.world_size > 1 else (flat, flat)
        self._pieces = (list(flat.split(sizes)), list(total.split(sizes)))
        for p, g in zip(params, use.split(sizes), strict=True):
            p.grad = g.view_as(p).clone()

    def clip_gradients(self, params: Sequence[torch.nn.Parameter], max_norm: float | None) -> float:
        local, total = self._pieces
        norm = self._clip_norm(local, total)
        if max_norm is not None:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in params:
                p.grad.mul_(coef)  # type: ignore[union-attr]
        return float(norm)


class LocalClipTrainer(_Step):
    """Reduces the gradients but clips with the rank's *local* gradient norm (computed before the
    all-reduce, as a per-rank clipping hook would) and reports it. Identical to the reference at
    world size 1. Caught by ``test_world_size_2_step_equals_world_size_1``."""

    def _clip_norm(self, local: list[torch.Tensor], total: list[torch.Tensor]) -> torch.Tensor:
        return _norm(local)


class AveragingTrainer(_Step):
    """Averages gradients across ranks (DDP's default) where the Objective contract says sum: at
    world size 2 every gradient is halved. Caught by ``test_world_size_2_step_equals_world_size_1``."""

    def _reduce(self, flat: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= dist.get_world_size()
        return flat, flat


class DriftingRankTrainer(_Step):
    """Rank 1 takes part in the all-reduce of step 3 but steps on its own local gradient (a
    reduce into a copy it then drops), while clipping with and reporting the global norm: rank 0
    is exact and every reported norm true, only rank 1's weights drift (the check's last step:
    from then on rank 1 would also corrupt the summed gradients). Caught by
    ``test_world_size_2_step_equals_world_size_1`` (rank 1's forward vs rank 0's)."""

    def _reduce(self, flat: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        reduced = flat.clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
        return (flat if step == 3 and dist.get_rank() == 1 else reduced), reduced


BF16_ONLY = dataclasses.replace(TRAINER, dtypes=frozenset({"bfloat16"}))


class Bf16OnlyTrainer(ReferenceTrainer):
    """NOT broken: the reference trainer declaring bfloat16 only, so every trainer check runs in
    bfloat16 (the control of :class:`Bf16DivergingStepTrainer`)."""

    capabilities = BF16_ONLY


class WorldSize1Trainer(ReferenceTrainer):
    """NOT broken: the reference trainer declaring ``max_world_size=1``: its world-size-2 checks
    are skipped for a requirement a loop does not need, so it reaches ``loop``, not ``full``."""

    capabilities = dataclasses.replace(TRAINER, max_world_size=1)


class Bf16DivergingStepTrainer(DivergingStepTrainer):
    """A bfloat16-only trainer stepping at twice the spec's lr (reports the spec's). Caught by
    ``test_step_equals_plain_adamw`` run in bfloat16."""

    capabilities = BF16_ONLY


class Bf16PathDivergingTrainer(DivergingStepTrainer):
    """Declares float32 and bfloat16 and is right in float32, but its bfloat16 path steps at twice
    the spec's lr (reports the spec's): a separate low-precision optimizer setup. A suite that checks
    only the preferred dtype passes it. Caught by ``test_step_equals_plain_adamw`` run in
    bfloat16."""

    def step(self) -> StepMetrics:
        if self._require()[2].dtype == "bfloat16":
            return super().step()  # the bug: DivergingStepTrainer's double lr
        return ReferenceTrainer.step(self)


class _Upcast:
    def __init__(self, inner: WeightSink) -> None:
        self.inner = inner

    def send(self, name: str, tensor: torch.Tensor) -> None:
        self.inner.send(name, tensor.float())


class Bf16GathersFloat32Trainer(ReferenceTrainer):
    """Declares float32 and bfloat16; in bfloat16 it gathers float32 copies (a trainer that
    broadcasts its float32 master weights) while ``param_specs()`` says bfloat16. Caught by
    ``test_init_loads_the_checkpoint_exactly`` run in bfloat16."""

    def gather_and_broadcast(self, sink: WeightSink | None) -> None:
        upcast = sink is not None and self._require()[2].dtype == "bfloat16"
        super().gather_and_broadcast(_Upcast(sink) if upcast and sink is not None else sink)  # the bug


class StaleLendTrainer(ReferenceTrainer):
    """The zero-copy path is stale: a sink that can ``lend`` (the SDK's sender, what the pipeline
    hands ``gather_and_broadcast``) is lent a snapshot of the weights taken at ``init``; any other
    sink is sent the live params. Every trainer check passes (their sinks have no ``lend``); the
    loop publishes the initial weights forever. Caught by ``test_trained_weights_reach_the_server``
    because the cross check publishes through the pipeline's own function."""

    def init(self, spec: TrainerSpec) -> None:
        super().init(spec)
        self._snapshot = {n: p.detach().clone() for n, p in self._require()[0].named_parameters()}

    def gather_and_broadcast(self, sink: WeightSink | None) -> None:
        if sink is None or not callable(getattr(sink, "lend", None)):
            super().gather_and_broadcast(sink)
            return
        for name, tensor in self._snapshot.items():
            lend(sink, name, tensor)


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
        "rank 0 of 2, step 1 vs the summed gradient: reported grad norm",
    ),
    "broken-whole-model-gather": (
        "test_gather_peak_memory_is_two_layers",
        "the gather holds more than two layers at a time",
    ),
    "broken-ignores-clip": (
        "test_clipped_steps_equal_adamw_with_clip_grad_norm",
        "params after 3 clipped steps",
    ),
    "broken-local-clip": (
        "test_world_size_2_step_equals_world_size_1",
        "rank 0 of 2, step 1 vs the summed gradient: reported grad norm",
    ),
    "broken-averages-grads": (
        "test_world_size_2_step_equals_world_size_1",
        "rank 0 of 2, step 1 vs the summed gradient: reported grad norm",
    ),
    "broken-drifting-rank": (
        "test_world_size_2_step_equals_world_size_1",
        "rank 1 of 2 after 3 steps: forward vs rank 0",
    ),
    "broken-bf16-diverging-step": (
        "test_step_equals_plain_adamw",
        "params after two steps vs torch AdamW",
    ),
    "broken-bf16-path-diverges": (
        "test_step_equals_plain_adamw",
        "of the step (> 0.15, bfloat16)",
    ),
    "broken-bf16-gathers-float32": (
        "test_init_loads_the_checkpoint_exactly",
        "gathered as torch.float32, spec dtype is bfloat16",
    ),
}
#: Backends that must PASS the checks of :data:`CAUGHT_BY` (controls of the twins above).
CONTROLS = ("reference", "bf16-only", "ws1-only")
#: Broken trainers caught by the cross check (a trainer and the reference server), not by the
#: trainer checks: backend -> (check, message).
CAUGHT_BY_CROSS: dict[str, tuple[str, str]] = {
    "broken-stale-lend": (
        "test_trained_weights_reach_the_server",
        "server and trainer disagree after the update",
    ),
}

_FACTORIES = {
    "broken-wrong-names": (WrongNamesTrainer, "gathers under names without the 'model.' prefix"),
    "broken-diverging-step": (DivergingStepTrainer, "AdamW at twice the spec's lr (reports the spec's)"),
    "broken-local-grads": (LocalGradsTrainer, "no gradient all-reduce across ranks"),
    "broken-whole-model-gather": (WholeModelGatherTrainer, "copies the whole model before sending any of it"),
    "broken-ignores-clip": (IgnoresClipTrainer, "never clips gradients"),
    "broken-local-clip": (LocalClipTrainer, "clips with the rank-local gradient norm"),
    "broken-averages-grads": (AveragingTrainer, "averages gradients across ranks instead of summing"),
    "broken-drifting-rank": (DriftingRankTrainer, "rank 1 steps on its local gradient at step 3"),
    "broken-bf16-diverging-step": (Bf16DivergingStepTrainer, "bfloat16 only, AdamW at twice the spec's lr"),
    "broken-bf16-path-diverges": (Bf16PathDivergingTrainer, "right in float32, twice the lr in bfloat16"),
    "broken-bf16-gathers-float32": (Bf16GathersFloat32Trainer, "gathers float32 copies when bfloat16"),
    "broken-stale-lend": (StaleLendTrainer, "lends the weights of init to a zero-copy sink"),
    "bf16-only": (Bf16OnlyTrainer, "NOT broken: the reference trainer, bfloat16 only"),
    "ws1-only": (WorldSize1Trainer, "NOT broken: the reference trainer, max_world_size=1"),
}


@hookimpl
def register_backends(registry: BackendRegistry) -> None:
    for name, (cls, description) in _FACTORIES.items():
        label = description if name in CONTROLS else f"BROKEN on purpose: {description}"
        registry.register_trainer_backend(name, f"{__name__}:{cls.__name__}", cls.capabilities, label)
