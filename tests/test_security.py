"""Hostile use of a real reference server and a real trainer (issue 15: security 1-5, 11, 12).

Outsiders on the group's store, a replaced trainer, unauthenticated big bodies, what a server
discloses, where it lets a token holder send it, unbounded versions, NaN weights, a stopped server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from test_server_integration import publish, run

from pipelinerl_sdk.conformance.inference import update_body
from pipelinerl_sdk.errors import FanOutError, GroupError, ServerError
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.launch import ServerProcess
from pipelinerl_sdk.protocol import parse_init_method
from pipelinerl_sdk.reference.trainer import ReferenceTrainer
from pipelinerl_sdk.testing.security import (
    forge,
    outsider,
    replace_a_waiting_trainer,
    take_rank_zero_while_it_forms,
    waiting_update,
)
from pipelinerl_sdk.weights.auth import new_group_secret
from pipelinerl_sdk.weights.group import GroupConfig, WeightSyncGroup
from pipelinerl_sdk.weights.publisher import WeightPublisher, free_port
from pipelinerl_sdk.weights.receive import update_key
from pipelinerl_sdk.weights.signed_store import verified_value

pytestmark = pytest.mark.integration
CHAT = {"messages": [{"role": "user", "content": "12+7="}], "max_tokens": 6, "temperature": 0, "return_token_ids": True}


# --- 1. the store: bound where asked, decisions unforgeable ---------------------------------------


def listen_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) of every socket listening on ``port``."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, port_hex = local.rsplit(":", 1)
                if state == "0A" and int(port_hex, 16) == port:
                    out.add(addr)
    return out


def test_store_listens_only_where_asked(server: Any) -> None:
    async def body() -> None:
        async with InferenceClient(server.url, control_token=server.control_token) as client:
            pub = WeightPublisher([client])
            await pub.connect(host="127.0.0.1")
            assert pub.group is not None
            _, port = parse_init_method(pub.group.config.init_method)
            # 127.0.0.1 as /proc/net/tcp writes it; every interface would be 00000000 or ::
            assert listen_addresses(port) == {"0100007F"}
            await pub.close()

    run(body)


def test_outsider_abort_on_the_store_does_not_affect_a_live_update(server: Any, trainer: ReferenceTrainer) -> None:
    """What issue 15 saw: an outsider sets ``abort`` on the store while the server waits for the
    decision. The server ignores it (and logs it), the trainer's ``go`` wins, the update lands."""

    async def body() -> None:
        async with InferenceClient(server.url, control_token=server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=64 << 10, timeout_s=30)
            await pub.connect()
            assert pub.group is not None
            store = outsider(pub)
            real_post = pub.group.post_decision
            forged: list[str] = []

            def forged_first(key: str, go: bool, reason: str = "") -> None:
                forged.extend(forge(store, key, "abort: outsider"))
                time.sleep(0.5)  # the server reads the forged value first
                real_post(key, go, reason)

            pub.group.post_decision = forged_first  # type: ignore[method-assign]
            version = (await client.info()).version + 1
            await publish(pub, trainer, version)
            assert forged, "the outsider found no key to write"
            assert (await client.info()).version == version
            await pub.close()
        assert "not signed by the trainer" in server.log_tail(200)

    run(body)


def test_forged_go_does_not_start_a_receive(server: Any, trainer: ReferenceTrainer) -> None:
    """An outsider posts ``go`` while the server waits; the trainer then calls the update off.
    A server that took the forged ``go`` would sit in the broadcast until the group's timeout and
    break the group; the real abort must end the update at once, group healthy."""

    async def body() -> None:
        async with InferenceClient(server.url, control_token=server.control_token) as client:
            info = await client.info()
            pub, req, call = await waiting_update(client, bucket_bytes=64 << 10, timeout_s=20, publisher_timeout_s=5)
            assert pub.group is not None
            key = update_key(req.version)
            assert forge(outsider(pub), key, "go")
            await asyncio.sleep(1.0)  # time for a server that believes it to enter the broadcast
            pub.group.post_decision(key, go=False, reason="called off by the trainer")
            with pytest.raises(ServerError) as err:
                await asyncio.wait_for(call.final, 60)
            assert "called off by the trainer" in str(err.value)
            after = await client.info()
            assert after.version == info.version and not after.updating
            assert after.group is not None and not after.group.broken, after.group
            train_step_version = info.version + 1
            await publish(pub, trainer, train_step_version)  # the group still works
            assert (await client.info()).version == train_step_version
            await pub.close()

    run(body)


