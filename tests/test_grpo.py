"""Simplified GRPO against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pipelinerl_sdk.contracts import TokenBatch
from pipelinerl_sdk.rl.grpo import GRPOObjective, group_advantages, off_policy_metrics


def test_group_advantages_are_reward_minus_group_mean() -> None:
    assert group_advantages([1, 0, 0, 1, 1, 1], group_size=3) == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0, 0, 0])


def test_group_advantages_std_normalisation() -> None:
    adv = group_advantages([1.0, 0.0, 3.0, 3.0], group_size=2, normalize_std=True, eps=0.0 + 1e-12)
    assert adv[:2] == pytest.approx([1.0, -1.0])
    assert adv[2:] == [0.0, 0.0]  # a group with one reward teaches nothing


@given(st.lists(st.floats(-10, 10), min_size=1, max_size=24), st.integers(1, 6))
def test_group_advantages_sum_to_zero_per_group(rewards: list[float], g: int) -> None:
    rewards = rewards[: len(rewards) // g * g] or [0.0] * g
    adv = group_advantages(rewards, g)
    for i in range(0, len(adv), g):
        assert abs(sum(adv[i : i + g])) < 1e-9


def test_group_advantages_reject_ragged_groups() -> None:
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages([1, 2, 3], 4)


def _batch() -> TokenBatch:
    # seq 0: prompt of 2 tokens, 2 completion tokens; seq 1: prompt of 1, 3 completion tokens
    return TokenBatch(
        input_ids=[[1, 2, 3, 4], [5, 6, 7, 8]],
        completion_start=[2, 1],
        advantages=[0.5, -1.0],
        behaviour_logprobs=[[-1.0, -2.0], [-0.5, -0.5, -0.5]],
        ref_logprobs=[[-1.0, -1.0], [-1.0, -1.0, -1.0]],
    )


def test_loss_value_and_gradient_by_hand() -> None:
    batch = _batch()
    # new logprobs for tokens 1..3 of each sequence (position j scores token j+1)
    lp0 = torch.tensor([-9.0, -1.0, -1.5], requires_grad=True)  # completion = last 2: [-1.0, -1.5]
    lp1 = torch.tensor([-0.5, -0.7, -0.2], requires_grad=True)  # completion = all 3
    loss, metrics = GRPOObjective(num_sequences=4)([lp0, lp1], batch)
    w0 = [math.exp(-1.0 + 1.0), math.exp(-1.5 + 2.0)]
    w1 = [math.exp(0.0), math.exp(-0.2), math.exp(0.3)]
    expected = (-(0.5) * sum(w0) + 1.0 * sum(w1)) / 4  # divided by sequences, not tokens
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert lp0.grad is not None and lp1.grad is not None
    assert lp0.grad.tolist() == pytest.approx([0.0, -0.5 * w0[0] / 4, -0.5 * w0[1] / 4])
    assert lp1.grad.tolist() == pytest.approx([w / 4 for w in w1])
    ratios = [0.0, 0.5, 0.0, -0.2, 0.3]
    assert metrics["mean_abs_log_ratio"] == pytest.approx(sum(abs(r) for r in ratios) / 5)
    ws = [math.exp(r) for r in ratios]
    assert metrics["ess"] == pytest.approx(sum(ws) ** 2 / (5 * sum(w * w for w in ws)))
    assert metrics["kl_new_old"] == pytest.approx(sum(w * r - (w - 1) for w, r in zip(ws, ratios, strict=False)) / 5)


def test_every_token_weighs_the_same_whatever_the_micro_batching() -> None:
    batch = _batch()
    lps = [torch.tensor([-9.0, -1.0, -1.5]), torch.tensor([-0.5, -0.7, -0.2])]
    whole, _ = GRPOObjective(num_sequences=2)(lps, batch)
    parts = [
        GRPOObjective(num_sequences=2)(
            [lps[i]],
            TokenBatch(
                input_ids=[batch.input_ids[i]],
                completion_start=[batch.completion_start[i]],
                advantages=[batch.advantages[i]],
                behaviour_logprobs=[batch.behaviour_logprobs[i]],
            ),
        )[0]
        for i in range(2)
    ]
    assert float(whole) == pytest.approx(float(parts[0] + parts[1]))


def test_on_policy_gradient_is_plain_reinforce() -> None:
    lp = torch.tensor([-3.0, -0.2, -0.4], requires_grad=True)
    batch = TokenBatch(
        input_ids=[[1, 2, 3, 4]], completion_start=[1], advantages=[2.0], behaviour_logprobs=[[-3.0, -0.2, -0.4]]
    )
    loss, metrics = GRPOObjective(num_sequences=1)([lp], batch)
    loss.backward()
    assert lp.grad is not None and lp.grad.tolist() == pytest.approx([-2.0, -2.0, -2.0])
    assert metrics["ess"] == pytest.approx(1.0) and metrics["kl_new_old"] == pytest.approx(0.0)


def test_optional_reference_kl_k3() -> None:
    batch = _batch()
    lps = [torch.tensor([-9.0, -1.0, -1.5]), torch.tensor([-0.5, -0.7, -0.2])]
    plain, _ = GRPOObjective(num_sequences=2)(lps, batch)
    with_kl, metrics = GRPOObjective(num_sequences=2, kl_coef=0.1)(lps, batch)
    d = [-1.0 + 1.0, -1.0 + 1.5, -1.0 + 0.5, -1.0 + 0.7, -1.0 + 0.2]
    k3 = [math.exp(x) - x - 1 for x in d]
    assert float(with_kl - plain) == pytest.approx(0.1 * sum(k3) / 2, rel=1e-5)
    assert metrics["kl_ref"] == pytest.approx(sum(k3) / 5, rel=1e-5)


def test_bad_inputs_name_the_field() -> None:
    with pytest.raises(ValueError, match="num_sequences"):
        GRPOObjective(num_sequences=0)
    batch = TokenBatch(input_ids=[[1, 2, 3]], completion_start=[1], advantages=[1.0], behaviour_logprobs=[[-1.0]])
    with pytest.raises(ValueError, match=r"behaviour_logprobs\[0\]"):
        GRPOObjective(num_sequences=1)([torch.zeros(2)], batch)
    with pytest.raises(ValueError, match="ref_logprobs"):
        GRPOObjective(num_sequences=1, kl_coef=0.1)([torch.zeros(2)], batch)


def test_off_policy_metrics_empty() -> None:
    assert off_policy_metrics([]) == {"kl_new_old": 0.0, "mean_abs_log_ratio": 0.0, "ess": 1.0}
