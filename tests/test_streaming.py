"""Streamed chat (server-sent events) as vLLM 0.32 sends it, driven by the official ``openai``
client against a real reference server: the chunks of a seeded request add up to the
non-streamed request's text, token ids, logprobs and weight versions; stop strings hold; usage
comes last; a client that leaves frees its admission; a stream past the admission limits is a
429 before any event. The text release rule (:class:`TextStream`) is checked on its own with
hypothesis against the non-streamed rule."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipelinerl_sdk.conformance.generation import vllm_stop_cut
from pipelinerl_sdk.kit.inference.chat import StopRule
from pipelinerl_sdk.kit.inference.stream import StopBorders, TextStream, TokenStep, held_back
from pipelinerl_sdk.launch import ServerProcess
from pipelinerl_sdk.protocol import ChatCompletionRequest

API_KEY = "sk-test-stream"
MESSAGES: list[Any] = [{"role": "user", "content": "Tell me about fish."}]
#: Tokens of a stream that must still be running when the test acts on it (seconds of decoding).
LONG = 4000


# --- the release rule, without a server ------------------------------------------------------------


class CharTokenizer:
    """A tokenizer whose token ``i`` is the character ``ALPHABET[i]``: decode is exact. Its last
    token stands for a partial UTF-8 character (U+FFFD, as a byte-level tokenizer decodes one)."""

    ALPHABET = "ab c.\n\ufffd"

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.ALPHABET[i] for i in ids)


def test_a_partial_character_ending_the_text_is_dropped_as_vllm_drops_it() -> None:
    """A finished text never ends with U+FFFD (a partial UTF-8 character whose last bytes never
    came: vLLM's detokenizer drops it); one inside the text stays."""
    tok = CharTokenizer()
    rule = StopRule(tok, ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]))  # type: ignore[list-item]
    ids = [0, 6, 1, 6, 6]  # "a\ufffdb\ufffd\ufffd"
    assert rule.finish(ids, "length", frozenset()) == ("a\ufffdb", None)


def test_held_back_keeps_what_may_begin_a_stop_string() -> None:
    assert held_back("hello wo", ["world"]) == 2
    assert held_back("hello", ["world"]) == 0
    assert held_back("abc\ufffd", []) == 1
    assert held_back("xab", ["abab", "b"]) == 2


def _held_by_definition(text: str, stops: list[str]) -> int:
    """The trailing partial character, and before it the longest end that begins a stop string,
    by brute force (what :class:`StopBorders` keeps incrementally)."""
    stable = text.rstrip("\ufffd")
    longest = max(
        (k for s in stops for k in range(1, min(len(s) - 1, len(stable)) + 1) if stable.endswith(s[:k])), default=0
    )
    return longest + len(text) - len(stable)


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="ab\ufffd", max_size=4), min_size=1, max_size=25),
    stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=6), max_size=4),
)
def test_stop_borders_fed_piece_by_piece_hold_what_the_definition_holds(pieces: list[str], stops: list[str]) -> None:
    """Fed a text as it grows (its trailing U+FFFD later replaced, as a partial character is
    completed), the automata hold back exactly what the definition does at every step."""
    borders, text = StopBorders(stops), ""
    for piece in pieces:
        text = text.rstrip("\ufffd") + piece if piece and piece[0] != "\ufffd" else text + piece
        assert borders.held(text) == _held_by_definition(text, stops), (text, stops)


