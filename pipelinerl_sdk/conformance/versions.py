"""Checks that every version tag is true: a token tagged v was computed by the weights of v."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from pipelinerl_sdk.conformance.common import (
    PROMPT,
    Timeline,
    arun,
    connect,
    open_connections,
    openai_headers,
    retry_budgets,
)
from pipelinerl_sdk.conformance.doors import DOORS, Door
from pipelinerl_sdk.conformance.mirror import TOLERANCES, Mirror, compare
from pipelinerl_sdk.conformance.targets import ServerUnderTest
from pipelinerl_sdk.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChoiceLogprobs,
    ChunkChoice,
)

#: The trainer waits this long between the server's ``accepted`` and its broadcast (a trainer
#: that gathers slowly): generation goes on meanwhile (staged) and its tokens must keep the old tag.
RECEIVE_WINDOW_S = 0.5
#: Perturbation of each update (times each tensor's std): versions differ by far more than the
#: float32 tolerance on every token.
SCALE = 0.1
#: The longest completion the check asks for (the replay runs one forward per token).
MAX_BUDGET = 4096
#: Tokens replayed past the last version boundary of a completion.
TAIL = 24


def judge_tags(
    mirror: Mirror,
    prompt: list[int],
    choice: ChatChoice,
    states: dict[int, dict[str, torch.Tensor]],
    what: str,
    upto: int = 0,
) -> tuple[bool, str]:
    """(the tags are true, a message naming the first token that is not): the tokens up to
    :data:`TAIL` past the last version boundary are replayed, and at least ``upto``."""
    assert choice.token_ids is not None and choice.logprobs is not None, f"{what}: token ids or logprobs missing"
    tags = list(choice.weight_versions)
    if tags != sorted(tags):
        return False, f"{what}: versions go back: {tags}"
    unknown = set(tags) - set(states)
    if unknown:
        return False, f"{what}: versions {sorted(unknown)} were never published (published {sorted(states)})"
    bounds = [j for j in range(1, len(tags)) if tags[j] != tags[j - 1]]
    end = min(len(tags), max(upto, (bounds[-1] if bounds else 0) + TAIL))
    got = torch.tensor([t.logprob for t in choice.logprobs.content[:end]], dtype=torch.float64)
    kept, fresh = mirror.replay(prompt, choice.token_ids[:end], tags[:end], states)
    kept, fresh = kept.double(), fresh.double()
    best = torch.where((got - kept).abs() <= (got - fresh).abs(), kept, fresh)
    ok, msg = compare(got.tolist(), best, mirror.dtype)
    if ok:
        return True, ""
    j = int((got - best).abs().argmax())
    seq = prompt + choice.token_ids[: j + 1]
    others = []
    current = mirror.state()
    for v in sorted(states):
        mirror.load(states[v])
        others.append(f"weights {v} give {float(mirror.logprobs(seq)[-1]):.4f}")
    mirror.load(current)
    return False, (
        f"{what}: token {j} tagged version {tags[j]} has logprob {float(got[j]):.4f}; the weights of version "
        f"{tags[j]} give {float(kept[j]):.4f} (KV kept across updates) or {float(fresh[j]):.4f} (KV recomputed); "
        f"on the whole sequence ({', '.join(others)}); tags {_spans(tags)}: {msg}"
    )


#: Choices of the slowly read stream: several tokens per engine step, so its bytes outgrow the
#: buffers between engine and client in a few hundred steps. Not more: at 32 (with 20 top logprobs)
#: vLLM 0.32's engine core outran its front on 2 CPU cores, and the update's control calls, whose
#: replies queue behind the outputs, went live only once the stream had ended (nothing crossed).
SLOW_N = 8
#: The slow client's socket receive buffer.
SLOW_RCVBUF = 1 << 16
#: User-space buffering assumed between an engine and the socket (asyncio's write buffer, an HTTP
#: server's, a frontend's), past the kernel's.
USER_BUFFERS = 1 << 20
#: The slow client reads at its own pace first, to time the engine: until the leading choice has
#: this many tokens and ...
PROBE_TOKENS = 32
#: ... at least this long after its first token (an engine that sends several tokens per event, or a
#: backlog read at once, would otherwise look far faster than it is).
PROBE_S = 1.0
#: Token budget of the slowly read stream (the server's context permitting; the stream is closed
#: once read far enough, so a large budget costs nothing).
SLOW_BUDGET = 4096
#: Tokens of the longest choice replayed when no choice's tags cross the update: past where it
#: landed after a first hold of a few seconds, so tags that never change are caught.
UNCROSSED_REPLAY = 1024
#: The first hold: this many times what the probe's rate needs to outgrow the buffers.
FIRST_HOLD = 1.3
#: Holds tried at most: each after the first halves the bracket (too short: too few bytes waited;
#: too long: no choice crossed the update), or doubles or quarters the hold while one side is open.
SLOW_ATTEMPTS = 4
#: The hold leaves the leading choice at least this share of its remaining budget to generate after
#: the update (a longer hold would see the stream end before the update).
HOLD_SHARE = 0.6


def stream_buffering() -> int:
    """Bytes the buffers between a server's engine and a client that does not read may hold: the
    largest TCP send buffer (Linux's ``tcp_wmem`` maximum; 4 MiB where unreadable), twice the
    client's receive buffer (the kernel doubles it), and :data:`USER_BUFFERS`."""
    try:
        wmem = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, ValueError, IndexError):
        wmem = 4 << 20
    return wmem + 2 * SLOW_RCVBUF + USER_BUFFERS


