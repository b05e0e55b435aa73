"""DeepSpeed ZeRO-1/2/3 trainer backend: torch AdamW, gloo or NCCL, no JIT-built ops.

Contract (see :class:`pipelinerl_sdk.contracts.TrainerBackend`), as this backend keeps it:

- built on the trainer kit (:mod:`pipelinerl_sdk.kit.trainer`: process group, AdamW, the
  forward/backward template with its idle pass, close); DeepSpeed wraps the kit's group;
- no JIT builds: DeepSpeed's shared-memory comm op (compiled on first ``init_distributed``,
  ~90 s on CPU) is skipped so gloo does all communication (:func:`skip_shm_op_build`), and the
  optimizer is ``torch.optim.AdamW`` (not FusedAdam/CPUAdam);
- ``init``: every rank loads the HF checkpoint, then ``deepspeed.initialize`` partitions it for the
  ZeRO stage (``options["zero_stage"]``, default 3; or fixed by the backend name);
- gradients: ``managed_gradient_accumulation: false``, so ``backward`` only accumulates and each
  ``step`` is one real optimizer step on everything accumulated since the last one. DeepSpeed
  *averages* gradients over ranks; the loss is multiplied by the world size before backward so
  the step uses the gradient of the objective *summed* over ranks and micro-batches;
- ``step`` clips to exactly ``spec.grad_clip`` (DeepSpeed's ``gradient_clipping``, 0 = off; its
  default of 1.0 is never used); reports DeepSpeed's global (pre-clip) grad norm and the lr;
- ``gather_and_broadcast``: ZeRO-3 gathers one unit (a decoder layer; each parameter outside the
  layers) at a time from the ZeRO-3 partitions (``ds_tensor``, read only: the kit's
  :class:`~pipelinerl_sdk.kit.trainer.UnitGather` with :func:`zero3_shard`, through
  :func:`~pipelinerl_sdk.kit.trainer.stream_units`: the next unit in flight while this one is sent,
  except on gloo): a large param whose partitions hold no padding is all-gathered straight into
  the sender's bucket, the others with one all-gather of their partitions; extra memory within two
  layers plus one param. (DeepSpeed's own ``all_gather_coalesced`` allocates an input copy beside
  its output: 3.0 layers on gloo.) ZeRO-1/2 hold full parameters on every rank: rank 0 lends them
  (unchanged until the next ``step``).

Options (``TrainerSpec.options``): ``zero_stage`` (1, 2 or 3), ``mixed_precision`` = ``"bf16"``
(DeepSpeed's bf16 mode: bfloat16 module parameters, which are what ``param_specs`` reports and
``gather_and_broadcast`` sends, with float32 master weights in the optimizer), ``deepspeed_config``
(a dict merged over the generated config, for experts).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from pipelinerl_sdk.contracts import Into, TrainerSpec
from pipelinerl_sdk.hf import layer_units, load_model
from pipelinerl_sdk.kit.trainer import FlatShard, KitTrainer, UnitGathers, stream_units
from pipelinerl_sdk.protocol import ParamSpec
from pipelinerl_sdk.weights.tensors import dtype_name, hf_name
from pipelinerl_sdk_deepspeed.capabilities import CAPABILITIES, ZERO1, ZERO2, ZERO3

__all__ = [
    "DeepSpeedTrainer",
    "DeepSpeedZero1Trainer",
    "DeepSpeedZero2Trainer",
    "DeepSpeedZero3Trainer",
    "hf_name",
    "shm_op_builds_skipped",
    "skip_shm_op_build",
    "zero3_shard",
]

_skipped_builds = 0


def _no_shm_op() -> None:
    global _skipped_builds
    _skipped_builds += 1


def skip_shm_op_build() -> None:
    """Make DeepSpeed's ``TorchBackend`` skip the JIT build of its shared-memory comm op (it then
    uses plain torch.distributed). Idempotent. The module is looked up through ``sys.modules``:
    ``deepspeed.comm.torch`` as an attribute is shadowed by the ``torch`` package."""
    module = importlib.import_module("deepspeed.comm.torch")
    module.build_shm_op = _no_shm_op  # type: ignore[attr-defined]


def shm_op_builds_skipped() -> int:
    """How many times DeepSpeed asked for the shm comm op in this process and was refused."""
    return _skipped_builds


def zero3_shard(p: torch.Tensor) -> FlatShard | None:
    """The :class:`~pipelinerl_sdk.kit.trainer.FlatShard` of a ZeRO-3 param: its partition
    ``ds_tensor`` (the flattened param split in equal, padded parts over ``ds_process_group``),
    the values DeepSpeed's own gathers read; None for a param that is not partitioned."""
    part = getattr(p, "ds_tensor", None)
    group = getattr(p, "ds_process_group", None)
    if part is None or getattr(p, "ds_secondary_tensor", None) is not None:
        return None
    return FlatShard(part.data, part.numel(), int(p.ds_numel), p.element_size(), tuple(p.ds_shape), p.dtype, group)  # type: ignore[attr-defined]


