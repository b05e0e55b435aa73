"""Structured output, as vLLM 0.32 serves it: what a request constrains its text to, and the
token constraint a Python-loop engine applies at every step.

What constrains the text (:func:`structured_output`):

- ``response_format`` ``json_object``: any JSON object; ``json_schema``: JSON matching
  ``json_schema.schema``;
- vLLM's ``structured_outputs`` extension: ``json``, ``json_object``, ``regex``, ``grammar``
  (EBNF), ``choice``, and ``disable_any_whitespace``;
- ``tool_choice`` ``"required"``: a JSON array of at least one ``{"name", "parameters"}`` object,
  one of the ``tools`` with its parameters' schema (vLLM's schema); a named function: that
  function's parameters (an object), without optional whitespace if the extension's
  ``disable_any_whitespace`` says so. The text becomes ``tool_calls``
  (:func:`pipelinerl_sdk.kit.inference.tools.choice_tool_calls`).

An engine with its own structured outputs maps :class:`StructuredOutput` onto them (vLLM's
``StructuredOutputsParams``); a Python-loop engine uses :class:`Grammars` (xgrammar, the grammar
library vLLM's default backend uses): one :class:`GrammarConstraint` per sample masks the tokens
that cannot continue a valid text before the draw, accepts the drawn one, and says when the text
is complete. Logprobs are then those of the masked distribution (vLLM applies the grammar's mask
before it computes them; a token the grammar forbids has none).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Literal

from pipelinerl_sdk.errors import InvalidRequest
from pipelinerl_sdk.protocol import ChatCompletionRequest

__all__ = ["GrammarConstraint", "Grammars", "StructuredOutput", "choice_grammar", "forced_tool", "structured_output"]

#: What to install for :class:`Grammars`.
XGRAMMAR_HINT = "pip install 'pipelinerl-sdk[structured]' (xgrammar)"


Kind = Literal["json_object", "json_schema", "regex", "grammar", "choice"]


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What a request's text must be: ``kind`` ``json_object`` (any JSON object),
    ``json_schema`` (``spec`` its JSON text), ``regex`` (``spec``), ``grammar`` (``spec``, an EBNF
    grammar, xgrammar's dialect as in vLLM) or ``choice`` (``spec`` a JSON list of strings: exactly
    one of them); ``any_whitespace`` False: JSON without optional whitespace (vLLM's
    ``disable_any_whitespace``); ``field`` the request field that asked it (``response_format``,
    ``structured_outputs`` or ``tool_choice``); ``tool`` the forced tool's mode: ``"required"``,
    a function name, or None."""

    kind: Kind
    spec: str | None
    field: str
    tool: str | None = None
    any_whitespace: bool = True


