"""The inference contract end to end: a real reference server process, a real trainer, a real
gloo weight-update group between them."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import torch

from pipelinerl_sdk.conformance.inference import update_body
from pipelinerl_sdk.contracts import TokenBatch
from pipelinerl_sdk.errors import FanOutError
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.launch import ServerProcess
from pipelinerl_sdk.protocol import ChatCompletionResponse
from pipelinerl_sdk.reference.trainer import ReferenceTrainer
from pipelinerl_sdk.rl.objectives import CompletionNLL
from pipelinerl_sdk.weights.publisher import WeightPublisher

pytestmark = pytest.mark.integration
T = TypeVar("T")
PROMPT = [{"role": "user", "content": "12+7="}]


def run(coro_fn: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await coro_fn()

    return asyncio.run(main())


def train_step(trainer: ReferenceTrainer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 200, (2, 12), generator=g).tolist()
    trainer.backward(TokenBatch(input_ids=ids, completion_start=[6, 6]), CompletionNLL(2))
    trainer.step()


async def scored_chat(client: InferenceClient, **extra: Any) -> ChatCompletionResponse:
    body = {
        "messages": PROMPT,
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "return_token_ids": True,
        "prompt_logprobs": True,
        **extra,
    }
    return await client.chat(body)


def trainer_logprobs(trainer: ReferenceTrainer, resp: ChatCompletionResponse) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt logprobs, completion logprobs) of the server's exact tokens, by the trainer."""
    prompt = resp.prompt_token_ids or []
    choice = resp.choices[0]
    seq = prompt + (choice.token_ids or [])
    lp = trainer.forward(TokenBatch(input_ids=[seq], completion_start=[len(prompt)]))[0]
    return lp[: len(prompt) - 1], lp[len(prompt) - 1 :]


def server_logprobs(resp: ChatCompletionResponse) -> tuple[torch.Tensor, torch.Tensor]:
    prompt = torch.tensor([x for x in resp.prompt_token_logprobs() if x is not None])
    content = resp.choices[0].logprobs.content if resp.choices[0].logprobs else []
    return prompt, torch.tensor([t.logprob for t in content])


async def publish(pub: WeightPublisher, trainer: ReferenceTrainer, version: int) -> None:
    async with pub.update(version, trainer.param_specs()) as sink:
        await asyncio.to_thread(trainer.gather_and_broadcast, sink)


@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_update_makes_server_logprobs_equal_trainer_logprobs(server: Any, trainer: ReferenceTrainer, mode: str) -> None:
    async def body() -> None:
        async with InferenceClient(server.url, control_token=server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=64 << 10, mode=mode)  # type: ignore[arg-type]
            await pub.connect()
            before = await scored_chat(client)
            train_step(trainer, seed=len(mode))
            version = (await client.info()).version + 1
            await publish(pub, trainer, version)
            assert pub.last is not None
            event = next(iter(pub.last.events.values()))
            assert event.mode == mode and event.version == version
            assert event.timings["pause_s"] >= event.timings["apply_s"] > 0
            after = await scored_chat(client)
            assert set(after.choices[0].weight_versions) == {version}
            assert (await client.info()).version == version
            sp, sc = server_logprobs(after)
            tp, tc = trainer_logprobs(trainer, after)
            assert torch.allclose(sp, tp, atol=1e-5, rtol=0), (sp - tp).abs().max()
            assert torch.allclose(sc, tc, atol=1e-5, rtol=0), (sc - tc).abs().max()
            # and the update really changed what the server computes
            bp, _ = server_logprobs(before)
            assert (bp - sp).abs().max() > 1e-3
            await pub.close()

    run(body)


def test_request_in_flight_across_update_keeps_running_and_switches_version(
    server: Any, trainer: ReferenceTrainer
) -> None:
    async def body() -> None:
        async with InferenceClient(server.url, control_token=server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=64 << 10)
            await pub.connect()
            old = (await client.info()).version
            train_step(trainer, seed=11)  # before the requests start: the update follows them at once
            # 6 x 2000 tokens take over a second on the tiny model; the update lands after 0.1 s
            # plus its own few tens of ms (with 1000 tokens, a fast machine finished them first)
            n, budget = 6, 2000
            running = [
                asyncio.create_task(
                    client.chat({"messages": PROMPT, "max_tokens": budget, "ignore_eos": True, "seed": i})
                )
                for i in range(n)
            ]
            await asyncio.sleep(0.1)
            assert not any(r.done() for r in running), "the requests must still be running when the update starts"
            await publish(pub, trainer, old + 1)
            assert not all(r.done() for r in running), "the update must land while the requests run"
            for resp in await asyncio.gather(*running):  # none dropped, none aborted
                versions = resp.choices[0].weight_versions
                assert len(versions) == budget and resp.choices[0].finish_reason == "length"
                assert versions == sorted(versions), "versions never go back"
                assert versions[0] == old and versions[-1] == old + 1
                assert set(versions) == {old, old + 1}
            await pub.close()

    run(body)


