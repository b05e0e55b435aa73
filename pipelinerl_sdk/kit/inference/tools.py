"""Tool calls in a chat choice, as vLLM 0.32 makes them.

- ``tool_choice`` ``"required"``: the text (constrained to vLLM's schema,
  :func:`~pipelinerl_sdk.kit.inference.structured.structured_output`) is a JSON array of
  ``{"name", "parameters"}``; each becomes a call, finish reason ``tool_calls``;
- a named function: the text (its parameters' JSON) is that call's ``arguments``, finish reason
  as generated (``stop``);
- ``auto`` (or absent) with ``tools`` and a tool-call parser on the server
  (``--option tool_call_parser=hermes``): calls parsed from the text, finish reason
  ``tool_calls`` when there are some. Parsers: ``hermes`` (Qwen2.5/Qwen3's and Hermes' format,
  one ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block per call).

Text that does not parse stays content, with no calls (as vLLM). Content is the text before
the first call (``""`` when none).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from pipelinerl_sdk.kit.inference.structured import forced_tool
from pipelinerl_sdk.protocol import ChatCompletionRequest

__all__ = ["TOOL_CALL_PARSERS", "choice_tool_calls", "parse_hermes"]

#: Tool-call parsers a server can be started with (``--option tool_call_parser=NAME``).
TOOL_CALL_PARSERS = ("hermes",)

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def parse_hermes(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, calls) of a Hermes-format text: every ``<tool_call>...</tool_call>`` block (the
    last may be unterminated) a JSON object with a string ``name`` and ``arguments``; content is
    the text before the first block. Any block that does not parse: ``(text, [])``."""
    if "<tool_call>" not in text:
        return text, []
    calls: list[dict[str, Any]] = []
    for m in _HERMES.finditer(text):
        body = (m.group(1) if m.group(1) is not None else m.group(2) or "").strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(_call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    return text[: text.index("<tool_call>")], calls


def _required_calls(text: str) -> list[dict[str, Any]] | None:
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not all(
        isinstance(i, dict) and isinstance(i.get("name"), str) and "parameters" in i for i in items
    ):
        return None
    return [_call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]


def choice_tool_calls(
    req: ChatCompletionRequest, text: str, finish_reason: str, parser: str | None
) -> tuple[str, list[dict[str, Any]], str]:
    """(content, tool_calls, finish_reason) of one choice's ``text`` (module docstring); a
    request without tools, or with ``tool_choice`` ``none``, keeps its text."""
    if not req.tools or req.tool_choice == "none":
        return text, [], finish_reason
    tool = forced_tool(req)
    if tool == "required":
        calls = _required_calls(text)
        if calls is None:
            return text, [], finish_reason
        return "", calls, "tool_calls" if finish_reason == "stop" else finish_reason
    if tool is not None:
        return ("", [_call(tool, text)], finish_reason) if text.strip() else (text, [], finish_reason)
    if parser == "hermes":
        content, calls = parse_hermes(text)
        return content, calls, "tool_calls" if calls else finish_reason
    return text, [], finish_reason
