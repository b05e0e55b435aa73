"""The generation API as a vLLM drop-in, driven by the official ``openai`` client against a real
reference server: the exception classes with the server's ``param``, and every parameter with
vLLM's semantics (stop strings, stop token ids, logit bias, penalties, top-k/min-p, logprob
tokens as text or ``token_id:N``, vLLM-shaped prompt logprobs, generation to the context's end).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pipelinerl_sdk.conformance.structured import TOOLS
from pipelinerl_sdk.launch import ServerProcess

pytestmark = pytest.mark.integration
API_KEY = "sk-test-gen-api"
CONTEXT = 512
MESSAGES: list[Any] = [{"role": "user", "content": "What is 12 + 7?"}]
TOOL_F = {"type": "function", "function": {"name": "f"}}


@pytest.fixture(scope="module")
def served(tiny_model: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "reference",
        tiny_model,
        api_key=API_KEY,
        startup_timeout_s=120,
        options={"threads": 1, "max_model_len": CONTEXT, "tool_call_parser": "hermes"},
    )
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(served: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def chat(client: openai.OpenAI, model: str, **kw: Any) -> Any:
    extra = kw.pop("extra_body", {})
    return client.chat.completions.create(model=model, messages=kw.pop("messages", MESSAGES), extra_body=extra, **kw)


def ids_of(choice: Any) -> list[int]:
    return [int(t.token.split(":")[-1]) for t in choice.logprobs.content]


# --- errors: the official client's exception classes, with the server's param ---------------------


def test_validation_error_is_bad_request_naming_param(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, temperature=5.0, max_tokens=2)
    assert e.value.status_code == 400 and e.value.param == "temperature", e.value.body
    assert str(e.value.code) == "400" and "temperature" in e.value.message


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= ("}}}, "structured_outputs"),
        ({"stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
        ({"extra_body": {"chat_template_kwargs": {"tokenize": False}}}, "chat_template_kwargs"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids"),
        ({"max_tokens": CONTEXT}, "max_tokens"),
    ],
)
def test_refusals_are_bad_request_naming_param(client: openai.OpenAI, model: str, kw: Any, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, **{"max_tokens": 2, **kw})
    assert e.value.param == param, e.value.body


def test_wrong_key_is_authentication_error(served: ServerProcess, model: str) -> None:
    bad = openai.OpenAI(base_url=f"{served.url}/v1", api_key="sk-wrong", max_retries=0)
    with bad, pytest.raises(openai.AuthenticationError) as e:
        chat(bad, model, max_tokens=2)
    assert e.value.status_code == 401 and e.value.type == "authentication_error"


def test_unknown_model_route_and_method_are_openai_shaped(client: openai.OpenAI, served: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, "no-such-model", max_tokens=2)
    assert e.value.param == "model"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for method, path, status in (("POST", "/v1/no-such-route", 404), ("GET", "/v1/chat/completions", 405)):
        r = httpx.request(method, served.url + path, headers=headers, timeout=30)
        err = r.json()["error"]
        assert r.status_code == status and set(err) == {"message", "type", "param", "code"}, r.text
        assert err["code"] == status


def test_model_object_has_created(client: openai.OpenAI) -> None:
    card = client.models.list().data[0]
    assert card.object == "model" and card.created > 1_600_000_000


# --- parameters -------------------------------------------------------------------------------------


def test_unknown_fields_ignored_and_content_parts_name_accepted(client: openai.OpenAI, model: str) -> None:
    plain = chat(client, model, max_tokens=6, temperature=0)
    parts = chat(
        client,
        model,
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is 12 + 7?"}], "name": "ann"}],
        max_tokens=6,
        temperature=0,
        extra_body={"some_vllm_field_we_do_not_know": 1, "priority": 0},
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_stop_strings_cut_the_same_generation(client: openai.OpenAI, model: str) -> None:
    """The text with ``stop`` is the prefix, before the stop string, of the same greedy text
    without it; with ``include_stop_str_in_output`` it ends with the stop string."""
    full = chat(client, model, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}).choices[0]
    text = full.message.content
    assert len(text) >= 8, text
    stop = text[5:7]
    at = text.index(stop)
    cut = chat(client, model, max_tokens=24, temperature=0, stop=stop, extra_body={"ignore_eos": True}).choices[0]
    assert cut.message.content == text[:at] and cut.finish_reason == "stop"
    assert cut.model_extra is not None and cut.model_extra["stop_reason"] == stop
    kept = chat(
        client,
        model,
        max_tokens=24,
        temperature=0,
        stop=[stop, "never-there"],
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    ).choices[0]
    assert kept.message.content == text[: at + len(stop)]


def test_stop_token_ids_end_at_the_first_occurrence(client: openai.OpenAI, model: str) -> None:
    kw: dict[str, Any] = {"max_tokens": 16, "temperature": 0, "logprobs": True}
    body = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    full = chat(client, model, **kw, extra_body=body).choices[0]
    ids = ids_of(full)
    target = ids[4]
    cut = chat(client, model, **kw, extra_body={**body, "stop_token_ids": [target]}).choices[0]
    assert ids_of(cut) == ids[: ids.index(target) + 1] and cut.finish_reason == "stop"
    assert cut.model_extra is not None and cut.model_extra["stop_reason"] == target


def test_logit_bias_forces_a_token_and_top_k_min_p_are_greedy_at_one(client: openai.OpenAI, model: str) -> None:
    forced = 300
    r = chat(
        client,
        model,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        logit_bias={str(forced): 100},
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True},
    ).choices[0]
    assert ids_of(r) == [forced] * 6
    greedy = chat(client, model, max_tokens=10, temperature=0).choices[0].message.content
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        sampled = chat(client, model, max_tokens=10, temperature=1.0, seed=11, extra_body=extra)
        assert sampled.choices[0].message.content == greedy, extra


def test_penalties_change_a_repetitive_greedy_text(client: openai.OpenAI, model: str) -> None:
    """Greedy on the tiny model repeats tokens; each penalty lowers the count of the most
    repeated token, by vLLM's rules (frequency: per occurrence; presence: once; repetition: the
    prompt's tokens too)."""
    kw: dict[str, Any] = {"max_tokens": 48, "temperature": 0, "logprobs": True}
    body = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    base = ids_of(chat(client, model, **kw, extra_body=body).choices[0])
    top = max(base.count(t) for t in set(base))
    assert top >= 4, base
    for name, value in (("frequency_penalty", 2.0), ("presence_penalty", 2.0), ("repetition_penalty", 3.0)):
        got = ids_of(chat(client, model, **kw, extra_body={**body, name: value}).choices[0])
        assert got != base and max(got.count(t) for t in set(got)) < top, (name, got)