def test_bad_updates_are_refused_before_receive_and_lose_nothing(server: Any) -> None:
    async def body() -> None:
        async with InferenceClient(server.url, control_token=server.control_token) as client:
            pub = WeightPublisher([client])
            await pub.connect()
            info = await client.info()
            v = info.version
            before = await scored_chat(client)
            params = [p.model_dump(mode="json") for p in info.params]
            renamed = [dict(params[0], name="model.not_a_layer.weight"), *params[1:]]
            reshaped = [dict(params[0], shape=[params[0]["shape"][0] + 1, *params[0]["shape"][1:]]), *params[1:]]
            retyped = [dict(params[0], dtype="bfloat16"), *params[1:]]
            cases: list[tuple[dict[str, Any] | str, int, str]] = [
                (update_body(info, v + 1, params=renamed), 422, "unknown param"),
                (update_body(info, v + 1, params=reshaped), 422, "shape"),
                (update_body(info, v + 1, params=retyped), 422, "dtype"),
                (update_body(info, v + 1, params=params[1:]), 422, "missing"),
                (update_body(info, v), 409, "version must increase"),
                (update_body(info, max(v - 1, 0) or v), 409, "version"),
                (update_body(info, v + 1, plan_digest="f" * 64), 400, "plan_digest"),
                (update_body(info, v + 1, surprise=1), 400, "surprise"),
                (update_body(info, v + 1, mode="teleport"), 400, "mode"),
                ("{not json", 400, ""),
            ]
            headers = {"Authorization": f"Bearer {server.control_token}"}
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                for case, status, needle in cases:
                    if isinstance(case, str):
                        r = await http.post("/request_weight_update", content=case, headers=headers)
                    else:
                        r = await http.post("/request_weight_update", json=case, headers=headers)
                    assert r.status_code == status, (needle, r.status_code, r.text)
                    err = r.json()["error"]
                    assert needle.lower() in err["message"].lower() + str(err.get("param")).lower(), err
            after_info = await client.info()
            assert after_info.version == v and after_info.group is not None and not after_info.group.broken
            after = await scored_chat(client)
            assert after.choices[0].token_ids == before.choices[0].token_ids
            assert server_logprobs(after)[0].tolist() == server_logprobs(before)[0].tolist()
            await pub.close()

    run(body)


def test_control_routes_need_the_control_token(server: Any) -> None:
    async def body() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            for path in ("/request_weight_update", "/init_process_group", "/probe_broadcast", "/bench/apply_floor"):
                r = await http.post(path, json={})
                assert r.status_code == 401, (path, r.text)
                r = await http.post(path, json={}, headers={"Authorization": "Bearer nope"})
                assert r.status_code == 403, (path, r.text)
            assert (await http.get("/health")).status_code == 200
            r = await http.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 2})
            assert r.status_code == 200  # no api key configured on this server

    run(body)


def test_api_key_guards_chat_and_differs_from_control_token(tiny_model: Path) -> None:
    with ServerProcess("reference", tiny_model, api_key="sk-test", options={"threads": 1}) as srv:

        async def body() -> None:
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
                chat = {"messages": PROMPT, "max_tokens": 2}
                assert (await http.post("/v1/chat/completions", json=chat)).status_code == 401
                bad = {"Authorization": f"Bearer {srv.control_token}"}  # a wrong key is 401, as OpenAI answers
                assert (await http.post("/v1/chat/completions", json=chat, headers=bad)).status_code == 401
                good = {"Authorization": "Bearer sk-test"}
                assert (await http.post("/v1/chat/completions", json=chat, headers=good)).status_code == 200
                # the API key opens no control route
                assert (await http.post("/init_process_group", json={}, headers=good)).status_code == 403

        run(body)


def test_concurrent_update_requests_are_refused_not_interleaved(server: Any, trainer: ReferenceTrainer) -> None:
    async def body() -> None:
        async with InferenceClient(server.url, control_token=server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=64 << 10)
            await pub.connect()
            info = await client.info()
            v = info.version
            train_step(trainer, seed=21)
            headers = {"Authorization": f"Bearer {server.control_token}"}
            async with (
                httpx.AsyncClient(base_url=server.url, timeout=30) as http,
                pub.update(v + 1, trainer.param_specs()) as sink,
            ):
                # the first update is accepted and receiving: a second one must be refused
                r = await http.post("/request_weight_update", json=update_body(info, v + 2), headers=headers)
                assert r.status_code == 409 and "another control operation" in r.json()["error"]["message"]
                assert (await client.info()).updating
                await asyncio.to_thread(trainer.gather_and_broadcast, sink)
            assert (await client.info()).version == v + 1
            assert not (await client.info()).updating
            await pub.close()

    run(body)


