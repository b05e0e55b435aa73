"""Admission bounds (http.admission) and the kit's sampling values and text check, as properties."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipelinerl_sdk.errors import InvalidRequest, Overloaded
from pipelinerl_sdk.http.admission import Admission, Limits, chat_cost, cost_field
from pipelinerl_sdk.kit.inference.chat import MIN_TEMPERATURE, check_text, sampling_temperature
from pipelinerl_sdk.protocol import ChatCompletionRequest, CompletionRequest


@given(
    max_requests=st.integers(1, 5),
    max_tokens=st.integers(1, 100),
    costs=st.lists(st.integers(1, 150), max_size=20),
)
def test_admission_never_exceeds_its_bounds_and_releases_everything(
    max_requests: int, max_tokens: int, costs: list[int]
) -> None:
    adm = Admission(Limits(max_requests=max_requests, max_tokens=max_tokens))
    with ExitStack() as held:
        for cost in costs:
            before = (adm.requests, adm.tokens)
            try:
                held.enter_context(adm.admit(cost, field="n"))
            except InvalidRequest as e:  # can never fit: refused whatever runs
                assert cost > max_tokens and e.field == "n" and (adm.requests, adm.tokens) == before
                continue
            except Overloaded as e:
                assert (adm.requests, adm.tokens) == before and e.retry_after_s >= 1
                assert before[0] >= max_requests or before[1] + cost > max_tokens
                continue
            assert cost <= max_tokens
            assert adm.requests <= max_requests and adm.tokens <= max_tokens
    assert (adm.requests, adm.tokens) == (0, 0)


def test_admission_releases_on_error_and_costs_n_times_the_budget() -> None:
    adm = Admission(Limits(max_requests=1, max_tokens=10))
    with pytest.raises(RuntimeError), adm.admit(5):
        raise RuntimeError("the request failed")
    assert (adm.requests, adm.tokens) == (0, 0)
    msgs = [{"role": "user", "content": "hi"}]
    assert chat_cost(ChatCompletionRequest(messages=msgs, n=3, max_tokens=7), 256) == 21
    assert chat_cost(ChatCompletionRequest(messages=msgs, n=2), 256) == 512
    # the hostile request: 1000 prompts x 128 x 2000 tokens, 244x the default bound
    many = CompletionRequest(prompt=[[5]] * 1000, n=128, max_tokens=2000)
    assert chat_cost(many, 256) == 256_000_000 and cost_field(many, 256, 1 << 20) == "max_tokens"
    assert cost_field(ChatCompletionRequest(messages=msgs, n=8, max_tokens=100), 256, 500) == "n"
    with pytest.raises(ValueError, match="max_requests"):
        Limits(max_requests=0)


@given(st.floats(0, 2))
def test_sampling_temperature_is_greedy_or_computable(t: float) -> None:
    got = sampling_temperature(t)
    assert got == 0 if t == 0 else got == max(t, MIN_TEMPERATURE)


def test_text_that_is_not_unicode_names_its_message() -> None:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "ok"}, {"role": "user", "content": "a\ud800"}])
    with pytest.raises(InvalidRequest, match="not valid Unicode") as e:
        check_text(req)
    assert e.value.field == "messages.1.content"
