"""The chat choice's ``logprobs`` block that every inference backend builds with one helper."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pipelinerl_sdk.logprobs import choice_logprobs


def test_entries_carry_token_text_logprob_and_ranked_alternatives(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok.encode("12+7=19", add_special_tokens=False)
    lps = [-0.5 * (i + 1) for i in range(len(ids))]
    tops = [[(ids[i], lps[i]), (ids[0], -9.0)] for i in range(len(ids))]
    block = choice_logprobs(tok, ids, lps, tops)
    assert [e.token for e in block.content] == tok.convert_ids_to_tokens(ids)
    assert [e.logprob for e in block.content] == lps
    assert [[(a.token, a.logprob) for a in e.top_logprobs] for e in block.content] == [
        [(tok.convert_ids_to_tokens(ids[i]), lps[i]), (tok.convert_ids_to_tokens(ids[0]), -9.0)]
        for i in range(len(ids))
    ]
    assert all(e.top_logprobs == [] for e in choice_logprobs(tok, ids, lps).content)


def test_a_logprob_missing_for_a_token_is_an_error(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok.encode("12+7=19", add_special_tokens=False)
    with pytest.raises(ValueError):
        choice_logprobs(tok, ids, [-1.0] * (len(ids) - 1))
    with pytest.raises(ValueError):
        choice_logprobs(tok, ids, [-1.0] * len(ids), [[]] * (len(ids) + 1))
