"""Structured output and tool calls, unit level: what a request constrains its text to (vLLM's
rules and schemas), the Hermes tool-call parser, a choice's tool calls, and the xgrammar
constraint a Python-loop engine applies (driven token by token over the tiny tokenizer)."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelinerl_sdk.errors import InvalidRequest
from pipelinerl_sdk.kit.inference.chat import constrain
from pipelinerl_sdk.kit.inference.structured import Grammars, structured_output
from pipelinerl_sdk.kit.inference.tools import ToolCallStream, choice_tool_calls, parse_hermes
from pipelinerl_sdk.protocol import ChatCompletionRequest
from pipelinerl_sdk.reference.tiny import build_tokenizer

MSG = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "now"}}


def req(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MSG, **kw})


def test_required_tool_choice_is_vllms_array_schema() -> None:
    so = structured_output(req(tools=[WEATHER, CLOCK], tool_choice="required"))
    assert so is not None and so.kind == "json_schema" and so.tool == "required" and so.field == "tool_choice"
    schema = json.loads(so.spec or "")
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [alt["properties"]["name"]["enum"] for alt in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["now"]]
    # a tool without parameters still takes an object, as in vLLM
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    one = structured_output(req(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    assert one is not None and json.loads(one.spec or "")["maxItems"] == 1


def test_named_tool_choice_constrains_to_its_parameters() -> None:
    so = structured_output(req(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert so is not None and so.tool == "get_weather"
    assert json.loads(so.spec or "") == WEATHER["function"]["parameters"]  # type: ignore[index]


def test_precedence_is_vllms_tool_then_response_format_then_extension() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    both = structured_output(
        req(response_format={"type": "json_object"}, structured_outputs={"regex": "a+", "disable_any_whitespace": True})
    )
    assert both is not None and both.kind == "json_object" and not both.any_whitespace
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    forced = structured_output(req(tools=[WEATHER], tool_choice="required", response_format=fmt))
    assert forced is not None and forced.field == "tool_choice"
    for kw, kind in (
        ({"json": schema}, "json_schema"),
        ({"json": json.dumps(schema)}, "json_schema"),
        ({"json_object": True}, "json_object"),
        ({"regex": "a+"}, "regex"),
        ({"grammar": 'root ::= "x"'}, "grammar"),
        ({"choice": ["a", "b"]}, "choice"),
    ):
        so = structured_output(req(structured_outputs=kw))
        assert so is not None and so.kind == kind and so.field == "structured_outputs"
    assert structured_output(req(response_format={"type": "text"})) is None
    assert structured_output(req(tools=[WEATHER], tool_choice="auto")) is None


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools.0"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ],
)
def test_bad_constraints_name_their_field(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        structured_output(req(**kw))
    assert e.value.field == field


def test_extension_refuses_two_constraints_and_what_is_not_served() -> None:
    bads = ({"regex": "a", "choice": ["x"]}, {"json_object": True, "grammar": "root ::= x"}, {"structural_tag": "t"})
    for bad in bads:
        with pytest.raises(ValueError, match="structured"):
            req(structured_outputs=bad)


def test_a_backend_without_structured_output_refuses_it_naming_the_field() -> None:
    for kw, field in (
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ):
        with pytest.raises(InvalidRequest) as e:
            constrain(req(**kw), served=False)
        assert e.value.field == field and "not served" in str(e.value)
    assert constrain(req(tools=[WEATHER], tool_choice="auto"), served=False) is None


def test_hermes_parser() -> None:
    one = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_hermes(one)
    assert content == "Let me look." and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("chatcmpl-tool-")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}'
    content, calls = parse_hermes(two)  # the last block unterminated; arguments given as text kept as text
    assert content == "" and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert calls[1]["function"]["arguments"] == '{"x": 1}'
    for text in ("no calls here", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'):
        assert parse_hermes(text) == (text, [])


def test_choice_tool_calls_follow_vllm() -> None:
    tools = {"tools": [WEATHER]}
    required = req(**tools, tool_choice="required")
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    content, calls, finish = choice_tool_calls(required, text, "stop", None)
    assert (content, finish) == ("", "tool_calls") and calls[0]["function"]["arguments"] == '{"city": "Rome"}'
    # cut short: not JSON, so no calls and the text stays content
    assert choice_tool_calls(required, '[{"name": "get_w', "length", None) == ('[{"name": "get_w', [], "length")
    named = req(**tools, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    content, calls, finish = choice_tool_calls(named, '{"city":"Rome"}', "stop", None)
    assert (content, finish) == ("", "stop")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city":"Rome"}'}
    hermes = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    auto = req(**tools, tool_choice="auto")
    assert choice_tool_calls(auto, hermes, "stop", None) == (hermes, [], "stop")  # no parser on the server
    assert choice_tool_calls(auto, hermes, "stop", "hermes")[2] == "tool_calls"
    assert choice_tool_calls(req(**tools, tool_choice="none"), hermes, "stop", "hermes") == (hermes, [], "stop")


def _drive(grammars: Grammars, so_req: ChatCompletionRequest, seed: int, max_tokens: int = 200) -> str:
    """Sample from random logits under the request's constraint until it is done."""
    tok = build_tokenizer()
    so = structured_output(so_req)
    assert so is not None
    constraint = grammars.constraint(grammars.compile(so))
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(max_tokens):
        logits = torch.randn(512, generator=gen)
        constraint.mask_(logits)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        constraint.accept(token)
        out.append(token)
        if constraint.done:
            break
    assert constraint.done, f"not complete after {max_tokens} tokens: {tok.decode(out)!r}"
    return str(tok.decode(out, skip_special_tokens=True))


