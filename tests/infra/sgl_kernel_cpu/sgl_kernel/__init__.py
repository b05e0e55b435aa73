"""TEST INFRASTRUCTURE: pure-torch stand-ins for the two ``sgl_kernel`` helpers that SGLang 0.5.23's
CPU engine imports at module load (``sglang.srt.mem_cache.allocation`` and
``sglang.kernels.ops.kvcache.cache_move``). SGLang publishes no CPU build of its kernel package;
these reproduce the semantics of SGLang's own Triton kernels for the same operations, so the real
engine runs unchanged on a CPU-only CI machine. Not used on a GPU (the real sgl-kernel is there).
"""

from __future__ import annotations

import ctypes

import torch

#: Imported at module load by SGLang's speculative-decoding (EAGLE) code on CPU, called only when
#: speculative decoding is enabled, which the adapter never does: they raise if called.
_SPECULATIVE = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
]

__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu", *_SPECULATIVE]
__version__ = "0.0.1+cpu-standin"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For each request i: ``req_to_token[req_pool_indices[i], start[i]:end[i]]`` = its slice of
    ``out_cache_loc`` (slices laid end to end in request order), as SGLang's Triton
    ``assign_req_to_token_pool`` does. ``pool_len`` is ``req_to_token.shape[1]``."""
    del pool_len
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, s, e in zip(rows, starts, ends, strict=True):
        n = e - s
        if n > 0:
            req_to_token[row, s:e] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For each KV buffer b (base address ``data_ptrs[b]``, row size ``strides[b]`` bytes), copy
    row ``src_loc[j]`` to row ``tgt_loc[j]`` for every j, as SGLang's Triton
    ``copy_all_layer_kv_cache_tiled`` does (raw addresses, hence ctypes)."""
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist(), strict=True))
    for base, row in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        for tgt, src in pairs:
            ctypes.memmove(base + tgt * row, base + src * row, row)


def _not_provided(name: str):  # type: ignore[no-untyped-def]
    def kernel(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"sgl_kernel.{name}: not provided by the CPU test stand-in (speculative decoding)")

    kernel.__name__ = name
    return kernel


for _name in _SPECULATIVE:
    globals()[_name] = _not_provided(_name)
