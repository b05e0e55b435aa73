"""Checks of serving: only the control token opens control routes (on a server that has an
OpenAI API key too), and more sequences than the engine's batch are queued, not refused."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import torch

from pipelinerl_sdk.conformance.common import PROMPT, arun, open_connections
from pipelinerl_sdk.conformance.mirror import Mirror, compare
from pipelinerl_sdk.conformance.targets import ServerUnderTest

CONTROL_ROUTES = ("/init_process_group", "/request_weight_update", "/probe_broadcast")

#: Sequences in flight at once in the overload check: more than any launched engine's batch (the
#: reference's ``max_batch_size`` 32, vLLM's ``max_num_seqs`` 64 as the adapter launches it).
OVERLOAD_REQUESTS, OVERLOAD_N, OVERLOAD_TOKENS = 3, 32, 16


def almost_right(token: str, api_key: str | None) -> dict[str, tuple[dict[str, str], dict[str, str]]]:
    """Ways a request can carry something close to the control token: name -> (headers, query)."""
    bearer = "Bearer "
    cases: dict[str, tuple[dict[str, str], dict[str, str]]] = {
        "no Authorization header": ({}, {}),
        "an empty bearer token": ({"Authorization": "Bearer"}, {}),
        "the token without its last character": ({"Authorization": bearer + token[:-1]}, {}),
        "the first half of the token": ({"Authorization": bearer + token[: len(token) // 2]}, {}),
        "the token plus one character": ({"Authorization": bearer + token + "A"}, {}),
        "the token plus a second word": ({"Authorization": f"{bearer}{token} {token}"}, {}),
        "the token with a space inside": ({"Authorization": f"{bearer}{token[:8]} {token[8:]}"}, {}),
        "the token without 'Bearer '": ({"Authorization": token}, {}),
        "the token under the Basic scheme": ({"Authorization": f"Basic {token}"}, {}),
        "the token in an X-Control-Token header": ({"X-Control-Token": token}, {}),
        "the token in an Api-Key header": ({"Api-Key": token}, {}),
        "the token in the query string": ({}, {"token": token, "access_token": token, "control_token": token}),
    }
    if token.swapcase() != token:
        cases["the token in the wrong case"] = ({"Authorization": bearer + token.swapcase()}, {})
    if api_key:
        cases["the OpenAI API key"] = ({"Authorization": bearer + api_key}, {})
        cases["the API key plus the token"] = ({"Authorization": f"{bearer}{api_key},{token}"}, {})
    return cases


class ServingChecks:
    """Mixed into :class:`~pipelinerl_sdk.conformance.inference.InferenceContractTests`."""

    def test_control_routes_need_the_control_token(self, server_under_test: ServerUnderTest) -> None:
        """Every control route, asked with anything but the exact control token (the OpenAI API
        key, a prefix, the token plus a suffix, wrong case, no ``Bearer``, in another header or
        the query string...), answers 401 or 403 with a message and does nothing; with the
        token, the same (empty) body reaches the route and is refused as a bad body instead.
        The suite launches every server with an API key as well, so the key is tried too."""
        sut = server_under_test

        async def body() -> None:
            token = sut.control_token
            async with httpx.AsyncClient(base_url=sut.url, timeout=60) as http:
                opened = []
                for path in CONTROL_ROUTES:
                    r = await http.post(path, json={}, headers={"Authorization": f"Bearer {token}"})
                    assert r.status_code not in (401, 403), f"{path}: the control token itself is refused: {r.text}"
                    opened.append(r.status_code)
                accepted = []
                for name, (headers, query) in almost_right(token, sut.api_key).items():
                    for path in CONTROL_ROUTES:
                        r = await http.post(path, json={}, headers=headers, params=query)
                        if r.status_code not in (401, 403) or not r.json().get("error", {}).get("message"):
                            accepted.append(f"{path} with {name}: {r.status_code} {r.text[:120]}")
                assert not accepted, "a control route opened without the exact control token: " + "; ".join(accepted)
                if sut.api_key:  # the key still opens the OpenAI routes
                    r = await http.get("/v1/models", headers={"Authorization": f"Bearer {sut.api_key}"})
                    assert r.status_code == 200, f"/v1/models with the API key: {r.status_code}"

        arun(body)

    def test_more_sequences_than_the_batch_are_queued(self, server_under_test: ServerUnderTest, mirror: Mirror) -> None:
        """96 sequences at once (3 requests of n=32; more than the engine's batch) are queued,
        not refused: every request answers 200, every choice has its full budget, the current
        version and the logprobs the served weights give."""

        async def body() -> None:
            async with server_under_test.client() as client:
                version = (await client.info()).version
                req: dict[str, Any] = {
                    "messages": PROMPT, "max_tokens": OVERLOAD_TOKENS, "n": OVERLOAD_N, "ignore_eos": True,
                    "logprobs": True, "return_token_ids": True,
                }  # fmt: skip
                # Connections opened first: the requests then arrive together, not one per TCP
                # handshake, so they overlap in the engine (a refusal past the batch shows).
                await open_connections(client, OVERLOAD_REQUESTS)
                outcomes = await asyncio.gather(
                    *(client.chat({**req, "seed": i}) for i in range(OVERLOAD_REQUESTS)), return_exceptions=True
                )
            refused = [f"request {i}: {o}" for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
            assert not refused, (
                f"{len(refused)} of {OVERLOAD_REQUESTS} requests ({OVERLOAD_N} sequences each) were refused, not "
                "queued: " + "; ".join(refused[:3])
            )
            seqs: list[list[int]] = []
            got: list[float] = []
            for resp in outcomes:
                assert not isinstance(resp, BaseException) and resp.prompt_token_ids
                assert len(resp.choices) == OVERLOAD_N, f"{len(resp.choices)} choices for n={OVERLOAD_N}"
                for c in resp.choices:
                    assert c.token_ids is not None and c.logprobs is not None
                    assert c.finish_reason == "length" and len(c.token_ids) == OVERLOAD_TOKENS, (
                        f"a queued sequence ended {c.finish_reason!r} after {len(c.token_ids)} tokens"
                    )
                    assert set(c.weight_versions) == {version}, c.weight_versions
                    seqs.append(resp.prompt_token_ids + c.token_ids)
                    got.extend(t.logprob for t in c.logprobs.content)
            start = len(seqs[0]) - OVERLOAD_TOKENS
            logits = mirror.next_token_logits(seqs, start)
            ids = torch.tensor([s[start:] for s in seqs])
            ref = torch.log_softmax(logits, dim=-1).gather(-1, ids[..., None]).reshape(-1)
            ok, msg = compare(got, ref, mirror.dtype)
            assert ok, f"logprobs of the queued sequences differ from the served weights': {msg}"

        arun(body)