def client_ports(server_port: int) -> set[int]:
    """Local ports of every TCP socket on this host connected to ``server_port`` (any state,
    TIME_WAIT included): one port per connection a client has opened."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, remote = line.split()[1:3]
                if int(remote.rsplit(":", 1)[1], 16) == server_port:
                    ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket table")
def test_updates_reuse_one_connection(server: Any, trainer: ReferenceTrainer) -> None:
    """Each update's NDJSON stream is read to its end, so its connection goes back to the pool:
    three updates and the info calls around them open one connection, not one per update (a
    new connection cost about 3 ms of every update on the development machine)."""

    async def body() -> None:
        port = int(server.url.rsplit(":", 1)[1])
        before = client_ports(port)
        async with InferenceClient(server.url, control_token=server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=64 << 10)
            await pub.connect()
            version = (await client.info()).version
            for v in range(version + 1, version + 4):
                await publish(pub, trainer, v)
            assert (await client.info()).version == version + 3
            opened = client_ports(port) - before
            await pub.close()
        assert len(opened) == 1, f"{len(opened)} connections for 3 updates: {sorted(opened)}"

    run(body)


TRAINER_KILLED_SCRIPT = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from pipelinerl_sdk.contracts import TrainerSpec
    from pipelinerl_sdk.http.client import InferenceClient
    from pipelinerl_sdk.reference.trainer import ReferenceTrainer
    from pipelinerl_sdk.weights.publisher import WeightPublisher

    url, token, model, version = sys.argv[1], os.environ["TOKEN"], sys.argv[2], int(sys.argv[3])

    async def main():
        t = ReferenceTrainer(); t.init(TrainerSpec(model=model))
        client = InferenceClient(url, control_token=token)
        pub = WeightPublisher([client], bucket_bytes=16 << 10, timeout_s=float(sys.argv[4]))
        await pub.connect()
        async with pub.update(version, t.param_specs()) as sink:
            for i, (name, p) in enumerate(t.model.named_parameters()):
                sink.send(name, p.detach() + 1.0)
                if i == 6:
                    print("killing myself mid-broadcast", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(main())
    """
)


def test_trainer_killed_mid_broadcast_leaves_server_serving_old_weights(
    server: Any, tiny_model: Path, trainer: ReferenceTrainer
) -> None:
    timeout_s = 8.0

    async def body() -> None:
        async with InferenceClient(server.url, control_token=server.control_token) as client:
            v = (await client.info()).version
            before = await scored_chat(client)
            env = {**os.environ, "TOKEN": server.control_token}
            t0 = time.monotonic()
            proc = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-c", TRAINER_KILLED_SCRIPT, server.url, str(tiny_model), str(v + 1), str(timeout_s)],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert proc.returncode == -signal.SIGKILL, proc.stderr
            assert "killing myself" in proc.stdout
            # within the timeout the server has given up on the update, unpaused, old weights
            deadline = t0 + 60
            while (await client.info()).updating and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            info = await client.info()
            assert not info.updating
            assert info.version == v
            assert info.group is not None and info.group.broken
            after = await asyncio.wait_for(scored_chat(client), 30)
            assert set(after.choices[0].weight_versions) == {v}
            assert after.choices[0].token_ids == before.choices[0].token_ids
            assert server_logprobs(after)[0].tolist() == server_logprobs(before)[0].tolist()
            # a broken group refuses updates (409) until the trainer forms a new one, which works
            pub = WeightPublisher([client], bucket_bytes=64 << 10)
            await pub.connect()
            train_step(trainer, seed=31)
            await publish(pub, trainer, v + 1)
            assert (await client.info()).version == v + 1
            await pub.close()

    run(body)


def test_fan_out_refusal_names_the_server_and_aborts_the_others(
    server: Any, tiny_model_bf16: Path, trainer: ReferenceTrainer
) -> None:
    """Two servers; the bf16 one refuses fp32 weights. The fp32 one had accepted: it is called off
    at once (not after a timeout) and its group stays healthy."""
    with ServerProcess("reference", tiny_model_bf16, dtype="bfloat16", options={"threads": 1}) as other:

        async def body() -> None:
            a = InferenceClient(server.url, control_token=server.control_token)
            b = InferenceClient(other.url, control_token=other.control_token)
            pub = WeightPublisher([a, b], bucket_bytes=64 << 10, timeout_s=60)
            await pub.connect()
            va = (await a.info()).version
            t0 = time.monotonic()
            with pytest.raises(FanOutError) as err:
                await publish(pub, trainer, max(va, 0) + 1)
            assert time.monotonic() - t0 < 20
            assert [e.url for e in err.value.errors] == [other.url]
            assert err.value.errors[0].status == 422 and "dtype" in str(err.value)
            ia = await a.info()
            assert ia.version == va and not ia.updating and ia.group is not None and not ia.group.broken
            await pub.close()
            await a.aclose()
            await b.aclose()

        run(body)


def test_serve_reports_startup_errors_clearly(tmp_path: Path, tiny_model: Path, server: Any) -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "pipelinerl_sdk.cli", "serve", "--model", str(tmp_path / "nope"), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "config.json missing" in bad.stderr
    port = int(server.url.rsplit(":", 1)[1])
    taken = subprocess.run(
        [sys.executable, "-m", "pipelinerl_sdk.cli", "serve", "--model", str(tiny_model), "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert taken.returncode == 2 and f"cannot bind 127.0.0.1:{port}" in taken.stderr
    unknown = subprocess.run(
        [sys.executable, "-m", "pipelinerl_sdk.cli", "serve", "--backend", "nosuch", "--model", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert unknown.returncode == 2 and "no inference backend named 'nosuch'" in unknown.stderr