# --- 2. an update belongs to the group it was formed for ------------------------------------------


@pytest.mark.parametrize("signed", [False, True])
def test_an_outsider_cannot_take_a_members_place_while_the_group_forms(signed: bool) -> None:
    """The store lists its keys to anyone (``list_keys``), secret namespace included: an outsider
    who writes its own gloo address over the trainer's before a server joins becomes that
    server's rank 0 and feeds it its own bytes (the unsigned case shows it happen; one run in
    eight the trainer's own connection races the outsider's and the group breaks). With the
    rendezvous signed, the server reads a value nobody with the secret wrote and refuses to form
    the group, naming the key."""
    init = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    secret = new_group_secret()
    cfg = GroupConfig(init, 0, 2, "gloo", "pipelinerl-weights", 10, secret, signed)

    kept: list[WeightSyncGroup] = []

    def trainer() -> None:
        # Its server went to the outsider: it times out, or (the server's gloo accepts the
        # trainer's connection before it reads rank 0's value) it forms its own half of the group.
        # Signed, it keeps that half, and the store it hosts, until the server is done: a store
        # closed under the joining server failed its join with "Failed to recv" instead of the
        # refusal (2 runs in 10 at load 5). Unsigned, the half it keeps could be the server's
        # peer, which sends nothing: dropped, it breaks the server's group at once.
        with contextlib.suppress(GroupError):
            group = WeightSyncGroup(cfg)
            if signed:
                kept.append(group)

    threading.Thread(target=trainer, daemon=True).start()
    try:
        _take_a_members_place(cfg, init, signed)
    finally:
        for group in kept:
            group.close()


def _take_a_members_place(cfg: GroupConfig, init: str, signed: bool) -> None:
    attacker = take_rank_zero_while_it_forms(init, fill=7.0)
    deadline = time.monotonic() + 10
    joining = dataclasses.replace(cfg, rank=1)
    if not signed:  # the outsider is the server's rank 0: it feeds it (or, when the trainer's own
        # connection races it in gloo's handshake, the group breaks on the first broadcast)
        server = WeightSyncGroup(joining)
        received = torch.zeros(4)
        try:
            server.broadcast(received)
            assert received.tolist() == [7.0] * 4, received  # the outsider's bytes
        except GroupError as e:
            assert "Connection reset" in str(e) or "Connection closed" in str(e), e
        finally:
            server.close()
        return
    with pytest.raises(GroupError, match="not written by a member") as err:
        WeightSyncGroup(joining)
    assert "//cpu//0/0" in str(err.value) and time.monotonic() < deadline + 5
    attacker.join(15)
    assert attacker.outcome != "sent"


def test_a_server_of_the_sdk_joins_a_signed_rendezvous(server: Any, trainer: ReferenceTrainer) -> None:
    """The reference server says ``signed_rendezvous`` in ``/info``; the trainer then signs every
    rendezvous value (an outsider reads tags it cannot make), and updates work as before."""

    async def body() -> tuple[bool, bytes]:
        async with InferenceClient(server.url, control_token=server.control_token) as client:
            signed = (await client.info()).signed_rendezvous
            pub = WeightPublisher([client], bucket_bytes=1 << 20, timeout_s=30)
            await pub.connect()
            assert pub.group is not None and pub.group.config.signed
            store = outsider(pub)
            key = next(k for k in store.list_keys() if k.endswith("//cpu//0/0"))
            raw = bytes(store.get(key))
            verified_value(pub.group.config.secret, key, raw)  # a member's tag
            with pytest.raises(GroupError):
                verified_value(new_group_secret(), key, raw)
            await publish(pub, trainer, (await client.info()).version + 1)
            await pub.close()
            return signed, raw

    signed, raw = run(body)
    assert signed and len(raw) > 32


def test_update_from_a_replaced_trainer_is_refused_at_once(server: Any, trainer: ReferenceTrainer) -> None:
    async def body() -> None:
        async with (
            InferenceClient(server.url, control_token=server.control_token) as old_client,
            InferenceClient(server.url, control_token=server.control_token) as new_client,
        ):
            old = WeightPublisher([old_client], bucket_bytes=64 << 10, timeout_s=10)
            new = WeightPublisher([new_client], bucket_bytes=64 << 10, timeout_s=10)
            await old.connect()
            await new.connect()  # replaces the old trainer's group on the server
            version = (await new_client.info()).version + 1
            stale = asyncio.create_task(publish(old, trainer, version))
            while not stale.done() and not (await new_client.info()).updating:
                await asyncio.sleep(0.05)
            await publish(new, trainer, version)  # the new trainer is not kept waiting (no 409)
            with pytest.raises(FanOutError) as err:
                await stale
            assert err.value.errors[0].status == 409 and "group_id" in str(err.value), err.value
            assert (await new_client.info()).version == version
            await old.close()
            await new.close()

    run(body)


