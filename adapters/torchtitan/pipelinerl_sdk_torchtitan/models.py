"""HF checkpoint config -> TorchTitan ``ModelSpec``: TorchTitan's model registry, sized from ``config.json``.

TorchTitan's registries (``torchtitan.models.llama3`` / ``qwen3``) hold fixed flavors (``debugmodel``,
``8B``...). A trainer that starts from an HF checkpoint needs the checkpoint's sizes, so
:func:`model_spec` takes the family's registry entry (its model class, parallelize function and HF
state-dict adapter) and rebuilds the layer configs with the same registry helpers at the checkpoint's
sizes. Families (``config.model_type``):

- ``llama``: ``Llama3Model`` and ``Llama3StateDictAdapter`` (RoPE without scaling, or ``llama3`` scaling);
- ``qwen3``: ``Qwen3Model`` and ``Qwen3StateDictAdapter`` (dense, q/k RMSNorm);
- ``qwen2``: TorchTitan's Qwen3 decoder without q/k norm and with biases on the fused QKV projection,
  which is the Qwen2 architecture; :class:`Qwen2StateDictAdapter` adds the three bias names.

Always fused QKV (TorchTitan's default), inner attention SDPA with causal masking (the flex backends have
no CPU backward), norms' eps and RoPE theta from the checkpoint. Importing this module applies
:func:`pipelinerl_sdk_torchtitan.cpu_shims.apply` first, then imports TorchTitan.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pipelinerl_sdk_torchtitan import cpu_shims

cpu_shims.apply()

from torchtitan.models import llama3, qwen3  # noqa: E402
from torchtitan.models.common import CosSinRoPE  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.rope import ComplexRoPE  # noqa: E402

__all__ = ["FAMILIES", "Qwen2StateDictAdapter", "model_spec", "rope_theta", "set_tp_sharding"]

FAMILIES = ("llama", "qwen2", "qwen3")


def rope_theta(hf_config: Any) -> float:
    """RoPE base of an HF config (transformers 5 keeps it in ``rope_parameters``)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError(f"{hf_config.model_type}: no rope_theta in the config")
    return float(theta)


def _rope_type(hf_config: Any) -> str:
    params = getattr(hf_config, "rope_parameters", None) or {}
    return str(params.get("rope_type", "default"))


def _sdpa_layers(layers: list[Any], eps: float, *, qk_norm: bool, qkv_bias: bool) -> list[Any]:
    """The registry's layer configs with SDPA inner attention, the checkpoint's norm eps, q/k norm on or
    off and a bias on the fused QKV projection or not."""
    out = []
    for layer in layers:
        attn = layer.attention
        qkv = attn.qkv_linear
        qkv = dataclasses.replace(qkv, wqkv=dataclasses.replace(qkv.wqkv, bias=qkv_bias))
        norm = dataclasses.replace(attn.qk_norm, eps=eps) if (qk_norm and attn.qk_norm is not None) else None
        if qk_norm and norm is None:
            raise ValueError("the registry's layer config has no q/k norm")
        attn = dataclasses.replace(
            attn, qkv_linear=qkv, qk_norm=norm, inner_attention=ScaledDotProductAttention.Config()
        )
        out.append(
            dataclasses.replace(
                layer,
                attention=attn,
                attention_norm=dataclasses.replace(layer.attention_norm, eps=eps),
                ffn_norm=dataclasses.replace(layer.ffn_norm, eps=eps),
            )
        )
    return out


def _check_common(hf_config: Any) -> None:
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r}: TorchTitan's feed-forward is SwiGLU (silu)")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")


