"""Tiny offline models (Qwen2 by default; Qwen3 or Llama on request) and a ChatML byte-level BPE
tokenizer for tests and benchmarks.

Nothing here touches a model hub: the tokenizer is trained with ``tokenizers`` on a corpus
generated in code, and the model is a randomly initialised ``Qwen2ForCausalLM`` (or
``Qwen3ForCausalLM`` / ``LlamaForCausalLM``: ``arch=``, for trainers such as TorchTitan that model
those families) of a preset's sizes.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from pipelinerl_sdk.hf import load_model

__all__ = [
    "ARCHS",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "IM_START",
    "PAD_TOKEN",
    "PRESETS",
    "TinyPreset",
    "build_tiny_model",
    "build_tokenizer",
    "load_model",
    "param_bytes",
    "preset_config",
]

IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, EOS_TOKEN)

#: ChatML. ``tools`` (when given) render as a system turn of one JSON object per tool, first;
#: ``enable_thinking=false`` (a ``chat_template_kwargs`` of Qwen3's templates) closes an empty
#: think block after the generation prompt. Without them a conversation renders as plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

#: Architectures a tiny model can have (``config.model_type``); the preset gives the sizes.
ARCHS = ("qwen2", "qwen3", "llama")

_WORDS_TEXT = (
    "the a an one two three cat dog bird fish model token answer question number sum is was are "
    "were has had makes gives sees likes runs jumps adds counts thinks big small red blue quick "
    "slow happy old new first last good right wrong and or but so then because if when what "
    "which who how why please thanks compute solve add subtract multiply result equals plus "
    "minus times"
)
_ROLES = ("system", "user", "assistant")
# Qwen2's pre-tokenizer split (``\p{N}`` alone: one token per digit). Using the very pipeline of
# transformers' ``Qwen2Tokenizer`` (NFC, this split, byte-level) makes ``AutoTokenizer`` -- which
# picks ``Qwen2Tokenizer`` for a qwen2 checkpoint and rebuilds the pipeline -- encode identically.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@dataclass(frozen=True, slots=True)
class TinyPreset:
    """A preset's architecture; head_dim = hidden_size // num_attention_heads (>= 64: vLLM CPU)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 4096
    # Target standard deviation of the logits at init (see ``build_tiny_model``).
    logit_std: float = 4.0


PRESETS: dict[str, TinyPreset] = {
    # ~0.4 M parameters, ~1.6 MB in fp32.
    "tiny": TinyPreset(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    ),
    # ~25.7 M parameters, ~103 MB in fp32 (100e6 <= bytes < 200e6 is a tested contract).
    "bench": TinyPreset(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
}


def _corpus(seed: int = 0) -> list[str]:
    """Deterministic training corpus: arithmetic, digits, short sentences and ChatML turns."""
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(800):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        c = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"{a}{op}{b}={c}")
        lines.append(f"What is {a} {op} {b}? The answer is {c}.")
    lines.append(" ".join(str(d) for d in range(10)) + " " + "".join(str(d) for d in range(10)))
    vocabulary = _WORDS_TEXT.split()
    sentences: list[str] = []
    for _ in range(1500):
        words = rng.choices(vocabulary, k=rng.randint(3, 10))
        sentence = " ".join(words).capitalize() + rng.choice(".?!")
        sentences.append(sentence)
    lines.extend(sentences)
    for i in range(0, len(sentences) - 1, 2):
        role = _ROLES[i % 3]
        lines.append(
            f"{IM_START}{role}\n{sentences[i]}{EOS_TOKEN}\n{IM_START}assistant\n{sentences[i + 1]}{EOS_TOKEN}\n"
        )
    return lines


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer offline; same vocabulary and merges on every call.

    Digits are pre-tokenized one by one (Qwen2's split regex), so every digit is its own token.
    Special tokens: ``<|endoftext|>`` (pad, id 0), ``<|im_start|>`` (id 1), ``<|im_end|>`` (eos,
    id 2). The chat template is ChatML and honours ``add_generation_prompt``. ``vocab_size`` must
    exceed 259 (bytes + specials).
    """
    if vocab_size <= 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be > {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=PRESETS["tiny"].max_position_embeddings,
    )


def preset_config(
    preset: str, vocab_size: int, *, eos_token_id: int = 2, pad_token_id: int = 0, arch: str = "qwen2"
) -> PretrainedConfig:
    """The config of a preset: ``Qwen2Config`` (untied embeddings, no sliding window), or with
    ``arch="qwen3"`` / ``"llama"`` a ``Qwen3Config`` / ``LlamaConfig`` of the same sizes (head_dim
    ``hidden_size // num_attention_heads``, no attention bias, untied, default RoPE)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {list(ARCHS)}")
    p = PRESETS[preset]
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "max_position_embeddings": p.max_position_embeddings,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }
    if arch == "llama":
        return LlamaConfig(**common, head_dim=p.hidden_size // p.num_attention_heads, attention_bias=False)
    if arch == "qwen3":
        return Qwen3Config(
            **common, head_dim=p.hidden_size // p.num_attention_heads, attention_bias=False, use_sliding_window=False
        )
    return Qwen2Config(**common, use_sliding_window=False)


def build_tiny_model(
    path: str | Path, *, preset: str = "tiny", dtype: str = "float32", seed: int = 0, arch: str = "qwen2"
) -> Path:
    """Write a randomly initialised model (Qwen2, or ``arch``: see :func:`preset_config`; safetensors)
    and its tokenizer into ``path``.

    Deterministic for a given ``(preset, dtype, seed, arch)``; the global torch RNG is left untouched.
    The lm_head is re-drawn with std ``logit_std / sqrt(hidden_size)``: the final RMSNorm gives
    unit-RMS hidden states, so logits then have std ~``logit_std`` (4 nats) instead of ~0.2 at
    the default init. A peaked next-token distribution keeps greedy decoding away from near-ties,
    so batched vs. unbatched (or bf16 vs. fp32) numerics rarely flip tokens and logprob
    comparisons stay meaningful.
    Returns ``path`` as a ``Path``.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    assert isinstance(eos_id, int) and isinstance(pad_id, int)
    config = preset_config(preset, len(tokenizer), eos_token_id=eos_id, pad_token_id=pad_id, arch=arch)
    with torch.random.fork_rng(devices=[]):  # seed locally; the caller's RNG state is restored
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
        with torch.no_grad():
            std = PRESETS[preset].logit_std / math.sqrt(config.hidden_size)
            model.lm_head.weight.normal_(0.0, std)
    model = model.to(_DTYPES[dtype])
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the model's parameters (shared parameters counted once; buffers excluded)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
