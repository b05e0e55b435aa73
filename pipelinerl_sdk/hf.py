"""HF-format models for any backend: load a checkpoint, score token sequences, find decoder layers.

What trainer and engine adapters share about transformers models, apart from any engine (the
reference backends use it too). Imports torch and transformers: import it only where a backend is
created, never from a plugin module. Needs the SDK's ``hf`` extra.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from pipelinerl_sdk.weights.tensors import TORCH_DTYPES

__all__ = ["decoder_layers", "layer_units", "load_model", "pad_batch", "pad_token_id", "token_logprobs"]


def load_model(
    path: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM (SDPA attention, eval mode, on ``device``) and its tokenizer from ``path``.

    ``dtype=None`` keeps the dtype stored in the checkpoint.
    """
    torch_dtype: str | torch.dtype = (
        "auto" if dtype is None else TORCH_DTYPES[dtype] if isinstance(dtype, str) else dtype
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa")
    model = model.to(device).eval()  # type: ignore[arg-type]
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The tokenizer's pad id, or 0 when it has none (padding is masked or after the last token)."""
    pad = tokenizer.pad_token_id
    return int(pad) if isinstance(pad, int) else 0


def pad_batch(
    input_ids: Sequence[Sequence[int]], pad_id: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to a [B, T] tensor and its attention mask, on ``device`` (default CPU)."""
    width = max(len(s) for s in input_ids)
    ids = torch.full((len(input_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(input_ids), width), dtype=torch.long)
    for i, s in enumerate(input_ids):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    return (ids, mask) if device is None else (ids.to(device), mask.to(device))


def token_logprobs(
    model: torch.nn.Module,
    input_ids: Sequence[Sequence[int]],
    pad_id: int = 0,
    device: torch.device | str | None = None,
) -> list[torch.Tensor]:
    """Per sequence, ``log p(tok_t | tok_<t)`` for t >= 1: the log-softmax of the raw logits (no
    temperature) in float32, ``len(ids) - 1`` values, on ``device``; the graph is kept if grad is on.
    ``model`` is an HF causal LM (or a wrapper that takes its keyword arguments)."""
    ids, mask = pad_batch(input_ids, pad_id, device)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return [logp[i, : len(s) - 1] for i, s in enumerate(input_ids)]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers: modules whose class is in HF's ``_no_split_modules``, else the children
    of every ``ModuleList``. The unit a sharding trainer wraps, and gathers, one at a time."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        layers = [c for m in model.modules() if isinstance(m, torch.nn.ModuleList) for c in m]
    return layers


def layer_units(model: torch.nn.Module) -> Iterator[list[tuple[str, torch.nn.Parameter]]]:
    """``named_parameters()`` in order, grouped: consecutive params of one decoder layer (a class
    in HF's ``_no_split_modules``) form one unit; every other param is a unit of its own. Gathering
    unit by unit keeps a trainer's extra memory to one layer."""
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    owner: dict[int, str] = {}
    for mname, module in model.named_modules():
        if any(c.__name__ in kinds for c in type(module).__mro__):  # FSDP2 subclasses the layer's class
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