def model_spec(hf_config: Any) -> Any:
    """The TorchTitan ``ModelSpec`` of an HF checkpoint config (see the module docstring); ValueError
    for a family or feature TorchTitan does not model."""
    family = hf_config.model_type
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r} is not supported (supported: {list(FAMILIES)})")
    _check_common(hf_config)
    dim = int(hf_config.hidden_size)
    n_heads = int(hf_config.num_attention_heads)
    n_kv = int(getattr(hf_config, "num_key_value_heads", None) or n_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or dim // n_heads)
    vocab = int(hf_config.vocab_size)
    eps = float(hf_config.rms_norm_eps)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    max_len = int(hf_config.max_position_embeddings)
    theta = rope_theta(hf_config)
    rope_type = _rope_type(hf_config)

    # the layer stack's shape, the same for both builders
    shape = {
        "n_layers": int(hf_config.num_hidden_layers),
        "dim": dim,
        "n_heads": n_heads,
        "n_kv_heads": n_kv,
        "hidden_dim": int(hf_config.intermediate_size),
        "fuse_qkv": True,
        "attn_backend": "flex",
    }
    if family == "llama":
        if getattr(hf_config, "attention_bias", False):
            raise ValueError("llama with attention_bias=True is not supported")
        if head_dim != dim // n_heads:
            raise ValueError("llama: TorchTitan's Llama3 derives head_dim = hidden_size // num_attention_heads")
        if rope_type == "default":
            rope = ComplexRoPE.Config(dim=head_dim, max_seq_len=max_len, theta=theta, scaling="none")
        elif rope_type == "llama3":
            p = hf_config.rope_parameters
            rope = ComplexRoPE.Config(
                dim=head_dim,
                max_seq_len=max_len,
                theta=theta,
                scaling="llama",
                scaling_factor=float(p["factor"]),
                low_freq_factor=float(p["low_freq_factor"]),
                high_freq_factor=float(p["high_freq_factor"]),
                original_max_position_embeddings=int(p["original_max_position_embeddings"]),
            )
        else:
            raise ValueError(f"llama: rope_type {rope_type!r} is not supported")
        base = llama3.model_registry("debugmodel", attn_backend="flex")
        layers = llama3._build_llama3_layers(**shape, rope=rope)
        layers = _sdpa_layers(layers, eps, qk_norm=False, qkv_bias=False)
        adapter: type = llama3.Llama3StateDictAdapter
    else:
        if rope_type != "default":
            raise ValueError(f"{family}: rope_type {rope_type!r} is not supported")
        if family == "qwen3" and getattr(hf_config, "attention_bias", False):
            raise ValueError("qwen3 with attention_bias=True is not supported")
        base = qwen3.model_registry("debugmodel", attn_backend="flex")
        layers = qwen3._build_qwen3_layers(
            **shape, head_dim=head_dim, rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=max_len, theta=theta)
        )
        is_qwen2 = family == "qwen2"
        layers = _sdpa_layers(layers, eps, qk_norm=not is_qwen2, qkv_bias=is_qwen2)
        adapter = Qwen2StateDictAdapter if is_qwen2 else qwen3.Qwen3StateDictAdapter

    top = base.model
    config = dataclasses.replace(
        top,
        dim=dim,
        vocab_size=vocab,
        enable_weight_tying=tied,
        tok_embeddings=dataclasses.replace(top.tok_embeddings, num_embeddings=vocab, embedding_dim=dim),
        lm_head=dataclasses.replace(top.lm_head, in_features=dim, out_features=vocab),
        norm=dataclasses.replace(top.norm, normalized_shape=dim, eps=eps),
        layers=layers,
    )
    return dataclasses.replace(base, flavor=f"hf:{family}", model=config, state_dict_adapter=adapter)


def set_tp_sharding(mspec: Any) -> None:
    """Fill the family's tensor-parallel sharding config on ``mspec.model`` (no sequence parallel, no
    expert parallel), what TorchTitan's trainer does in ``update_from_config`` before building."""
    if mspec.name == "llama3":
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(mspec.model, enable_sp=False)
    else:
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        set_qwen3_sharding_config(mspec.model, enable_sp=False, enable_ep=False)


class Qwen2StateDictAdapter(qwen3.Qwen3StateDictAdapter):  # type: ignore[misc]
    """TorchTitan's Qwen3 adapter plus the q/k/v projection biases of Qwen2 (no q/k norm weights)."""

    def __init__(self, model_config: Any, hf_assets_path: str | None) -> None:
        super().__init__(model_config, hf_assets_path)
        for proj, short in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv")):
            self.from_hf_map[f"model.layers.{{}}.self_attn.{proj}.bias"] = (
                f"layers.{{}}.attention.qkv_linear.{short}.bias"
            )
