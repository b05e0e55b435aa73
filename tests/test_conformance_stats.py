"""The statistics and the mirror replay the sampling and version-tag checks rest on."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelinerl_sdk.conformance.mirror import Mirror
from pipelinerl_sdk.conformance.stats import (
    all_equal_bound,
    dkw_uniformity,
    nucleus_is_ambiguous,
    randomized_pit,
    sampling_distribution,
)
from pipelinerl_sdk.reference.tiny import build_tiny_model


def test_top_p_keeps_the_smallest_set_reaching_top_p_then_renormalises() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    out = sampling_distribution(probs.log(), 1.0, 0.7)  # 0.5 < 0.7, 0.8 >= 0.7: two tokens
    assert torch.allclose(out, torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=torch.float64))
    assert torch.allclose(sampling_distribution(probs.log(), 1.0, 0.5), torch.tensor([1.0, 0, 0, 0]).double())
    hot = sampling_distribution(probs.log(), 0.5, 1.0)
    assert torch.allclose(hot, probs**2 / (probs**2).sum())
    assert bool(nucleus_is_ambiguous(probs.log(), 1.0, 0.8 + 1e-4, 1e-3))
    assert not bool(nucleus_is_ambiguous(probs.log(), 1.0, 0.7, 1e-3))


def test_the_cuts_come_after_the_temperature_as_in_vllm() -> None:
    """min-p, top-k and top-p cut the tempered distribution: at temperature 0.5 the nucleus of
    top_p 0.6 is one token where the untempered one has two; min-p 0.4 keeps 2 tokens untempered,
    1 at temperature 0.5 and 3 at temperature 2; top-k keeps the k best (ties kept), renormalised."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    x = probs.log()
    assert int((sampling_distribution(x, 1.0, 0.6) > 0).sum()) == 2  # 0.5 < 0.6
    assert int((sampling_distribution(x, 0.5, 0.6) > 0).sum()) == 1  # 0.25 / 0.365 = 0.68 >= 0.6
    assert [int((sampling_distribution(x, t, min_p=0.4) > 0).sum()) for t in (1.0, 0.5, 2.0)] == [2, 1, 3]
    hot = probs[:2] ** 2 / (probs[:2] ** 2).sum()
    assert torch.allclose(sampling_distribution(x, 0.5, top_k=2)[:2], hot)
    assert int((sampling_distribution(torch.tensor([1.0, 1.0, 0.0]), 1.0, top_k=1) > 0).sum()) == 2  # a tie stays
    assert bool(nucleus_is_ambiguous(x, 1.0, 1.0, 0.0, min_p=0.6 + 1e-5, logit_slack=1e-3))  # 0.3 vs 0.6 * 0.5
    assert not bool(nucleus_is_ambiguous(x, 1.0, 1.0, 0.0, min_p=0.4, logit_slack=1e-3))
    assert (
        bool(nucleus_is_ambiguous(torch.tensor([2.0, 1.0, 1.0005]), 1.0, 1.0, 0.0, top_k=1, logit_slack=1e-3)) is False
    )
    assert bool(nucleus_is_ambiguous(torch.tensor([2.0, 1.0, 1.0005]), 1.0, 1.0, 0.0, top_k=2, logit_slack=1e-3))


def test_pit_is_none_outside_the_support_and_spans_the_token_interval() -> None:
    p = torch.tensor([0.2, 0.5, 0.3, 0.0], dtype=torch.float64)
    assert randomized_pit(p, 3, 0.5) is None
    assert randomized_pit(p, 1, 0.0) == 0.0  # most likely first
    assert randomized_pit(p, 2, 1.0) == pytest.approx(0.8)
    assert randomized_pit(p, 0, 0.5) == pytest.approx(0.9)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), vocab=st.integers(2, 50), temperature=st.sampled_from([0.5, 1.0, 2.0]))
def test_exact_draws_pass_and_greedy_draws_fail(seed: int, vocab: int, temperature: float) -> None:
    """Draws from the distribution itself: uniform transforms (the DKW test at alpha = 1e-6
    keeps them); always the most likely token: rejected once the distribution is spread."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    rows = torch.randn(400, vocab, generator=g, dtype=torch.float64) * 2
    probs = sampling_distribution(rows, temperature, 1.0)
    draws = torch.multinomial(probs, 1, generator=g).squeeze(-1).tolist()
    points = [randomized_pit(p, t, rng.random()) for p, t in zip(probs, draws, strict=True)]
    assert not dkw_uniformity([u for u in points if u is not None], 1e-6).rejected
    greedy = [randomized_pit(p, int(p.argmax()), rng.random()) for p in probs]
    if float(probs.max(-1).values.mean()) < 0.6:
        assert dkw_uniformity([u for u in greedy if u is not None], 1e-6).rejected


def test_dkw_bound_numbers() -> None:
    u = dkw_uniformity([0.5], 1e-6)
    assert u.d == pytest.approx(0.5) and u.critical == pytest.approx(math.sqrt(math.log(2e6) / 2))
    assert dkw_uniformity([(i + 0.5) / 100 for i in range(100)], 1e-6).d == pytest.approx(0.005)
    assert all_equal_bound(10, 1e-6) == pytest.approx(1e-7)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("stats") / "tiny", seed=0)


def test_replay_of_one_version_is_a_plain_forward_and_versions_matter(tiny: Path) -> None:
    """Tags all v: kept-KV and recomputed replays equal a full forward by v's weights. Tags
    switching mid-way: the tokens after the switch follow the new weights, and differ from the
    old weights' by far more than the float32 tolerance."""
    m = Mirror(tiny, "float32")
    prompt, tokens = [1, 5, 9, 13, 2], [40, 41, 42, 43, 44, 45]
    states = {0: m.state()}
    want0 = m.logprobs(prompt + tokens)[len(prompt) - 1 :]
    kept, fresh = m.replay(prompt, tokens, [0] * len(tokens), states)
    assert torch.allclose(kept, want0, atol=1e-5) and torch.allclose(fresh, want0, atol=1e-5)
    m.perturb(seed=1, scale=0.1)
    states[1] = m.state()
    want1 = m.logprobs(prompt + tokens)[len(prompt) - 1 :]
    tags = [0, 0, 0, 1, 1, 1]
    kept, fresh = m.replay(prompt, tokens, tags, states)
    assert torch.allclose(kept[:3], want0[:3], atol=1e-5) and torch.allclose(fresh[3:], want1[3:], atol=1e-5)
    assert float((kept[3:] - want0[3:]).abs().min()) > 1e-2  # the new weights, not the old
    assert float((kept[3:] - fresh[3:]).abs().max()) > 1e-5  # KV kept: old K/V under the new query
    assert torch.equal(m.state()["lm_head.weight"], states[1]["lm_head.weight"])  # weights restored


def test_steering_to_eos_ends_greedy_decoding_there(tiny: Path) -> None:
    m = Mirror(tiny, "float32")
    prompt = [1, 5, 9, 13, 2, 7]
    before = m.greedy(prompt, 6, stop=2)[0]
    m.steer_to(prompt, 2, after=3)
    path, gap = m.greedy(prompt, 10, stop=2)
    assert path == [*before[:3], 2]  # the earlier positions did not move
    assert gap > 0