class SlowReader:
    """A streamed chat read only when asked: each chunk with its size on the wire and whether it
    was read after the update went live (``live``, set by the caller). Closing it closes the
    stream (the server aborts the request)."""

    def __init__(self, sut: ServerUnderTest, body: dict[str, Any]) -> None:
        transport = httpx.AsyncHTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, SLOW_RCVBUF)])
        self._http = httpx.AsyncClient(base_url=sut.url, transport=transport, timeout=600, headers=openai_headers(sut))
        self._body = body
        self._stack = contextlib.AsyncExitStack()
        self._lines: AsyncIterator[str] | None = None
        self.live = False
        self.prompt: list[int] = []
        #: (part, bytes of its chunk's line shared by its parts, read after the update)
        self.parts: list[tuple[ChunkChoice, float, bool]] = []
        self._versions: dict[int, list[int]] = {}  # versions read of each choice
        self._bytes = 0  # bytes read
        #: (time, leading choice's tokens, bytes) at the first token, and at the probe's end
        self._start: tuple[float, int, int] | None = None
        self._probed: tuple[float, int, int] | None = None

    async def __aenter__(self) -> SlowReader:
        await self._stack.enter_async_context(self._http)
        resp = await self._stack.enter_async_context(self._http.stream("POST", "/v1/chat/completions", json=self._body))
        if resp.status_code != 200:
            await resp.aread()
            raise AssertionError(f"the streamed request was refused: {resp.status_code} {resp.text[:300]}")
        self._lines = resp.aiter_lines()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _next(self) -> bool:
        """Read one chunk; False at the stream's end."""
        assert self._lines is not None
        async for line in self._lines:
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return False
            assert not line.startswith('data: {"error"'), f"the stream sent an error: {line[:300]}"
            chunk = ChatCompletionChunk.model_validate_json(line[6:])
            self.prompt = self.prompt or list(chunk.prompt_token_ids or [])
            share = (len(line) + 2) / max(1, len(chunk.choices))
            self._bytes += len(line) + 2
            for part in chunk.choices:
                self.parts.append((part, share, self.live))
                self._versions.setdefault(part.index, []).extend(part.weight_versions)
            if self._start is None and self.lead():
                self._start = (time.perf_counter(), self.lead(), self._bytes)
            return True
        return False

    def lead(self) -> int:
        """Tokens read of the leading choice (the engine's steps, for a choice running from the start;
        one version per token)."""
        return max(map(len, self._versions.values()), default=0)

    async def probe(self, tokens: int, span_s: float) -> bool:
        """Read at once until the leading choice has ``tokens`` tokens and ``span_s`` passed since
        the first token; False if the stream ended first."""
        while self._start is None or self.lead() < tokens or time.perf_counter() - self._start[0] < span_s:
            if not await self._next():
                return False
        self._probed = (time.perf_counter(), self.lead(), self._bytes)
        return True

    async def read_until(self, done: Callable[[dict[int, list[int]]], bool]) -> None:
        """Read until ``done(each choice's versions so far)`` or the stream's end."""
        while not done(self.versions()):
            if not await self._next():
                return

    def versions(self) -> dict[int, list[int]]:
        """Each choice's versions read so far (kept as read: a stream read to its end is long)."""
        return self._versions

    def rate(self) -> float:
        """The leading choice's tokens per second while the probe read at once."""
        assert self._start is not None and self._probed is not None
        span = self._probed[0] - self._start[0]
        return max(1.0, (self._probed[1] - self._start[1]) / span) if span > 0 else 1000.0

    def bytes_per_token(self) -> float:
        """Stream bytes per token of the leading choice (every choice's share) while probed."""
        assert self._start is not None and self._probed is not None
        return max(1.0, (self._probed[2] - self._start[2]) / max(1, self._probed[1] - self._start[1]))

    def waited(self, version: int) -> int:
        """Bytes of chunks carrying ``version``'s tokens that were read after the update went live."""
        return int(sum(size for p, size, after in self.parts if after and version in p.weight_versions))

    def choices(self) -> list[ChatChoice]:
        """Each choice as read so far (its parts put together), by index."""
        out = []
        for i in sorted({p.index for p, _, _ in self.parts}):
            mine = [p for p, _, _ in self.parts if p.index == i]
            lps = [t for p in mine for t in (p.logprobs.content if p.logprobs else [])]
            out.append(
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content="".join(p.delta.content or "" for p in mine)),
                    finish_reason=mine[-1].finish_reason or "length",
                    token_ids=[t for p in mine for t in p.token_ids or []],
                    logprobs=ChoiceLogprobs(content=lps),
                    weight_versions=[v for p in mine for v in p.weight_versions],
                )
            )
        return out


