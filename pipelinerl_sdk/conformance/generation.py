"""Checks that generation parameters do what vLLM does with them: the engine's sampling, not only
the schema. Each is gated on the capability the backend declares.

- ``stop``: the text with a stop string is the same greedy generation's text up to (excluded)
  the stop string's first occurrence, and ``stop`` is its finish reason; with
  ``include_stop_str_in_output`` it ends with the stop string. Exact (no tolerance).
- ``logit_bias``: +100 on one token makes every sampled token that token (temperature 1, its
  bias dwarfs any logit gap of a real model); -100 on the greedy first token moves the greedy
  choice off it. Exact.
- Penalties: on a greedy text that repeats a token, a frequency penalty lowers the count of its
  most repeated token. Exact.
- ``streaming``: the chunks of a seeded sampled request (``n`` 2, logprobs, token ids; greedy on a
  backend that does not declare ``seeds``) add up,
  per choice, to the same request's non-streamed text, token ids, logprobs and weight versions,
  with the finish reason on the last content chunk only; with ``stop_strings`` declared, the same
  for a greedy request with a stop string. Exact (no tolerance): one token dropped or sent
  twice, or one character of a stop string streamed, is a failure.
- Streamed tool calls (``streaming`` and ``structured_outputs``; optional JSON whitespace kept
  out as the structured-output checks do): a greedy ``tool_choice``
  ``required`` and a named-function request, streamed, join (content, and the tool-call parts by
  index) to the non-streamed message's content and calls, with its finish reason and its tokens'
  ids and versions; each call's id, type and name come on its first part. Exact.
"""

from __future__ import annotations

from typing import Any

import pytest

from pipelinerl_sdk.conformance.common import PROMPT, arun
from pipelinerl_sdk.conformance.mirror import Mirror
from pipelinerl_sdk.conformance.structured import TOOLS, no_whitespace
from pipelinerl_sdk.conformance.targets import ServerUnderTest
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.protocol import ChatChoice, ChatCompletionChunk

#: Tokens of the greedy text the stop and penalty checks cut or count.
TOKENS = 32


