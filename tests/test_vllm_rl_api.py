"""vLLM 0.32's RL API on a real reference server (:mod:`pipelinerl_sdk.http.vllm_rl`), driven by
the trainer side of vLLM's flow over the SDK's group (:mod:`pipelinerl_sdk.http.vllm_flow`): the
weights arrive while requests run, a refused update costs no byte and keeps the old weights, and
vLLM's ordering rules hold. vLLM's own trainer-side code drives the same routes in the vllm
adapter's tests."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from pipelinerl_sdk.conformance.mirror import Mirror
from pipelinerl_sdk.errors import FanOutError, ServerError
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.http.vllm_flow import ControlTokenClient, VLLMFlowLink, VLLMFlowPublisher
from pipelinerl_sdk.launch import ServerProcess
from pipelinerl_sdk.protocol import ParamSpec
from pipelinerl_sdk.weights.publisher import WeightPublisher

pytestmark = pytest.mark.integration

PROMPT = [{"role": "user", "content": "Count: 1 2 3 4 5 6 7 8 9"}]


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess("reference", tiny_model, startup_timeout_s=120, options={"threads": 1, "max_model_len": 512})
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


def _post(proc: ServerProcess, path: str, body: Any = None, *, token: str | None = "control") -> httpx.Response:
    headers = {"Authorization": f"Bearer {proc.control_token}"} if token == "control" else {}
    return httpx.post(f"{proc.url}{path}", json=body, headers=headers, timeout=60)


def _weight_version(proc: ServerProcess) -> str:
    r = httpx.get(f"{proc.url}/weight_info", headers={"Authorization": f"Bearer {proc.control_token}"}, timeout=10)
    assert r.status_code == 200, r.text
    return str(r.json()["weight_version"])


def _specs(mirror: Mirror) -> list[ParamSpec]:
    return [ParamSpec(name=n, dtype="float32", shape=tuple(t.shape)) for n, t in mirror.state().items()]


def _serves(proc: ServerProcess, mirror: Mirror, version: int) -> None:
    """Greedy logprobs and version tags of the server are those of ``mirror``'s weights."""
    body = {"messages": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": True, "return_token_ids": True}
    out = httpx.post(f"{proc.url}/v1/chat/completions", json=body, timeout=120).json()
    choice = out["choices"][0]
    want = mirror.logprobs(out["prompt_token_ids"] + choice["token_ids"])[-len(choice["token_ids"]) :]
    got = torch.tensor([t["logprob"] for t in choice["logprobs"]["content"]])
    assert torch.allclose(got, want.float(), atol=1e-4), (got, want)
    assert set(choice["weight_versions"]) == {version}


def _long_call(proc: ServerProcess) -> list[int]:
    body = {"messages": PROMPT, "max_tokens": 200, "temperature": 1.0, "ignore_eos": True, "seed": 1}
    r = httpx.post(f"{proc.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["weight_versions"])


def _streamed_call(proc: ServerProcess, started: threading.Event) -> list[int]:
    """A streamed 200-token call's version tags; ``started`` set once two tokens came."""
    body = {"messages": PROMPT, "max_tokens": 200, "temperature": 1.0, "ignore_eos": True, "seed": 2, "stream": True}
    tags: list[int] = []
    with httpx.stream("POST", f"{proc.url}/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    tags.extend(choice.get("weight_versions", []))
            if len(tags) >= 2:
                started.set()
    return tags


def test_vllms_flow_updates_the_server_while_requests_run(server: ServerProcess, tiny_model: Path) -> None:
    mirror = Mirror(tiny_model, "float32")
    client = ControlTokenClient(server.url, server.control_token)
    flow = VLLMFlowPublisher([VLLMFlowLink(client, receiving_workers=1)], bucket_bytes=1 << 20, timeout_s=60)
    flow.connect()
    try:
        assert _weight_version(server) == "default"  # as vLLM before any update
        with ThreadPoolExecutor(6) as pool:
            calls = [pool.submit(_long_call, server) for _ in range(6)]
            for version in (1, 2, 3):
                mirror.perturb(seed=version, scale=0.05)
                flow.publish(version, _specs(mirror), mirror.state().items())
            tags = [c.result() for c in calls]
        # every call's tokens carry non-decreasing versions; some call crossed an update
        assert all(t == sorted(t) and set(t) <= {0, 1, 2, 3} for t in tags), tags
        assert any(len(set(t)) > 1 for t in tags), f"no call crossed an update: {[sorted(set(t)) for t in tags]}"
        _serves(server, mirror, 3)
        assert _weight_version(server) == "3"  # finish_weight_update's label: the version's string
        last = flow.publisher.last  # the await answer carries the update's timings
        assert last is not None and {"pause_s", "receive_s", "apply_s"} <= set(last.events[server.url].timings)

        # refused before any byte (a param the server does not hold): the old weights serve on,
        # the session is closed, and the next update goes through on the same group
        noise = {n: torch.randn_like(t) for n, t in mirror.state().items()}
        specs = _specs(mirror)
        renamed = [ParamSpec(name="model.value_head.weight", dtype="float32", shape=specs[0].shape), *specs[1:]]
        items = [("model.value_head.weight", noise[specs[0].name]), *((s.name, noise[s.name]) for s in specs[1:])]
        with pytest.raises(FanOutError, match="value_head"):
            flow.publish(4, renamed, items)
        _serves(server, mirror, 3)
        mirror.perturb(seed=4, scale=0.05)
        flow.publish(4, _specs(mirror), mirror.state().items())
        _serves(server, mirror, 4)

        label = _post(server, "/update_weight_version", {"new_version": "step-4"})
        assert label.json() == {"success": True, "new_version": "step-4"}
        assert _weight_version(server) == "step-4"
    finally:
        flow.close()
        client.close()


def test_vllms_ordering_rules_and_refusals_are_answered_with_the_field(server: ServerProcess) -> None:
    # the control token on every route that acts (vLLM serves them open); the reads as /info
    # (this server has no API key: open)
    for path in ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update"):
        assert _post(server, path, token=None).status_code == 401, path
    assert httpx.get(f"{server.url}/weight_info", timeout=10).status_code == 200
    # out of order, as vLLM's worker refuses (409 here: a conflict with the session's state)
    r = _post(server, "/finish_weight_update", {"weight_version": "x"})
    assert r.status_code == 409 and "without a matching start_weight_update" in r.text, r.text
    r = _post(server, "/update_weights", {"update_info": {"op": "await"}})
    assert r.status_code == 409 and "start_weight_update must be called before update_weights" in r.text, r.text
    # vLLM's own transports are not received here: 400 naming init_info
    nccl = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
    r = _post(server, "/init_weight_transfer_engine", {"init_info": nccl})
    assert r.status_code == 400 and r.json()["error"]["param"] == "init_info", r.text
    assert "init_info.master_address" in r.json()["error"]["message"]
    r = _post(server, "/init_weight_transfer_engine", {"init_info": {"request": {"init_method": "tcp://x"}}})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("init_info.request"), r.text
    assert _post(server, "/init_weight_transfer_engine", {}).json()["error"]["param"] == "init_info"
    r = httpx.get(f"{server.url}/get_world_size", headers={"Authorization": f"Bearer {server.control_token}"})
    assert r.json() == {"world_size": 1}


def test_a_session_start_twice_is_refused_and_finish_closes_it(server: ServerProcess) -> None:
    """Run after the update test (the server has a group): the session's own rules."""
    client = ControlTokenClient(server.url, server.control_token)
    flow = VLLMFlowPublisher([VLLMFlowLink(client, receiving_workers=1)], timeout_s=30)
    flow.connect()
    try:
        assert _post(server, "/start_weight_update").json() == {"message": "Weight update started"}
        r = _post(server, "/start_weight_update")
        assert r.status_code == 409 and "already active" in r.text, r.text
        r = _post(server, "/update_weights", {"update_info": {"op": "receive", "version": 9, "params": "x"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "update_info.params", r.text
        for params in ([["w", "float32", 3]], [["w", "float32", [2]], ["w", "float32", [2]]], [["w", "f99", [2]]]):
            assert _post(server, "/start_weight_update").status_code == 200
            body = {"update_info": {"op": "receive", "version": 9, "params": params, "bucket_bytes": 1 << 20}}
            r = _post(server, "/update_weights", body)
            assert r.status_code == 400 and r.json()["error"]["param"].startswith("update_info"), (params, r.text)
        # the refusal closed the session (as vLLM's worker does when update_weights raises)
        r = _post(server, "/finish_weight_update")
        assert r.status_code == 409, r.text
        assert _post(server, "/start_weight_update").status_code == 200
        assert _post(server, "/finish_weight_update", {"weight_version": None}).json() == {
            "message": "Weight update finished"
        }
        with pytest.raises(ServerError, match="409"):
            client.finish_weight_update("again")
    finally:
        flow.close()
        client.close()


def test_a_keep_pause_holds_generation_and_an_sdk_update_lands_inside_it(
    server: ServerProcess, tiny_model: Path
) -> None:
    """vLLM's ``/pause`` on the SDK's server: the control token required, modes other than
    ``keep`` refused naming ``mode``; ``keep`` holds a running request (idempotent), an update
    through the SDK's own routes lands inside the hold and leaves it held; ``/resume``
    (idempotent) lets the request finish whole, its tokens after the resume tagged with the new
    version."""
    assert _post(server, "/pause", token=None).status_code == 401
    for mode in ("abort", "wait", "bogus"):
        r = httpx.post(f"{server.url}/pause?mode={mode}", headers={"Authorization": f"Bearer {server.control_token}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "mode", (mode, r.text)
    assert httpx.get(f"{server.url}/is_paused", timeout=10).json() == {"is_paused": False}
    mirror = Mirror(tiny_model, "float32")
    start = httpx.get(f"{server.url}/info", timeout=10).json()["version"]

    async def update_while_paused() -> None:
        async with InferenceClient(server.url, control_token=server.control_token) as client:
            publisher = WeightPublisher([client], bucket_bytes=1 << 20, timeout_s=60)
            await publisher.connect()
            mirror.perturb(seed=start + 1, scale=0.05)
            await mirror.publish(publisher, start + 1, (await client.info()).params)
            await publisher.close()

    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(_streamed_call, server, started)
        assert started.wait(120), "the streamed call never began"
        for _ in range(2):  # idempotent
            r = _post(server, "/pause?mode=keep")
            assert r.status_code == 200 and r.json() == {"status": "paused"}, r.text
        assert httpx.get(f"{server.url}/is_paused", timeout=10).json() == {"is_paused": True}
        asyncio.run(update_while_paused())
        assert httpx.get(f"{server.url}/is_paused", timeout=10).json() == {"is_paused": True}
        assert not call.done(), "the paused request finished while the server was paused"
        for _ in range(2):
            r = _post(server, "/resume")
            assert r.status_code == 200 and r.json() == {"status": "resumed"}, r.text
        assert httpx.get(f"{server.url}/is_paused", timeout=10).json() == {"is_paused": False}
        tags = call.result(timeout=300)
    assert len(tags) == 200 and tags == sorted(tags) and tags[-1] == start + 1 and tags[0] == start, tags
    _serves(server, mirror, start + 1)
