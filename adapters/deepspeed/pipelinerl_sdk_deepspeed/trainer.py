"""DeepSpeed ZeRO-1/2/3 trainer backend: torch AdamW, gloo or NCCL, no JIT-built ops.

Contract (see :class:`pipelinerl_sdk.contracts.TrainerBackend`), as this backend keeps it:

- runs in the default ``torch.distributed`` group the launcher initialised (``run_ranks`` or
  ``torchrun``); DeepSpeed wraps that group. With no group at all, ``init`` creates a private
  1-rank gloo group and ``close`` destroys it;
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
- ``gather_and_broadcast``: ZeRO-3 enters ``GatheredParameters`` per decoder layer (and per
  parameter outside the layers) on every rank: extra memory is one layer. ZeRO-1/2 hold full
  parameters on every rank: rank 0 sends them directly.

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

from pipelinerl_sdk.contracts import (
    Objective,
    StepMetrics,
    TokenBatch,
    TrainerBackend,
    TrainerSpec,
    WeightSink,
)
from pipelinerl_sdk.protocol import ParamSpec
from pipelinerl_sdk.reference.tiny import load_model
from pipelinerl_sdk.reference.trainer import token_logprobs
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


def _units(model: torch.nn.Module) -> Iterator[list[tuple[str, torch.nn.Parameter]]]:
    """``named_parameters()`` in order, grouped: consecutive params of one decoder layer (a class
    in HF's ``_no_split_modules``) form one unit; every other param is a unit of its own."""
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    owner: dict[int, str] = {}
    for mname, module in model.named_modules():
        if type(module).__name__ in kinds:
            for p in module.parameters():
                owner.setdefault(id(p), mname)
    unit: list[tuple[str, torch.nn.Parameter]] = []
    current: str | None = None
    for name, p in model.named_parameters():
        key = owner.get(id(p))
        if unit and (key is None or key != current):
            yield unit
            unit = []
        unit.append((name, p))
        current = key
    if unit:
        yield unit


class DeepSpeedTrainer(TrainerBackend):
    """One rank of a DeepSpeed ZeRO trainer (see the module docstring for the contract)."""

    capabilities = CAPABILITIES
    #: Fixed ZeRO stage (the ``deepspeed-zeroN`` backends); None reads ``options["zero_stage"]``.
    zero_stage: int | None = None

    def __init__(self) -> None:
        self.engine: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._spec: TrainerSpec | None = None
        self._stage = 3
        self._steps = 0
        self._pad_id = 0
        self._own_group = False
        self._device = torch.device("cpu")

    def _require(self) -> tuple[Any, torch.optim.Optimizer, TrainerSpec]:
        if self.engine is None or self.optimizer is None or self._spec is None:
            raise RuntimeError("call init() first")
        return self.engine, self.optimizer, self._spec

    @property
    def stage(self) -> int:
        return self._stage

    def init(self, spec: TrainerSpec) -> None:
        if spec.dtype not in self.capabilities.dtypes:
            raise ValueError(f"dtype: {spec.dtype!r} not supported (supported: {sorted(self.capabilities.dtypes)})")
        stage = self.zero_stage if self.zero_stage is not None else int(spec.options.get("zero_stage", 3))
        if stage not in (1, 2, 3):
            raise ValueError(f"zero_stage: {stage!r} not supported (1, 2 or 3)")
        mp = spec.options.get("mixed_precision")
        if mp not in (None, "no", "bf16"):
            raise ValueError(f"options.mixed_precision: {mp!r} not supported (use 'bf16' or leave unset)")
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
            self._own_group = True
        if dist.get_backend() == "nccl":
            self._device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
            torch.cuda.set_device(self._device)
        if "LOCAL_RANK" not in os.environ:  # DeepSpeed insists on it; torchrun and run_ranks set it
            local = self._device.index if self._device.type == "cuda" else 0
            os.environ["LOCAL_RANK"] = str(local)
        skip_shm_op_build()
        import deepspeed

        torch.manual_seed(spec.seed)
        model, tokenizer = load_model(spec.model, dtype=spec.dtype, device=self._device)
        model.train()
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=spec.lr,
            betas=spec.betas,
            eps=spec.eps,
            weight_decay=spec.weight_decay,
            foreach=False,
        )
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            # backward() only accumulates; every step() is the accumulation boundary
            "managed_gradient_accumulation": False,
            "gradient_clipping": float(spec.grad_clip) if spec.grad_clip is not None else 0.0,
            "zero_optimization": {"stage": stage, "overlap_comm": False},
            "bf16": {"enabled": mp == "bf16"},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**62,
            "wall_clock_breakdown": False,
        }
        config.update(spec.options.get("deepspeed_config", {}))
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config, dist_init_required=False
        )
        del ds_optimizer
        self.engine, self.optimizer, self._spec, self._stage, self._steps = engine, optimizer, spec, stage, 0

    # -- contract --------------------------------------------------------------------------------

    def param_specs(self) -> list[ParamSpec]:
        engine, _, _ = self._require()
        return [
            ParamSpec(name=hf_name(n), dtype=dtype_name(p.dtype), shape=tuple(getattr(p, "ds_shape", p.shape)))
            for n, p in engine.module.named_parameters()
        ]

    def _idle_pass(self, engine: Any, backward: bool) -> None:
        """Take part in the collectives of a forward (and backward) with no sequences of our own."""
        out = engine(input_ids=torch.tensor([[self._pad_id]], device=self._device), use_cache=False).logits
        if backward:
            engine.backward(out.float().sum() * 0.0, scale_wrt_gas=False)

    def forward(self, batch: TokenBatch) -> list[torch.Tensor]:
        engine, _, _ = self._require()
        with torch.no_grad():
            if len(batch) == 0:
                self._idle_pass(engine, backward=False)
                return []
            return [t.detach().float().cpu() for t in token_logprobs(engine, batch.input_ids, self._pad_id)]

    def backward(self, batch: TokenBatch, objective: Objective) -> dict[str, float]:
        engine, _, _ = self._require()
        if len(batch) == 0:
            self._idle_pass(engine, backward=True)
            return {"loss": 0.0}
        logprobs = token_logprobs(engine, batch.input_ids, self._pad_id)
        loss, metrics = objective(logprobs, batch)
        # DeepSpeed averages gradients over the data-parallel ranks; the contract sums them.
        engine.backward(loss * dist.get_world_size(), scale_wrt_gas=False)
        return {"loss": float(loss.detach()), **metrics}

    def step(self) -> StepMetrics:
        engine, optimizer, _ = self._require()
        engine.step()
        norm = engine.get_global_grad_norm()
        self._steps += 1
        return StepMetrics(
            step=self._steps,
            grad_norm=float(norm) if norm is not None else float("nan"),
            lr=float(optimizer.param_groups[0]["lr"]),
        )

    def gather_and_broadcast(self, sink: WeightSink | None) -> None:
        engine, _, _ = self._require()
        with torch.no_grad():
            if self._stage < 3:
                if sink is not None:
                    for name, p in engine.module.named_parameters():
                        sink.send(hf_name(name), p.detach())
                return
            import deepspeed

            for unit in _units(engine.module):
                with deepspeed.zero.GatheredParameters([p for _, p in unit], modifier_rank=None):
                    if sink is not None:
                        for name, p in unit:
                            sink.send(hf_name(name), p.detach())

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """Full parameters under HF names on every rank (a collective; for tests and checkpoints)."""
        out: dict[str, torch.Tensor] = {}

        class _Keep:
            def send(self, name: str, tensor: torch.Tensor) -> None:
                out[name] = tensor.detach().clone().cpu()

        self.gather_and_broadcast(_Keep())
        return out

    def close(self) -> None:
        if self.engine is not None:
            try:
                self.engine.destroy()
            except Exception:
                pass
        self.engine = None
        self.optimizer = None
        if self._own_group and dist.is_initialized():
            # through DeepSpeed, so that it also drops the groups it cloned from this one (a later
            # init in this process would otherwise use a destroyed group)
            ds_comm = importlib.import_module("deepspeed.comm.comm")  # holds the live ``cdb``

            if ds_comm.cdb is not None and ds_comm.cdb.is_initialized():
                ds_comm.destroy_process_group()
            else:
                dist.destroy_process_group()
        self._own_group = False


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