def test_long_stop_strings_are_held_back_step_by_step() -> None:
    """16 stop strings of up to 10,001 characters (issue 35, finding 3: each streamed token then
    compared up to every prefix of every stop string, 16 x 10,000^2 / 2 characters a step) over
    a text growing 2 characters a step for 1,024 steps: all of it may still begin a stop string,
    so all of it is held, at every step; the automata see each new character once per stop."""
    stops = [("ab" * 5000)[i:] + "c" for i in range(16)]
    borders, text = StopBorders(stops), ""
    for _ in range(1024):
        text += "ab"
        assert borders.held(text) == len(text)
    assert borders.held(text + "c") == 0  # a "c" this early begins no stop string: nothing held


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(0, len(CharTokenizer.ALPHABET) - 1), min_size=1, max_size=30),
    stops=st.lists(st.text(alphabet=CharTokenizer.ALPHABET, min_size=1, max_size=3), max_size=3),
    include=st.booleans(),
    cuts=st.lists(st.integers(1, 4), min_size=1, max_size=30),
    min_tokens=st.integers(0, 6),
)
def test_streamed_text_adds_up_to_the_non_streamed_text(
    ids: list[int], stops: list[str], include: bool, cuts: list[int], min_tokens: int
) -> None:
    """However the tokens are grouped into steps, the released deltas concatenate to what the
    non-streamed rule gives for the tokens up to the first stop (the engine stops there), and
    no delta ever holds a stop string's text that the final text leaves out (``min_tokens``
    included: a stop string inside the first tokens' text is streamed, not cut)."""
    tok = CharTokenizer()
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}],  # type: ignore[list-item]
        stop=stops or None,
        include_stop_str_in_output=include,
        min_tokens=min_tokens,
    )
    rule = StopRule(tok, req)
    end = next((k for k in range(1, len(ids) + 1) if rule.hit(ids[:k])), len(ids))  # the engine's stop
    ids = ids[:end]
    finish = "stop" if rule.hit(ids) else "length"
    expected, _ = rule.finish(ids, finish, frozenset())
    stream, out, at, k = TextStream(rule, frozenset()), [], 0, 0
    while at < len(ids):
        n = cuts[k % len(cuts)]
        k += 1
        last = at + n >= len(ids)
        part = ids[at : at + n]
        delta, _ = stream.step(TokenStep(part, [0.0] * len(part), [0] * len(part), (), finish if last else None))
        out.append(delta)
        assert expected.startswith("".join(out)), (out, expected)
        at += n
    assert "".join(out) == expected


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, len(CharTokenizer.ALPHABET) - 2), min_size=1, max_size=30),
    stops=st.lists(st.text(alphabet=CharTokenizer.ALPHABET[:-1], min_size=1, max_size=3), min_size=1, max_size=3),
    min_tokens=st.integers(0, 8),
)
@example(ids=[0, 1, 3], stops=["c", "bc"], min_tokens=0)  # both end on "c": the first listed cuts ("ab")
@example(ids=[3, 0, 3, 0], stops=["c"], min_tokens=1)  # the first "c" is inside the first token: the second cuts
def test_the_stop_rule_is_vllms(ids: list[int], stops: list[str], min_tokens: int) -> None:
    """The kit's stop rule (where the engine stops, the text it keeps) equals the conformance
    suite's independent model of vLLM 0.32's detokenizer (:func:`vllm_stop_cut`): the stop string
    that ends first cuts (ties: the first listed), and with ``min_tokens`` only one ending past
    the first ``min_tokens`` tokens' text counts."""
    tok = CharTokenizer()
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}],  # type: ignore[list-item]
        stop=stops,
        min_tokens=min_tokens,
    )
    rule = StopRule(tok, req)
    end = next((k for k in range(1, len(ids) + 1) if rule.hit(ids[:k])), None)
    want = vllm_stop_cut(tok, ids, stops, min_tokens)
    if want is None:
        assert end is None and rule.finish(ids, "length", frozenset()) == (tok.decode(ids), None)
    else:
        assert end == want[1], (end, want)
        assert rule.finish(ids[:end], "stop", frozenset())[0] == want[0]


# --- a real server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny_model: Path) -> Iterator[ServerProcess]:
    opts: dict[str, object] = {"threads": 1, "max_model_len": LONG + 64}
    with ServerProcess("reference", tiny_model, api_key=API_KEY, startup_timeout_s=120, options=opts) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(served: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def _both(client: openai.OpenAI, **kw: Any) -> tuple[Any, list[Any]]:
    """The same request non-streamed and streamed: (response, chunks)."""
    extra = kw.pop("extra_body", {})
    base = {"model": "tiny", "messages": MESSAGES, **kw}
    whole = client.chat.completions.create(**base, extra_body=extra)
    chunks = list(
        client.chat.completions.create(**base, stream=True, stream_options={"include_usage": True}, extra_body=extra)
    )
    return whole, chunks


def _extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {}).get(name)


