"""Hostile hand-written requests against a real server of the backend under test
(``--reliability-backend``; issue 15, items 6-10): none may fail another request, stall the event
loop, outstay its welcome, or get a 5xx.

Every test here failed before its fix on some backend; the bounds on time are generous and only
prove that something does not wait behind something else (seconds against the minutes it took
before). The servers are the suite's shared ones (``conftest.py``): ``server`` (no limits of its
own) and ``limited`` (small admission limits, stopped by the SIGTERM case, last). Engine-specific
skips say why where they are made.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from reliability_backends import LIMITED, Servers
from test_server_integration import run, train_step

from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.launch import ServerProcess
from pipelinerl_sdk.reference.trainer import ReferenceTrainer
from pipelinerl_sdk.weights.publisher import WeightPublisher

pytestmark = pytest.mark.integration
SMALL = {"messages": [{"role": "user", "content": "12+7="}], "max_tokens": 6, "temperature": 0}
#: Sampled, 64 tokens whatever the model says: tokens repeat, so a repetition penalty applies.
SAMPLED_64 = {"temperature": 1.0, "max_tokens": 64, "ignore_eos": True}
#: A token seen before: its logit / 1e-40 overflows float32 to infinity.
OVERFLOWING = {**SMALL, **SAMPLED_64, "top_p": 0.9, "repetition_penalty": 1e-40}
#: A request that keeps one sequence slot busy for minutes on the tiny model at batch size 1.
#: Two sequences of 1450 tokens: the limited server's whole batch and nearly its token bound (3000).
HOG = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 1450, "ignore_eos": True, "n": 2}


def post(srv: ServerProcess, path: str, body: Any, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {srv.control_token}"} if not path.startswith("/v1") else {}
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=120, **kw)


# --- 6. a request the engine cannot compute fails nobody, itself included -------------------------


def test_underflowing_temperature_and_top_p_are_served_and_fail_no_neighbour(server: Any, backend: str) -> None:
    """1e-40 underflows float32: the temperature is raised to the smallest one sampled (vLLM's
    rule), top-p keeps the most likely token; a repetition penalty that overflows a logit to
    infinity fails that request alone at most; the neighbours decoding in the same batch finish."""

    async def body() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            innocent = [
                asyncio.ensure_future(http.post("/v1/chat/completions", json={**SMALL, "max_tokens": 64, "seed": i}))
                for i in range(4)
            ]
            hostile = [
                http.post("/v1/chat/completions", json={**SMALL, "temperature": 1e-40}),
                http.post("/v1/chat/completions", json={**SMALL, "temperature": 1.0, "top_p": 1e-46}),
                http.post("/v1/chat/completions", json={**SMALL, "temperature": 5e-324, "top_p": 5e-324, "n": 3}),
                # a token seen before: its logit / 1e-40 overflows to inf, its probability NaN (killed
                # SGLang's scheduler, every request with it, found by fuzzing)
                http.post("/v1/chat/completions", json=OVERFLOWING),
            ]
            bad = await asyncio.gather(*hostile)
            return list(await asyncio.gather(*innocent)), list(bad)

    innocent, hostile = run(body)
    print(
        f"\n[{backend}] underflowing sampling: {sum(r.status_code != 200 for r in innocent)} of {len(innocent)} "
        f"innocent requests failed; hostile answered {[r.status_code for r in hostile]}"
    )
    assert [r.status_code for r in innocent] == [200] * 4
    assert [r.status_code for r in hostile[:3]] == [200] * 3, [r.text[:200] for r in hostile]
    # served from finite logits (vLLM; SGLang, its logits sanitised), or refused alone (the reference)
    assert hostile[3].status_code == 200 or (hostile[3].status_code == 400 and "error" in hostile[3].json())
    greedy = post(server, "/v1/chat/completions", {**SMALL, "return_token_ids": True}).json()
    tiny_top_p = post(server, "/v1/chat/completions", {**SMALL, "top_p": 1e-46, "temperature": 1.0}).json()
    assert tiny_top_p["choices"][0]["message"] == greedy["choices"][0]["message"]  # only the top token is kept


# --- 7. body size and CPU work off the event loop --------------------------------------------------


def raw_request(url: str, head: str, body: bytes = b"") -> bytes:
    """Send ``head`` (and ``body``) on a fresh connection; the status line read back within 60 s."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head.encode() + body)
        return sock.recv(4096).split(b"\r\n", 1)[0]


