"""The SGLang adapter (``adapters/sglang``) on a real SGLang 0.5.23 server: no mocks.

Runs only in the SGLang environment (``scripts/setup-sglang`` prints its path: on this CPU-only
CI machine a test harness with a pure-torch stand-in for two ``sgl_kernel`` helpers, see
``tests/infra/sgl_kernel_cpu``); elsewhere the module is skipped with the reason. One real
SGLang server (gateway + ``sglang.launch_server`` child) serves the module: the standard
conformance checks, the state machine, the cross check with the reference trainer and the
receive-pause check all run against it. At most one SGLang server is alive at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from pipelinerl_sdk.conformance.common import check_against_mirror, greedy
from pipelinerl_sdk.conformance.inference import InferenceContractTests
from pipelinerl_sdk.conformance.mirror import Mirror
from pipelinerl_sdk.conformance.stateful import StatefulContractTests
from pipelinerl_sdk.conformance.targets import ServerUnderTest
from pipelinerl_sdk.contracts import TokenBatch, TrainerSpec
from pipelinerl_sdk.errors import GroupError, ServerError
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.launch import ServerProcess
from pipelinerl_sdk.protocol import ChatCompletionResponse
from pipelinerl_sdk.reference.trainer import ReferenceTrainer
from pipelinerl_sdk.testing.security import outsider, take_rank_zero_while_it_forms
from pipelinerl_sdk.weights.auth import new_group_secret
from pipelinerl_sdk.weights.group import GroupConfig, WeightSyncGroup
from pipelinerl_sdk.weights.publisher import WeightPublisher, free_port
from pipelinerl_sdk.weights.signed_store import verified_value

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
HAVE_ADAPTER = importlib.util.find_spec("pipelinerl_sdk_sglang") is not None
requires_sglang = pytest.mark.skipif(
    not (HAVE_SGLANG and HAVE_ADAPTER),
    reason="SGLang or the SGLang adapter is not installed here: run these tests in the env scripts/setup-sglang prints",
)
ADAPTER_DIR = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration
T = TypeVar("T")
PROMPT = [{"role": "user", "content": "12+7="}]
ENV = {"TOKENIZERS_PARALLELISM": "false"}


def run(fn: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await fn()

    return asyncio.run(main())


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


@pytest.fixture(scope="module")
def sglang_server(tiny_model: Path) -> Iterator[ServerProcess]:
    """The module's one server; on teardown every process it started must be gone."""
    import psutil

    proc = ServerProcess("sglang", tiny_model, env=ENV, startup_timeout_s=600)
    t0 = time.monotonic()
    proc.start()
    print(f"\nsglang server ready in {time.monotonic() - t0:.1f}s at {proc.url}")
    children = _descendants(proc.pid)
    try:
        yield proc
    finally:
        proc.stop()
        alive = [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"processes of the SGLang server outlived it: {alive}"


@pytest.fixture(scope="module")
def server_under_test(sglang_server: ServerProcess, tiny_model: Path) -> ServerUnderTest:
    """The conformance suite's fixture, pointed at this module's SGLang server."""
    from pipelinerl_sdk_sglang.plugin import CAPABILITIES

    return ServerUnderTest(
        "inference:sglang", sglang_server.url, sglang_server.control_token, CAPABILITIES, tiny_model, "float32",
        "sglang", sglang_server.pid, sglang_server.log_path,
    )  # fmt: skip


@requires_sglang
class TestSGLangInferenceContract(InferenceContractTests):
    """Every standard check of the inference contract, on real SGLang. SGLang on CPU does not
    declare ``seeds`` (see the plugin), so its streams are compared greedy and the seed check is
    skipped for that capability."""


@requires_sglang
class TestSGLangStatefulContract(StatefulContractTests):
    """The suite's Hypothesis state machine (generations, updates, bad requests, interrupted
    updates in any order), on the same SGLang server. It was an xfail: 3 of 4 runs beside other
    work once found an update still in progress after an interrupted one. Since the group's close
    ends a peer's receive at once and SGLang runs on half the cores' threads, 4 of 4 runs beside
    a busy core and one idle passed (which of the two changes fixed it was not isolated)."""


# --- the plugin ---------------------------------------------------------------------------------


@requires_sglang
def test_backend_is_registered_and_its_import_is_light() -> None:
    from pipelinerl_sdk.plugins import load_registry

    entry = load_registry().get("inference", "sglang")
    assert entry.factory == "pipelinerl_sdk_sglang.backend:SGLangInferenceBackend"
    assert entry.capabilities.receive_modes == frozenset({"staged", "direct"})
    code = "import sys, pipelinerl_sdk_sglang.plugin; print(sorted({'sglang', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", f"importing the plugin imported {out.stdout.strip()}"


# --- start-up errors are reported, not hung on ----------------------------------------------------


def _serve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pipelinerl_sdk.cli", "serve", "--backend", "sglang", *args]
    env = {**os.environ, **ENV, "PIPELINERL_CONTROL_TOKEN": "t"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@requires_sglang
def test_bad_model_path_exits_with_a_message(tmp_path: Path) -> None:
    r = _serve("--model", str(tmp_path / "nope"), "--port", "0")
    assert r.returncode != 0
    assert "config.json missing" in r.stderr, r.stderr[-2000:]


@requires_sglang
def test_unknown_option_exits_with_a_message(tiny_model: Path) -> None:
    r = _serve("--model", str(tiny_model), "--port", "0", "--option", "bogus=1")
    assert r.returncode != 0 and "unknown option" in r.stderr, r.stderr[-2000:]


@requires_sglang
def test_sglang_start_up_failure_exits_with_its_log(tiny_model: Path) -> None:
    """SGLang itself refuses to start (a flag it does not know): ``serve`` exits non-zero, quoting
    SGLang's own error, and leaves no SGLang process behind."""
    t0 = time.monotonic()
    r = _serve("--model", str(tiny_model), "--port", "0", "--option", "sglang_args=--no-such-sglang-flag")
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "SGLang exited with code" in out and "--no-such-sglang-flag" in out, out[-3000:]
    assert time.monotonic() - t0 < 240


@requires_sglang
def test_launch_args_parse_in_sglang_for_any_api_key() -> None:
    """SGLang's own parser reads back the key ``launch_args`` passes, also one that starts with
    ``-`` (1 in 64 of ``new_api_key``'s keys; passed as a separate word, SGLang refused to start),
    and the two switches the version tags rely on: no prefix cache, no overlap scheduler (with
    it, the batch in flight at a pause is computed by the old weights and tagged with the new
    version: ``test_every_version_tag_is_true`` failed on exactly those tokens)."""
    import argparse

    from pipelinerl_sdk_sglang.engine import launch_args
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for key in ("-leading-dash", "--double", "plain_Key-09"):
        args = launch_args("m", dtype="float32", port=1, api_key=key, device="cpu", context_length=64, options={})
        parsed = parser.parse_args(args)
        assert parsed.api_key == key
        assert parsed.disable_radix_cache and parsed.disable_overlap_schedule
        assert parsed.sleep_on_idle  # on cpu by default
    cases = (("cpu", {"sleep_on_idle": "0"}, False), ("cuda", {}, False), ("cuda", {"sleep_on_idle": "1"}, True))
    for device, options, asleep in cases:
        options = {**options, "mem_fraction_static": "0.3"}
        args = launch_args("m", dtype="float32", port=1, api_key="k", device=device, context_length=64, options=options)
        parsed = parser.parse_args(args)
        assert parsed.sleep_on_idle is asleep and args.count("--mem-fraction-static") == 1, (device, args)
        assert parsed.mem_fraction_static == 0.3, (device, args)


@pytest.mark.skipif(not HAVE_ADAPTER, reason="the SGLang adapter is not installed here")
def test_sglangs_cpu_threads_come_from_the_option_the_operator_or_half_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pipelinerl_sdk_sglang.engine import default_cpu_threads, launch_env

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_cpu_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
    assert launch_env("cpu")["OMP_NUM_THREADS"] == str(default_cpu_threads())
    assert launch_env("cpu", {"cpu_threads": "3"})["OMP_NUM_THREADS"] == "3"
    assert "OMP_NUM_THREADS" not in launch_env("cuda")  # a GPU host's threads are left alone
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert launch_env("cpu")["OMP_NUM_THREADS"] == "5"
    assert launch_env("cpu", {"cpu_threads": "2"})["OMP_NUM_THREADS"] == "2"
    for bad in ("0", "-1", "two", ""):
        with pytest.raises(ValueError, match="cpu_threads"):
            launch_env("cpu", {"cpu_threads": bad})


@pytest.mark.skipif(HAVE_SGLANG, reason="SGLang is installed here: this checks the message when it is missing")
def test_missing_sglang_exits_with_a_message(tmp_path: Path) -> None:
    """The adapter on the path without SGLang: a clear error, exit 2, no hang."""
    from pipelinerl_sdk.reference.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ADAPTER_DIR), os.environ.get("PYTHONPATH", "")]),
        "PIPELINERL_EXTRA_PLUGINS": "pipelinerl_sdk_sglang.plugin",
        "PIPELINERL_CONTROL_TOKEN": "t",
    }
    cmd = [sys.executable, "-m", "pipelinerl_sdk.cli", "serve", "--backend", "sglang", "--model", str(model)]
    r = subprocess.run([*cmd, "--port", "0"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "needs SGLang 0.5.23" in r.stderr and "scripts/setup-sglang" in r.stderr, r.stderr[-2000:]


# --- cross check with the reference trainer -------------------------------------------------------


def _objective(logprobs: Any, batch: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
    total = sum(lp[s - 1 :].sum() for lp, s in zip(logprobs, batch.completion_start, strict=True))
    return -total / len(logprobs), {}


async def _scored(client: InferenceClient) -> ChatCompletionResponse:
    body = {
        "messages": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": True, "return_token_ids": True,
        "prompt_logprobs": True,
    }  # fmt: skip
    return await client.chat(body)


def _step(trainer: ReferenceTrainer, seed: int) -> None:
    """One optimizer step of ``trainer`` on two random sequences: weights no server holds yet."""
    ids = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(seed)).tolist()
    trainer.backward(TokenBatch(input_ids=ids, completion_start=[6, 6]), _objective)
    trainer.step()


async def _publish(pub: WeightPublisher, trainer: ReferenceTrainer, version: int) -> None:
    async with pub.update(version, trainer.param_specs()) as sink:
        await asyncio.to_thread(trainer.gather_and_broadcast, sink)


@requires_sglang
@pytest.mark.parametrize(("bucket_bytes", "mode"), [(1 << 20, "staged"), (16 << 10, "staged"), (16 << 10, "direct")])
def test_reference_trainer_updates_sglang_and_logprobs_agree(
    sglang_server: ServerProcess,
    tiny_model: Path,
    bucket_bytes: int,
    mode: str,
    record_property: Callable[[str, object], None],
) -> None:
    """The reference trainer takes a real optimizer step and publishes it (one bucket, then many;
    received staged, then direct); SGLang's prompt and completion logprobs then equal the
    trainer's for the same tokens (fp32: 1e-4), and differ from the logprobs before the step."""
    trainer = ReferenceTrainer()
    trainer.init(TrainerSpec(model=str(tiny_model), lr=3e-3, grad_clip=None))

    async def body() -> None:
        async with InferenceClient(sglang_server.url, control_token=sglang_server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=bucket_bytes, mode=mode)  # type: ignore[arg-type]
            await pub.connect()
            info = await client.info()
            assert info.default_mode == "staged"
            assert [p.name for p in info.params] == [p.name for p in trainer.param_specs()]
            _step(trainer, seed=bucket_bytes + (mode == "direct"))  # weights no earlier case published
            version = info.version + 1
            before = await _scored(client)
            await _publish(pub, trainer, version)
            assert pub.last is not None
            event = next(iter(pub.last.events.values()))
            assert event.mode == mode and event.version == version
            for k, v in event.timings.items():
                record_property(k, v)
            print(f"\nbucket_bytes={bucket_bytes}, {mode}: {event.timings}")
            resp = await _scored(client)
            choice = resp.choices[0]
            assert set(choice.weight_versions) == {version}
            prompt = resp.prompt_token_ids or []
            seq = prompt + (choice.token_ids or [])
            lp = trainer.forward(TokenBatch(input_ids=[seq], completion_start=[len(prompt)]))[0]
            served_prompt = torch.tensor([x for x in resp.prompt_token_logprobs() if x is not None])
            served = torch.tensor([t.logprob for t in (choice.logprobs.content if choice.logprobs else [])])
            assert (served_prompt - lp[: len(prompt) - 1]).abs().max() < 1e-4
            assert (served - lp[len(prompt) - 1 :]).abs().max() < 1e-4
            old = torch.tensor([x for x in before.prompt_token_logprobs() if x is not None])
            assert (old - served_prompt).abs().max() > 1e-3, "the step did not change the served logprobs"
            await pub.close()

    try:
        run(body)
    finally:
        trainer.close()


@requires_sglang
def test_apply_floor_times_sglangs_load_and_puts_the_trained_weights_back(
    sglang_server: ServerProcess, tiny_model: Path
) -> None:
    """After an update to trained weights (not the checkpoint's), the apply floor loads the
    checkpoint's tensors through SGLang's own session steps inside its scheduler, timed there
    (positive seconds, one per repeat), and puts the served weights back: every logprob and token
    bit-identical to before it, the version unchanged."""
    trainer = ReferenceTrainer()
    trainer.init(TrainerSpec(model=str(tiny_model), lr=3e-3, grad_clip=None))

    async def body() -> None:
        async with InferenceClient(sglang_server.url, control_token=sglang_server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=1 << 20)
            await pub.connect()
            version = (await client.info()).version + 1
            _step(trainer, seed=7)
            await _publish(pub, trainer, version)
            before = await _scored(client)
            floor = await client.apply_floor(3)
            assert len(floor.seconds) == 3 and all(s > 0 for s in floor.seconds), floor
            assert "load_weights" in floor.detail
            after = await _scored(client)
            assert after.choices[0].token_ids == before.choices[0].token_ids
            assert after.prompt_token_logprobs() == before.prompt_token_logprobs()  # bit-identical
            content = [c.choices[0].logprobs.content for c in (before, after) if c.choices[0].logprobs]
            assert [t.logprob for t in content[0]] == [t.logprob for t in content[1]]
            assert set(after.choices[0].weight_versions) == {version}
            await pub.close()

    try:
        run(body)
    finally:
        trainer.close()


@requires_sglang
def test_a_failing_scheduler_hook_reports_its_error_and_sglang_lives_on(sglang_server: ServerProcess) -> None:
    """SGLang does not catch a custom loader's exception: one ends its scheduler, hence the whole
    server. A hook that fails (``restore`` with no snapshot taken) reports its error to the
    gateway instead, and SGLang keeps generating."""
    from pipelinerl_sdk_sglang.engine import SGLangClient, SGLangError

    url, key = _sglang_child(sglang_server.pid)

    async def body() -> None:
        sgl = SGLangClient(url, key)
        try:
            await sgl.control("/begin_weight_update", {})
            try:
                with pytest.raises(SGLangError, match="hook restore failed: KeyError"):
                    await sgl.call_hook("restore")
            finally:
                await sgl.control("/end_weight_update", {})
            out = await sgl.generate({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
            assert len(out["output_ids"]) == 2
        finally:
            await sgl.close()

    run(body)


# --- a direct receive holds generation, and only while it lasts -----------------------------------


@requires_sglang
def test_sampling_values_sglang_cannot_hold_never_reach_its_scheduler(sglang_server: ServerProcess) -> None:
    """A ``top_k`` past 2^31 killed SGLang's scheduler (an int32 tensor of the batch's top_k;
    found by tests/reliability's fuzzing): past the vocabulary it is off, as asked (every token
    kept); a seed past int64 is taken modulo 2^63; ``stop_token_ids`` outside the vocabulary are
    refused naming the field, as on the reference; what SGLang itself refuses (a repetition
    penalty past 2, a schema keyword xgrammar would ignore) is a 400 naming the field. The
    server serves on."""
    import httpx

    def chat(**extra: Any) -> httpx.Response:
        body = {"messages": PROMPT, "max_tokens": 4, "temperature": 0, **extra}
        return httpx.post(sglang_server.url + "/v1/chat/completions", json=body, timeout=60)

    plain = chat().json()["choices"][0]["message"]
    assert chat(top_k=2**31 + 5).json()["choices"][0]["message"] == plain
    assert chat(top_k=2**40, temperature=1.0, seed=2**70).status_code == 200
    refused = chat(stop_token_ids=[5, -1])
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stop_token_ids", refused.text
    # SGLang's /generate refused these with its 400, which the gateway answered 500 (fuzzing)
    refused = chat(repetition_penalty=4.5, n=2)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "repetition_penalty", refused.text
    refused = chat(structured_outputs={"json": {"not": {"type": "string"}}})  # SGLang: "not" would be ignored
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "structured_outputs", refused.text
    assert chat().json()["choices"][0]["message"] == plain


@requires_sglang
def test_generation_waits_for_a_direct_receive(
    sglang_server: ServerProcess, tiny_model: Path, record_property: Callable[[str, object], None]
) -> None:
    """The trainer hands over its first param (its ``sending`` mark is posted), then holds the
    broadcast open for ``hold`` seconds: SGLang is paused (in place) for the receive, so no chat
    finishes meanwhile; the chats sent during the receive complete right after it, on the new
    version."""
    from pipelinerl_sdk.conformance.mirror import Mirror

    mirror = Mirror(tiny_model, "float32")
    hold = 3.0

    async def body() -> None:
        async with InferenceClient(sglang_server.url, control_token=sglang_server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=1 << 20, timeout_s=60, mode="direct")
            await pub.connect()
            info = await client.info()
            mirror.perturb(seed=info.version + 100)
            done_during: list[int] = []
            async with pub.update(info.version + 1, info.params) as sink:
                await asyncio.to_thread(mirror.send_all, sink, info.params, stop_after=1)
                await asyncio.sleep(0.5)  # bytes flow next: the server pauses and enters the receive
                t_end = time.monotonic() + hold
                chats = [
                    asyncio.create_task(client.chat({"messages": PROMPT, "max_tokens": 4, "ignore_eos": True}))
                    for _ in range(3)
                ]
                await asyncio.sleep(hold)
                done_during = [i for i, c in enumerate(chats) if c.done()]
                await asyncio.to_thread(mirror.send_all, sink, info.params, start=1)
            results = await asyncio.wait_for(asyncio.gather(*chats), 60)
            assert time.monotonic() >= t_end
            assert pub.last is not None
            event = next(iter(pub.last.events.values()))
            record_property("pause_s", event.timings["pause_s"])
            print(f"\n{len(done_during)} chats finished during a {hold:.0f}s receive; {event.timings}")
            assert done_during == [], "a chat finished while SGLang was receiving (direct mode must hold generation)"
            assert event.timings["pause_s"] >= hold * 0.8
            for r in results:
                assert set(r.choices[0].weight_versions) == {info.version + 1}
            await pub.close()

    run(body)


@requires_sglang
def test_generation_goes_on_during_a_staged_receive(
    sglang_server: ServerProcess, tiny_model: Path, record_property: Callable[[str, object], None]
) -> None:
    """The twin of the direct check above: the trainer hands over its first param, then holds the
    broadcast open for ``hold`` seconds. Received staged (in a thread of SGLang's scheduler
    process), SGLang keeps generating meanwhile: the chats sent during the receive finish during
    it, every token on the old version, and the pause is a small fraction of the receive (SGLang's
    ``load_weights`` of the staged tensors). Afterwards SGLang serves exactly the new weights."""
    mirror = Mirror(tiny_model, "float32")
    hold = 3.0

    async def body() -> None:
        async with InferenceClient(sglang_server.url, control_token=sglang_server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=16 << 10, timeout_s=60, mode="staged")
            await pub.connect()
            info = await client.info()
            mirror.perturb(seed=info.version + 400)
            async with pub.update(info.version + 1, info.params) as sink:
                await asyncio.to_thread(mirror.send_all, sink, info.params, stop_after=1)
                await asyncio.sleep(0.5)  # the first buckets are staged: SGLang is receiving
                chats = [
                    asyncio.create_task(client.chat({"messages": PROMPT, "max_tokens": 4, "ignore_eos": True}))
                    for _ in range(3)
                ]
                during = await asyncio.wait_for(asyncio.gather(*chats), hold)  # raises if generation waits
                await asyncio.to_thread(mirror.send_all, sink, info.params, start=1)
            assert pub.last is not None
            event = next(iter(pub.last.events.values()))
            record_property("pause_s", event.timings["pause_s"])
            print(f"\n{len(during)} chats finished during a staged receive; {event.timings}")
            for r in during:
                assert set(r.choices[0].weight_versions) == {info.version}
            assert event.mode == "staged"
            assert event.timings["pause_s"] < 0.25 * event.timings["receive_s"], event.timings
            after = await greedy(client, prompt_logprobs=True)
            assert set(after.choices[0].weight_versions) == {info.version + 1}
            check_against_mirror(after, mirror, prompt=True)
            await pub.close()

    run(body)


@requires_sglang
def test_a_staged_update_holding_a_nan_is_refused_and_the_old_weights_serve(
    sglang_server: ServerProcess, tiny_model: Path
) -> None:
    """A NaN in one param of a many-bucket staged update: SGLang's staged receiver finds it
    before anything is loaded, the update fails naming the param, SGLang serves the old weights
    and version bit for bit, the group stays healthy and the next update of the same trainer
    lands (the staging buffer is reused)."""
    from pipelinerl_sdk.errors import FanOutError
    from pipelinerl_sdk.weights.tensors import TORCH_DTYPES

    mirror = Mirror(tiny_model, "float32")

    async def body() -> None:
        async with InferenceClient(sglang_server.url, control_token=sglang_server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=16 << 10, timeout_s=60, mode="staged")
            await pub.connect()
            info = await client.info()
            target = info.params[len(info.params) // 2].name
            before = await _scored(client)
            local = dict(mirror.model.named_parameters())

            def poisoned(sink: Any) -> None:
                for spec in info.params:
                    t = local[spec.name].detach().to(TORCH_DTYPES[spec.dtype]).clone()
                    if spec.name == target:
                        t.view(-1)[t.numel() // 2] = float("nan")
                    sink.send(spec.name, t)

            with pytest.raises(FanOutError) as err:
                async with pub.update(info.version + 1, info.params) as sink:
                    await asyncio.to_thread(poisoned, sink)
            assert repr(target) in str(err.value) and "NaN or infinity" in str(err.value), err.value
            after_info = await client.info()
            assert after_info.version == info.version and after_info.group is not None
            assert not after_info.group.broken
            after = await _scored(client)
            assert after.prompt_token_logprobs() == before.prompt_token_logprobs()  # untouched
            assert set(after.choices[0].weight_versions) == {info.version}
            mirror.perturb(seed=info.version + 500)
            await mirror.publish(pub, info.version + 1, info.params)
            check_against_mirror(await greedy(client, prompt_logprobs=True), mirror, prompt=True)
            await pub.close()

    run(body)


@requires_sglang
def test_a_trainer_that_fails_before_its_first_byte_ends_the_update_at_once(
    sglang_server: ServerProcess, tiny_model: Path
) -> None:
    """The trainer said ``go``, then its gather fails before it hands over a param: SGLang never
    held generation nor entered the collective, so the publisher's ``abort`` on its sending mark
    ends the server's update at once (not after the update's 60 s timeout), naming the cause, the
    old weights serving; the trainer reconnects and its next update is applied."""
    mirror = Mirror(tiny_model, "float32")
    url, token = sglang_server.url, sglang_server.control_token

    async def body() -> None:
        async with InferenceClient(url, control_token=token) as client:
            pub = WeightPublisher([client], bucket_bytes=1 << 20, timeout_s=60)
            await pub.connect()
            info = await client.info()
            before = await _scored(client)
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match="gather failed"):
                async with pub.update(info.version + 1, info.params):
                    raise RuntimeError("gather failed")
            took = time.monotonic() - t0  # the publisher waited for the server's final answer
            print(f"\nan update whose trainer failed before its first byte ended in {took:.2f} s")
            assert took < 10, took
            assert (await client.info()).version == info.version
            after = await _scored(client)
            assert after.prompt_token_logprobs() == before.prompt_token_logprobs()  # the old weights, untouched
            assert set(after.choices[0].weight_versions) == {info.version}
            await pub.connect()  # the sender's failure broke the trainer's side of the group
            mirror.perturb(seed=info.version + 300)
            await mirror.publish(pub, info.version + 1, info.params)
            assert (await client.info()).version == info.version + 1
            await pub.close()

    run(body)


# --- a replaced trainer's update that waits for its decision ---------------------------------------


@requires_sglang
def test_new_group_ends_an_update_still_waiting_for_the_old_trainer(
    sglang_server: ServerProcess, tiny_model: Path
) -> None:
    """The old trainer asked for an update and never decided: a new trainer's
    ``/init_process_group`` ends it at once (``cancel_waiting_update``) instead of a 409 for the
    update's whole timeout (120 s here), and the new trainer's update is applied."""
    from pipelinerl_sdk.testing.security import replace_a_waiting_trainer

    mirror = Mirror(tiny_model, "float32")
    url, token = sglang_server.url, sglang_server.control_token

    async def body() -> None:
        async with (
            InferenceClient(url, control_token=token) as old_client,
            InferenceClient(url, control_token=token) as new_client,
        ):
            old, new, error = await replace_a_waiting_trainer(old_client, new_client, bucket_bytes=1 << 20)
            assert "replaced the group" in error, error
            info = await new_client.info()
            mirror.perturb(seed=info.version + 200)
            async with new.update(info.version + 1, info.params) as sink:
                await asyncio.to_thread(mirror.send_all, sink, info.params)
            assert (await new_client.info()).version == info.version + 1
            await old.close()
            await new.close()

    run(body)


# --- the probe: one flat broadcast received by SGLang's own group, then dropped --------------------


@requires_sglang
def test_probe_broadcast_is_received_by_sglang(sglang_server: ServerProcess) -> None:
    """``/probe_broadcast`` runs a receive inside SGLang's scheduler on SGLang's group (a hook
    carrying no tensor data); the server keeps its version and serves right after."""

    async def body() -> None:
        async with InferenceClient(sglang_server.url, control_token=sglang_server.control_token) as client:
            pub = WeightPublisher([client])
            await pub.connect()
            before = (await client.info()).version
            send_s, by_url = await pub.probe(4 << 20)
            assert send_s > 0 and by_url[sglang_server.url] > 0
            info = await client.info()
            assert info.version == before and info.group is not None and not info.group.broken
            resp = await client.chat({"messages": PROMPT, "max_tokens": 3})
            assert set(resp.choices[0].weight_versions) == {before}
            await pub.close()

    run(body)


@requires_sglang
def test_sglang_signs_its_rendezvous_and_an_outsider_cannot_take_rank_0(sglang_server: ServerProcess) -> None:
    """SGLang forms the group with its own call, its rendezvous signed in its scheduler
    (``scheduler_hooks.sign_rendezvous``): ``/info`` says ``signed_rendezvous``, the trainer forms
    signed, and the value SGLang's rank wrote in the store carries the group's tag (an outsider
    cannot make one). Then a second group: an outsider writes its own address over the trainer's
    before SGLang joins; SGLang reads a value no member signed and refuses to form, naming the
    key (unsigned, it would have taken the outsider as its rank 0), and keeps serving."""

    async def body() -> None:
        async with InferenceClient(sglang_server.url, control_token=sglang_server.control_token) as client:
            assert (await client.info()).signed_rendezvous
            pub = WeightPublisher([client], timeout_s=30)
            await pub.connect()
            assert pub.group is not None and pub.group.config.signed
            cfg = pub.group.config
            store = outsider(pub)
            key = next(k for k in store.list_keys() if k.endswith("//cpu//0/1"))  # SGLang's rank 1
            verified_value(cfg.secret, key, bytes(store.get(key)))  # its member's tag
            with pytest.raises(GroupError):
                verified_value(new_group_secret(), key, bytes(store.get(key)))
            version = (await client.info()).version
            send_s, by_url = await pub.probe(1 << 20)  # the signed group carries a broadcast
            assert send_s > 0 and by_url[sglang_server.url] > 0
            await pub.close()

            init = f"tcp://127.0.0.1:{free_port()}"
            second = dataclasses.replace(cfg, init_method=init, secret=new_group_secret(), timeout_s=15)
            trainer = threading.Thread(target=_form, args=(second,), daemon=True)
            trainer.start()
            attacker = await asyncio.to_thread(take_rank_zero_while_it_forms, init, 7.0, 15)
            with pytest.raises(ServerError) as err:
                await client.init_process_group(second.invitation(1))
            assert "not written by a member" in str(err.value) and "//cpu//0/0" in str(err.value), err.value
            await asyncio.to_thread(attacker.join, 20)
            assert attacker.outcome != "sent"  # type: ignore[attr-defined]
            resp = await client.chat({"messages": PROMPT, "max_tokens": 3})
            assert set(resp.choices[0].weight_versions) == {version}  # still serving, same weights

    run(body)


def _form(cfg: GroupConfig) -> None:
    """The trainer's side of a group (rank 0): it times out once its server refused to join."""
    try:
        WeightSyncGroup(cfg)
    except GroupError:
        pass


# --- streaming, /v1/completions and structured output on SGLang -----------------------------------


def _sglang_child(gateway_pid: int) -> tuple[str, str]:
    """(url, api key) of the ``sglang.launch_server`` child of the gateway, read from its command
    line: the test asks SGLang itself, not the gateway, what it is running."""
    import psutil

    for p in psutil.Process(gateway_pid).children(recursive=True):
        cmd = p.cmdline()
        if "sglang.launch_server" in cmd:
            port = cmd[cmd.index("--port") + 1]
            key = next(a.split("=", 1)[1] for a in cmd if a.startswith("--api-key="))
            return f"http://127.0.0.1:{port}", key
    raise AssertionError("no sglang.launch_server child of the gateway")


async def _running_in_sglang(url: str, key: str) -> int:
    """Requests SGLang's scheduler holds (running or waiting), from its own ``/v1/loads``."""
    import httpx

    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as h:
        r = await h.get("/v1/loads")
        r.raise_for_status()
        loads = r.json()["loads"]
    return sum(int(s["num_running_reqs"]) + int(s["num_waiting_reqs"]) for s in loads)


@requires_sglang
def test_streamed_greedy_chat_equals_the_non_streamed_one(sglang_server: ServerProcess) -> None:
    """A greedy stream (n 2, logprobs, token ids, usage), and one with a stop string, add up per
    choice to the non-streamed response: text, token ids, raw logprobs, weight versions, finish
    reason on the last chunk only. Exact, but logprobs to 2e-5: SGLang's CPU kernels reduce in an
    order that depends on the batch a token is decoded in (3.6e-7 seen in CI). (Sampled streams
    cannot be compared with a seed here: SGLang 0.5.23 honours ``sampling_seed`` only with
    ``--enable-deterministic-inference``, which needs a GPU attention backend.)"""
    from pipelinerl_sdk.conformance.generation import check_stream as exact_stream
    from pipelinerl_sdk.conformance.generation import stop_string_of

    def check_stream(choices: Any, chunks: Any, what: str = "") -> None:
        for choice in choices:
            mine = [p for c in chunks[1:] for p in c.choices if p.index == choice.index]
            got = [t.logprob for p in mine for t in (p.logprobs.content if p.logprobs else [])]
            want = [t.logprob for t in (choice.logprobs.content if choice.logprobs else [])]
            assert len(got) == len(want), f"{what}{len(got)} streamed logprobs, {len(want)} not streamed"
            assert all(abs(a - b) < 2e-5 for a, b in zip(got, want, strict=True)), f"{what}{got} != {want}"
        exact_stream(
            [c.model_copy(update={"logprobs": None}) for c in choices],
            [ch.model_copy(update={"choices": [p.model_copy(update={"logprobs": None}) for p in ch.choices]})
             for ch in chunks],
            what,
        )  # fmt: skip

    body = {
        "messages": PROMPT, "max_tokens": 24, "temperature": 0, "n": 2, "ignore_eos": True, "logprobs": True,
        "top_logprobs": 2, "return_token_ids": True,
    }  # fmt: skip

    async def main() -> None:
        async with InferenceClient(sglang_server.url, control_token=sglang_server.control_token) as client:
            whole = await client.chat(body)
            chunks = [c async for c in client.chat_stream({**body, "stream_options": {"include_usage": True}})]
            check_stream(whole.choices, chunks)
            assert chunks[-1].usage == whole.usage
            parts = [p for c in chunks[1:] for p in c.choices if p.index == 0]
            assert sum(bool(p.token_ids) for p in parts) > 1, "one chunk: not streamed"
            tops = [len(t.top_logprobs) for p in parts for t in (p.logprobs.content if p.logprobs else [])]
            assert tops == [2] * 24, tops
            stop, _ = stop_string_of(whole.choices[0].message.content)
            one = {**body, "n": 1, "stop": [stop]}
            cut = await client.chat(one)
            check_stream(cut.choices, [c async for c in client.chat_stream(one)], f"stop={stop!r}: ")
            assert cut.choices[0].stop_reason == stop

    run(main)


@requires_sglang
def test_streamed_chunks_carry_the_version_that_computed_them(sglang_server: ServerProcess, tiny_model: Path) -> None:
    """After an update, every streamed chunk's ``weight_versions`` are the new version, one per
    token of the chunk; the greedy stream's text is the new weights' non-streamed text."""
    mirror = Mirror(tiny_model, "float32")

    async def main() -> None:
        async with InferenceClient(sglang_server.url, control_token=sglang_server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=1 << 20)
            await pub.connect()
            info = await client.info()
            mirror.perturb(seed=info.version + 300)
            async with pub.update(info.version + 1, info.params) as sink:
                await asyncio.to_thread(mirror.send_all, sink, info.params)
            body = {"messages": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            chunks = [c async for c in client.chat_stream(body)]
            parts = [p for c in chunks[1:] for p in c.choices]
            assert all(len(p.weight_versions) == len(p.token_ids or []) for p in parts)
            assert [v for p in parts for v in p.weight_versions] == [info.version + 1] * 8
            whole = await client.chat(body)
            assert "".join(p.delta.content or "" for p in parts) == whole.choices[0].message.content
            await pub.close()

    run(main)


@requires_sglang
def test_a_client_that_leaves_a_stream_aborts_it_in_sglang(sglang_server: ServerProcess) -> None:
    """A client reads three chunks of a long stream and disconnects: SGLang's own scheduler
    holds no request within seconds (the sample was aborted there, not run to its 1500 tokens),
    and the server serves the next request."""
    import httpx

    url, key = _sglang_child(sglang_server.pid)
    body = {"messages": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}

    async def main() -> None:
        headers = {"Authorization": f"Bearer {sglang_server.control_token}"}
        async with (
            httpx.AsyncClient(base_url=sglang_server.url, headers=headers, timeout=120) as h,
            h.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            assert r.status_code == 200
            seen, running, t_run = 0, 0, time.monotonic()
            async for line in r.aiter_lines():  # SGLang's load gauge is refreshed every few steps
                seen += line.startswith("data:")
                if seen >= 4 and seen % 4 == 0:
                    running = await _running_in_sglang(url, key)
                    if running or time.monotonic() - t_run > 30:
                        break
            assert running == 1, f"the stream is not running in SGLang ({running} after {seen} events)"
        t0 = time.monotonic()
        while await _running_in_sglang(url, key) and time.monotonic() - t0 < 30:
            await asyncio.sleep(0.2)
        left = await _running_in_sglang(url, key)
        assert left == 0, f"SGLang still runs {left} request(s) 30 s after the client left"
        print(f"\nSGLang idle {time.monotonic() - t0:.2f}s after the disconnect")
        async with InferenceClient(sglang_server.url, control_token=sglang_server.control_token) as client:
            resp = await client.chat({"messages": PROMPT, "max_tokens": 3})
            assert resp.choices[0].finish_reason in ("length", "stop")

    run(main)


@requires_sglang
def test_an_idle_sglang_server_leaves_the_cpu_alone(sglang_server: ServerProcess) -> None:
    """With nothing to do, the server's processes (gateway, SGLang's tokenizer, scheduler and
    detokenizer) use under 0.5 s of CPU in 3 s. SGLang's scheduler polls its sockets in a loop
    unless ``--sleep-on-idle``: 2.8 s of a core per 3 s, measured; on 2 cores that halved what a
    trainer or a replay beside it got (the reliability suite's replays of the load test ran 30x
    slower, 1.4 s per response instead of 0.05 s). A request afterwards is answered at once."""
    import psutil

    procs = [psutil.Process(pid) for pid in (sglang_server.pid, *_descendants(sglang_server.pid))]

    def cpu() -> float:
        total = 0.0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    run(lambda: _chat_once(sglang_server))  # whatever an earlier test left running has ended
    time.sleep(1.0)
    before = cpu()
    time.sleep(3.0)
    used = cpu() - before
    print(f"\nidle SGLang server: {used:.2f} s of CPU in 3 s ({len(procs)} processes)")
    assert used < 0.5, f"the idle server used {used:.2f} s of CPU in 3 s"
    t0 = time.monotonic()
    run(lambda: _chat_once(sglang_server))
    print(f"a request after the idle wait: {time.monotonic() - t0:.2f} s")


@requires_sglang
def test_sglang_decodes_on_the_threads_it_was_given(sglang_server: ServerProcess) -> None:
    """While a 600-token answer decodes, as many of SGLang's scheduler threads work as it was
    given (``cpu_threads``, default half the cores): torch threads past the free cores wait for
    each other at every parallel region. With SGLang's own default (all cores) both of this
    machine's cores' threads worked; beside one busy process the same answer then took 7.3 s
    instead of 2.8 s (idle: 2.4 and 1.6 s)."""
    import psutil
    from pipelinerl_sdk_sglang.engine import cpu_threads

    given = int(cpu_threads({}))
    procs = [psutil.Process(pid) for pid in _descendants(sglang_server.pid)]
    scheduler = next(p for p in procs if p.cmdline()[:1] == ["sglang::scheduler"])  # SGLang's process title
    environ = Path(f"/proc/{scheduler.pid}/environ").read_bytes().split(b"\0")  # (psutil's reads none here)
    assert f"OMP_NUM_THREADS={given}".encode() in environ

    def times() -> dict[int, float]:
        return {t.id: t.user_time + t.system_time for t in scheduler.threads()}

    async def long_answer() -> None:
        async with InferenceClient(sglang_server.url, control_token=sglang_server.control_token) as client:
            resp = await client.chat({"messages": PROMPT, "max_tokens": 600, "ignore_eos": True})
            assert resp.usage.completion_tokens == 600

    before = times()
    t0 = time.monotonic()
    run(long_answer)
    wall = time.monotonic() - t0
    used = {tid: t - before.get(tid, 0.0) for tid, t in times().items()}
    working = sorted((u for u in used.values() if u > 0.25 * wall), reverse=True)
    print(f"\n600 tokens in {wall:.2f} s; scheduler threads' CPU: {[round(u, 2) for u in working]} (given {given})")
    assert 1 <= len(working) <= given, f"{len(working)} threads worked (CPU s: {working}), given {given}"


async def _chat_once(server: ServerProcess) -> None:
    async with InferenceClient(server.url, control_token=server.control_token) as client:
        resp = await client.chat({"messages": PROMPT, "max_tokens": 3})
        assert resp.choices[0].finish_reason in ("length", "stop")


@requires_sglang
def test_completions_text_token_ids_and_batches(sglang_server: ServerProcess, tiny_model: Path) -> None:
    """``/v1/completions`` on SGLang: a text prompt (tokenized with the special tokens) and the
    same prompt as token ids give the same greedy completion; a batch of two prompts with n 2
    gives choice ``p * n + i``; logprobs (with alternatives), prompt logprobs, token ids and
    one weight version per token; a stream adds up to the non-streamed choice."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)

    async def main() -> None:
        async with InferenceClient(sglang_server.url, control_token=sglang_server.control_token) as client:
            common = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True, "logprobs": 2}
            text = await client.completion({**common, "prompt": "12+7=", "prompt_logprobs": True})
            ids = tok("12+7=")["input_ids"]
            by_ids = await client.completion({**common, "prompt": ids})
            a, b = text.choices[0], by_ids.choices[0]
            assert a.prompt_token_ids == ids and b.prompt_token_ids == ids
            assert a.token_ids == b.token_ids and a.text == b.text and len(a.token_ids or []) == 6
            assert a.logprobs is not None and len(a.logprobs.token_logprobs) == 6
            # text -> logprob: alternatives whose texts decode alike (U+FFFD) share one key
            assert all(1 <= len(t) <= 3 for t in a.logprobs.top_logprobs or [])
            assert a.weight_versions == [a.weight_versions[0]] * 6
            assert a.prompt_logprobs is not None and a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(ids)
            batch = await client.completion({**common, "prompt": [ids, ids[:3]], "n": 2})
            assert [c.index for c in batch.choices] == [0, 1, 2, 3]
            assert batch.choices[0].token_ids == batch.choices[1].token_ids == a.token_ids
            assert batch.choices[2].prompt_token_ids == ids[:3]
            assert batch.usage.prompt_tokens == len(ids) + 3 and batch.usage.completion_tokens == 24
        headers = {"Authorization": f"Bearer {sglang_server.control_token}"}
        import httpx

        async with httpx.AsyncClient(base_url=sglang_server.url, headers=headers, timeout=120) as h:
            r = await h.post("/v1/completions", json={**common, "prompt": ids, "stream": True})
            assert r.status_code == 200, r.text
            events = [json.loads(x[5:]) for x in r.text.splitlines() if x.startswith("data:") and "[DONE]" not in x]
            parts = [c for e in events for c in e["choices"]]
            assert "".join(c["text"] for c in parts) == a.text
            assert [t for c in parts for t in c.get("token_ids") or []] == a.token_ids
            assert [v for c in parts for v in c["weight_versions"]] == a.weight_versions
            # the same request not streamed, to 2e-5: SGLang's CPU kernels reduce in an order
            # that depends on the batch a token is decoded in (6e-7 seen; main's engine tests
            # allow 2e-5 for the same reason); ids, text and versions above are exact
            assert b.logprobs is not None
            streamed = [x for c in parts for x in c["logprobs"]["token_logprobs"]]
            assert len(streamed) == len(b.logprobs.token_logprobs)
            assert max(abs(x - y) for x, y in zip(streamed, b.logprobs.token_logprobs, strict=True)) < 2e-5
            assert [c.get("finish_reason") for c in parts][-1] == "length"
            for bad, field in (
                ({"logit_bias": {"5": 1}}, "logit_bias"),
                ({"prompt_logprobs": 2}, "prompt_logprobs"),
                ({"echo": True, "logprobs": 2}, "echo"),  # it needs prompt logprobs with 2 alternatives
            ):
                r = await h.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, **bad})
                assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            # echo with logprobs 0 is served (the router's): the prompt's tokens first, the first with none
            r = await h.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "echo": True, "logprobs": 0})
            assert r.status_code == 200, r.text
            echoed = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            assert len(echoed) == len(ids) + 2 and echoed[0] is None and all(v <= 0 for v in echoed[1:])

    run(main)


@requires_sglang
def test_structured_output_on_sglang(sglang_server: ServerProcess) -> None:
    """SGLang's grammar backend constrains every sampled choice (n 4, temperature 1): a choice
    whose options need escaping, a regex, a grammar, a JSON schema without optional whitespace,
    a named tool; streamed too; a spec that does not compile is a 400 naming its field."""
    import httpx

    choices = ['say "hi"', "back\\slash", "yes"]
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    base = {"messages": PROMPT, "max_tokens": 40, "temperature": 1.0, "n": 4}

    async def main() -> None:
        async with InferenceClient(sglang_server.url, control_token=sglang_server.control_token) as client:
            r = await client.chat({**base, "structured_outputs": {"choice": choices}})
            assert all(c.message.content in choices and c.finish_reason == "stop" for c in r.choices), r.choices
            r = await client.chat({**base, "structured_outputs": {"regex": "[0-9]{2}-[xy]"}})
            assert all(re.fullmatch("[0-9]{2}-[xy]", c.message.content) for c in r.choices), r.choices
            r = await client.chat({**base, "structured_outputs": {"grammar": 'root ::= "a" ("b" | "c") "!"'}})
            assert all(c.message.content in ("ab!", "ac!") for c in r.choices), r.choices
            r = await client.chat({**base, "structured_outputs": {"json": schema, "disable_any_whitespace": True}})
            assert all(c.message.content in ('{"ok":true}', '{"ok":false}') for c in r.choices), r.choices
            r = await client.chat(
                {
                    **base, "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}},
                    "structured_outputs": {"disable_any_whitespace": True},
                }
            )  # fmt: skip
            for c in r.choices:
                assert [t["function"]["name"] for t in c.message.tool_calls] == ["f"], c
                assert json.loads(c.message.tool_calls[0]["function"]["arguments"]) in ({"ok": True}, {"ok": False})
            chunks = [
                ch
                async for ch in client.chat_stream({**base, "n": 2, "structured_outputs": {"regex": "[0-9]{2}-[xy]"}})
            ]
            for i in (0, 1):
                text = "".join(p.delta.content or "" for ch in chunks[1:] for p in ch.choices if p.index == i)
                assert re.fullmatch("[0-9]{2}-[xy]", text), text
        headers = {"Authorization": f"Bearer {sglang_server.control_token}"}
        async with httpx.AsyncClient(base_url=sglang_server.url, headers=headers, timeout=120) as h:
            for bad, field in (
                ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
                ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
                (
                    {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
                    "response_format",
                ),
            ):
                for stream in (False, True):
                    r = await h.post("/v1/chat/completions", json={**base, **bad, "stream": stream})
                    assert r.status_code == 400 and r.json()["error"]["param"] == field, (bad, stream, r.text)

    run(main)
