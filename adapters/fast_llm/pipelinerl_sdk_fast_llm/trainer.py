"""Fast-LLM trainer backend: Fast-LLM's GPT model, HF converters, ZeRO stages, schedule runner and AdamW.

Contract (see :class:`pipelinerl_sdk.contracts.TrainerBackend`), as this backend keeps it:

- ``init``: every rank builds Fast-LLM's ``GPTModel`` from the HF checkpoint through Fast-LLM's own
  converter for its ``model_type`` (``qwen2``, ``llama``, ``mistral``), sets it up on Fast-LLM's
  ``Distributed`` (its own process groups: gloo on CPU, NCCL on GPU, rendezvous on a fresh port handed
  out over the launcher's default group), loads the weights (each rank its shard), and builds Fast-LLM's
  ``Optimizer`` (its fused AdamW) with the spec's lr, betas, eps and weight decay. The contract's AdamW
  decays every parameter, as ``torch.optim.AdamW`` with one group does; Fast-LLM by default exempts
  norms and biases, so the adapter sets every param group to the spec's decay
  (``options["fast_llm_decay_exemptions"]=True`` keeps Fast-LLM's). ``grad_clip=None`` is an infinite
  clipping threshold (Fast-LLM's clipping cannot be switched off; the norm is still computed);
- ``forward``: the sequences packed into one Fast-LLM batch (document boundaries, no padding), its
  inference schedule, logprobs from the head's logits;
- ``backward``: Fast-LLM's training schedule (forward, its own backward, its gradient reduction) with
  the head's loss being the SDK objective (:mod:`pipelinerl_sdk_fast_llm.objective_loss`). Fast-LLM's
  runner overwrites the gradient shards at every run, so the adapter adds back what earlier ``backward``
  calls accumulated since the last ``step``: gradients are the objective summed over calls and ranks;
- ``step``: Fast-LLM's ``Optimizer.step`` (clip, AdamW), then the gradient shards are zeroed;
- ``gather_and_broadcast``: stage by stage (a decoder layer), ``restore_parameters`` all-gathers the
  stage's weight buffer (what Fast-LLM's next forward does), and Fast-LLM's HF converter (the one its
  ``iter_checkpoint`` export uses) turns its parameters into HF names and layouts, one at a time; rank 0
  hands each tensor to the sink in ``param_specs()`` order (computed once at ``init``). Views of a
  buffer only one stage uses (ZeRO-1/2) are lent (they stay unchanged until the next ``step``);
  converted copies and ZeRO-3's shared buffers are sent.

Options (``TrainerSpec.options``): ``zero_stage`` (1, 2 or 3; Fast-LLM's default when unset),
``fast_llm_decay_exemptions`` (see above). ``dtype="bfloat16"`` is Fast-LLM's mixed precision: bf16
compute, float32 master weights and optimizer state; ``param_specs`` and the gathered tensors are bf16.
"""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipelinerl_sdk.contracts import Objective, StepMetrics, TokenBatch, TrainerBackend, TrainerSpec
from pipelinerl_sdk.kit.trainer import FullParamsOut
from pipelinerl_sdk.protocol import ParamSpec
from pipelinerl_sdk.weights.tensors import spec_of
from pipelinerl_sdk_fast_llm.capabilities import CAPABILITIES

__all__ = ["HF_FORMATS", "FastLLMTrainer"]

#: HF ``model_type`` -> Fast-LLM checkpoint format name (its converters).
HF_FORMATS = {"qwen2": "qwen2", "llama": "llama", "mistral": "mistral"}
_FL_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


class _StepLater:
    """The optimizer as Fast-LLM's schedule runner sees it: ``run_step`` runs forward, backward and the
    gradient reduction, then calls ``step``, which here updates nothing (and says so: the runner then
    keeps its weight buffers). The contract's ``step`` calls the real optimizer's."""

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = optimizer

    @property
    def grad_scale(self) -> float:
        return float(self._optimizer.grad_scale)

    def step(self, metrics: dict[str, Any] | None = None) -> bool:
        return False