@pytest.mark.integration
def test_stream_adds_up_to_the_non_streamed_request(client: openai.OpenAI) -> None:
    """A seeded sampled request (n=2), streamed: the role chunk first (prompt ids in it), each
    choice's deltas concatenate to the non-streamed text, its token ids, logprobs and weight
    versions to the non-streamed ones, ``finish_reason`` on its last content chunk, usage last."""
    kw = {
        "max_tokens": 24,
        "temperature": 1.0,
        "seed": 11,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "extra_body": {"return_token_ids": True},
    }
    whole, chunks = _both(client, **kw)
    first, usage = chunks[0], chunks[-1]
    assert first.object == "chat.completion.chunk"
    assert [(c.index, c.delta.role, c.delta.content) for c in first.choices] == [
        (0, "assistant", ""),
        (1, "assistant", ""),
    ]
    assert _extra(first, "prompt_token_ids") == _extra(whole, "prompt_token_ids")
    assert usage.choices == [] and usage.usage is not None and whole.usage is not None
    assert usage.usage.model_dump() == whole.usage.model_dump()
    for choice in whole.choices:
        mine = [c for ch in chunks[1:-1] for c in ch.choices if c.index == choice.index]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [t for c in mine for t in _extra(c, "token_ids")] == _extra(choice, "token_ids")
        assert [v for c in mine for v in _extra(c, "weight_versions")] == _extra(choice, "weight_versions")
        streamed_lps = [
            (t.token, t.logprob, [a.token for a in t.top_logprobs]) for c in mine for t in c.logprobs.content
        ]
        assert streamed_lps == [
            (t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in choice.logprobs.content
        ]
        assert [c.finish_reason for c in mine][-1] == choice.finish_reason
        assert all(c.finish_reason is None for c in mine[:-1])
    assert len(chunks) > 4, f"{len(chunks)} chunks: not streamed token by token"


@pytest.mark.integration
def test_stream_honours_stop_strings(client: openai.OpenAI) -> None:
    """Greedy, with a stop string from the middle of the text: the streamed text is the
    non-streamed one (the text before the stop string), never a character of the stop string."""
    full = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    text = full.choices[0].message.content or ""
    stop = text[6:9]
    whole, chunks = _both(client, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    streamed = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
    assert streamed == whole.choices[0].message.content == text[: text.index(stop)]
    last = [c for ch in chunks for c in ch.choices if c.finish_reason][-1]
    assert last.finish_reason == "stop" and _extra(last, "stop_reason") == stop


@pytest.mark.integration
def test_client_that_leaves_frees_its_admission(served: ServerProcess) -> None:
    """A client that reads one event of a long stream and disconnects: the server's admitted
    requests and tokens go back to 0 (the request was cancelled, not left running)."""
    body = {"messages": MESSAGES, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=served.url, headers=headers, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            lines = resp.iter_lines()  # kept: a dropped line iterator closes the response (the client leaves)
            line = next(lines)
            assert line.startswith("data: ") and json.loads(line[6:])["object"] == "chat.completion.chunk"
            live = http.get("/info").json()
            assert (live["requests_in_flight"], live["tokens_in_flight"]) == (1, LONG), live  # still streaming
        deadline = time.monotonic() + 30
        info: dict[str, Any] = {}
        while time.monotonic() < deadline:
            info = http.get("/info").json()
            if info["requests_in_flight"] == 0:
                break
            time.sleep(0.1)
        assert (info["requests_in_flight"], info["tokens_in_flight"]) == (0, 0), info


@pytest.mark.integration
def test_stream_refusals_are_400_before_any_event(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, extra_body={"prompt_logprobs": 1})
    assert e.value.param == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, logit_bias={"999999": 5})
    assert e.value.param == "logit_bias"
