"""FSDP2 trainer backend: ``fully_shard`` per decoder layer, then the root; torch AdamW; gloo or NCCL.

Contract (see :class:`pipelinerl_sdk.contracts.TrainerBackend`), as this backend keeps it:

- runs in the default ``torch.distributed`` group the launcher initialised (``run_ranks`` or
  ``torchrun``); with no group at all, ``init`` creates a private 1-rank gloo group and ``close``
  destroys it. The device is CUDA (``LOCAL_RANK``) when the group's backend is NCCL, else CPU;
- ``init``: every rank builds the model with parameters on the meta device (buffers real), shards
  it, and rank 0 alone reads the HF checkpoint and broadcasts it shard by shard
  (``set_model_state_dict(..., broadcast_from_rank0=True)``); non-persistent buffers (rotary
  ``inv_freq``) are restored from the meta-build's real values;
- gradients are *summed* over ranks (FSDP's divide factor is set to 1 with plain SUM reductions,
  which gloo needs), so the accumulated gradient is the gradient of the objective summed over
  every backward call of every rank since the last ``step``;
- ``step`` clips to exactly ``spec.grad_clip`` (None: no clipping; the norm is still reported);
- ``gather_and_broadcast`` all-gathers one parameter at a time (``DTensor.full_tensor``): the
  extra memory on each rank is ~2x the largest parameter (the all-gather's output and its
  concatenation); rank 0 hands each to the sink under its HF name, in ``param_specs()`` order;
- ``forward`` returns float32 logprobs on the CPU; a rank with an empty batch still joins the
  collectives of ``forward`` and ``backward``.

Options (``TrainerSpec.options``): ``mixed_precision`` = ``"bf16"`` computes in bfloat16 with
float32 master weights and float32 gradient reduction; ``reshard_after_forward`` (default True).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from pipelinerl_sdk.contracts import (
    Objective,
    StepMetrics,
    TokenBatch,
    TrainerBackend,
    TrainerSpec,
    WeightSink,
)
from pipelinerl_sdk.protocol import ParamSpec
from pipelinerl_sdk.reference.trainer import token_logprobs
from pipelinerl_sdk.weights.tensors import TORCH_DTYPES, hf_name, spec_of
from pipelinerl_sdk_fsdp.capabilities import CAPABILITIES

__all__ = ["FSDPTrainer", "hf_name"]

#: Prefixes wrappers put in front of HF parameter names (FSDP1, activation checkpointing, compile, DDP).


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build modules with parameters on the meta device and buffers real (computed in the
    constructor, so non-persistent ones such as rotary ``inv_freq`` are correct)."""
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules to shard one by one: those whose class is in HF's ``_no_split_modules``
    (decoder layers), else the children of every ``ModuleList``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        layers = [c for m in model.modules() if isinstance(m, torch.nn.ModuleList) for c in m]
    return layers


