"""Dtype names <-> torch dtypes, and byte views of tensors (the only torch glue the protocol needs)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipelinerl_sdk.protocol import DTYPE_SIZES, DTypeName, ParamSpec

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES: dict[torch.dtype, DTypeName] = {v: k for k, v in TORCH_DTYPES.items()}  # type: ignore[misc]
assert set(TORCH_DTYPES) == set(DTYPE_SIZES)


def dtype_name(dtype: torch.dtype) -> DTypeName:
    """The wire name of ``dtype``; ValueError for a dtype the protocol does not carry."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not carried by the weight-sync protocol") from None


def spec_of(name: str, tensor: torch.Tensor) -> ParamSpec:
    return ParamSpec(name=name, dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape))


def hf_param_specs(model: str, dtype: str) -> list[ParamSpec]:
    """The params of the HF model at ``model`` under HF names, in the model's order, as ``dtype``:
    the model is built from its config on the meta device, so no weights are read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call]
    return [ParamSpec(name=n, dtype=dtype, shape=tuple(p.shape)) for n, p in m.named_parameters()]  # type: ignore[arg-type]


@torch.no_grad()
def flatten_params(params: Sequence[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """Move ``params`` (name, tensor; on one device) into one new uint8 buffer laid out like every
    bucket plan's staging layout (:func:`~pipelinerl_sdk.weights.buckets.flat_layout`) and make
    each param's ``.data`` its view there; returns the buffer. Values, dtypes, shapes and the
    tensor objects are unchanged (optimizers and tied modules keep working), and a
    :class:`~pipelinerl_sdk.weights.send.WeightSender` can then broadcast whole buckets of these
    params, lent in this order, without a copy. Call it before building the optimizer."""
    from pipelinerl_sdk.weights.buckets import flat_layout

    if not params:
        raise ValueError("params: at least one param is required")
    specs = [spec_of(name, t) for name, t in params]
    offsets, total = flat_layout(specs)
    flat = torch.zeros(total, dtype=torch.uint8, device=params[0][1].device)
    for (_, t), spec, offset in zip(params, specs, offsets, strict=True):
        view = from_bytes(flat[offset:], spec)
        view.copy_(t)
        t.data = view
    return flat


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``tensor`` (copied first if it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def from_bytes(raw: torch.Tensor, spec: ParamSpec) -> torch.Tensor:
    """A typed, shaped view of the first ``spec.nbytes`` of ``raw`` (no copy)."""
    return raw[: spec.nbytes].view(TORCH_DTYPES[spec.dtype]).view(spec.shape)


#: Module-wrapper prefixes that trainers (FSDP, DeepSpeed, torch.compile, checkpointing) insert
#: into parameter names; HF names have none.
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def hf_name(name: str) -> str:
    """``name`` without wrapper prefixes, wherever they occur (``module.a._orig_mod.b`` -> ``a.b``)."""
    for prefix in WRAPPER_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
        name = name.replace("." + prefix, ".")
    return name
