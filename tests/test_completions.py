"""``/v1/completions`` as vLLM 0.32 serves it, driven by the official ``openai`` client against a
real reference server: text and token-id prompts (token-in, token-out: the ids of a chat's
prompt give that chat's generation), a batch, the extensions (token ids, logprobs, prompt
logprobs, weight versions), the stop rule, and refusals naming their field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from pipelinerl_sdk.launch import ServerProcess

pytestmark = pytest.mark.integration
API_KEY = "sk-test-completions"
CONTEXT = 160
TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def client(tiny_model: Path) -> Iterator[openai.OpenAI]:
    opts: dict[str, object] = {"threads": 1, "max_model_len": CONTEXT}
    with (
        ServerProcess("reference", tiny_model, api_key=API_KEY, startup_timeout_s=120, options=opts) as proc,
        openai.OpenAI(base_url=f"{proc.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c,
    ):
        yield c


def complete(client: openai.OpenAI, prompt: Any, **kw: Any) -> Any:
    extra = {"ignore_eos": True, "return_token_ids": True, **kw.pop("extra_body", {})}
    return client.completions.create(model="tiny", prompt=prompt, extra_body=extra, **kw)


def x(obj: Any, name: str) -> Any:
    return (obj.model_extra or {})[name]


def test_text_prompt_with_every_extension(client: openai.OpenAI) -> None:
    r = complete(client, TEXT, max_tokens=8, temperature=0, logprobs=2, extra_body={"prompt_logprobs": 1})
    assert r.object == "text_completion" and len(r.choices) == 1
    c = r.choices[0]
    ids, prompt_ids = x(c, "token_ids"), x(c, "prompt_token_ids")
    assert len(ids) == 8 and c.finish_reason == "length"
    assert x(c, "weight_versions") == [0] * 8
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == len(prompt_ids)
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert all(v <= 0 for v in lp.token_logprobs) and lp.text_offset[0] == 0
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[tok] == v and 1 <= len(top) <= 3  # the token and its 2 best alternatives
        assert v == max(top.values())  # greedy: the sampled token is the best
    prompt_lps = x(c, "prompt_logprobs")
    assert len(prompt_lps) == len(prompt_ids) and prompt_lps[0] is None
    assert all(str(prompt_ids[i]) in prompt_lps[i] for i in range(1, len(prompt_ids)))
    assert c.text == "".join(lp.tokens) or "\ufffd" in "".join(lp.tokens)


def test_token_ids_in_give_the_chat_generation_out(client: openai.OpenAI) -> None:
    """The prompt ids of a greedy chat, sent as a completions prompt, give the chat's tokens and
    text (nothing re-tokenised); the text prompt's ids sent back give the same completion."""
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    out = complete(client, x(chat, "prompt_token_ids"), max_tokens=10, temperature=0).choices[0]
    assert x(out, "token_ids") == x(chat.choices[0], "token_ids")
    assert out.text == chat.choices[0].message.content
    by_text = complete(client, TEXT, max_tokens=6, temperature=0).choices[0]
    by_ids = complete(client, x(by_text, "prompt_token_ids"), max_tokens=6, temperature=0).choices[0]
    assert (by_ids.text, x(by_ids, "token_ids")) == (by_text.text, x(by_text, "token_ids"))


