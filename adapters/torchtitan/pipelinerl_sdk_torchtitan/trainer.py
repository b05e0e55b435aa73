"""TorchTitan trainer backend: TorchTitan's model, parallelize function, optimizer container and HF adapter.

Contract (see :class:`pipelinerl_sdk.contracts.TrainerBackend`), as this backend keeps it:

- runs in the default ``torch.distributed`` group the launcher initialised (``run_ranks`` or ``torchrun``);
  with no group at all, ``init`` creates a private 1-rank gloo group and ``close`` destroys it. The device
  is CUDA (``LOCAL_RANK``) when the group's backend is NCCL, else CPU (then :mod:`cpu_shims` apply);
- ``init``: the model is TorchTitan's (:func:`pipelinerl_sdk_torchtitan.models.model_spec`: llama3 or
  qwen3 registry entry sized from the checkpoint's ``config.json``), built on the meta device, sharded
  by the family's own parallelize function (FSDP2 over every rank, ``spmd_backend="partial_dtensor"``),
  materialised, its buffers (RoPE cache) initialised by TorchTitan; then every rank reads the HF
  safetensors, converts them with the family's state-dict adapter (``from_hf``, fused QKV merged by
  TorchTitan's own load hook) and copies its shard of each parameter. The optimizer is TorchTitan's
  ``OptimizersContainer`` (torch AdamW, one param group, ``for-loop`` implementation);
- gradients are *summed* over ranks (FSDP divide factor 1, plain SUM reductions: gloo has no
  PREMUL_SUM), so the accumulated gradient is that of the objective summed over every ``backward``
  of every rank since the last ``step``;
- ``step`` clips to exactly ``spec.grad_clip`` with TorchTitan's ``clip_grad_norm_`` (None: no
  clipping, the norm is still reported), steps, zeroes gradients;
- ``gather_and_broadcast`` walks the model one unit at a time (embeddings, each decoder layer, final
  norm, lm_head): ``DTensor.full_tensor()`` per parameter of the unit, the fused QKV split by
  TorchTitan's own save hook, ``to_hf`` of that unit alone, and rank 0 hands each tensor to the sink
  under its HF name in ``param_specs()`` order. Extra memory: one unit's full parameters (plus the
  split copy of its QKV weight); the sink owns bucketing;
- every FSDP unit reshards after forward (``fsdp_reshard_after_forward="always"``): TorchTitan's default
  keeps the last unit unsharded, and then a ``forward`` between ``backward`` and ``step`` loses part of
  the accumulated gradient;
- ``forward`` returns float32 logprobs on the CPU; sequences are right-padded and attention is causal
  SDPA, so padding never reaches a real token. A rank with an empty batch still joins the collectives.

Options (``TrainerSpec.options``): ``mixed_precision="bf16"`` (TorchTitan's
``mixed_precision_param="bfloat16"``: bf16 compute, fp32 master weights and gradient reduction);
``tensor_parallel`` (TP degree,
default 1; experimental: every rank of a TP group must pass the *same* batch, and gradients are then
summed over the data-parallel ranks only, so the standard world-size checks do not apply; it must
divide ``num_key_value_heads``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pipelinerl_sdk_torchtitan import cpu_shims

cpu_shims.apply()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed.utils import clip_grad_norm_  # noqa: E402
from torchtitan.models.common.attention import FusedQKVLinear  # noqa: E402

from pipelinerl_sdk.contracts import (  # noqa: E402
    Objective,
    StepMetrics,
    TokenBatch,
    TrainerBackend,
    TrainerSpec,
    WeightSink,
)
from pipelinerl_sdk.protocol import ParamSpec  # noqa: E402
from pipelinerl_sdk.weights.tensors import spec_of  # noqa: E402
from pipelinerl_sdk_torchtitan.capabilities import CAPABILITIES  # noqa: E402
from pipelinerl_sdk_torchtitan.models import model_spec, set_tp_sharding  # noqa: E402

__all__ = ["TorchTitanTrainer", "read_hf_checkpoint", "titan_token_logprobs"]

_MIXED_PRECISION = {None: "float32", "no": "float32", "bf16": "bfloat16"}


def read_hf_checkpoint(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of an HF model dir (FileNotFoundError if none)."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def merge_fused_qkv(model: torch.nn.Module, titan_sd: dict[str, Any]) -> None:
    """In place: replace ``wq``/``wk``/``wv`` entries of ``titan_sd`` by each fused module's ``wqkv``
    (TorchTitan's own load hook, the one ``load_state_dict`` runs)."""
    for name, module in model.named_modules():
        if isinstance(module, FusedQKVLinear):
            FusedQKVLinear._merge_qkv_on_load(module, titan_sd, f"{name}.")


def titan_token_logprobs(model: torch.nn.Module, input_ids: Sequence[Sequence[int]], pad_id: int) -> list[torch.Tensor]:
    """Per sequence, ``log p(tok_t | tok_<t)`` for t >= 1 in float32 (graph kept if grad is on): one
    right-padded batch through a TorchTitan decoder (causal attention: padding reaches no real token)."""
    device = next(model.parameters()).device
    width = max(len(s) for s in input_ids)
    ids = torch.full((len(input_ids), width), pad_id, dtype=torch.long, device=device)
    for i, s in enumerate(input_ids):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
    logits = model(ids)
    if isinstance(logits, DTensor):  # tensor parallel: the lm_head's output is sharded over vocab
        logits = logits.full_tensor()
    logits = logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return [logp[i, : len(s) - 1] for i, s in enumerate(input_ids)]


class TorchTitanTrainer(TrainerBackend):
    """One rank of a TorchTitan trainer (see the module docstring for the contract)."""

    capabilities = CAPABILITIES

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self.optimizer: OptimizersContainer | None = None
        self.adapter: Any = None
        self._spec: TrainerSpec | None = None
        self._steps = 0
        self._pad_id = 0
        self._own_group = False
        self._device = torch.device("cpu")
        self._specs: list[ParamSpec] | None = None

    # -- setup -----------------------------------------------------------------------------------

    def _require(self) -> tuple[torch.nn.Module, OptimizersContainer, TrainerSpec]:
        if self.model is None or self.optimizer is None or self._spec is None:
            raise RuntimeError("call init() first")
        return self.model, self.optimizer, self._spec

    def init(self, spec: TrainerSpec) -> None:
        from transformers import AutoConfig, AutoTokenizer

        if spec.dtype not in self.capabilities.dtypes:
            raise ValueError(f"dtype: {spec.dtype!r} not supported (supported: {sorted(self.capabilities.dtypes)})")
        mp = spec.options.get("mixed_precision")
        if mp not in _MIXED_PRECISION:
            raise ValueError(f"options.mixed_precision: {mp!r} not supported (use 'bf16' or leave unset)")
        tp = int(spec.options.get("tensor_parallel", 1))
        n_kv = getattr(AutoConfig.from_pretrained(spec.model), "num_key_value_heads", None)
        if tp > 1 and n_kv is not None and n_kv % tp:
            raise ValueError(f"options.tensor_parallel={tp} must divide num_key_value_heads={n_kv}")
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
            self._own_group = True
        if dist.get_backend() == "nccl":
            self._device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
            torch.cuda.set_device(self._device)
        torch.manual_seed(spec.seed)
        world = dist.get_world_size()

        hf_config = AutoConfig.from_pretrained(spec.model)
        mspec = model_spec(hf_config)
        if tp > 1:
            set_tp_sharding(mspec)
        with torch.device("meta"):
            model = mspec.model.build()

        parallelism = ParallelismConfig(
            data_parallel_shard_degree=-1,
            tensor_parallel_degree=tp,
            spmd_backend="partial_dtensor",
            # "always", not TorchTitan's default (which keeps [norm, lm_head] unsharded after forward):
            # with that, a no_grad forward between backward and step drops part of the accumulated
            # lm_head gradient (measured: grad norm 526.44 instead of 526.74 on the tiny model).
            fsdp_reshard_after_forward="always",
        )
        dims = ParallelDims.from_config(parallelism, world)
        dims.build_mesh()
        training = TrainingConfig(mixed_precision_param=_MIXED_PRECISION[mp], mixed_precision_reduce="float32")
        with tempfile.TemporaryDirectory() as dump:
            model = mspec.parallelize_fn(
                model,
                parallel_dims=dims,
                training=training,
                parallelism=parallelism,
                compile_config=CompileConfig(enable=False),
                ac_config=None,
                dump_folder=dump,
            )
        for m in model.modules():
            if isinstance(m, FSDPModule):  # sum, not mean, across ranks; plain SUM (gloo has no PREMUL_SUM)
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        model.to_empty(device=self._device)
        with torch.no_grad():
            model.init_states(buffer_device=self._device)  # RoPE cache (params are overwritten below)

        self.adapter = mspec.state_dict_adapter(mspec.model, None)
        self._load_hf(model, read_hf_checkpoint(spec.model))
        model.train()

        tokenizer = AutoTokenizer.from_pretrained(spec.model)
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.model = model
        self.optimizer = OptimizersContainer(
            OptimizersContainer.Config(
                param_groups=[
                    ParamGroupConfig(
                        pattern=".*",
                        optimizer_name="AdamW",
                        optimizer_kwargs={
                            "lr": spec.lr,
                            "betas": tuple(spec.betas),
                            "eps": spec.eps,
                            "weight_decay": spec.weight_decay,
                        },
                    )
                ],
                implementation="for-loop",
            ),
            model_parts=[model],
        )
        self._spec = spec
        self._steps = 0
        self._specs = None

    def _load_hf(self, model: torch.nn.Module, hf_sd: dict[str, torch.Tensor]) -> None:
        """Copy this rank's shard of every parameter from the HF state dict (identical on every rank)."""
        titan_sd = self.adapter.from_hf(hf_sd)
        merge_fused_qkv(model, titan_sd)
        names = [n for n, _ in model.named_parameters()]
        missing = sorted(set(names) - set(titan_sd))
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")
        with torch.no_grad():
            for name, param in model.named_parameters():
                full = titan_sd.pop(name).to(device=self._device, dtype=param.dtype)
                if isinstance(param, DTensor):
                    shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                    param.to_local().copy_(shard.to_local())
                else:
                    param.copy_(full)
        tied = {"lm_head.weight"} if getattr(model, "enable_weight_tying", False) else set()
        unused = sorted(set(titan_sd) - tied)
        if unused:
            raise ValueError(f"the model has no parameter for {len(unused)} checkpoint tensors, e.g. {unused[:3]}")

    # -- weights out -----------------------------------------------------------------------------

    def _units(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
        """The gather units in order: (prefix, module) for the embeddings, each decoder layer, the
        final norm and the lm_head."""
        for name, child in model.named_children():
            if name == "layers":
                for idx, layer in child.named_children():
                    yield f"layers.{idx}.", layer
            else:
                yield f"{name}.", child

    def _unit_hf(self, prefix: str, module: torch.nn.Module, full: bool) -> dict[str, torch.Tensor]:
        """One unit's parameters under HF names: full tensors (a collective) or meta placeholders."""
        titan: dict[str, Any] = {}
        for name, p in module.named_parameters():
            if full:
                titan[prefix + name] = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            else:
                titan[prefix + name] = torch.empty(p.shape, dtype=p.dtype, device="meta")
        for name, sub in module.named_modules():
            if isinstance(sub, FusedQKVLinear):  # TorchTitan's own save hook: wqkv -> wq, wk, wv
                FusedQKVLinear._split_qkv_on_save(sub, titan, f"{prefix}{name}.", None)
        n_in = sum(t.numel() for t in titan.values())
        hf: dict[str, torch.Tensor] = self.adapter.to_hf(titan)
        if sum(t.numel() for t in hf.values()) != n_in:
            raise RuntimeError(f"{prefix}: to_hf dropped tensors of {sorted(titan)} (got {sorted(hf)})")
        return hf

    def param_specs(self) -> list[ParamSpec]:
        model, _, _ = self._require()
        if self._specs is None:
            self._specs = [
                spec_of(name, t)
                for prefix, unit in self._units(model)
                for name, t in self._unit_hf(prefix, unit, False).items()
            ]
        return list(self._specs)

    def gather_and_broadcast(self, sink: WeightSink | None) -> None:
        model, _, _ = self._require()
        with torch.no_grad():
            for prefix, unit in self._units(model):
                hf = self._unit_hf(prefix, unit, True)
                if sink is not None:
                    for name, tensor in hf.items():
                        sink.send(name, tensor)
                del hf

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """Full parameters under HF names on every rank (a collective; for tests and checkpoints)."""
        model, _, _ = self._require()
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for prefix, unit in self._units(model):
                out.update({k: v.detach().clone().cpu() for k, v in self._unit_hf(prefix, unit, True).items()})
        return out

    # -- contract --------------------------------------------------------------------------------

    def _idle_pass(self, model: torch.nn.Module, backward: bool) -> None:
        """Take part in the collectives of a forward (and backward) with no sequences of our own."""
        out = model(torch.tensor([[self._pad_id]], device=self._device))
        if backward:
            (out.float().sum() * 0.0).backward()

    def forward(self, batch: TokenBatch) -> list[torch.Tensor]:
        model, _, _ = self._require()
        with torch.no_grad():
            if len(batch) == 0:
                self._idle_pass(model, backward=False)
                return []
            return [t.detach().float().cpu() for t in titan_token_logprobs(model, batch.input_ids, self._pad_id)]

    def backward(self, batch: TokenBatch, objective: Objective) -> dict[str, float]:
        model, _, _ = self._require()
        if len(batch) == 0:
            self._idle_pass(model, backward=True)
            return {"loss": 0.0}
        logprobs = titan_token_logprobs(model, batch.input_ids, self._pad_id)
        loss, metrics = objective(logprobs, batch)
        loss.backward()  # type: ignore[no-untyped-call]
        return {"loss": float(loss.detach()), **metrics}

    def step(self) -> StepMetrics:
        model, optimizer, spec = self._require()
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # same as the reference: every param steps (Adam moments, decay)
                p.grad = torch.zeros_like(p)
        if spec.grad_clip is not None:
            norm = clip_grad_norm_(params, spec.grad_clip, foreach=False)
        else:
            grads = [p.grad for p in params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False, foreach=False)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self._steps += 1
        lr = float(optimizer.optimizers[0].param_groups[0]["lr"])
        return StepMetrics(step=self._steps, grad_norm=float(norm), lr=lr)

    def close(self) -> None:
        self.model = None
        self.optimizer = None
        self.adapter = None
        self._specs = None
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
        self._own_group = False