def test_new_group_ends_an_update_still_waiting_for_the_old_trainer(server: Any, trainer: ReferenceTrainer) -> None:
    """The old trainer asked for an update and never decided (hung, replaced): a new trainer's
    ``/init_process_group`` is not refused for the update's whole timeout; the stale update ends
    at once with an error saying why."""

    async def body() -> None:
        async with (
            InferenceClient(server.url, control_token=server.control_token) as old_client,
            InferenceClient(server.url, control_token=server.control_token) as new_client,
        ):
            info = await old_client.info()
            old, new, error = await replace_a_waiting_trainer(old_client, new_client, bucket_bytes=64 << 10)
            assert "replaced the group" in error, error
            await publish(new, trainer, info.version + 1)
            assert (await new_client.info()).version == info.version + 1
            await old.close()
            await new.close()

    run(body)


def test_a_failed_init_leaves_the_pending_update_alone(server: Any) -> None:
    """Issue 35, finding 5: a new ``/init_process_group`` whose trainer's store does not answer
    is a 502 naming ``init_method``, and the update pending on the live group (waiting for its
    trainer's decision) is left alone: still waiting, ended only by its own trainer (here a
    call-off, whose reason it then names). It was ended by the failed init."""
    headers = {"Authorization": f"Bearer {server.control_token}"}

    async def body() -> None:
        async with (
            InferenceClient(server.url, control_token=server.control_token) as client,
            httpx.AsyncClient(base_url=server.url, timeout=60, headers=headers) as http,
        ):
            info = await client.info()
            live, req, call = await waiting_update(client, bucket_bytes=64 << 10, timeout_s=120)
            assert live.group is not None
            port = free_port()  # a port nobody listens on
            dead = {
                "init_method": f"tcp://127.0.0.1:{port}", "rank_offset": 1, "world_size": 2,
                "group_secret": new_group_secret(), "timeout_s": 5,
            }  # fmt: skip
            r = await http.post("/init_process_group", json=dead)
            assert r.status_code == 502 and "does not answer" in r.text and "left as they were" in r.text, r.text
            await asyncio.sleep(0.5)
            assert not call.final.done(), "the failed init ended the pending update"
            now = await client.info()
            assert now.updating and now.group is not None and now.group.group_id == live.group.group_id
            live.group.post_decision(update_key(req.version), go=False, reason="called off by its own trainer")
            with pytest.raises(ServerError, match="called off by its own trainer"):
                await asyncio.wait_for(call.final, 30)
            assert (await client.info()).version == info.version
            await live.close()

    run(body)


# --- 3. the token is checked before the body is read ----------------------------------------------