class DeepSpeedTrainer(KitTrainer):
    """One rank of a DeepSpeed ZeRO trainer (see the module docstring for the contract).
    ``model`` is the DeepSpeed engine once ``init`` returns."""

    capabilities = CAPABILITIES
    mixed_precision_options = frozenset({None, "no", "bf16"})
    #: Fixed ZeRO stage (the ``deepspeed-zeroN`` backends); None reads ``options["zero_stage"]``.
    zero_stage: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self._stage = 3
        self._hf: torch.nn.Module | None = None

    @property
    def stage(self) -> int:
        return self._stage

    def check_spec(self, spec: TrainerSpec) -> None:
        super().check_spec(spec)
        stage = self.zero_stage if self.zero_stage is not None else int(spec.options.get("zero_stage", 3))
        if stage not in (1, 2, 3):
            raise ValueError(f"zero_stage: {stage!r} not supported (1, 2 or 3)")
        self._stage = stage

    def build_model(self, spec: TrainerSpec) -> torch.nn.Module:
        if "LOCAL_RANK" not in os.environ:  # DeepSpeed insists on it; torchrun and run_ranks set it
            os.environ["LOCAL_RANK"] = str(self.device.index if self.device.type == "cuda" else 0)
        skip_shm_op_build()
        model, _ = load_model(spec.model, dtype=spec.dtype, device=self.device)
        model.train()
        self._hf = model
        return model

    def finish_init(self, spec: TrainerSpec) -> None:
        """Wrap model and optimizer in a DeepSpeed engine for the ZeRO stage."""
        import deepspeed

        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            # backward() only accumulates; every step() is the accumulation boundary
            "managed_gradient_accumulation": False,
            "gradient_clipping": float(spec.grad_clip) if spec.grad_clip is not None else 0.0,
            "zero_optimization": {"stage": self._stage, "overlap_comm": False},
            "bf16": {"enabled": spec.options.get("mixed_precision") == "bf16"},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**62,
            "wall_clock_breakdown": False,
        }
        config.update(spec.options.get("deepspeed_config", {}))
        engine, _, _, _ = deepspeed.initialize(
            model=self.model, optimizer=self.optimizer, config=config, dist_init_required=False
        )
        self.model = engine

    def hf_module(self) -> torch.nn.Module:
        assert self._hf is not None
        return self._hf  # the engine's ``module``

    def param_specs(self) -> list[ParamSpec]:
        self._require()
        return [
            ParamSpec(name=hf_name(n), dtype=dtype_name(p.dtype), shape=tuple(getattr(p, "ds_shape", p.shape)))
            for n, p in self.hf_module().named_parameters()
        ]

    def backward_loss(self, loss: torch.Tensor) -> None:
        # DeepSpeed averages gradients over the data-parallel ranks; the contract sums them.
        self.model.backward(loss * dist.get_world_size(), scale_wrt_gas=False)

    def optimizer_step(self) -> float:
        """DeepSpeed's own step: reduce, clip (``gradient_clipping``), step, zero; its global
        pre-clip norm (NaN when it reports none)."""
        self.model.step()
        norm = self.model.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def lendable(self, tensor: torch.Tensor) -> bool:
        """ZeRO-1/2's replicated params stay unchanged until the next ``step``: lent."""
        return self._stage < 3

    def full_params(self, into: Into | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """ZeRO-1/2: the full params every rank holds (``into`` unused: they are lent). ZeRO-3:
        one unit at a time (the kit's :class:`UnitGathers` of :func:`zero3_shard`, through
        :func:`stream_units`), copied out into ``into``'s slots: extra memory within two layers."""
        module = self.hf_module()
        if self._stage < 3:
            for name, p in module.named_parameters():
                yield hf_name(name), p.detach()
            return
        units = ([(hf_name(n), p) for n, p in unit] for unit in layer_units(module))
        yield from stream_units(units, UnitGathers(zero3_shard, into))

    def release(self) -> None:
        self._hf = None
        try:
            self.model.destroy()
        except Exception:
            pass

    def destroy_group(self) -> None:
        # through DeepSpeed, so that it also drops the groups it cloned from this one (a later
        # init in this process would otherwise use a destroyed group)
        ds_comm = importlib.import_module("deepspeed.comm.comm")  # holds the live ``cdb``
        if ds_comm.cdb is not None and ds_comm.cdb.is_initialized():
            ds_comm.destroy_process_group()
        else:
            dist.destroy_process_group()


class DeepSpeedZero1Trainer(DeepSpeedTrainer):
    """ZeRO-1: optimizer states partitioned; parameters and gradients replicated."""

    capabilities = ZERO1
    zero_stage = 1


class DeepSpeedZero2Trainer(DeepSpeedTrainer):
    """ZeRO-2: optimizer states and gradients partitioned; parameters replicated."""

    capabilities = ZERO2
    zero_stage = 2


class DeepSpeedZero3Trainer(DeepSpeedTrainer):
    """ZeRO-3: parameters, gradients and optimizer states partitioned."""

    capabilities = ZERO3
    zero_stage = 3