def _function_tools(req: ChatCompletionRequest) -> dict[str, dict[str, Any]]:
    """name -> parameters schema of the request's function tools (InvalidRequest naming
    ``tools`` for a tool without a function name)."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(req.tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"tools.{i}: a function tool needs function.name", field=f"tools.{i}")
        params = fn.get("parameters") if isinstance(fn, dict) else None
        out[name] = params if isinstance(params, dict) and params else {"type": "object", "properties": {}}
    return out


def forced_tool(req: ChatCompletionRequest) -> str | None:
    """The tool mode ``tool_choice`` forces: ``"required"``, the named function's name, or None
    (``none``, ``auto``, absent). InvalidRequest naming ``tool_choice`` for another string or an
    object that names no function."""
    choice = req.tool_choice
    if choice is None or choice in ("none", "auto"):
        return None
    if choice == "required":
        return "required"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") == "function" and isinstance(name, str) and name:
            return name
    raise InvalidRequest(
        f"tool_choice: {choice!r} is none of 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}",
        field="tool_choice",
    )


def _required_schema(tools: dict[str, dict[str, Any]], parallel: bool | None) -> dict[str, Any]:
    """vLLM's schema of ``tool_choice="required"``: an array of at least one (at most one with
    ``parallel_tool_calls`` false) ``{"name", "parameters"}`` of one of the tools."""
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                    "required": ["name", "parameters"],
                }
                for name, params in tools.items()
            ],
        },
    }
    if parallel is False:
        schema["maxItems"] = 1
    return schema


def _from_extension(req: ChatCompletionRequest) -> StructuredOutput | None:
    """vLLM's ``structured_outputs`` extension, with a structured ``response_format`` overriding
    its constraint (vLLM's order; ``disable_any_whitespace`` kept)."""
    ext, fmt = req.structured_outputs, req.response_format
    any_ws = not (ext is not None and ext.disable_any_whitespace)
    if fmt is not None and fmt.type == "json_object":
        return StructuredOutput("json_object", None, "response_format", any_whitespace=any_ws)
    if fmt is not None and fmt.type == "json_schema":
        spec = fmt.json_schema
        if spec is None or spec.json_schema_body is None:
            raise InvalidRequest(
                "response_format: type 'json_schema' needs json_schema.schema", field="response_format.json_schema"
            )
        schema = json.dumps(spec.json_schema_body)
        return StructuredOutput("json_schema", schema, "response_format", any_whitespace=any_ws)
    if ext is None:
        return None
    field = "structured_outputs"
    if ext.json_ is not None:
        schema = ext.json_ if isinstance(ext.json_, str) else json.dumps(ext.json_)
        return StructuredOutput("json_schema", schema, field, any_whitespace=any_ws)
    if ext.json_object:
        return StructuredOutput("json_object", None, field, any_whitespace=any_ws)
    if ext.regex is not None:
        return StructuredOutput("regex", ext.regex, field)
    if ext.grammar is not None:
        return StructuredOutput("grammar", ext.grammar, field)
    if ext.choice is not None:
        return StructuredOutput("choice", json.dumps(ext.choice), field)
    return None


def structured_output(req: ChatCompletionRequest) -> StructuredOutput | None:
    """What ``req`` constrains its text to (None: free text), as vLLM 0.32 decides: a forced
    ``tool_choice`` overrides any other constraint; a structured ``response_format`` overrides the
    ``structured_outputs`` extension's. InvalidRequest naming the field for a ``json_schema``
    without a schema, or a forced tool choice without ``tools`` or naming a tool not among them."""
    tool = forced_tool(req)
    if tool is None:
        return _from_extension(req)
    if not req.tools:
        raise InvalidRequest(f"tool_choice: {req.tool_choice!r} needs tools", field="tool_choice")
    tools = _function_tools(req)
    # the extension's disable_any_whitespace holds for the call's JSON too (vLLM 0.32 takes the
    # request's flag nowhere: its adapter refuses it, so no vLLM answer differs)
    any_ws = not (req.structured_outputs is not None and req.structured_outputs.disable_any_whitespace)
    if tool == "required":
        schema = _required_schema(tools, req.parallel_tool_calls)
        return StructuredOutput("json_schema", json.dumps(schema), "tool_choice", tool, any_ws)
    if tool not in tools:
        raise InvalidRequest(f"tool_choice: tool {tool!r} is not among the request's tools", field="tool_choice")
    return StructuredOutput("json_schema", json.dumps(tools[tool]), "tool_choice", tool, any_ws)


def _ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal (quotes, backslashes and control characters escaped)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_grammar(spec: str | None) -> str:
    """The EBNF grammar (xgrammar's dialect) of a ``choice`` constraint: exactly one of the
    strings of ``spec`` (a JSON list), each an escaped string literal."""
    choices = json.loads(spec or "[]")
    return "root ::= " + " | ".join(_ebnf_literal(str(c)) for c in choices)


class GrammarConstraint:
    """One sample's constraint (an xgrammar matcher): :meth:`mask_` before each draw,
    :meth:`accept` after it; :attr:`done` once the text is complete (the end-of-sequence token
    accepted, or nothing but it may follow)."""

    def __init__(self, matcher: Any, vocab_size: int, xgr: Any) -> None:
        self._matcher, self._xgr = matcher, xgr
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask_(self, logits: Any) -> None:
        """Set to -inf, in place, the logits (one fp32 row) of tokens that cannot continue."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        row = logits.view(1, -1)
        self._xgr.apply_token_bitmask_inplace(row, self._bitmask.to(row.device))

    def accept(self, token: int) -> None:
        """Advance past ``token`` (one :meth:`mask_` allowed); RuntimeError if it did not."""
        if not self._matcher.accept_token(int(token)):
            raise RuntimeError(f"the grammar refused token {token}, which its mask allowed")

    @property
    def done(self) -> bool:
        return bool(self._matcher.is_terminated())


class Grammars:
    """Compiled grammars of one tokenizer (xgrammar's compiler, its cache included), thread-safe:
    :meth:`constraint` gives a fresh :class:`GrammarConstraint` per sample. The first use
    imports xgrammar; without it, InvalidRequest naming the request's field and what to install."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer, self._vocab_size, self._stop = tokenizer, vocab_size, list(stop_token_ids)
        self._compiler: Any = None
        self._xgr: Any = None
        self._lock = threading.Lock()

    def _load(self, field: str) -> tuple[Any, Any]:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise InvalidRequest(
                        f"{field}: structured output needs xgrammar on this server ({XGRAMMAR_HINT})", field=field
                    ) from None
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop
                )
                self._compiler, self._xgr = xgr.GrammarCompiler(info), xgr
            return self._compiler, self._xgr

    def compile(self, so: StructuredOutput) -> Any:
        """The compiled grammar of ``so`` (cached by the compiler); InvalidRequest naming its
        field for a spec xgrammar cannot compile."""
        compiler, _ = self._load(so.field)
        ws: dict[str, Any] = {"any_whitespace": so.any_whitespace}
        if not so.any_whitespace:
            ws["separators"] = (",", ":")
        try:
            if so.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', **ws)
            if so.kind == "json_schema":
                return compiler.compile_json_schema(so.spec or "{}", **ws)
            if so.kind == "regex":
                return compiler.compile_regex(so.spec or "")
            if so.kind == "grammar":
                return compiler.compile_grammar(so.spec or "")
            return compiler.compile_grammar(choice_grammar(so.spec))
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequest(f"{so.field}: does not compile to a grammar: {e}", field=so.field) from e

    def constraint(self, compiled: Any) -> GrammarConstraint:
        """A fresh constraint for one sample of a :meth:`compile` d grammar."""
        _, xgr = self._load("response_format")
        return GrammarConstraint(xgr.GrammarMatcher(compiled), self._vocab_size, xgr)
