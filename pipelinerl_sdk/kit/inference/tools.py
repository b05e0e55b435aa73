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

Streamed (:class:`ToolCallStream`), a choice's deltas add up to the same message: a named
function's arguments stream as they are released (the call's id, type and name on its first
part, as vLLM streams them); ``required`` calls and parsed calls come whole in the choice's last
chunk, since only the finished text says whether it parses (Hermes content before the first
``<tool_call>`` streams as it comes).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from pipelinerl_sdk.kit.inference.structured import forced_tool
from pipelinerl_sdk.protocol import ChatCompletionRequest

__all__ = ["TOOL_CALL_PARSERS", "ToolCallStream", "choice_tool_calls", "parse_hermes"]

#: Tool-call parsers a server can be started with (``--option tool_call_parser=NAME``).
TOOL_CALL_PARSERS = ("hermes",)

_TAG = "<tool_call>"
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


def _tag_start(text: str) -> int:
    """Where in ``text`` a Hermes call begins or may begin: the first ``<tool_call>``, else the
    longest end that is a start of one (it may complete into it), else ``len(text)``."""
    at = text.find(_TAG)
    if at >= 0:
        return at
    for k in range(min(len(_TAG) - 1, len(text)), 0, -1):
        if text.endswith(_TAG[:k]):
            return len(text) - k
    return len(text)


class ToolCallStream:
    """One streamed choice's tool calls (module docstring): :meth:`step` turns the text a step
    releases into (content delta, tool-call parts, finish reason) so that the content deltas
    add up to the non-streamed message's ``content`` and the parts to its ``tool_calls``
    (ids aside), with the same finish reason (:func:`choice_tool_calls`)."""

    def __init__(self, req: ChatCompletionRequest, parser: str | None) -> None:
        self.req, self.parser = req, parser
        self.mode: str | None = None  # None: plain text; "named", "required", "hermes"
        self.name: str | None = None
        if req.tools and req.tool_choice != "none":
            tool = forced_tool(req)
            if tool == "required":
                self.mode = "required"
            elif tool is not None:
                self.mode, self.name = "named", tool
            elif parser == "hermes":
                self.mode = "hermes"
        self.text = ""
        self.sent = 0  # characters of text sent as content (hermes) or as arguments (named)
        self.call_id: str | None = None

    def step(self, delta: str, finish_reason: str | None) -> tuple[str, list[dict[str, Any]], str | None]:
        """(content to send, tool-call parts to send, finish reason) for a step that released
        ``delta`` (``finish_reason`` set on the choice's last step)."""
        if self.mode is None:
            return delta, [], finish_reason
        self.text += delta
        done = finish_reason is not None
        if self.mode == "named":
            return self._named(done), self._named_parts(done), finish_reason
        if not done:
            if self.mode == "hermes":
                upto = _tag_start(self.text)
                out, self.sent = self.text[self.sent : upto], max(self.sent, upto)
                return out, [], None
            return "", [], None
        content, calls, finish = choice_tool_calls(self.req, self.text, finish_reason or "stop", self.parser)
        parts = [{"index": k, **c} for k, c in enumerate(calls)]
        return content[self.sent :], parts, finish  # what was sent is a start of the content

    def _named(self, done: bool) -> str:
        # whitespace-only text is content (no call), as the non-streamed choice has it
        return self.text if done and self.call_id is None and not self.text.strip() else ""

    def _named_parts(self, done: bool) -> list[dict[str, Any]]:
        if self.call_id is None:
            if not self.text.strip():
                return []
            call = _call(self.name or "", self.text)
            self.call_id, self.sent = call["id"], len(self.text)
            return [{"index": 0, **call}]
        new, self.sent = self.text[self.sent :], len(self.text)
        return [{"index": 0, "function": {"arguments": new}}] if new else []