async def _one(client: InferenceClient, **extra: Any) -> ChatChoice:
    body = {"messages": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    resp = await client.chat({**body, **extra})
    choice = resp.choices[0]
    assert choice.token_ids is not None, "return_token_ids: choices[].token_ids missing"
    return choice


def stop_string_of(text: str) -> tuple[str, int]:
    """A two-character stop string from the middle of ``text`` and its first occurrence (no
    U+FFFD: a partial UTF-8 character decodes to it until its last byte arrives)."""
    for start in range(len(text) // 3, len(text) - 2):
        stop = text[start : start + 2]
        if stop.strip() and stop.isprintable() and "\ufffd" not in stop:
            return stop, text.index(stop)
    raise AssertionError(f"greedy text {text!r} has no printable two characters to stop on")


def _most_repeated(ids: list[int]) -> int:
    return max(ids.count(t) for t in set(ids))


class GenerationChecks:
    """Mixed into :class:`~pipelinerl_sdk.conformance.inference.InferenceContractTests`."""

    @pytest.mark.requires("stop_strings")
    def test_stop_strings_cut_where_they_should(self, server_under_test: ServerUnderTest, mirror: Mirror) -> None:
        """``stop``: the text equals the greedy text without ``stop`` up to the stop string's
        first occurrence (excluded), finish reason ``stop``; with ``include_stop_str_in_output``
        the stop string ends the text. Exact, like vLLM's detokenizer."""

        async def body() -> None:
            async with server_under_test.client() as client:
                full = await _one(client)
                text = full.message.content
                stop, at = stop_string_of(text)
                cut = await _one(client, stop=[stop])
                kept = await _one(client, stop=stop, include_stop_str_in_output=True)
            assert cut.finish_reason == "stop", f"stop={stop!r} hit at {at}: finish_reason {cut.finish_reason!r}"
            assert cut.message.content == text[:at], (
                f"stop={stop!r}: text {cut.message.content!r} is not the greedy text before the stop string "
                f"{text[:at]!r} (full text {text!r})"
            )
            assert kept.message.content == text[: at + len(stop)], (
                f"stop={stop!r} with include_stop_str_in_output: text {kept.message.content!r}, expected "
                f"{text[: at + len(stop)]!r}"
            )

        arun(body)

    @pytest.mark.requires("logit_bias")
    def test_logit_bias_forces_a_token(self, server_under_test: ServerUnderTest, mirror: Mirror) -> None:
        """``logit_bias`` +100 on a token the model does not favour makes it every sampled
        token (temperature 1); -100 on the greedy first token moves greedy off it."""

        async def body() -> None:
            async with server_under_test.client() as client:
                greedy = await _one(client, max_tokens=4)
                assert greedy.token_ids
                first = greedy.token_ids[0]
                forced = next(
                    t for t in range(int(mirror.model.config.vocab_size) - 1, 0, -1) if t not in greedy.token_ids
                )
                pushed = await _one(client, max_tokens=8, temperature=1.0, seed=7, logit_bias={str(forced): 100})
                banned = await _one(client, max_tokens=1, logit_bias={str(first): -100})
            assert pushed.token_ids == [forced] * 8, (
                f"logit_bias +100 on token {forced}: sampled {pushed.token_ids} "
                f"({(pushed.token_ids or []).count(forced)} of 8 are {forced})"
            )
            assert banned.token_ids != [first], f"logit_bias -100 on the greedy token {first}: still chosen"

        arun(body)

    @pytest.mark.requires("penalties")
    def test_penalties_change_a_repetitive_greedy_text(
        self, server_under_test: ServerUnderTest, mirror: Mirror
    ) -> None:
        """A frequency penalty of 2 lowers the count of the most repeated token of a greedy text
        of ``TOKENS`` tokens that repeats one (skipped on a model whose greedy text does not)."""

        async def body() -> None:
            async with server_under_test.client() as client:
                base = (await _one(client)).token_ids or []
                if _most_repeated(base) < 4:
                    pytest.skip(f"the greedy text repeats no token 4 times: {base}")
                penalised = (await _one(client, frequency_penalty=2.0)).token_ids or []
            assert _most_repeated(penalised) < _most_repeated(base), (
                f"frequency_penalty=2 left the most repeated token at {_most_repeated(penalised)} of {TOKENS} "
                f"(without: {_most_repeated(base)}): {penalised}"
            )

        arun(body)

    @pytest.mark.requires("streaming")
    def test_streamed_deltas_add_up_to_the_non_streamed_text(
        self, server_under_test: ServerUnderTest, mirror: Mirror
    ) -> None:
        """``stream=true``: a seeded sampled request (n 2, logprobs, token ids, usage) streamed
        gives, per choice, the deltas whose concatenation is the non-streamed text, and token
        ids, logprobs and weight versions (one per token) equal to the non-streamed ones; the
        role comes first, the finish reason on the last content chunk, usage last. A backend
        that does not declare ``seeds`` cannot replay a sample, so its streams are greedy. With
        ``stop_strings`` declared, the same holds for a greedy request with a stop string (no
        character of it streamed). Exact."""
        sampled = {"temperature": 1.0, "seed": 5} if server_under_test.capabilities.seeds else {"temperature": 0}
        body = {
            "messages": PROMPT,
            "max_tokens": TOKENS,
            **sampled,
            "n": 2,
            "logprobs": True,
            "return_token_ids": True,
        }

        async def body_() -> None:
            async with server_under_test.client() as client:
                whole = await client.chat(body)
                chunks = [c async for c in client.chat_stream({**body, "stream_options": {"include_usage": True}})]
            check_stream(whole.choices, chunks)
            assert chunks[-1].usage == whole.usage, f"usage chunk {chunks[-1].usage} != non-streamed {whole.usage}"
            if not server_under_test.capabilities.stop_strings:
                return
            async with server_under_test.client() as client:  # a stop string: never streamed past
                greedy = {**body, "temperature": 0, "n": 1, "ignore_eos": True}
                greedy.pop("seed", None)
                stop, _ = stop_string_of((await client.chat(greedy)).choices[0].message.content)
                cut = await client.chat({**greedy, "stop": [stop]})
                cut_chunks = [c async for c in client.chat_stream({**greedy, "stop": [stop]})]
            check_stream(cut.choices, cut_chunks, f"with stop={stop!r}: ")

        arun(body_)

    @pytest.mark.requires("streaming", "structured_outputs")
    def test_streamed_tool_calls_add_up_to_the_non_streamed_calls(self, server_under_test: ServerUnderTest) -> None:
        """A forced tool choice streamed (greedy: ``required`` with one call, and a named
        function) joins to the non-streamed message: same content, the same calls (name and
        arguments, parts joined by index), the finish reason on the last chunk, the same token
        ids and versions (module docstring). Exact."""
        base: dict[str, Any] = {
            "messages": PROMPT,
            "max_tokens": 96,
            "temperature": 0,
            "tools": TOOLS,
            "return_token_ids": True,
            **no_whitespace(server_under_test),
        }
        named = {"type": "function", "function": {"name": "get_time"}}
        cases: dict[str, dict[str, Any]] = {
            "tool_choice='required'": {"tool_choice": "required", "parallel_tool_calls": False},
            "tool_choice get_time": {"tool_choice": named},
        }

        async def body() -> None:
            for what, extra in cases.items():
                async with server_under_test.client() as client:
                    whole = await client.chat({**base, **extra})
                    chunks = [c async for c in client.chat_stream({**base, **extra})]
                (choice,) = whole.choices
                want = [(c["function"]["name"], c["function"]["arguments"]) for c in choice.message.tool_calls]
                assert want, f"{what}: the non-streamed choice has no tool call: {choice.message}"
                content, calls = streamed_message(chunks, what)
                assert calls == want, f"{what}: streamed calls {calls} != non-streamed {want}"
                assert content == choice.message.content, (
                    f"{what}: streamed content {content!r} != non-streamed {choice.message.content!r}"
                )
                streamed = choice.model_copy(update={"message": choice.message.model_copy(update={"content": ""})})
                check_stream([streamed], [chunks[0], *_without_content(chunks[1:])], f"{what}: ")

        arun(body)


def streamed_message(chunks: list[ChatCompletionChunk], what: str) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)] by index) of choice 0 of ``chunks``, joined as a client
    joins them; AssertionError where a call's first part lacks its id, type or name, or a later
    part repeats them."""
    content, calls = "", {}
    for ch in chunks[1:]:
        for c in ch.choices:
            content += c.delta.content or ""
            for part in c.delta.tool_calls or []:
                fn = part.get("function") or {}
                if part["index"] not in calls:
                    assert part.get("id") and part.get("type") == "function" and fn.get("name"), (
                        f"{what}: a call's first streamed part lacks its id, type or name: {part}"
                    )
                    calls[part["index"]] = [fn["name"], ""]
                else:
                    assert "id" not in part and "name" not in fn, (
                        f"{what}: a later part repeats the call's id or name: {part}"
                    )
                calls[part["index"]][1] += fn.get("arguments", "")
    return content, [(n, a) for n, a in (calls[k] for k in sorted(calls))]


def _without_content(chunks: list[ChatCompletionChunk]) -> list[ChatCompletionChunk]:
    """``chunks`` with their text content dropped (compared separately)."""
    return [
        ch.model_copy(
            update={
                "choices": [
                    c.model_copy(update={"delta": c.delta.model_copy(update={"content": None})}) for c in ch.choices
                ]
            }
        )
        for ch in chunks
    ]


def check_stream(choices: list[ChatChoice], chunks: list[ChatCompletionChunk], what: str = "") -> None:
    """AssertionError (its message led by ``what``) naming the first difference between
    ``chunks`` and the non-streamed ``choices`` of the same request."""
    assert chunks and all(c.delta.role == "assistant" for c in chunks[0].choices), "the first chunk is not the role's"
    for choice in choices:
        mine = [c for ch in chunks[1:] for c in ch.choices if c.index == choice.index]
        text = "".join(c.delta.content or "" for c in mine)
        ids = [t for c in mine for t in c.token_ids or []]
        versions = [v for c in mine for v in c.weight_versions]
        lps = [t.logprob for c in mine for t in (c.logprobs.content if c.logprobs else [])]
        want_lps = [t.logprob for t in choice.logprobs.content] if choice.logprobs else []
        assert text == choice.message.content, (
            f"{what}choice {choice.index}: streamed deltas add up to {len(text)} characters {text!r}, the non-streamed "
            f"text has {len(choice.message.content)}: {choice.message.content!r}"
        )
        assert ids == choice.token_ids, (
            f"choice {choice.index}: streamed token ids ({len(ids)}) {ids} != non-streamed "
            f"({len(choice.token_ids or [])}) {choice.token_ids}"
        )
        assert versions == choice.weight_versions, (
            f"choice {choice.index}: streamed weight versions {versions} != non-streamed {choice.weight_versions}"
        )
        assert lps == want_lps, f"choice {choice.index}: streamed logprobs {lps} != non-streamed {want_lps}"
        reasons = [c.finish_reason for c in mine]
        assert reasons and reasons[-1] == choice.finish_reason and not any(reasons[:-1]), (
            f"choice {choice.index}: finish reasons by chunk {reasons}, non-streamed {choice.finish_reason!r}"
        )