def raw_post_head(url: str, path: str, content_length: int, first_bytes: int) -> tuple[socket.socket, bytes]:
    """Open a connection, send a POST's headers announcing ``content_length`` bytes and only the
    first ``first_bytes`` of them; return the socket and the status line read back (b"" if the
    server did not answer within 30 s)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {content_length}\r\n\r\n"
    )
    sock.sendall(head.encode() + b" " * first_bytes)
    try:
        return sock, sock.recv(4096).split(b"\r\n", 1)[0]
    except TimeoutError:
        return sock, b""


@pytest.mark.parametrize("path", ["/request_weight_update", "/init_process_group", "/probe_broadcast"])
def test_unauthenticated_big_body_gets_401_before_it_is_read(server: Any, path: str) -> None:
    sock, status = raw_post_head(server.url, path, content_length=63_500_000, first_bytes=64 << 10)
    sock.close()
    assert status.startswith(b"HTTP/1.1 401"), f"no 401 while the body was still unsent: {status!r}"


# --- 4. what a server discloses -------------------------------------------------------------------


def test_info_and_schema_need_a_token_when_an_api_key_is_set(tiny_model: Path) -> None:
    with ServerProcess("reference", tiny_model, api_key="sk-test", options={"threads": 1}) as srv:

        async def body() -> None:
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
                for path in ("/info", "/openapi.json"):
                    assert (await http.get(path)).status_code == 401, path
                    wrong = await http.get(path, headers={"Authorization": "Bearer nope"})
                    assert wrong.status_code == 403, path
                    for token in ("sk-test", srv.control_token):
                        ok = await http.get(path, headers={"Authorization": f"Bearer {token}"})
                        assert ok.status_code == 200, (path, ok.text)
                for path in ("/docs", "/redoc"):
                    assert (await http.get(path)).status_code == 404, path
                health = await http.get("/health")
                assert health.status_code == 200 and set(health.json()) == {"status", "version"}
                key = {"Authorization": "Bearer sk-test"}
                info = (await http.get("/info", headers=key)).json()
                models = (await http.get("/v1/models", headers=key)).json()
                chat = (await http.post("/v1/chat/completions", json=CHAT, headers=key)).json()
                assert info["model"] == models["data"][0]["id"] == chat["model"] == tiny_model.name
                for text in (str(info), str(models), str(chat), health.text):
                    assert str(tiny_model.parent) not in text, text

        run(body)


def test_generated_control_token_never_reaches_the_log(tmp_path: Path, tiny_model: Path) -> None:
    ready, token_file, log = tmp_path / "ready.json", tmp_path / "token", tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "PIPELINERL_CONTROL_TOKEN"}
    cmd = [sys.executable, "-m", "pipelinerl_sdk.cli", "serve", "--model", str(tiny_model), "--port", "0"]
    cmd += ["--ready-file", str(ready), "--control-token-file", str(token_file), "--option", "threads=1"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), log.read_text()
        token = token_file.read_text()
        assert len(token) >= 24 and token not in log.read_text()
        assert str(token_file) in log.read_text()
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


# --- 5. a token holder cannot send the server anywhere --------------------------------------------


def test_init_process_group_joins_only_allowed_trainer_hosts(server: Any) -> None:
    async def body() -> None:
        headers = {"Authorization": f"Bearer {server.control_token}"}
        req = {
            "init_method": "tcp://192.0.2.1:29500",  # TEST-NET-1: nobody there
            "rank_offset": 1,
            "world_size": 2,
            "timeout_s": 2,
            "group_secret": "5e" * 32,
        }
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            r = await http.post("/init_process_group", json=req, headers=headers)
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["param"] == "init_method" and "192.0.2.1" in err["message"], err
        assert "--allow-trainer-host" in err["message"]

    run(body)


def test_trainer_host_allow_list() -> None:
    from pipelinerl_sdk.http.server import trainer_host_allowed

    for loopback in ("127.0.0.1", "127.8.9.10", "[::1]", "localhost", "LOCALHOST"):
        assert trainer_host_allowed(f"tcp://{loopback}:29500", ())
    for other in ("192.0.2.1", "0.0.0.0", "[::]", "trainer-0", "localhost.evil.example"):
        assert not trainer_host_allowed(f"tcp://{other}:29500", ())
    assert trainer_host_allowed("tcp://trainer-0:29500", ("trainer-0",))
    assert trainer_host_allowed("tcp://10.0.0.7:29500", ("trainer-0", "10.0.0.7"))
    assert not trainer_host_allowed("tcp://10.0.0.8:29500", ("trainer-0", "10.0.0.7"))


# --- 11. bounded versions, finite weights ---------------------------------------------------------


def test_version_past_the_bound_is_refused_and_later_updates_work(server: Any, trainer: ReferenceTrainer) -> None:
    async def body() -> None:
        async with InferenceClient(server.url, control_token=server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=64 << 10, timeout_s=30)
            await pub.connect()
            info = await client.info()
            headers = {"Authorization": f"Bearer {server.control_token}"}
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                r = await http.post("/request_weight_update", json=update_body(info, 2**64 + 7), headers=headers)
            assert r.status_code == 400 and r.json()["error"]["param"] == "version", r.text
            await publish(pub, trainer, info.version + 1)  # a normal update still works
            assert (await client.info()).version == info.version + 1
            await pub.close()

    run(body)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_weights_are_refused_and_old_weights_serve(
    server: Any, trainer: ReferenceTrainer, bad: float
) -> None:
    assert trainer.model is not None
    params = dict(trainer.model.named_parameters())
    target = list(params)[len(params) // 2]

    def poisoned(sink: Any) -> None:
        for name, p in params.items():
            t = p.detach().clone()
            if name == target:
                t.view(-1)[t.numel() // 2] = bad
            sink.send(name, t)

    async def body() -> None:
        async with InferenceClient(server.url, control_token=server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=64 << 10, timeout_s=30)
            await pub.connect()
            info = await client.info()
            before = await client.chat(CHAT)
            with pytest.raises(FanOutError) as err:
                async with pub.update(info.version + 1, trainer.param_specs()) as sink:
                    await asyncio.to_thread(poisoned, sink)
            assert repr(target) in str(err.value) and "NaN or infinity" in str(err.value), err.value
            after_info = await client.info()
            assert after_info.version == info.version and not after_info.updating
            assert after_info.group is not None and not after_info.group.broken
            after = await client.chat(CHAT)
            assert after.choices[0].token_ids == before.choices[0].token_ids
            await publish(pub, trainer, info.version + 1)  # same group, next update lands
            assert (await client.info()).version == info.version + 1
            await pub.close()

    run(body)


def test_first_non_finite_names_the_param_and_survives_overflowing_sums() -> None:
    from pipelinerl_sdk.weights.receive import first_non_finite

    big = torch.full((1000,), 3e38)  # finite, but its float32 sum overflows
    half = torch.full((10,), 60000.0, dtype=torch.float16)  # finite, its float16 sum would overflow
    ok = [("a", torch.zeros(3)), ("big", big), ("half", half), ("ids", torch.arange(4))]
    assert first_non_finite(iter(ok)) is None
    for bad in (math.nan, math.inf):
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            t = torch.zeros(7, dtype=dtype)
            t[5] = bad
            assert first_non_finite(iter([*ok, ("w", t), ("x", t)])) == "w"


# --- 12. a stopped server ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_a_trainer_that_fails_half_way_ends_the_servers_update_at_once(
    server: Any, trainer: ReferenceTrainer, mode: str
) -> None:
    """The trainer's body raises after sending half the params, with the update's timeout at
    30 s: the publisher closes the group, so the server's receive ends at once ("Connection
    closed by peer") and the publisher reports both sides within seconds (before: the server
    waited out its 30 s timeout, generation paused all along in direct mode, and the
    publisher with it). The server serves the old version and weights, its group broken."""
    assert trainer.model is not None
    params = [(n, p.detach().clone()) for n, p in trainer.model.named_parameters()]

    def half(sink: Any) -> None:
        for name, t in params[: len(params) // 2]:
            sink.send(name, t)
        raise RuntimeError("the trainer failed half-way")

    async def body() -> float:
        async with InferenceClient(server.url, control_token=server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=4 << 10, timeout_s=30, mode=mode)  # type: ignore[arg-type]
            await pub.connect()
            info = await client.info()
            before = await client.chat(CHAT)
            t0 = time.perf_counter()
            with pytest.raises(RuntimeError, match="half-way"):
                async with pub.update(info.version + 1, trainer.param_specs()) as sink:
                    await asyncio.to_thread(half, sink)
            took = time.perf_counter() - t0
            after_info = await client.info()
            assert after_info.version == info.version and not after_info.updating, after_info
            assert after_info.group is not None and after_info.group.broken
            after = await client.chat(CHAT)
            assert after.choices[0].token_ids == before.choices[0].token_ids
            assert set(after.choices[0].weight_versions) == {info.version}
            await pub.connect()  # a new group: the next update lands
            await publish(pub, trainer, info.version + 1)
            assert (await client.info()).version == info.version + 1
            await pub.close()
            return took

    took = run(body)
    print(f"\n{mode}: the publisher reported the failed update after {took:.2f} s (timeout 30 s)")
    assert took < 10, f"the failed update took {took:.1f} s to end (its timeout: 30 s)"


def test_publisher_reports_a_stopped_server_within_the_update_timeout(
    tiny_model: Path, trainer: ReferenceTrainer
) -> None:
    with ServerProcess("reference", tiny_model, options={"threads": 1}) as srv:

        async def body() -> None:
            async with InferenceClient(srv.url, control_token=srv.control_token) as client:
                pub = WeightPublisher([client], bucket_bytes=64 << 10, timeout_s=3)
                await pub.connect()
                version = (await client.info()).version + 1
                os.kill(srv.pid, signal.SIGSTOP)
                t0 = time.perf_counter()
                try:
                    with pytest.raises(FanOutError) as err:
                        await asyncio.wait_for(publish(pub, trainer, version), 120)
                finally:
                    os.kill(srv.pid, signal.SIGCONT)
                print(f"\npublisher reported the stopped server after {time.perf_counter() - t0:.1f} s (timeout 3 s)")
                assert err.value.errors[0].url == srv.url
                message = str(err.value)
                assert "did not answer within the update's timeout_s=3" in message, message
                assert "stopped or hung" in message
                await pub.close()

        run(body)