async def room_left(sut: ServerUnderTest) -> int:
    """Completion tokens the server's context leaves after :data:`PROMPT` (capped at
    :data:`MAX_BUDGET`: the replay runs one forward per token)."""
    async with sut.client() as client:
        info = await client.info()
        probe = await client.chat({"messages": PROMPT, "max_tokens": 1, "return_token_ids": True})
        return min(MAX_BUDGET, (info.max_model_len or MAX_BUDGET) - len(probe.prompt_token_ids or []) - 16)


def _spans(tags: list[int]) -> str:
    out, start = [], 0
    for j in range(1, len(tags) + 1):
        if j == len(tags) or tags[j] != tags[start]:
            out.append(f"v{tags[start]} x{j - start}")
            start = j
    return ", ".join(out)


class VersionTagChecks:
    """Mixed into :class:`~pipelinerl_sdk.conformance.inference.InferenceContractTests`."""

    @pytest.mark.parametrize("door", DOORS)
    @pytest.mark.requires("in_flight_updates")
    def test_every_version_tag_is_true(self, server_under_test: ServerUnderTest, mirror: Mirror, door: Door) -> None:
        """Completions running across two updates (through each door), and one sent while an update is being
        received, are replayed token by token against the mirror with the weights of each
        token's tag: every logprob must be what those weights give (tolerance by dtype), either
        on the KV cache as the engine computed it at the time (an engine that keeps its cache
        across updates; see :meth:`Mirror.replay`) or on a recomputed one. A token computed by
        other weights than its tag's (a tag set before the new weights are live, or after)
        fails. The request sent mid-receive is answered (awaited before the second update),
        its tags are the old or the new version, and true.

        No scheduler is assumed: the updates follow the requests at once, with no barrier
        request (a static batch would hold it behind them; a loaded engine's front may too). A
        completion the engine starts after an update begins on the newer version, and its tags
        are judged the same way. Inconclusive runs (no completion crossed an update) retry with
        twice the budget up to what the server's context leaves, then twice more at that."""
        tol = TOLERANCES[mirror.dtype]
        assert tol.max_abs < 1.0
        timelines: list[str] = []

        async def attempt(budget: int) -> tuple[int, list[str]]:
            tl = Timeline()
            async with server_under_test.client() as client, server_under_test.client() as other:
                publisher = await connect(server_under_test, client, door=door)
                info = await client.info()
                start = info.version
                states = {start: mirror.state()}
                for k in (1, 2):  # every version's weights are made before the requests start
                    mirror.perturb(seed=start + k, scale=SCALE)
                    states[start + k] = mirror.state()
                req: dict[str, Any] = {
                    "messages": PROMPT, "max_tokens": budget, "ignore_eos": True, "temperature": 1.0,
                    "logprobs": True, "return_token_ids": True,
                }  # fmt: skip
                await open_connections(client, 4)
                await open_connections(other, 1)
                tl.mark("ready")

                async def timed(i: int) -> ChatCompletionResponse:
                    resp = await client.chat({**req, "seed": i})
                    tl.mark(f"request {i} done")
                    return resp

                running = [asyncio.create_task(timed(i)) for i in range(2)]
                await asyncio.sleep(0.02)  # sent before the first update is requested
                mid: asyncio.Task[ChatCompletionResponse] | None = None
                for k in (1, 2):
                    mirror.load(states[start + k])
                    async with publisher.update(start + k, info.params) as sink:
                        tl.mark(f"v{start + k} accepted")
                        if mid is None:  # sent while the server is receiving
                            mid = asyncio.create_task(other.chat({**req, "max_tokens": 16, "seed": 7}))
                        await asyncio.sleep(RECEIVE_WINDOW_S)
                        await asyncio.to_thread(mirror.send_all, sink, info.params)
                    tl.mark(f"v{start + k} live")
                    if k == 1:  # answered before the next version exists: it can only begin with
                        # the old or the new one (a loaded engine may start it after the next update)
                        assert mid is not None
                        mid_resp = await mid
                results = await asyncio.gather(*running)
                await publisher.close()
            timelines.append(f"{budget} tokens: {tl}")
            failures, crossed = [], 0
            for i, resp in enumerate(results):
                assert resp.prompt_token_ids, "return_token_ids: prompt_token_ids missing"
                c = resp.choices[0]
                crossed += len(set(c.weight_versions)) > 1
                ok, msg = judge_tags(mirror, resp.prompt_token_ids, c, states, f"in-flight request {i}")
                if not ok:
                    failures.append(msg)
            c = mid_resp.choices[0]
            assert mid_resp.prompt_token_ids
            if c.weight_versions[:1] not in ([start], [start + 1]):
                failures.append(f"a request sent while version {start + 1} was being received began with "
                                f"version {c.weight_versions[:1]}")  # fmt: skip
            ok, msg = judge_tags(mirror, mid_resp.prompt_token_ids, c, states, "the request sent mid-receive")
            if not ok:
                failures.append(msg)
            return crossed, failures

        room = arun(functools.partial(room_left, server_under_test))
        for budget in retry_budgets(128, room):
            crossed, failures = arun(functools.partial(attempt, budget))
            assert not failures, "a version tag lies: " + " | ".join(failures)
            if crossed:
                return
        pytest.fail("inconclusive: no completion was still running when an update went live; " + "; ".join(timelines))

    @pytest.mark.requires("streaming", "in_flight_updates")
    def test_streamed_version_tags_are_true(self, server_under_test: ServerUnderTest, mirror: Mirror) -> None:
        """A streamed completion read by a slow client across an update: the client reads the
        first tokens (timing the engine: :data:`PROBE_TOKENS` of the leading choice over at least
        :data:`PROBE_S`), then stops reading while the engine generates more than every buffer
        between the engine and the client can hold (:func:`stream_buffering`, ``n``
        :data:`SLOW_N` choices with top logprobs so few steps suffice; the hold leaves the
        leading choice :data:`HOLD_SHARE` of its budget to run after the update), then the
        trainer publishes the next version, and only then does the client read on. Old-version
        tokens that waited in the server across the update must keep their version: a token's
        tag is the version of the weights that computed it, not the one live when its chunk was
        written. The first choice that crossed the update (an engine may queue some of the
        ``n`` choices behind the others) is replayed against the mirror as in
        :meth:`test_every_version_tag_is_true` (every tag true, versions never going back); every
        choice's versions never go back. An inconclusive run (no choice crossed the update: the
        hold was too long, the engine may run ahead of what its front has sent; or fewer
        old-version bytes than the buffers hold arrived after it: too short) is tried again with
        another hold, up to :data:`SLOW_ATTEMPTS` runs."""
        timelines: list[str] = []
        backlog = stream_buffering()

        async def attempt(budget: int, held: float | None) -> tuple[bool, bool, float]:
            tl = Timeline()
            async with server_under_test.client() as client:
                publisher = await connect(server_under_test, client)
                info = await client.info()
                start = info.version
                states = {start: mirror.state()}
                mirror.perturb(seed=start + 1, scale=SCALE)
                states[start + 1] = mirror.state()
                mirror.load(states[start])  # the update sends start + 1's weights from the states
                body: dict[str, Any] = {
                    "messages": PROMPT, "max_tokens": budget, "n": SLOW_N, "ignore_eos": True, "temperature": 1.0,
                    "seed": 11, "logprobs": True, "return_token_ids": True, "stream": True,
                }  # fmt: skip
                if server_under_test.capabilities.top_logprobs:
                    body["top_logprobs"] = 20
                tl.mark("ready")
                async with SlowReader(server_under_test, body) as reader:
                    if not await reader.probe(PROBE_TOKENS, PROBE_S):
                        timelines.append(f"{budget} tokens: the stream ended while timed")
                        await publisher.close()
                        return False, False, 0.0
                    rate, per_token, lead = reader.rate(), reader.bytes_per_token(), reader.lead()
                    wanted = FIRST_HOLD * backlog / (per_token * rate)
                    hold = min(wanted, HOLD_SHARE * (budget - lead) / rate) if held is None else held
                    tl.mark(
                        f"{lead} tokens read ({rate:.0f}/s, {per_token / 1024:.1f} KiB each): "
                        f"reading held {hold:.2f}s ({wanted:.1f}s at that rate)"
                    )
                    await asyncio.sleep(hold)
                    mirror.load(states[start + 1])
                    await mirror.publish(publisher, start + 1, info.params)
                    reader.live = True
                    tl.mark(f"v{start + 1} live")
                    # generation order: once any choice has TAIL new tokens, every choice that was
                    # running at the update has shown its crossing
                    await reader.read_until(lambda vs: any(tags.count(start + 1) >= TAIL for tags in vs.values()))
                    tl.mark("read on")
                await publisher.close()
            choices = reader.choices()
            waited = reader.waited(start)
            crossed = [c for c in choices if len(set(c.weight_versions)) > 1]
            timelines.append(
                f"{budget} tokens: {tl}; {waited >> 10} KiB of v{start} after; "
                f"{len(crossed)} of {len(choices)} choices crossed"
            )
            for c in choices:
                tags = list(c.weight_versions)
                assert len(tags) == len(c.token_ids or []), f"choice {c.index}: {len(tags)} versions for its tokens"
                assert tags == sorted(tags), f"a version tag lies: choice {c.index}: versions go back: {_spans(tags)}"
            assert reader.prompt, "return_token_ids: the first chunk carries no prompt_token_ids"
            # nothing crossed by its tags: the longest choice is replayed far past where the update
            # landed (tokens the new weights computed, tagged with the old version, lie)
            judged = crossed[0] if crossed else max(choices, key=lambda c: len(c.token_ids or []))
            upto = 0 if crossed else UNCROSSED_REPLAY
            what = f"streamed choice {judged.index} (read slowly)"
            ok, msg = judge_tags(mirror, reader.prompt, judged, states, what, upto=upto)
            assert ok, "a version tag lies: " + msg
            return bool(crossed), waited >= backlog, hold

        budget = min(SLOW_BUDGET, arun(functools.partial(room_left, server_under_test)))
        held: float | None = None  # the first hold comes from the probe's timing
        short: float | None = None  # the longest hold after which too few bytes had waited
        long: float | None = None  # the shortest hold after which no choice crossed the update
        for _ in range(SLOW_ATTEMPTS):
            crossed, enough, hold = arun(functools.partial(attempt, budget, held))
            if crossed and enough:
                return
            if crossed:
                short = hold
            else:  # the engine ran ahead of what the client saw (a front slower than its engine)
                long = hold if long is None else min(long, hold)
            if short is not None and long is not None:
                held = (short + long) / 2
            else:
                held = hold * 2 if long is None else hold / 4
        pytest.fail(
            f"inconclusive: no stream had {backlog >> 10} KiB of old-version tokens waiting across the update; "
            + "; ".join(timelines)
        )
