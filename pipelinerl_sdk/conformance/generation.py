"""Checks that generation parameters do what vLLM does with them: the engine's sampling, not only
the schema. Each is gated on the capability the backend declares.

- ``stop``: the text with a stop string is the same greedy generation's text up to (excluded)
  the stop string's first occurrence, and ``stop`` is its finish reason; with
  ``include_stop_str_in_output`` it ends with the stop string. Exact (no tolerance).
- ``logit_bias``: +100 on one token makes every sampled token that token (temperature 1, its
  bias dwarfs any logit gap of a real model); -100 on the greedy first token moves the greedy
  choice off it. Exact.
- Penalties: greedy texts under ``presence_penalty``, ``frequency_penalty`` and
  ``repetition_penalty``, each alone and the three together, equal vLLM's rules computed on the
  mirror (which tokens each counts: the repetition penalty the prompt's and the output's, the
  other two the output's; the repetition penalty first). Exact, up to a near-tie.
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

from collections.abc import Collection
from typing import Any

import httpx
import pytest
import torch

from pipelinerl_sdk.conformance.common import PROMPT, arun, openai_headers
from pipelinerl_sdk.conformance.mirror import Mirror, compare
from pipelinerl_sdk.conformance.sampling import LOGIT_SLACK
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


#: A greedy request of ``TOKENS`` tokens (``messages`` added by the caller).
GREEDY: dict[str, Any] = {"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
#: The prompts ``test_stop_token_ids_end_as_vllm`` and ``test_stop_strings_at_token_edges`` try, in
#: order, for a greedy path they can use.
STOP_TOKEN_PROMPTS: tuple[list[dict[str, str]], ...] = (
    PROMPT,
    [{"role": "user", "content": "Name three colours of the rainbow."}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
    [{"role": "user", "content": "List the days of the week."}],
)

#: The penalty cases: each penalty alone, then all three together (where their order matters).
PENALTIES: dict[str, dict[str, Any]] = {
    "presence_penalty=1.5": {"presence_penalty": 1.5},
    "frequency_penalty=0.7": {"frequency_penalty": 0.7},
    "repetition_penalty=1.6": {"repetition_penalty": 1.6},
    "presence 0.5, frequency 0.4, repetition 1.3": {
        "presence_penalty": 0.5,
        "frequency_penalty": 0.4,
        "repetition_penalty": 1.3,
    },
}


def edge_stop_strings(tokenizer: Any, ids: list[int], text: str) -> dict[str, tuple[list[str], int | None, int]]:
    """Stop-string cases from a greedy completion (``ids``, its ``text``): name -> (stop strings,
    where the text is cut (None: never), index of the token that completes the cut). Chosen where
    each string first occurs at the intended place; AssertionError (the check cannot run) if the
    text has no such places."""
    ends = [len(tokenizer.decode(ids[: k + 1], skip_special_tokens=True)) for k in range(len(ids))]
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    # an engine may drop a partial UTF-8 character (U+FFFD) that ends the text, as vLLM does
    assert decoded.rstrip("\ufffd") == text.rstrip("\ufffd"), (
        f"the tokenizer decodes the greedy ids {ids} to {decoded!r}, not the text {text!r}"
    )

    def clean(s: str) -> bool:
        return bool(s.strip()) and s.isprintable() and "\ufffd" not in s

    def sound_cut(at: int) -> bool:
        # the text cut before a stop string may not end with U+FFFD: an engine may drop such a
        # character at the end of a text (a partial UTF-8 character, as vLLM does)
        return not text[:at].endswith("\ufffd")

    def token_of(char: int) -> int:
        return next(k for k, e in enumerate(ends) if e > char)

    spanning = inside = None
    for k in range(1, len(ids)):
        start, end = ends[k - 1], ends[k]
        before = ends[k - 2] if k >= 2 else 0
        if spanning is None and start - before >= 2 and end - start >= 2:
            s = text[start - 2 : start + 2]  # two characters of each of two tokens
            if clean(s) and text.find(s) == start - 2 and sound_cut(start - 2):
                spanning = (s, start - 2)
        if inside is None and start - before >= 1 and end - start >= 3:
            s = text[start - 1 : start + 1]  # the last character of one token, the first of the next
            if clean(s) and text.find(s) == start - 1 and sound_cut(start - 1):
                inside = (s, start - 1)
    assert spanning and inside, f"the greedy text {text!r} has no stop strings at token edges (ends {ends})"
    cases: dict[str, tuple[list[str], int | None, int]] = {
        "spanning two tokens": ([spanning[0]], spanning[1], token_of(spanning[1] + len(spanning[0]) - 1)),
        "ending inside a token": ([inside[0]], inside[1], token_of(inside[1] + len(inside[0]) - 1)),
    }
    (a, at_a), (b, at_b) = sorted([spanning, inside], key=lambda x: x[1] + len(x[0]))
    if token_of(at_a + len(a) - 1) != token_of(at_b + len(b) - 1):
        cases["two at once, the later listed first"] = ([b, a], at_a, token_of(at_a + len(a) - 1))
    never = text[-3:] + "\u2603"
    if clean(text[-3:]) and never not in text:
        cases["never completed, its prefix ending the text"] = ([never], None, len(ids) - 1)
    return cases


def stops_hit(stops: list[str], text: str, at: int) -> str:
    """The stop string of ``stops`` that occurs in ``text`` at ``at``."""
    return next(s for s in stops if text.startswith(s, at))


def retokenized_apart(tokenizer: Any, vocab_size: int) -> list[int]:
    """Token ids whose text encodes to other ids: a few ordinary tokens, then a word of the
    vocabulary spelled one character per token (its text encodes to the word's own token). No
    special token, no BOS."""
    special = set(tokenizer.all_special_ids)
    spelled: list[int] = []
    for word in range(vocab_size):
        text = tokenizer.decode([word])
        if word in special or len(text) < 3 or not text.isalpha():
            continue
        chars = [tokenizer.encode(c, add_special_tokens=False) for c in text]
        if all(len(c) == 1 for c in chars) and tokenizer.encode(text, add_special_tokens=False) == [word]:
            spelled = [c[0] for c in chars]
            break
    assert spelled, "no vocabulary word spelled one token per character: cannot build a prompt that re-encodes apart"
    ids: list[int] = list(tokenizer.encode("Say it again:", add_special_tokens=False)) + spelled
    assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) != ids
    return ids


@torch.no_grad()
def penalised_greedy(
    mirror: Mirror,
    prompt: list[int],
    tokens: int,
    *,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    held: Collection[int] = (),
    min_tokens: int = 0,
) -> tuple[list[int], list[float]]:
    """The greedy completion of ``prompt`` under vLLM 0.32's penalty rules on the mirror's weights,
    and at each step the gap between the best two processed logits. vLLM's order: the repetition
    penalty on every token seen in the prompt or the output (a positive logit divided by it, any
    other multiplied), then ``frequency_penalty`` times each token's count in the output and
    ``presence_penalty`` once per token in the output subtracted; greedy is their argmax. The
    ``held`` ids (vLLM's stop and end-of-sequence ids) are masked while fewer than ``min_tokens``
    tokens are out."""
    ids, out, gaps = list(prompt), list[int](), list[float]()
    masked = torch.tensor(sorted(held), dtype=torch.long)
    for _ in range(tokens):
        logits = mirror.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].double()
        if len(out) < min_tokens and masked.numel():
            logits[masked] = float("-inf")
        if repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(ids)))
            x = logits[seen]
            logits[seen] = torch.where(x > 0, x / repetition_penalty, x * repetition_penalty)
        if out:
            counts = torch.bincount(torch.tensor(out), minlength=logits.numel()).double()
            logits -= frequency_penalty * counts + presence_penalty * (counts > 0).double()
        top = torch.topk(logits, 2)
        gaps.append(float(top.values[0] - top.values[1]))
        tok = int(top.indices[0])
        out.append(tok)
        ids.append(tok)
    return out, gaps


def eos_ids(mirror: Mirror) -> set[int]:
    """The served model's end-of-sequence ids (its config's and its generation config's)."""
    found: set[int] = set()
    for eos in (mirror.model.config.eos_token_id, mirror.model.generation_config.eos_token_id):
        found.update([eos] if isinstance(eos, int) else (eos or []))
    return found


def vllm_stop_cut(tokenizer: Any, ids: list[int], stops: list[str], min_tokens: int) -> tuple[str, int] | None:
    """Where vLLM 0.32's detokenizer stops the greedy ``ids`` on ``stops`` under ``min_tokens``:
    (the text before the stop string, the tokens kept), or None where no stop string counts.
    After each token past the first ``min_tokens`` it looks for stop strings that end in that
    token's new text; the one ending first cuts (ties: the first listed)."""
    before = ""
    for k in range(len(ids)):
        text = tokenizer.decode(ids[: k + 1], skip_special_tokens=True)
        if k + 1 > min_tokens:
            starts = [(i, s, text.find(s, max(0, len(before) - len(s) + 1))) for i, s in enumerate(stops)]
            found = [(at + len(s), i, at) for i, s, at in starts if at >= 0]
            if found:
                return text[: min(found)[2]], k + 1
        before = text
    return None


def min_tokens_stop_cases(tokenizer: Any, ids: list[int], eos: set[int]) -> list[tuple[str, int]]:
    """(stop string, ``min_tokens``) cases from a greedy path ``ids``: a two-character string
    whose first occurrence ends inside token ``min_tokens - 1``, so vLLM does not count it; first
    one that occurs again further on (vLLM cuts there), then one that does not (no cut). No
    end-of-sequence id among the first ``min_tokens`` tokens (masking it would change the path)."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    ends = [len(tokenizer.decode(ids[: k + 1], skip_special_tokens=True)) for k in range(len(ids))]
    again: tuple[str, int] | None = None
    once: tuple[str, int] | None = None
    for a in range(len(text) - 2):
        s = text[a : a + 2]
        if not (s.strip() and s.isprintable() and "\ufffd" not in s) or text.find(s) != a:
            continue
        m = next(k for k, e in enumerate(ends) if e >= a + 2) + 1
        if not 2 <= m < len(ids) - 2 or eos & set(ids[:m]):
            continue
        if vllm_stop_cut(tokenizer, ids, [s], m) is not None:
            again = again or (s, m)
        else:
            once = once or (s, m)
    return [c for c in (again, once) if c is not None]


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

    @pytest.mark.requires("stop_strings")
    def test_stop_strings_at_token_edges(self, server_under_test: ServerUnderTest) -> None:
        """Stop strings taken from the server's own greedy text (:func:`edge_stop_strings`): one
        spanning two tokens, one ending inside a token, both at once (listed late first: the one
        completed first cuts), and one that never completes but whose prefix ends the text. Each
        with ``include_stop_str_in_output`` off and on: the text is the greedy text up to the stop
        string (excluded or included, even inside a token), the tokens up to the one that
        completed it, finish reason ``stop`` (``length`` for the one never completed); streamed
        (``streaming`` declared), the same chunk for chunk, no prefix held back at the end. Exact."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(server_under_test.model_dir)

        async def body() -> None:
            async with server_under_test.client() as client:
                # The first prompt whose greedy text has such edges: the weights served (other
                # checks update them) may make one prompt's text a run of one-character tokens.
                misses = []
                for prompt in STOP_TOKEN_PROMPTS:
                    full = await _one(client, messages=prompt)
                    text, ids = full.message.content, list(full.token_ids or [])
                    try:
                        cases = edge_stop_strings(tokenizer, ids, text)
                        break
                    except AssertionError as e:
                        misses.append(str(e))
                else:
                    raise AssertionError(f"none of {len(STOP_TOKEN_PROMPTS)} prompts: " + "; ".join(misses))
                for what, (stops, at, end_token) in cases.items():
                    for include in (False, True):
                        extra = {"messages": prompt, "stop": stops, "include_stop_str_in_output": include}
                        got = await _one(client, **extra)
                        hit = at is not None
                        want = text
                        if at is not None:
                            want = text[: at + (len(stops_hit(stops, text, at)) if include else 0)]
                        label = f"{what} {stops!r}, include_stop_str_in_output={include}"
                        assert got.message.content == want, (
                            f"{label}: text {got.message.content!r}, vLLM gives {want!r} (full greedy text {text!r})"
                        )
                        assert got.finish_reason == ("stop" if hit else "length"), (
                            f"{label}: finish_reason {got.finish_reason!r}"
                        )
                        want_ids = ids[: end_token + 1] if hit else ids
                        assert got.token_ids == want_ids, (
                            f"{label}: tokens {got.token_ids}, expected up to the one completing the stop string "
                            f"{want_ids}"
                        )
                        if server_under_test.capabilities.streaming:
                            chunks = [c async for c in client.chat_stream({**GREEDY, "messages": PROMPT, **extra})]
                            check_stream([got], chunks, f"{label}, streamed: ", dtype=server_under_test.dtype)

        arun(body)

    @pytest.mark.requires("stop_strings")
    def test_stop_token_ids_end_as_vllm(self, server_under_test: ServerUnderTest, mirror: Mirror) -> None:
        """``stop_token_ids`` holding a token of the greedy path (its first occurrence, past the
        first three tokens, before any end-of-sequence) ends the completion on that token, with
        ``ignore_eos`` and without (vLLM: ``ignore_eos`` ignores only end-of-sequence): the token
        is kept in the token ids, finish reason ``stop``, ``stop_reason`` the token id, and the
        text is the text before the token (with ``include_stop_str_in_output``, through it);
        streamed (``streaming`` declared), the same. Exact."""
        eos = {mirror.model.config.eos_token_id, mirror.model.generation_config.eos_token_id} - {None}

        async def body() -> None:
            async with server_under_test.client() as client:
                # The first prompt whose greedy path has a new token past the third: the weights
                # served (other checks update them) may make one prompt's path a short cycle.
                paths = []
                for prompt in STOP_TOKEN_PROMPTS:
                    ids = list((await _one(client, messages=prompt)).token_ids or [])
                    ends = [i for i, t in enumerate(ids) if t in eos]
                    k = next((j for j in range(3, min(ends or [len(ids)])) if ids[j] not in ids[:j]), None)
                    paths.append(ids)
                    if k is not None:
                        break
                if k is None:
                    pytest.skip(
                        f"no greedy path of {len(paths)} prompts has a new token past the third before "
                        f"end-of-sequence: {paths}"
                    )
                before = (await _one(client, messages=prompt, max_tokens=k)).message.content
                through = (await _one(client, messages=prompt, max_tokens=k + 1)).message.content
                for ignore_eos in (True, False):
                    for include in (False, True):
                        extra = {"messages": prompt, "stop_token_ids": [ids[k]], "ignore_eos": ignore_eos}
                        got = await _one(client, **extra, include_stop_str_in_output=include)
                        label = f"stop_token_ids=[{ids[k]}] (token {k}), ignore_eos={ignore_eos}, include={include}"
                        want_ids = ids[: k + 1]
                        assert got.token_ids == want_ids, f"{label}: tokens {got.token_ids}, expected {want_ids}"
                        assert (got.finish_reason, got.stop_reason) == ("stop", ids[k]), (
                            f"{label}: finish_reason {got.finish_reason!r}, stop_reason {got.stop_reason!r}"
                        )
                        want = through if include else before
                        assert got.message.content == want, f"{label}: text {got.message.content!r}, expected {want!r}"
                        if server_under_test.capabilities.streaming:
                            streamed = {**GREEDY, **extra, "include_stop_str_in_output": include}
                            chunks = [c async for c in client.chat_stream(streamed)]
                            check_stream([got], chunks, f"{label}, streamed: ", dtype=server_under_test.dtype)

        arun(body)

    def test_min_tokens_holds_the_end_off(self, server_under_test: ServerUnderTest, mirror: Mirror) -> None:
        """``min_tokens`` (vLLM's extension). Declared: greedy with a stop token of the path
        (``stop_token_ids``, ``ignore_eos`` on and off) and ``min_tokens`` past it, the tokens are
        the mirror's greedy path with every stop and end-of-sequence id masked for the first
        ``min_tokens`` tokens, ended at the first of them after (vLLM masks its end-of-sequence
        ids even under ``ignore_eos``); a stop string whose first occurrence ends inside the first
        ``min_tokens`` tokens does not count, a later one cuts (:func:`vllm_stop_cut`), streamed
        the same (``streaming`` declared); ``min_tokens`` above ``max_tokens`` is a 400 naming it.
        Not declared: any ``min_tokens`` is a 400 naming it, and the server keeps serving. Exact,
        up to the first near-tie of the mirror's logits."""
        caps = server_under_test.capabilities

        async def refused(http: httpx.AsyncClient, body: dict[str, Any], why: str) -> None:
            r = await http.post("/v1/chat/completions", json={"messages": PROMPT, **body})
            param = r.json().get("error", {}).get("param") if r.status_code == 400 else None
            assert param == "min_tokens", f"{why}: {body} answered {r.status_code} {r.text[:300]}, not a 400 naming it"

        async def body() -> None:
            async with httpx.AsyncClient(
                base_url=server_under_test.url, timeout=120, headers=openai_headers(server_under_test)
            ) as http:
                if not caps.min_tokens:
                    await refused(http, {"max_tokens": 4, "min_tokens": 2}, "min_tokens not declared")
                    r = await http.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 2})
                    assert r.status_code == 200, f"after the refused min_tokens: {r.status_code} {r.text[:300]}"
                    return
                await refused(http, {"max_tokens": 4, "min_tokens": 5}, "min_tokens above max_tokens")
            async with server_under_test.client() as client:
                resp = await client.chat({**GREEDY, "messages": PROMPT})
                base = resp.choices[0]
                await self._min_tokens_stop_token(client, mirror, base, list(resp.prompt_token_ids or []))
                if caps.stop_strings:
                    await self._min_tokens_stop_string(client, server_under_test, base, eos_ids(mirror))

        arun(body)

    @staticmethod
    async def _min_tokens_stop_token(
        client: InferenceClient, mirror: Mirror, base: ChatChoice, prompt: list[int]
    ) -> None:
        ids, eos = list(base.token_ids or []), eos_ids(mirror)
        ends = [i for i, t in enumerate(ids) if t in eos]
        k = next((j for j in range(3, min(ends or [len(ids)])) if ids[j] not in ids[:j]), None)
        if k is None:
            pytest.skip(f"the greedy path {ids} has no new token past the third before end-of-sequence")
        stop, m = ids[k], min(k + 3, TOKENS - 2)
        assert prompt, "return_token_ids: prompt_token_ids missing"
        path, gaps = penalised_greedy(mirror, prompt, TOKENS, held={stop, *eos}, min_tokens=m)
        judged = next((i for i, g in enumerate(gaps) if g < LOGIT_SLACK[mirror.dtype]), TOKENS)
        for ignore_eos in (True, False):
            label = f"min_tokens={m}, stop_token_ids=[{stop}] (greedy token {k}), ignore_eos={ignore_eos}"
            got = await _one(client, stop_token_ids=[stop], ignore_eos=ignore_eos, min_tokens=m)
            tokens = list(got.token_ids or [])
            early = [t for t in tokens[:m] if t == stop or t in eos]
            assert not early, f"{label}: stop or end-of-sequence ids {early} among the first {m} tokens {tokens}"
            ending = {stop} | (set() if ignore_eos else eos)
            end = next((i for i in range(m, TOKENS) if path[i] in ending), None)
            want = path if end is None else path[: end + 1]
            n = min(judged, len(want))
            assert tokens[:n] == want[:n], (
                f"{label}: tokens {tokens}, vLLM's rule gives {want} (the path without min_tokens ends at token {k}: "
                f"{ids[: k + 1]})"
            )
            if judged >= len(want):
                assert tokens == want, f"{label}: tokens {tokens}, vLLM's rule gives {want}"
                reason = ("length", None) if end is None else ("stop", stop if want[-1] == stop else None)
                assert (got.finish_reason, got.stop_reason) == reason, (
                    f"{label}: finish_reason {got.finish_reason!r}, stop_reason {got.stop_reason!r}, expected {reason}"
                )

    @staticmethod
    async def _min_tokens_stop_string(
        client: InferenceClient, server: ServerUnderTest, base: ChatChoice, eos: set[int]
    ) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(server.model_dir)
        ids, text = list(base.token_ids or []), base.message.content
        cases = min_tokens_stop_cases(tokenizer, ids, eos | ({tokenizer.eos_token_id} - {None}))
        if not cases:
            pytest.skip(f"the greedy text {text!r} has no stop string ending inside its first tokens")
        for stop, m in cases:
            cut = vllm_stop_cut(tokenizer, ids, [stop], m)
            want, kept = (text, len(ids)) if cut is None else cut
            label = f"min_tokens={m}, stop={[stop]!r} (first ending inside token {m - 1})"
            got = await _one(client, stop=[stop], min_tokens=m)
            assert got.message.content == want, (
                f"{label}: text {got.message.content!r}, vLLM gives {want!r} (a stop string counts only where it ends "
                f"past the first {m} tokens' text; greedy text {text!r})"
            )
            assert got.token_ids == ids[:kept], f"{label}: tokens {got.token_ids}, expected {ids[:kept]}"
            assert got.finish_reason == ("length" if cut is None else "stop"), (
                f"{label}: finish_reason {got.finish_reason!r}"
            )
            if server.capabilities.streaming:
                chunks = [c async for c in client.chat_stream({**GREEDY, "messages": PROMPT, "stop": [stop],
                                                               "min_tokens": m})]  # fmt: skip
                check_stream([got], chunks, f"{label}, streamed: ", dtype=server.dtype)

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
    def test_penalties_follow_vllms_rules(self, server_under_test: ServerUnderTest, mirror: Mirror) -> None:
        """Greedy texts of ``TOKENS`` tokens under each penalty alone and all three together are
        the ones vLLM's rules give on the served weights (:func:`penalised_greedy`): the repetition
        penalty over the prompt's and the output's tokens, then the frequency and presence
        penalties over the output's. Exact, up to the first step where the mirror's best two
        processed logits are nearer than the dtype's numerics can order."""

        async def body() -> None:
            async with server_under_test.client() as client:
                base = await client.chat({**GREEDY, "messages": PROMPT})
                got = {w: await client.chat({**GREEDY, "messages": PROMPT, **x}) for w, x in PENALTIES.items()}
            prompt = list(base.prompt_token_ids or [])
            assert prompt, "return_token_ids: prompt_token_ids missing"
            gap = LOGIT_SLACK[mirror.dtype]
            plain, _ = penalised_greedy(mirror, prompt, TOKENS)
            blind = []
            for what, extra in PENALTIES.items():
                want, gaps = penalised_greedy(mirror, prompt, TOKENS, **extra)
                judged = next((i for i, g in enumerate(gaps) if g < gap), TOKENS)
                tokens = list(got[what].choices[0].token_ids or [])
                if tokens[:judged] != want[:judged]:
                    at = next(i for i, (a, b) in enumerate(zip(tokens, want, strict=False)) if a != b) if tokens else 0
                    pytest.fail(
                        f"{what}: greedy tokens differ from vLLM's rules from token {at} on (of {judged} judged): "
                        f"got {tokens}, vLLM's rules give {want} (no penalty: {plain})"
                    )
                if want[:judged] == plain[:judged]:
                    blind.append(what)
            if len(blind) == len(PENALTIES):
                pytest.skip(f"no penalty case changes this model's greedy text: {plain}")

        arun(body)

    @pytest.mark.requires("completions")
    def test_completion_token_ids_are_used_as_given(self, server_under_test: ServerUnderTest, mirror: Mirror) -> None:
        """``/v1/completions`` with a prompt of token ids uses exactly those ids: no decode and
        re-encode, no added BOS. The prompt is chosen so that its text re-encodes to other ids
        (:func:`retokenized_apart`); the answer's ``prompt_token_ids`` must be the ids sent, its
        greedy tokens the mirror's greedy path from them, and (``prompt_logprobs`` declared) its
        prompt logprobs those of the ids sent. Exact ids; logprobs within the dtype's tolerance."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(server_under_test.model_dir)
        ids = retokenized_apart(tokenizer, int(mirror.model.config.vocab_size))
        want, gap = mirror.greedy(ids, 8, stop=-1)
        body: dict[str, Any] = {"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                "return_token_ids": True}  # fmt: skip
        prompt_lps = server_under_test.capabilities.prompt_logprobs
        if prompt_lps:
            body["prompt_logprobs"] = 0

        async def main() -> None:
            async with server_under_test.client() as client:
                resp = await client.completion(body)
            (choice,) = resp.choices
            text = tokenizer.decode(ids)
            assert choice.prompt_token_ids == ids, (
                f"prompt_token_ids {choice.prompt_token_ids} are not the ids sent {ids} (their text {text!r} "
                f"encodes to {tokenizer.encode(text)})"
            )
            if gap >= LOGIT_SLACK[mirror.dtype]:
                assert choice.token_ids == want, (
                    f"greedy tokens {choice.token_ids} from the prompt ids {ids} are not the served weights' greedy "
                    f"path {want} from them (the prompt was not used as given)"
                )
            if prompt_lps:
                entries = choice.prompt_logprobs or []
                assert len(entries) == len(ids) and entries[0] is None, f"prompt_logprobs: {len(entries)} entries"
                got = []
                for k, (tok, entry) in enumerate(zip(ids[1:], entries[1:], strict=True)):
                    assert entry is not None and tok in entry, f"prompt_logprobs[{k + 1}] has no entry for id {tok}"
                    got.append(entry[tok].logprob)
                ok, msg = compare(got, mirror.logprobs(ids), mirror.dtype)
                assert ok, f"prompt logprobs of the ids sent: {msg}"

        arun(main)

    def test_tokenize_gives_the_ids_generation_uses(self, server_under_test: ServerUnderTest) -> None:
        """``/tokenize`` and ``/detokenize`` (vLLM 0.32's routes and shapes). A chat's ids are the
        ``prompt_token_ids`` the chat route generates from, with ``token_strs`` the tokenizer's
        strings and ``max_model_len`` the server's; a text prompt's ids are the tokenizer's with
        and without special tokens; ``/detokenize`` gives the tokenizer's text of the ids, special
        tokens kept. A backend that does not serve them answers each with a 400 naming the route
        (``tokenize``, ``detokenize``) and keeps serving. Exact."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(server_under_test.model_dir)
        text = "Hello, wörld! 12 + 7 = 19 " + str(tokenizer.eos_token or "")

        async def main() -> None:
            async with httpx.AsyncClient(
                base_url=server_under_test.url, timeout=120, headers=openai_headers(server_under_test)
            ) as http:
                r = await http.post("/tokenize", json={"messages": PROMPT, "return_token_strs": True})
                if r.status_code == 400 and r.json().get("error", {}).get("param") == "tokenize":
                    r = await http.post("/detokenize", json={"tokens": [0]})
                    param = r.json().get("error", {}).get("param") if r.status_code == 400 else None
                    assert param == "detokenize", f"/tokenize refused, /detokenize answered {r.status_code} {r.text}"
                    r = await http.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 2})
                    assert r.status_code == 200, f"after the refused /tokenize: {r.status_code} {r.text[:300]}"
                    return
                assert r.status_code == 200, f"/tokenize answered {r.status_code} {r.text[:300]}"
                got = r.json()
            async with server_under_test.client() as client:
                info = await client.info()
                resp = await client.chat({"messages": PROMPT, "max_tokens": 1, "return_token_ids": True})
            prompt = list(resp.prompt_token_ids or [])
            assert got["tokens"] == prompt, f"/tokenize of the chat gave {got['tokens']}; the chat used {prompt}"
            assert got["count"] == len(prompt) and got["max_model_len"] == info.max_model_len, (
                f"/tokenize: count {got['count']} for {len(prompt)} ids, max_model_len {got['max_model_len']} "
                f"(the server's is {info.max_model_len})"
            )
            strs = tokenizer.convert_ids_to_tokens(prompt)
            assert got.get("token_strs") == strs, f"token_strs {got.get('token_strs')} are not the tokenizer's {strs}"
            async with httpx.AsyncClient(
                base_url=server_under_test.url, timeout=120, headers=openai_headers(server_under_test)
            ) as http:
                for special in (True, False):
                    r = await http.post("/tokenize", json={"prompt": text, "add_special_tokens": special})
                    want = tokenizer(text, add_special_tokens=special)["input_ids"]
                    assert r.status_code == 200 and r.json()["tokens"] == want, (
                        f"/tokenize of {text!r} (add_special_tokens {special}): {r.text[:300]}, the tokenizer's {want}"
                    )
                for ids in (prompt, want):
                    r = await http.post("/detokenize", json={"tokens": ids})
                    decoded = tokenizer.decode(ids)
                    assert r.status_code == 200 and r.json() == {"prompt": decoded}, (
                        f"/detokenize of {ids}: {r.text[:300]}, the tokenizer's {decoded!r}"
                    )

        arun(main)

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
            check_stream(whole.choices, chunks, dtype=server_under_test.dtype)
            assert chunks[-1].usage == whole.usage, f"usage chunk {chunks[-1].usage} != non-streamed {whole.usage}"
            if not server_under_test.capabilities.stop_strings:
                return
            async with server_under_test.client() as client:  # a stop string: never streamed past
                greedy = {**body, "temperature": 0, "n": 1, "ignore_eos": True}
                greedy.pop("seed", None)
                stop, _ = stop_string_of((await client.chat(greedy)).choices[0].message.content)
                cut = await client.chat({**greedy, "stop": [stop]})
                cut_chunks = [c async for c in client.chat_stream({**greedy, "stop": [stop]})]
            check_stream(cut.choices, cut_chunks, f"with stop={stop!r}: ", dtype=server_under_test.dtype)

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


def check_stream(
    choices: list[ChatChoice], chunks: list[ChatCompletionChunk], what: str = "", dtype: str | None = None
) -> None:
    """AssertionError (its message led by ``what``) naming the first difference between
    ``chunks`` and the non-streamed ``choices`` of the same request. Text, token ids, versions and
    finish reasons exactly; logprobs exactly, or within ``dtype``'s tolerance when given (two runs
    of one request, in other batches, may differ in the last bits)."""
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
        if dtype is None or len(lps) != len(want_lps):
            assert lps == want_lps, f"choice {choice.index}: streamed logprobs {lps} != non-streamed {want_lps}"
        else:
            ok, msg = compare(lps, torch.tensor(want_lps), dtype)
            assert ok, f"choice {choice.index}: streamed logprobs differ from the non-streamed ones: {msg}"
        reasons = [c.finish_reason for c in mine]
        assert reasons and reasons[-1] == choice.finish_reason and not any(reasons[:-1]), (
            f"choice {choice.index}: finish reasons by chunk {reasons}, non-streamed {choice.finish_reason!r}"
        )
