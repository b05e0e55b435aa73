"""FSDP2 trainer backend: ``fully_shard`` per decoder layer, then the root; torch AdamW; gloo or NCCL.

Contract (see :class:`pipelinerl_sdk.contracts.TrainerBackend`), as this backend keeps it:

- built on the trainer kit (:mod:`pipelinerl_sdk.kit.trainer`: process group, AdamW, the
  forward/backward template with its idle pass, step, close); this module is what is FSDP's;
- ``init``: every rank builds the model with parameters on the meta device (buffers real), shards
  it, and rank 0 alone reads the HF checkpoint and broadcasts it shard by shard
  (``set_model_state_dict(..., broadcast_from_rank0=True)``); non-persistent buffers (rotary
  ``inv_freq``) are restored from the meta-build's real values;
- gradients are *summed* over ranks (FSDP's divide factor is set to 1 with plain SUM reductions,
  which gloo needs), so the accumulated gradient is the gradient of the objective summed over
  every backward call of every rank since the last ``step``;
- ``step`` clips the global norm over the DTensor shards to exactly ``spec.grad_clip`` (the kit's
  default; None: no clipping, the norm is still reported);
- ``gather_and_broadcast`` is the kit's default, one decoder layer (and each param outside the
  layers) at a time (:func:`~pipelinerl_sdk.kit.trainer.stream_units`, the next unit in flight
  except on gloo): each large param with whole shards all-gathered straight into the sender's
  bucket, the small ones with one all-gather of their flat shards
  (:class:`~pipelinerl_sdk.kit.trainer.UnitGather`); extra memory within two layers plus one
  param; rank 0 hands each tensor to the sink under its HF name, in ``param_specs()`` order.

Options (``TrainerSpec.options``): ``mixed_precision`` = ``"bf16"`` computes in bfloat16 with
float32 master weights and float32 gradient reduction; ``reshard_after_forward`` (default True).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from pipelinerl_sdk.contracts import TrainerSpec
from pipelinerl_sdk.hf import decoder_layers
from pipelinerl_sdk.kit.trainer import KitTrainer
from pipelinerl_sdk.weights.tensors import TORCH_DTYPES, hf_name
from pipelinerl_sdk_fsdp.capabilities import CAPABILITIES

__all__ = ["FSDPTrainer", "decoder_layers", "hf_name"]


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


class FSDPTrainer(KitTrainer):
    """One rank of an FSDP2 trainer (see the module docstring for the contract)."""

    capabilities = CAPABILITIES
    mixed_precision_options = frozenset({None, "no", "bf16"})

    def build_model(self, spec: TrainerSpec) -> Any:
        """Meta-build, shard per decoder layer then the root, load rank 0's checkpoint into the shards."""
        import torch.distributed as dist
        from transformers import AutoConfig, AutoModelForCausalLM

        dtype = TORCH_DTYPES[spec.dtype]
        config = AutoConfig.from_pretrained(spec.model)
        with _parameters_on_meta():
            model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, dtype=dtype, attn_implementation="sdpa"
            )
        persistent = set(model.state_dict())
        buffers = {n: b.detach().clone() for n, b in model.named_buffers() if n not in persistent}

        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        mp = spec.options.get("mixed_precision")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp == "bf16" else None
        kwargs: dict[str, Any] = {
            "mesh": mesh,
            "reshard_after_forward": bool(spec.options.get("reshard_after_forward", True)),
        }
        if policy is not None:
            kwargs["mp_policy"] = policy
        for layer in decoder_layers(model):
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        for m in model.modules():
            if isinstance(m, FSDPModule):  # sum, not mean, across ranks; plain SUM (gloo has no PREMUL_SUM)
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        model.to_empty(device=self.device)

        full: dict[str, Any] = {}
        if dist.get_rank() == 0:
            source = AutoModelForCausalLM.from_pretrained(spec.model, dtype=dtype, attn_implementation="sdpa")
            full = source.state_dict()
            del source
        set_model_state_dict(
            model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
        )
        del full
        with torch.no_grad():
            for name, value in buffers.items():
                model.get_buffer(name).copy_(value.to(self.device))
        model.train()
        return model
