"""The offline tiny model and tokenizer: round trip, chat template, digit tokens, preset sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2ForCausalLM

from pipelinerl_sdk.reference.tiny import (
    EOS_TOKEN,
    IM_START,
    PAD_TOKEN,
    build_tiny_model,
    build_tokenizer,
    load_model,
    param_bytes,
    preset_config,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3)


def test_round_trip_state_dict_and_tokenizer(tiny_dir: Path, tmp_path: Path) -> None:
    model, tokenizer = load_model(tiny_dir)
    assert not model.training
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    assert model.config.tie_word_embeddings is False
    assert model.config.hidden_size // model.config.num_attention_heads == 64

    # The checkpoint reloads exactly, and the same seed rebuilds the same weights.
    stored = load_file(tiny_dir / "model.safetensors")
    ours = model.state_dict()
    assert stored.keys() == ours.keys()
    for name, tensor in stored.items():
        assert torch.equal(tensor, ours[name]), name
    rng = torch.get_rng_state()
    again, _ = load_model(build_tiny_model(tmp_path / "again", seed=3))
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is not consumed
    theirs = again.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    other, _ = load_model(build_tiny_model(tmp_path / "other", seed=4))
    assert not torch.equal(other.state_dict()["lm_head.weight"], ours["lm_head.weight"])

    fresh = build_tokenizer()
    assert len(tokenizer) == len(fresh) == model.config.vocab_size == 512
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.pad_token == PAD_TOKEN
    assert model.config.eos_token_id == tokenizer.eos_token_id
    for text in ("<|im_start|>user\nWhat is 123+45?<|im_end|>\n", "Hello (world)! 3.14\tx\n\n"):
        assert tokenizer.encode(text) == fresh.encode(text)
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_bf16_round_trip(tmp_path: Path) -> None:
    model, _ = load_model(build_tiny_model(tmp_path, dtype="bfloat16"))
    assert model.dtype == torch.bfloat16
    upcast, _ = load_model(tmp_path, dtype="float32")
    assert upcast.dtype == torch.float32
    assert torch.equal(upcast.lm_head.weight, model.lm_head.weight.float())


def test_chat_template() -> None:
    tokenizer = build_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    bare = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert isinstance(bare, str) and bare.endswith("<|im_end|>\n") and "assistant" not in bare
    ids = tokenizer.encode(text)
    start = tokenizer.convert_tokens_to_ids(IM_START)
    assert ids.count(start) == 3 and ids.count(tokenizer.eos_token_id) == 2
    assert [tokenizer.convert_tokens_to_ids(t) for t in (PAD_TOKEN, IM_START, EOS_TOKEN)] == [
        0,
        1,
        2,
    ]


def test_digits_are_single_tokens() -> None:
    tokenizer = build_tokenizer()
    digit_ids = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    assert len(set(digit_ids)) == 10
    ids = tokenizer.encode("12+7=19 and 90210")
    pieces = [tokenizer.decode([i]) for i in ids]
    assert pieces[:7] == ["1", "2", "+", "7", "=", "1", "9"]
    assert pieces[-5:] == ["9", "0", "2", "1", "0"]
    assert tokenizer.encode("1234567890") == [digit_ids[int(c)] for c in "1234567890"]


def test_tokenizer_is_deterministic() -> None:
    a, b = build_tokenizer(), build_tokenizer()
    assert a.get_vocab() == b.get_vocab()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert len(build_tokenizer(vocab_size=400)) == 400
    with pytest.raises(ValueError):
        build_tokenizer(vocab_size=100)


def test_preset_sizes() -> None:
    sizes = {}
    for preset in ("tiny", "bench"):
        with torch.device("meta"):
            model = Qwen2ForCausalLM(preset_config(preset, 512))  # type: ignore[no-untyped-call]
        sizes[preset] = param_bytes(model)
        assert model.config.hidden_size // model.config.num_attention_heads == 64
    assert sizes["tiny"] < 2e6
    assert 100e6 <= sizes["bench"] < 200e6
    with pytest.raises(ValueError):
        preset_config("huge", 512)


def test_peaked_next_token_distribution(tiny_dir: Path) -> None:
    model, tokenizer = load_model(tiny_dir)
    ids = torch.tensor([tokenizer.encode("What is 12+7? The answer is 19. The quick red dog")])
    with torch.inference_mode():
        logits = model(ids).logits[0]
    # Default init gives logits of std ~0.2; the rescaled lm_head gives ~4.
    assert 2.0 < logits.std(dim=-1).mean().item() < 8.0
    assert logits.log_softmax(-1).max(dim=-1).values.mean().item() > -2.0


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_other_architectures(tmp_path: Path, arch: str) -> None:
    """``arch`` builds the same sizes in another family (for trainers that model only those), with
    the same tokenizer, deterministically, reloading exactly."""
    path = build_tiny_model(tmp_path / arch, seed=1, arch=arch)
    model, tokenizer = load_model(path)
    qwen2 = preset_config("tiny", len(tokenizer))
    assert model.config.model_type == arch
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert getattr(model.config, field) == getattr(qwen2, field), field
    assert model.config.head_dim == 64 and model.config.tie_word_embeddings is False
    assert not any(n.endswith(".bias") for n in load_file(path / "model.safetensors"))
    again = load_file(build_tiny_model(tmp_path / "again", seed=1, arch=arch) / "model.safetensors")
    stored = load_file(path / "model.safetensors")
    assert stored.keys() == again.keys() and all(torch.equal(stored[k], again[k]) for k in stored)
    assert all(torch.equal(stored[k], v) for k, v in model.state_dict().items() if k in stored)


def test_default_arch_is_qwen2_as_before(tmp_path: Path) -> None:
    """The default stays a Qwen2ForCausalLM drawn exactly as ``Qwen2ForCausalLM(config)`` draws it."""
    path = build_tiny_model(tmp_path / "q2", seed=0)
    config = preset_config("tiny", len(build_tokenizer()))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        direct = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
    stored = load_file(path / "model.safetensors")
    assert all(torch.equal(stored[k], v) for k, v in direct.state_dict().items() if k != "lm_head.weight")
    with pytest.raises(ValueError, match="unknown arch"):
        preset_config("tiny", 512, arch="gpt2")