def test_body_past_the_limit_is_413_before_it_is_read(limited: ServerProcess) -> None:
    host = limited.url.removeprefix("http://")
    declared = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Length: {8 << 20}\r\n\r\n"
    assert raw_request(limited.url, declared, b"{") == b"HTTP/1.1 413 Request Entity Too Large"
    chunk = b" " * (256 << 10)
    chunked = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunks = (f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n") * 5  # 1.25 MiB, no end: never parsed
    assert raw_request(limited.url, chunked, chunks) == b"HTTP/1.1 413 Request Entity Too Large"
    r = post(limited, "/v1/chat/completions", {**SMALL, "messages": [{"role": "user", "content": "x" * (2 << 20)}]})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text[:300]
    assert "limit of 1048576" in r.json()["error"]["message"]
    assert post(limited, "/v1/chat/completions", SMALL).status_code == 200  # under the limit: served


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB."""
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_health_answers_while_a_10_mb_prompt_is_tokenised(server: ServerProcess, backend: str) -> None:
    """The prompt's chat template and tokenisation run off the event loop (they took 15 s on it),
    and the memory they took goes back (1.2 GB stayed). Prints the issue's figure: the longest
    ``/health`` stall, asked every 10 ms while the prompt is read, parsed and tokenised. The shared
    server takes 32 MiB bodies; its RSS is that of the process serving HTTP (vLLM's API server,
    SGLang's gateway)."""
    srv = server
    # encoded once here: the client's own json.dumps would stall the asking loop, not the server
    prompt = json.dumps({**SMALL, "messages": [{"role": "user", "content": "ab " * ((10 << 20) // 3)}]}).encode()

    async def health_every_10_ms(http: httpx.AsyncClient, until: asyncio.Future[Any]) -> tuple[list[float], float]:
        """(/health answer times, the server's peak RSS) until ``until`` is done."""
        stalls: list[float] = []
        peak = 0.0
        start = time.perf_counter()
        while not until.done():
            t0 = time.perf_counter()
            assert (await http.get("/health")).status_code == 200
            stalls.append(time.perf_counter() - t0)
            if stalls[-1] > 0.1:
                print(f"\n/health: {stalls[-1] * 1000:.0f} ms, asked {t0 - start:.2f} s in", flush=True)
            peak = max(peak, rss_mb(srv.pid))
            await asyncio.sleep(0.01)
        return stalls, peak

    async def body() -> tuple[httpx.Response, list[float], list[float], float]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=600) as http:
            assert (await http.post("/v1/chat/completions", json=SMALL)).status_code == 200  # warm
            # the same asks with no request running: what the machine's load alone costs
            quiet, _ = await health_every_10_ms(http, asyncio.ensure_future(asyncio.sleep(3)))
            big = asyncio.ensure_future(
                http.post("/v1/chat/completions", content=prompt, headers={"Content-Type": "application/json"})
            )
            stalls, peak = await health_every_10_ms(http, big)
            return await big, quiet, stalls, peak

    before = rss_mb(srv.pid)
    resp, quiet, stalls, peak = run(body)
    time.sleep(0.5)
    after = rss_mb(srv.pid)
    print(
        f"\n[{backend}] /health during a 10 MB prompt: {len(stalls)} answers, longest {max(stalls) * 1000:.0f} ms "
        f"(with nothing running: longest of {len(quiet)} {max(quiet) * 1000:.0f} ms); server RSS {before:.0f} MB "
        f"before, {peak:.0f} MB peak, {after:.0f} MB after (kept {after - before:+.0f} MB)"
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"  # past the context
    assert len(stalls) >= 3, "the big request must still be processing while /health is asked"
    assert max(stalls) < 5.0, f"/health stalled {max(stalls):.1f} s behind one request"
    assert after - before < 200, f"the server kept {after - before:.0f} MB after one 10 MB prompt"


async def health_until(http: httpx.AsyncClient, until: asyncio.Future[Any]) -> list[tuple[float, float]]:
    """``/health`` asked every 10 ms until ``until`` is done: per answer, (its time, the part of it
    this client's own event loop did not run). On a loaded machine the asking process can itself be
    descheduled (on 2 busy cores vLLM's engine compiled a grammar on 8 threads and this client's
    loop stood still up to 1.9 s, using no CPU, while the server's loop answered at once): that
    part is not the server's stall."""
    still: list[tuple[float, float]] = []  # (from, to): this loop did not run

    async def watch() -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.005)
            if time.perf_counter() - t0 > 0.025:
                still.append((t0 + 0.005, time.perf_counter()))

    watching = asyncio.ensure_future(watch())
    answers: list[tuple[float, float]] = []
    try:
        while not until.done():
            t0 = time.perf_counter()
            assert (await http.get("/health")).status_code == 200
            t1 = time.perf_counter()
            answers.append((t1 - t0, sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in still)))
            await asyncio.sleep(0.01)
    finally:
        watching.cancel()
    return answers


@pytest.mark.parametrize("stream", [False, True])
def test_health_answers_while_a_slow_grammar_compiles(server: Any, backend: str, stream: bool) -> None:
    """A 28 KB regex of 4,000 alternations takes xgrammar seconds to compile (2.4 s on the
    development machine): the grammar compiles on a worker thread, before any sample (the
    backend's ``prepare``), not on the event loop, where the streamed path compiled it and
    ``/health`` waited for the whole compile. Each case has its own regex (the compiler caches).
    vLLM compiles in its engine core (another process), SGLang in its scheduler (another process)
    after the adapter's own check on a worker thread. The bound is on the server's part of each
    answer (:func:`health_until`)."""
    alternation = "(ac|bd)" if stream else "(ab|cd)"
    req = {**SMALL, "max_tokens": 4, "stream": stream, "structured_outputs": {"regex": alternation * 4000}}

    async def body() -> tuple[httpx.Response, list[tuple[float, float]], float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            start = time.perf_counter()
            big = asyncio.ensure_future(http.post("/v1/chat/completions", json=req))
            answers = await health_until(http, big)
            return await big, answers, time.perf_counter() - start

    resp, answers, wall = run(body)
    stalls = [t - ours for t, ours in answers]  # the server's part
    longest = max(answers)
    print(
        f"\n[{backend}] /health while a grammar compiles (stream {stream}): longest server stall {max(stalls):.3f} s "
        f"of {wall:.1f} s (longest answer {longest[0]:.3f} s, {longest[1]:.3f} s of it this client stood still)"
    )
    assert resp.status_code == 200, resp.text
    if stream:
        events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
        assert not [e for e in events if "error" in e], events
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    else:
        text = resp.json()["choices"][0]["message"]["content"]
    a, b = alternation[1:3], alternation[4:6]
    assert text and re.fullmatch(f"(?:{a}|{b})*[{a[0]}{b[0]}]?", text), text  # a prefix the grammar allows
    # on the loop, the compile is one stall of nearly the whole request (2.3 s of 2.5 s); off it,
    # stalls are the machine's own (9-16 ms idle, 0.72 s once in a CI run at load 5)
    assert max(stalls) < 0.4 * wall, f"/health stalled {max(stalls):.1f} s of the request's {wall:.1f} s"
    assert len(stalls) >= 10, "the compile must still be running while /health is asked"


# --- 8. admission, a client that leaves, SIGTERM ----------------------------------------------------


async def in_flight(http: httpx.AsyncClient, n: int) -> None:
    """Return once ``n`` chat requests are admitted (the server's /info counts them)."""
    while (await http.get("/info")).json()["requests_in_flight"] < n:
        await asyncio.sleep(0.01)


def test_requests_past_the_admission_limits_get_429_with_retry_after(limited: ServerProcess) -> None:
    long = {**SMALL, "max_tokens": 1500, "ignore_eos": True}

    async def body() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=limited.url, timeout=300) as http:
            running = [asyncio.ensure_future(http.post("/v1/chat/completions", json=long))]
            refused: list[httpx.Response] = []
            await in_flight(http, 1)
            # 1500 in flight + 1600 asked > 3000: refused while the long one runs
            while not running[0].done():
                r = await http.post("/v1/chat/completions", json={**SMALL, "max_tokens": 1600, "ignore_eos": True})
                if r.status_code == 429:
                    refused.append(r)
                    break
            # 3 requests in flight at most: a fourth small one is refused
            for _ in range(2):
                running.append(
                    asyncio.ensure_future(http.post("/v1/chat/completions", json={**long, "max_tokens": 700}))
                )
                await in_flight(http, len(running))
            while not all(t.done() for t in running):
                r = await http.post("/v1/chat/completions", json={**SMALL, "max_tokens": 1})
                if r.status_code == 429:
                    refused.append(r)
                    break
            return list(await asyncio.gather(*running)), refused

    done, refused = run(body)
    assert [r.status_code for r in done] == [200] * 3
    assert len(refused) == 2, "both bounds must refuse while the long requests run"
    tokens, requests = (r.json()["error"]["message"] for r in refused)
    assert "tokens in flight" in tokens and "limit of 3000" in tokens
    assert "requests in flight (limit 3)" in requests
    for r in refused:
        assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "overloaded"
    # A request whose own budget is past the token bound can never fit: a 400 naming the field to
    # lower, whatever runs (it was admitted alone, then took the server from everyone else).
    for body, field in (({**SMALL, "max_tokens": 3001}, "max_tokens"), ({**SMALL, "max_tokens": 1000, "n": 4}, "n")):
        r = post(limited, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text[:300]
        assert "can never be admitted" in r.json()["error"]["message"]
    assert post(limited, "/v1/chat/completions", {**SMALL, "max_tokens": 20, "n": 10}).status_code == 200


def test_a_client_that_leaves_frees_the_engine(limited: ServerProcess, backend: str) -> None:
    """2 x 1450 tokens fill the limited server's batch (2) and nearly its token bound (3000); once
    its client left, a small request is served at once: its admission freed (else a 429) and its
    sequences aborted in the engine (else the small one waits behind them)."""

    async def body() -> tuple[httpx.Response, float, int]:
        async with httpx.AsyncClient(base_url=limited.url, timeout=600) as http:
            hog = asyncio.ensure_future(http.post("/v1/chat/completions", json=HOG))
            await in_flight(http, 1)
            await asyncio.sleep(1.0)  # admitted and generating
            hog.cancel()  # the client leaves: its connection closes
            with pytest.raises(asyncio.CancelledError):
                await hog
            t0, refused = time.perf_counter(), 0
            while True:  # 429 until the server has seen the client leave
                r = await asyncio.wait_for(http.post("/v1/chat/completions", json=SMALL), 60)
                if r.status_code != 429 or time.perf_counter() - t0 > 60:
                    return r, time.perf_counter() - t0, refused
                refused += 1
                await asyncio.sleep(0.05)

    r, waited, refused = run(body)
    print(
        f"\n[{backend}] a client left 2 x 1450 tokens: the next request served {waited:.2f} s later ({refused} x 429)"
    )
    assert r.status_code == 200, r.text[:300]


# --- 9. a trainer stuck after its go holds no generation ------------------------------------------


def test_direct_update_pauses_only_once_bytes_flow(
    server: ServerProcess, backend: str, trainer: ReferenceTrainer
) -> None:
    """A ``direct`` update whose trainer said ``go`` and then sends nothing holds no generation:
    a request of 400 tokens started after the ``go`` ends on the old weights before the first
    byte is sent. (vLLM held generation from the ``go`` until it had a ``first_bytes`` step: the
    request waited the whole 60 s; SGLang, which receives in place, held it from the ``go``: it
    now holds it from the trainer's ``sending`` mark, posted as the first param is handed over.)"""

    async def body() -> float:
        async with InferenceClient(server.url, control_token=server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=64 << 10, mode="direct")
            await pub.connect()
            version = (await client.info()).version + 1
            train_step(trainer, seed=3)
            async with pub.update(version, trainer.param_specs()) as sink:
                # the go is posted; this trainer stalls before sending a byte. A request of
                # 400 tokens outlasts the server's reading of the go: held, it could not end
                t0 = time.perf_counter()
                chat = asyncio.ensure_future(client.chat({**SMALL, "max_tokens": 400, "ignore_eos": True}))
                finished, _ = await asyncio.wait({chat}, timeout=60)
                took = time.perf_counter() - t0
                assert chat in finished, "chat was held by an update whose bytes had not started"
                assert set(chat.result().choices[0].weight_versions) == {version - 1}
                await asyncio.to_thread(trainer.gather_and_broadcast, sink)
            after = await client.chat(SMALL)
            assert set(after.choices[0].weight_versions) == {version}
            await pub.close()
            return took

    took = run(body)
    print(f"\n[{backend}] direct update, trainer stalled after its go: 400 tokens served in {took:.2f} s meanwhile")


# --- 10. bad input is a 4xx naming the field --------------------------------------------------------


def test_lone_surrogate_is_400_naming_the_message(server: Any) -> None:
    raw = json.dumps({**SMALL, "messages": [{"role": "user", "content": "a\ud800b"}]})
    r = httpx.post(
        server.url + "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == "messages.0.content"


def test_rank_offset_past_world_size_is_400_before_joining(server: Any) -> None:
    body = {"init_method": "tcp://127.0.0.1:9", "rank_offset": 2, "world_size": 2, "group_secret": "ab" * 16}
    r = post(server, "/init_process_group", body)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == "rank_offset" and "world_size 2" in r.json()["error"]["message"]


def test_probe_without_a_decision_is_408(server: ServerProcess) -> None:
    async def body() -> httpx.Response:
        async with InferenceClient(server.url, control_token=server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=64 << 10)
            await pub.connect()
            group = (await client.info()).group
            assert group is not None
            probe = {"nbytes": 1024, "probe_id": 1, "group_id": group.group_id, "timeout_s": 1}
            r = await asyncio.to_thread(post, server, "/probe_broadcast", probe)
            await pub.close()
            return r

    r = run(body)
    assert r.status_code == 408, r.text[:300]
    assert r.json()["error"]["type"] == "decision_timeout" and "no decision" in r.json()["error"]["message"]


# --- 8, last: it stops the limited server ---------------------------------------------------------


def test_sigterm_stops_the_server_with_work_in_flight(servers: Servers, backend: str) -> None:
    srv = servers.take(LIMITED)  # --shutdown-timeout 1
    try:

        async def body() -> int | None:
            async with httpx.AsyncClient(base_url=srv.url, timeout=600) as http:
                hog = asyncio.ensure_future(http.post("/v1/chat/completions", json=HOG))
                await in_flight(http, 1)
                await asyncio.sleep(1.0)
                assert srv.proc is not None
                os.kill(srv.pid, signal.SIGTERM)
                t0 = time.perf_counter()
                code = await asyncio.to_thread(srv.proc.wait, 30)  # seconds of work were in flight
                print(
                    f"\n[{backend}] SIGTERM, seconds of work in flight: exit after {time.perf_counter() - t0:.1f} s "
                    "(drain bound 1 s)"
                )
                with pytest.raises(httpx.HTTPError):  # the connection ends with the process
                    (await hog).raise_for_status()
                return code

        assert run(body) == 0
    finally:
        srv.stop()