def test_grammar_constraint_makes_only_valid_texts() -> None:
    pytest.importorskip("xgrammar")
    grammars = Grammars(build_tokenizer(), 512, [2])
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    tight = req(structured_outputs={"json": schema, "disable_any_whitespace": True})
    for seed in range(5):
        text = _drive(grammars, tight, seed)
        value = json.loads(text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3), text
        assert not re.search(r"\s", text), text
        assert _drive(grammars, req(structured_outputs={"choice": ["yes", "no way"]}), seed) in ("yes", "no way")
        assert re.fullmatch(r"[0-9]{2}x", _drive(grammars, req(structured_outputs={"regex": "[0-9]{2}x"}), seed))
    with pytest.raises(InvalidRequest) as e:
        grammars.compile(structured_output(req(structured_outputs={"grammar": "root ::= ("})))  # type: ignore[arg-type]
    assert e.value.field == "structured_outputs"


_TEXTS = [
    "",
    "  ",
    "plain text, no call",
    "I will check.<tool_call>",
    'I will check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    'a <tool_c b<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{"name": "now"}',
    'x <tool_call>{"name": 3}</tool_call>',
    '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "now", "parameters": {}}]',
    '{"city": "Rome"}',
    ' \n{"city": 1}',
    "[{]",
]


@settings(max_examples=300, deadline=None)
@given(
    text=st.sampled_from(_TEXTS) | st.text(alphabet='<tol_ca>{}[]" :,namecity', max_size=40),
    cuts=st.lists(st.integers(0, 120), max_size=8),
    choice=st.sampled_from(["none", "auto", "required", "named", None]),
    parser=st.sampled_from([None, "hermes"]),
    finish=st.sampled_from(["stop", "length"]),
)
def test_streamed_tool_calls_add_up_to_the_choice(
    text: str, cuts: list[int], choice: str | None, parser: str | None, finish: str
) -> None:
    """However a choice's text is cut into deltas, the streamed content joins to the
    non-streamed content, the tool-call parts (joined by index) to its calls (ids aside: each
    call's id on its first part only, with its type and name), the finish reason is the same."""
    kw: dict[str, Any] = {"tools": [WEATHER, CLOCK]}
    if choice == "named":
        kw["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    elif choice is not None:
        kw["tool_choice"] = choice
    r = req(**kw)
    want_content, want_calls, want_finish = choice_tool_calls(r, text, finish, parser)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)] or [""]
    stream, content, joined, last = ToolCallStream(r, parser), "", {}, None
    for k, piece in enumerate(pieces):
        done = k == len(pieces) - 1
        delta, parts, reason = stream.step(piece, finish if done else None)
        assert (reason is None) == (not done)
        content, last = content + delta, reason
        for p in parts:
            if p["index"] not in joined:
                assert p["type"] == "function" and p["id"].startswith("chatcmpl-tool-"), p
                joined[p["index"]] = {"name": p["function"]["name"], "arguments": ""}
            else:
                assert "id" not in p and "name" not in p["function"], p
            joined[p["index"]]["arguments"] += p["function"]["arguments"]
    assert content == want_content and last == want_finish
    assert [joined[k] for k in sorted(joined)] == [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in want_calls
    ]


def test_hermes_content_streams_before_the_call_and_holds_a_partial_tag() -> None:
    r, s = req(tools=[WEATHER]), None
    s = ToolCallStream(r, "hermes")
    assert s.step("I will <tool", None) == ("I will ", [], None)
    assert s.step("_c", None) == ("", [], None)  # may still become <tool_call>
    assert s.step("ar", None) == ("<tool_car", [], None)
    assert s.step(' then<tool_call>{"name": "now"}', None) == (" then", [], None)
    content, parts, finish = s.step("</tool_call>", "stop")
    assert content == "" and finish == "tool_calls" and parts[0]["function"] == {"name": "now", "arguments": "{}"}


def test_disable_any_whitespace_holds_for_a_forced_tool_call() -> None:
    """The extension's ``disable_any_whitespace`` holds for a forced tool call's JSON too (the
    conformance checks use it on a backend without ``logit_bias``); without it, any whitespace."""
    for choice in ("required", {"type": "function", "function": {"name": WEATHER["function"]["name"]}}):
        tight = structured_output(
            req(tools=[WEATHER], tool_choice=choice, structured_outputs={"disable_any_whitespace": True})
        )
        loose = structured_output(req(tools=[WEATHER], tool_choice=choice))
        assert tight is not None and tight.field == "tool_choice" and not tight.any_whitespace
        assert loose is not None and loose.any_whitespace