def test_logprob_tokens_are_text_with_bytes(client: openai.OpenAI, model: str) -> None:
    r = chat(client, model, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2).choices[0]
    entries = r.logprobs.content
    assert "".join(e.token for e in entries) == r.message.content
    for e in entries:
        assert e.bytes == list(e.token.encode("utf-8")) and len(e.top_logprobs) == 2
        assert not any(c in e.token for c in "ĠĊ"), e.token


def test_without_max_tokens_generation_runs_to_the_context_end(client: openai.OpenAI, model: str) -> None:
    r = chat(client, model, temperature=0, logit_bias={"300": 100})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == CONTEXT


def test_prompt_logprobs_in_vllm_shape(served: ServerProcess, model: str) -> None:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 2, "return_token_ids": True}
    r = httpx.post(
        f"{served.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    )
    data = r.json()
    ids, entries = data["prompt_token_ids"], data["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for tid, entry in zip(ids[1:], entries[1:], strict=True):
        mine = entry[str(tid)]
        assert {1, 2} <= {e["rank"] for e in entry.values()} and isinstance(mine["decoded_token"], str)
        assert len(entry) == (2 if mine["rank"] <= 2 else 3)
        assert mine["logprob"] <= max(e["logprob"] for e in entry.values()) + 1e-6


def test_tools_rendered_and_chat_template_kwargs_passed(served: ServerProcess, model: str) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}

    def prompt_tokens(**kw: Any) -> int:
        body = {"model": model, "messages": MESSAGES, "max_tokens": 1, **kw}
        r = httpx.post(f"{served.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens"])

    plain = prompt_tokens()
    assert prompt_tokens(tools=[tool], tool_choice="none") > plain
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > plain
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == plain