class FSDPTrainer(TrainerBackend):
    """One rank of an FSDP2 trainer (see the module docstring for the contract)."""

    capabilities = CAPABILITIES

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._spec: TrainerSpec | None = None
        self._steps = 0
        self._pad_id = 0
        self._own_group = False
        self._device = torch.device("cpu")

    # -- setup -----------------------------------------------------------------------------------

    def _require(self) -> tuple[torch.nn.Module, torch.optim.Optimizer, TrainerSpec]:
        if self.model is None or self.optimizer is None or self._spec is None:
            raise RuntimeError("call init() first")
        return self.model, self.optimizer, self._spec

    def init(self, spec: TrainerSpec) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        if spec.dtype not in self.capabilities.dtypes:
            raise ValueError(f"dtype: {spec.dtype!r} not supported (supported: {sorted(self.capabilities.dtypes)})")
        mp = spec.options.get("mixed_precision")
        if mp not in (None, "no", "bf16"):
            raise ValueError(f"options.mixed_precision: {mp!r} not supported (use 'bf16' or leave unset)")
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
            self._own_group = True
        if dist.get_backend() == "nccl":
            self._device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
            torch.cuda.set_device(self._device)
        torch.manual_seed(spec.seed)
        dtype = TORCH_DTYPES[spec.dtype]
        rank, world = dist.get_rank(), dist.get_world_size()

        config = AutoConfig.from_pretrained(spec.model)
        with _parameters_on_meta():
            model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, dtype=dtype, attn_implementation="sdpa"
            )
        persistent = set(model.state_dict())
        buffers = {n: b.detach().clone() for n, b in model.named_buffers() if n not in persistent}

        mesh = init_device_mesh(self._device.type, (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp == "bf16" else None
        reshard = bool(spec.options.get("reshard_after_forward", True))
        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard}
        if policy is not None:
            kwargs["mp_policy"] = policy
        for layer in decoder_layers(model):
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        for m in model.modules():
            if isinstance(m, FSDPModule):  # sum, not mean, across ranks; plain SUM (gloo has no PREMUL_SUM)
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        model.to_empty(device=self._device)

        full: dict[str, Any] = {}
        if rank == 0:
            source = AutoModelForCausalLM.from_pretrained(spec.model, dtype=dtype, attn_implementation="sdpa")
            full = source.state_dict()
            del source
        set_model_state_dict(
            model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
        )
        del full
        with torch.no_grad():
            for name, value in buffers.items():
                model.get_buffer(name).copy_(value.to(self._device))
        model.train()

        tokenizer = AutoTokenizer.from_pretrained(spec.model)
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.model = model
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=spec.lr,
            betas=spec.betas,
            eps=spec.eps,
            weight_decay=spec.weight_decay,
            foreach=False,
        )
        self._spec = spec
        self._steps = 0

    # -- contract --------------------------------------------------------------------------------

    def param_specs(self) -> list[ParamSpec]:
        model, _, _ = self._require()
        return [spec_of(hf_name(n), p) for n, p in model.named_parameters()]

    def _idle_pass(self, model: torch.nn.Module, backward: bool) -> None:
        """Take part in the collectives of a forward (and backward) with no sequences of our own."""
        out = model(input_ids=torch.tensor([[self._pad_id]], device=self._device), use_cache=False).logits
        if backward:
            (out.float().sum() * 0.0).backward()

    def forward(self, batch: TokenBatch) -> list[torch.Tensor]:
        model, _, _ = self._require()
        with torch.no_grad():
            if len(batch) == 0:
                self._idle_pass(model, backward=False)
                return []
            return [t.detach().float().cpu() for t in token_logprobs(model, batch.input_ids, self._pad_id)]

    def backward(self, batch: TokenBatch, objective: Objective) -> dict[str, float]:
        model, _, _ = self._require()
        if len(batch) == 0:
            self._idle_pass(model, backward=True)
            return {"loss": 0.0}
        logprobs = token_logprobs(model, batch.input_ids, self._pad_id)
        loss, metrics = objective(logprobs, batch)
        loss.backward()  # type: ignore[no-untyped-call]
        return {"loss": float(loss.detach()), **metrics}

    def step(self) -> StepMetrics:
        model, optimizer, spec = self._require()
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # same as the reference: every param steps (Adam moments, decay)
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False, foreach=False)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if spec.grad_clip is not None:
            torch.nn.utils.clip_grads_with_norm_(params, spec.grad_clip, norm, foreach=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self._steps += 1
        return StepMetrics(step=self._steps, grad_norm=float(norm), lr=float(optimizer.param_groups[0]["lr"]))

    def gather_and_broadcast(self, sink: WeightSink | None) -> None:
        model, _, _ = self._require()
        with torch.no_grad():
            for name, p in model.named_parameters():
                full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
                if sink is not None:
                    sink.send(hf_name(name), full)
                del full

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """Full parameters under HF names on every rank (a collective; for tests and checkpoints)."""
        model, _, _ = self._require()
        with torch.no_grad():
            return {
                hf_name(n): (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone().cpu()
                for n, p in model.named_parameters()
            }

    def close(self) -> None:
        self.model = None
        self.optimizer = None
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
        self._own_group = False