class FastLLMTrainer(FullParamsOut, TrainerBackend):
    """One rank of a Fast-LLM trainer (see the module docstring for the contract)."""

    capabilities = CAPABILITIES

    def __init__(self) -> None:
        self._model: Any = None
        self._runner: Any = None
        self._optimizer: Any = None
        self._schedule: Any = None
        self._inference: Any = None
        self._pool: Any = None
        self._pool_store: Any = None  # rank 0: the store Fast-LLM's groups rendezvous at
        self._loss: Any = None
        self._format: Any = None
        self._export: Any = None
        self._specs: list[ParamSpec] = []
        self._spec: TrainerSpec | None = None
        self._steps = 0
        self._iteration = 0
        self._pad_id = 0
        self._has_grads = False
        self._adam_step_fixed = False

    # -- setup -----------------------------------------------------------------------------------

    def _require(self) -> TrainerSpec:
        if self._model is None or self._spec is None:
            raise RuntimeError("call init() first")
        return self._spec

    def _process_group_pool(self, timeout_s: float) -> Any:
        """Fast-LLM's pool of process groups for this rank. Fast-LLM builds its groups itself over a
        TCP store: rank 0 hosts it on a port the system picks (held from then on, so no other
        process can take it before the ranks connect), and its address reaches the other ranks
        through the launcher's default group; every rank, rank 0 included, joins it as a client."""
        from fast_llm.engine.distributed.config import DistributedBackend
        from fast_llm.engine.distributed.distributed import ProcessGroupPool

        if dist.is_initialized():
            rank, world, backend = dist.get_rank(), dist.get_world_size(), str(dist.get_backend())
        else:
            rank, world, backend = 0, 1, "gloo"
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"trainer group backend {backend!r}: Fast-LLM runs on gloo or nccl")
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        address = [""]
        if world > 1:
            if rank == 0:
                self._pool_store = dist.TCPStore(  # type: ignore[attr-defined]
                    host, 0, world, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s),
                )  # fmt: skip
                address = [f"tcp://{host}:{self._pool_store.port}"]
            dist.broadcast_object_list(address, src=0)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if backend == "nccl":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % local_world)))
        else:
            device = torch.device("cpu")
        # TORCHELASTIC_USE_AGENT_STORE makes torch's tcp:// rendezvous (Fast-LLM's) connect every
        # rank as a client, as torchrun's ranks connect to the store its agent hosts: here rank 0's.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        try:
            return ProcessGroupPool(
                rank=rank,
                world_size=world,
                local_world_size=local_world if backend == "nccl" else world,
                timeout=timeout_s,
                init_method=address[0],
                backend=DistributedBackend(backend),
                device=device,
            )
        finally:
            if agent_store is None:
                del os.environ["TORCHELASTIC_USE_AGENT_STORE"]
            else:
                os.environ["TORCHELASTIC_USE_AGENT_STORE"] = agent_store

    def init(self, spec: TrainerSpec) -> None:
        import fast_llm.engine.distributed.distributed as fl_distributed
        from fast_llm.config import UpdateType
        from fast_llm.engine.checkpoint.config import (
            CheckpointLoadConfig,
            CheckpointStateSaveConfigBase,
            ModelConfigType,
        )
        from fast_llm.engine.config_utils.data_type import DataType
        from fast_llm.engine.distributed.config import PhaseType
        from fast_llm.engine.multi_stage.config import StageMode
        from fast_llm.engine.optimizer.config import OptimizerConfig, ParamGroup
        from fast_llm.engine.schedule.config import ScheduleConfig
        from fast_llm.engine.schedule.runner import ScheduleRunner
        from fast_llm.engine.schedule.schedule import Schedule
        from fast_llm.models.gpt.config import GPTModelConfig
        from fast_llm.models.gpt.model import GPTInferenceRunner, GPTModel
        from transformers import AutoConfig, AutoTokenizer

        from pipelinerl_sdk_fast_llm.fixes import apply_adam_step_fix
        from pipelinerl_sdk_fast_llm.objective_loss import LOSS_TYPE, SDKObjectiveLoss

        if spec.dtype not in self.capabilities.dtypes:
            raise ValueError(f"dtype: {spec.dtype!r} not supported (supported: {sorted(self.capabilities.dtypes)})")
        model_type = AutoConfig.from_pretrained(spec.model).model_type
        if model_type not in HF_FORMATS:
            raise ValueError(f"model: model_type {model_type!r} not supported (supported: {sorted(HF_FORMATS)})")
        zero_stage = spec.options.get("zero_stage")
        if zero_stage not in (None, 1, 2, 3):
            raise ValueError(f"options.zero_stage: {zero_stage!r} (use 1, 2 or 3)")
        timeout_s = float(spec.options.get("timeout_s", 600.0))

        pool = self._process_group_pool(timeout_s)
        self._pool = pool
        checkpoint_format = GPTModelConfig.get_checkpoint_format(HF_FORMATS[model_type])
        load = CheckpointLoadConfig(path=Path(spec.model), format=checkpoint_format, load_config=ModelConfigType.model)
        updates: dict[str | tuple[str, ...], Any] = {
            ("distributed", "rank"): pool.rank,
            ("distributed", "world_size"): pool.world_size,
            ("distributed", "local_world_size"): pool.local_world_size,
            ("distributed", "backend"): str(pool.backend),
            ("distributed", "use_cuda"): pool.device.type == "cuda",
            ("distributed", "compute_dtype"): _FL_DTYPES[spec.dtype],
            ("distributed", "seed"): spec.seed,
            ("distributed", "timeout"): timeout_s,
            ("base_model", "head", "losses"): {"pipelinerl_sdk": {"type": LOSS_TYPE}},
        }
        if zero_stage is not None:
            updates[("multi_stage", "zero_stage")] = zero_stage
        metadata = GPTModelConfig.load_metadata(load)
        config = GPTModelConfig.from_dict(metadata.config, updates, update_type=UpdateType.update)
        model = GPTModel(config, optimizer_state_names=OptimizerConfig.state_names())
        # Fast-LLM's Distributed takes the pool a caller installed as its module default (what its
        # ProcessGroupPool context manager does); the pool stays owned by this trainer.
        from fast_llm.engine.distributed.distributed import Distributed

        previous = fl_distributed._default_pool
        fl_distributed._default_pool = pool
        try:
            distributed = Distributed(config.distributed)
        finally:
            fl_distributed._default_pool = previous
        model.setup(distributed, mode=StageMode.training)
        model.load_checkpoint(load)

        optimizer_config = OptimizerConfig.from_dict(
            {
                "learning_rate": {"base": spec.lr},
                "beta_1": spec.betas[0],
                "beta_2": spec.betas[1],
                "epsilon": spec.eps,
                "weight_decay": spec.weight_decay,
                "gradient_norm_clipping": math.inf if spec.grad_clip is None else spec.grad_clip,
            }
        )
        self._adam_step_fixed = apply_adam_step_fix(pool.device)
        param_groups, grads_for_norm = model.get_param_groups(ParamGroup)
        if not spec.options.get("fast_llm_decay_exemptions", False):
            for group in param_groups:
                group.weight_decay = None  # the optimizer's (the spec's) decay for every param
        optimizer = optimizer_config.optimizer_cls(
            optimizer_config, param_groups=param_groups, grads_for_norm=grads_for_norm, distributed=distributed
        )
        optimizer.reset_state()
        schedule_config = ScheduleConfig()
        runner = ScheduleRunner(config=schedule_config, multi_stage=model, distributed_config=config.distributed)
        runner.setup(distributed, _StepLater(optimizer))
        self._schedule = Schedule(
            config=schedule_config,
            multi_stage=model,
            batch_meta=model.get_preprocessing_config(PhaseType.training).get_input_meta(),
            distributed_config=config.distributed,
            phase=PhaseType.training,
        )
        self._inference = GPTInferenceRunner(model, runner)
        self._inference.setup()
        (loss,) = [m for m in model.base_model.modules() if isinstance(m, SDKObjectiveLoss)]

        self._model, self._runner, self._optimizer, self._loss = model, runner, optimizer, loss
        self._train_preprocessing = model.get_preprocessing_config(PhaseType.training)
        self._infer_preprocessing = model.get_preprocessing_config(PhaseType.inference)
        self._export = CheckpointStateSaveConfigBase(
            format=checkpoint_format, data_type=DataType(_FL_DTYPES[spec.dtype]), optimizer_state=False
        )
        tokenizer = AutoTokenizer.from_pretrained(spec.model)
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._spec = spec
        self._steps = 0
        self._zero_grads()
        self._specs = [spec_of(name, t) for name, t in self.full_params()]

    # -- helpers ---------------------------------------------------------------------------------

    def _grad_shards(self) -> list[torch.Tensor]:
        return [
            fsdp.grad_shard
            for stage in self._model.stages_on_device.values()
            for fsdp in stage.fsdps
            if fsdp.requires_grad and fsdp.grad_shard.numel() > 0
        ]

    def _zero_grads(self) -> None:
        for g in self._grad_shards():
            g.zero_()
        self._has_grads = False

    def full_params(self, into: Any = None) -> Any:
        """(HF name, full tensor) one at a time, in Fast-LLM's stage order; a collective on every rank.

        What Fast-LLM's ``iter_checkpoint`` does (its HF converter, ``_convert_state_dict``, one
        parameter at a time), but from the stage's weight buffer: ``restore_parameters`` all-gathers
        the stage's shards into it, as Fast-LLM's next forward would, so no gathered copy is made
        here (Fast-LLM's export gathers a copy of each stage, which gloo stages once more: 2.5x a
        layer). Tied-weight copies are skipped, as in Fast-LLM's export. ``into`` is not used: the
        converter makes the HF tensors (views of the stage's buffer, lent in ZeRO-1/2)."""
        handler = self._export.format.get_handler_class()(self._model)
        owned = self._model.stages_owned
        state: dict[str, torch.Tensor] = {}
        for index, stage in self._model.stages_on_device.items():
            if index not in owned:
                continue
            stage.restore_parameters()
            for fsdp in stage.fsdps:
                buffers = fsdp.split_buffer(fsdp._weight_buffer)
                for name, meta in fsdp._parameter_metas.items():
                    state[name] = meta.local_to_global(buffers[name])[0]
                    yield from handler._convert_state_dict(state, True).items()
        if state:
            raise RuntimeError(f"Fast-LLM's converter left parameters unconverted: {sorted(state)[:5]}")

    def lendable(self, tensor: torch.Tensor) -> bool:
        """A view of a weight buffer that only this stage uses (ZeRO-1/2): it stays unchanged until
        the next ``step`` and the restore after it. ZeRO-3 stages share buffers (restoring the next
        stage overwrites it) and converted tensors are fresh copies: those are sent."""
        if self._model.config.multi_stage.num_weight_buffers is not None:
            return False
        ptr = tensor.untyped_storage().data_ptr()
        return any(
            fsdp._weight_buffer.untyped_storage().data_ptr() == ptr
            for stage in self._model.stages_on_device.values()
            for fsdp in stage.fsdps
        )

    def _packed(self, sequences: Sequence[Sequence[int]], labels: bool) -> Any:
        """The sequences as one Fast-LLM batch of documents; with ``labels``, a one-token padding
        document closes the stream (Fast-LLM predicts token p+1 at p, across the whole stream)."""
        from fast_llm.data.document.language_model import LanguageModelBatch

        tokens = [t for seq in sequences for t in seq]
        lengths = [len(seq) for seq in sequences]
        if labels:
            tokens.append(self._pad_id)
            lengths.append(1)
        return LanguageModelBatch(tokens=torch.tensor(tokens, dtype=torch.int64), lengths=lengths)

    def _next_iteration(self) -> int:
        self._iteration += 1
        return self._iteration

    # -- contract --------------------------------------------------------------------------------

    def param_specs(self) -> list[ParamSpec]:
        self._require()
        return list(self._specs)

    def forward(self, batch: TokenBatch) -> list[torch.Tensor]:
        self._require()
        sequences = list(batch.input_ids) if len(batch) else [[self._pad_id]]
        (model_input,) = self._packed(sequences, labels=False).get_model_inputs(self._infer_preprocessing)
        with torch.no_grad():
            self._inference.forward(model_input, iteration=self._next_iteration())
        head = self._model.base_model.head
        # This rank's own logits: no tensor parallelism, so the local tensor is whole over the vocabulary
        # (``meta.local_to_global`` would gather the token dimension over the data-parallel ranks).
        _meta, logits = model_input.hidden_states[f"{head.module_name}.logits"]
        logits = logits.flatten(0, -2).float()
        ids = torch.tensor([t for seq in sequences for t in seq], dtype=torch.int64, device=logits.device)
        logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[1:, None])[:, 0]
        logprobs = torch.cat([logprobs, logprobs.new_zeros(1)])
        if not len(batch):
            return []
        from pipelinerl_sdk_fast_llm.objective_loss import split_logprobs

        return [t.detach().cpu().clone() for t in split_logprobs(logprobs, [len(s) for s in sequences])]

    def backward(self, batch: TokenBatch, objective: Objective) -> dict[str, float]:
        from pipelinerl_sdk_fast_llm.objective_loss import PendingObjective

        self._require()
        if len(batch):
            sequences = list(batch.input_ids)
            pending: PendingObjective | None = PendingObjective(
                fn=lambda logprobs: objective(logprobs, batch), lengths=[len(s) for s in sequences]
            )
        else:  # join the collectives with a zero loss
            sequences, pending = [[self._pad_id, self._pad_id]], None
        model_inputs = self._packed(sequences, labels=True).get_model_inputs(self._train_preprocessing)
        saved = [g.clone() for g in self._grad_shards()] if self._has_grads else None
        self._loss.install(pending)
        try:
            self._runner.run_step(iter([tuple(model_inputs)]), self._schedule, iteration=self._next_iteration())
        finally:
            self._loss.install(None)
        if saved is not None:
            for g, s in zip(self._grad_shards(), saved, strict=True):
                g.add_(s)
        self._has_grads = True
        if pending is None:
            return {"loss": 0.0}
        if pending.calls != 1:
            raise RuntimeError(f"Fast-LLM evaluated the objective {pending.calls} times for one micro-batch")
        return {"loss": pending.loss, **pending.metrics}

    def step(self) -> StepMetrics:
        self._require()
        metrics: dict[str, Any] = {}
        ok = self._optimizer.step(metrics)
        if not ok:
            raise RuntimeError("Fast-LLM skipped the optimizer step (non-finite gradients)")
        for stage in self._model.stages_on_device.values():
            stage.invalidate_buffer()
        self._zero_grads()
        self._steps += 1
        return StepMetrics(step=self._steps, grad_norm=float(metrics["grad_norm"]), lr=float(metrics["learning_rate"]))

    def check_ready(self) -> None:
        self._require()

    def close(self) -> None:
        self._model = self._runner = self._optimizer = self._inference = self._loss = None
        self._schedule = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