def test_a_batch_is_each_prompt_n_times_in_order(client: openai.OpenAI) -> None:
    """Two prompts, n=2, seeded: choice ``p * 2 + i`` is sample ``i`` of prompt ``p``, the same
    as that prompt asked alone with the same seed; usage counts both prompts."""
    prompts = [TEXT, "Once upon a time"]
    batch = complete(client, prompts, max_tokens=6, temperature=1.0, seed=4, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        alone = complete(client, prompt, max_tokens=6, temperature=1.0, seed=4, n=2)
        assert [x(c, "token_ids") for c in batch.choices[2 * p : 2 * p + 2]] == [
            x(c, "token_ids") for c in alone.choices
        ]
    assert batch.usage.completion_tokens == 24
    assert batch.usage.prompt_tokens == sum(len(x(batch.choices[2 * p], "prompt_token_ids")) for p in range(2))
    ids_batch = complete(client, [x(batch.choices[0], "prompt_token_ids")] * 2, max_tokens=3, temperature=0)
    assert len(ids_batch.choices) == 2 and x(ids_batch.choices[0], "token_ids") == x(ids_batch.choices[1], "token_ids")


def test_stop_strings_and_default_budget(client: openai.OpenAI) -> None:
    full = complete(client, TEXT, temperature=0).choices[0]
    assert len(x(full, "token_ids")) == 16  # vLLM's default max_tokens for completions
    text = full.text
    stop = text[4:6]
    cut = complete(client, TEXT, temperature=0, stop=[stop]).choices[0]
    assert cut.text == text[: text.index(stop)] and cut.finish_reason == "stop"
    assert x(cut, "stop_reason") == stop


def test_stream_adds_up_to_the_non_streamed_completion(client: openai.OpenAI) -> None:
    """A seeded batch (2 prompts x n 2, logprobs 1) streamed: per choice the text, token ids,
    weight versions and logprob tokens add up to the non-streamed ones, offsets run on through
    the choice, prompt ids on its first chunk, finish reason on its last; usage last."""
    kw: dict[str, Any] = {"max_tokens": 12, "temperature": 1.0, "seed": 9, "n": 2, "logprobs": 1}
    prompts = [TEXT, "Once upon a time"]
    whole = complete(client, prompts, **kw)
    chunks = list(complete(client, prompts, stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    for c in whole.choices:
        mine = [ch for chunk in chunks[:-1] for ch in chunk.choices if ch.index == c.index]
        assert "".join(m.text for m in mine) == c.text
        assert [t for m in mine for t in x(m, "token_ids")] == x(c, "token_ids")
        assert [v for m in mine for v in x(m, "weight_versions")] == x(c, "weight_versions")
        assert [t for m in mine for t in m.logprobs.tokens] == c.logprobs.tokens
        assert [o for m in mine for o in m.logprobs.text_offset] == c.logprobs.text_offset
        assert x(mine[0], "prompt_token_ids") == x(c, "prompt_token_ids")
        assert all("prompt_token_ids" not in (m.model_extra or {}) for m in mine[1:])
        assert [m.finish_reason for m in mine][-1] == c.finish_reason and not any(m.finish_reason for m in mine[:-1])


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"echo": True, "stream": True}, "echo"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"suffix": "x"}, "suffix"),
        ({"stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
        ({"max_tokens": CONTEXT}, "max_tokens"),
        ({"prompt": list(range(1, CONTEXT + 1))}, "prompt"),
        ({"logprobs": 21}, "logprobs"),
        # token ids outside the vocabulary, refused by the kit before any engine sees them (vLLM
        # answered a 500 for its own VLLMValidationError)
        ({"prompt": [5, -1]}, "prompt"),
        ({"prompt": [[5, 6], [7, 1 << 40]]}, "prompt.1"),
    ],
)
def test_refusals_are_bad_request_naming_param(client: openai.OpenAI, kw: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, kw.pop("prompt", TEXT), **kw)
    assert e.value.param == param, e.value.body


def test_echo_puts_each_prompt_in_front_as_vllm(client: openai.OpenAI) -> None:
    """``echo``: each choice's text starts with its prompt's (a text prompt as given, a token-id
    prompt decoded); with ``logprobs`` N the logprobs cover the prompt tokens first (the first with
    none, as vLLM writes it), each the prompt logprob the server reports, then the completion's, the
    same as without echo (greedy)."""
    ids = x(complete(client, TEXT, max_tokens=1).choices[0], "prompt_token_ids")
    for prompt in ([TEXT, TEXT], [ids, ids]):
        _echo_matches_the_plain_completion(client, prompt, ids)


def _echo_matches_the_plain_completion(client: openai.OpenAI, prompt: Any, ids: list[int]) -> None:
    plain = complete(client, prompt, max_tokens=6, temperature=0, logprobs=2, n=2)
    r = complete(client, prompt, max_tokens=6, temperature=0, logprobs=2, n=2, echo=True,
                 extra_body={"prompt_logprobs": 2})  # fmt: skip
    assert len(r.choices) == 4
    for k, (c, p) in enumerate(zip(r.choices, plain.choices, strict=True)):
        assert c.text == TEXT + p.text, (k, c.text)  # the token-id prompt decodes to TEXT too
        lp, plp = c.logprobs, p.logprobs
        n = len(ids)
        assert lp.tokens[n:] == plp.tokens  # and the same logprobs (prompt logprobs asked change the batch's shapes)
        assert lp.token_logprobs[n:] == pytest.approx(plp.token_logprobs, abs=1e-5)
        assert "".join(lp.tokens[:n]) == TEXT
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        prompt_lps = x(c, "prompt_logprobs")
        for j in range(1, n):
            own = prompt_lps[j][str(ids[j])]
            assert lp.token_logprobs[j] == own["logprob"]
            assert lp.top_logprobs[j][lp.tokens[j]] == own["logprob"] and 1 <= len(lp.top_logprobs[j]) <= 3
        texts = "".join(lp.tokens)
        assert all(texts.startswith(t, o) for o, t in zip(lp.text_offset, lp.tokens, strict=True))
        assert x(c, "weight_versions") == [0] * 6 and x(c, "token_ids") == x(p, "token_ids")


def test_echo_with_zero_tokens_scores_the_prompt(client: openai.OpenAI) -> None:
    """``max_tokens: 0`` with ``echo`` (vLLM's scoring form): the text and logprobs are the
    prompt's alone; the one token generated meanwhile (vLLM does the same) is counted."""
    r = complete(client, TEXT, max_tokens=0, echo=True, logprobs=0, extra_body={"return_token_ids": False})
    c = r.choices[0]
    assert c.text == TEXT and c.finish_reason == "length"
    assert c.logprobs.token_logprobs[0] is None and all(v <= 0 for v in c.logprobs.token_logprobs[1:])
    assert "".join(c.logprobs.tokens) == TEXT and r.usage.completion_tokens == 1
    assert "token_ids" not in (c.model_extra or {}) or x(c, "token_ids") is None  # not asked