def test_pipelinerl_actor_request_shape(served: ServerProcess, model: str) -> None:
    """PipelineRL's actor body (``pipelinerl/async_llm.py``): ``logprobs: 1``,
    ``include_stop_str_in_output``, ``skip_special_tokens: false`` and its configured extras;
    it reads the token ids back from ``token_id:N``. Those ids are the completion's, the
    text keeps the end marker, and usage counts them."""
    body = {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": 24,
        "temperature": 1.0,
        "top_k": 50,
        "top_logprobs": 1,
        "chat_template_kwargs": {"enable_thinking": False},
        "logprobs": 1,
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "seed": 5,
    }
    r = httpx.post(
        f"{served.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    parsed = [int(e["token"].split(":")[-1]) for e in choice["logprobs"]["content"]]
    assert parsed == choice["token_ids"] and len(parsed) == r.json()["usage"]["completion_tokens"]
    assert all(e["token"].startswith("token_id:") for e in choice["logprobs"]["content"])
    # The end marker, forced: its token id comes back and its text stays in the content.
    r = httpx.post(
        f"{served.url}/v1/chat/completions",
        json={**body, "logit_bias": {"2": 100}},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == "<|im_end|>"
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["token_id:2"]


# --- structured output and tool calls through the official client ----------------------------------

#: The conformance check's weather tool (a city of two).
WEATHER = TOOLS[0]


def test_json_schema_response_format(client: openai.OpenAI, model: str, tiny_model: Path) -> None:
    """The client's ``response_format`` json_schema: every choice is JSON of the schema (optional
    whitespace banned through ``logit_bias``, as the conformance check does)."""
    from pipelinerl_sdk.conformance.structured import SCHEMA, follows_schema, whitespace_ban

    fmt: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    ban = whitespace_ban(tiny_model)
    resp = chat(client, model, response_format=fmt, n=3, temperature=1.0, seed=3, max_tokens=48, logit_bias=ban)
    for c in resp.choices:
        assert c.finish_reason == "stop" and follows_schema(json.loads(c.message.content)), c


def test_required_tool_choice_gives_client_tool_calls(client: openai.OpenAI, model: str, tiny_model: Path) -> None:
    from pipelinerl_sdk.conformance.structured import whitespace_ban

    resp = chat(
        client,
        model,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        logit_bias=whitespace_ban(tiny_model),
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_hermes_tool_calls_are_parsed(client: openai.OpenAI, model: str) -> None:
    """``tool_choice`` auto on a server started with ``tool_call_parser=hermes``: a text in
    Hermes' format (forced here by a regex, the tiny model would not write it) comes back as the
    client's ``tool_calls``, the text before it as content; with ``tool_choice`` none it stays text."""
    block = r'I will check\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}</tool_call>'
    extra = {"structured_outputs": {"regex": block}}
    resp = chat(client, model, tools=[WEATHER], max_tokens=96, extra_body=extra)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will check.", choice
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    plain = chat(client, model, tools=[WEATHER], tool_choice="none", max_tokens=96, extra_body=extra).choices[0]
    assert plain.finish_reason == "stop" and not plain.message.tool_calls and "<tool_call>" in plain.message.content


def joined_stream(client: openai.OpenAI, model: str, **kw: Any) -> tuple[str, dict[int, dict[str, str]], str | None]:
    """(content, {call index: {id, name, arguments}}, finish reason) of a streamed choice 0,
    joined as a client joins deltas."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for part in ch.delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += part.id or ""
                call["name"] += (part.function.name if part.function else None) or ""
                call["arguments"] += (part.function.arguments if part.function else None) or ""
            finish = ch.finish_reason or finish
    return content, calls, finish


def test_streamed_tool_calls_add_up_to_the_non_streamed_ones(
    client: openai.OpenAI, model: str, tiny_model: Path
) -> None:
    """Streamed with the official client, a seeded choice's joined deltas give the same content,
    calls (name, arguments) and finish reason as the same request not streamed: ``required``,
    a named function (its arguments streamed part by part) and hermes-parsed calls."""
    from pipelinerl_sdk.conformance.structured import whitespace_ban

    block = r'I will check\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}</tool_call>'
    ban = whitespace_ban(tiny_model)
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    cases: list[dict[str, Any]] = [
        {"tool_choice": "required", "parallel_tool_calls": False, "logit_bias": ban},
        {"tool_choice": named, "logit_bias": ban},
        {"extra_body": {"structured_outputs": {"regex": block}}},
    ]
    for kw in cases:
        kw = {"tools": [WEATHER], "max_tokens": 96, "seed": 5, "temperature": 1.0, **kw}
        want = chat(client, model, **kw).choices[0]
        content, calls, finish = joined_stream(client, model, **kw)
        assert finish == want.finish_reason and content == (want.message.content or ""), (kw, content, want)
        got = [(calls[k]["name"], calls[k]["arguments"]) for k in sorted(calls)]
        assert got == [(c.function.name, c.function.arguments) for c in want.message.tool_calls or []], (kw, got)
        assert got and all(calls[k]["id"].startswith("chatcmpl-tool-") for k in calls), calls
