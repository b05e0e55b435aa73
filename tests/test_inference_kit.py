"""The inference kit on real pieces: a gloo group (rank 0 here), the reference backend on the tiny
model, a real uvicorn server for an engine-owned app.

Two bugs of the receive path are pinned here:
- a timeout waiting for the trainer's decision must leave the group broken (it used not to);
- a ``direct`` update the trainer calls off must never hold generation (it used to pause first).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_weight_sender import two_members

from pipelinerl_sdk.contracts import ServeConfig
from pipelinerl_sdk.errors import GroupError, InvalidRequest, PromptTooLong, UpdateAborted
from pipelinerl_sdk.kit.inference.chat import (
    COUNT_CHUNK_CHARS,
    CUT_SLACK_TOKENS,
    count_in_pieces,
    prepare_chat,
    render_prompt,
    rust_tokenizer,
    trim_heap,
    versions_from_spans,
)
from pipelinerl_sdk.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    InitProcessGroupRequest,
    WeightUpdateRequest,
    probe_key,
    update_key,
)
from pipelinerl_sdk.weights.auth import new_group_secret
from pipelinerl_sdk.weights.buckets import BucketPlan
from pipelinerl_sdk.weights.group import GroupConfig, WeightSyncGroup
from pipelinerl_sdk.weights.publisher import free_port
from pipelinerl_sdk.weights.receive import WeightReceiver
from pipelinerl_sdk.weights.send import WeightSender

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def pair() -> Iterator[tuple[WeightSyncGroup, WeightReceiver]]:
    """A fresh two-member group: the trainer (rank 0, here) and a receiver (rank 1)."""
    trainer, member = two_members()
    yield trainer, WeightReceiver(member)
    member.close()
    trainer.close()


def test_no_decision_in_time_breaks_the_group(pair: tuple[WeightSyncGroup, WeightReceiver]) -> None:
    """The receiver's docstring: a timeout waiting for the decision leaves the group broken
    (the trainer may still enter the broadcast it will not join). Failed before the fix:
    ``group.broken`` stayed None."""
    _, receiver = pair
    from pipelinerl_sdk.protocol import ParamSpec

    plan = BucketPlan.build([ParamSpec(name="w", dtype="float32", shape=(4,))], 1024)
    with pytest.raises(GroupError, match="no decision for 'update/7'"):
        receiver.receive(plan, update_key(7), decision_timeout_s=0.2)
    assert receiver.group.broken is not None and "no decision" in receiver.group.broken


def test_a_called_off_decision_leaves_the_group_healthy(pair: tuple[WeightSyncGroup, WeightReceiver]) -> None:
    trainer, receiver = pair
    trainer.post_decision(probe_key(3), go=False, reason="another server refused")
    with pytest.raises(UpdateAborted, match="another server refused"):
        receiver.receive_flat(1024, probe_key(3), decision_timeout_s=10)
    assert receiver.group.broken is None


# --- the reference backend on the kit ------------------------------------------------------------


async def _joined_backend(tiny_model: Path) -> tuple[object, WeightSyncGroup]:
    from pipelinerl_sdk.reference.backend import ReferenceInferenceBackend

    backend = ReferenceInferenceBackend(
        ServeConfig(model=str(tiny_model), control_token="t", receive_mode="direct", options={"threads": "1"})
    )
    await backend.start()
    init = f"tcp://127.0.0.1:{free_port()}"
    secret = new_group_secret()
    own = asyncio.create_task(asyncio.to_thread(WeightSyncGroup, GroupConfig(init, 0, 2, timeout_s=30, secret=secret)))
    await backend.init_process_group(
        InitProcessGroupRequest(init_method=init, rank_offset=1, world_size=2, group_secret=secret)
    )
    return backend, await own


def _request(backend: object, version: int) -> tuple[WeightUpdateRequest, BucketPlan]:
    specs = backend.param_specs()  # type: ignore[attr-defined]
    plan = BucketPlan.build(specs, 1 << 20)
    group_id = backend.group_state().group_id  # type: ignore[attr-defined]
    req = WeightUpdateRequest(
        version=version, params=specs, bucket_bytes=1 << 20, plan_digest=plan.digest(), group_id=group_id
    )
    return req, plan


def test_direct_update_called_off_never_pauses_generation(tiny_model: Path) -> None:
    """``direct`` holds generation for the receive, but only once the trainer said ``go``: an
    update it calls off never pauses. Failed before the fix: the reference backend entered the
    pause first (one hold). The twin below shows the counter counts a real direct update."""

    async def body() -> None:
        backend, trainer = await _joined_backend(tiny_model)
        gate = backend.engine.gate  # type: ignore[attr-defined]
        try:
            req, _ = _request(backend, 1)
            trainer.post_decision(update_key(1), go=False, reason="another server refused")
            accepted: list[bool] = []
            with pytest.raises(UpdateAborted, match="another server refused"):
                await backend.update_weights(req, "direct", lambda: accepted.append(True))  # type: ignore[attr-defined]
            assert accepted == [True]
            assert gate.holds == 0, "a called-off update paused generation"
            assert backend.version == 0 and backend.group_state().broken is False  # type: ignore[attr-defined]

            # the twin: the same update with go pauses exactly once and goes live
            req, plan = _request(backend, 2)
            params = dict(backend.model.named_parameters())  # type: ignore[attr-defined]
            trainer.clear_decision(update_key(2))

            def send() -> None:
                sender = WeightSender(trainer, plan)
                for spec in req.params:
                    sender.send(spec.name, params[spec.name].detach().clone())
                sender.finish()

            trainer.post_decision(update_key(2), go=True)
            sending = asyncio.create_task(asyncio.to_thread(send))
            report = await backend.update_weights(req, "direct", lambda: None)  # type: ignore[attr-defined]
            await sending
            assert gate.holds == 1 and report.version == 2 and backend.version == 2
        finally:
            await backend.stop()  # type: ignore[attr-defined]
            trainer.close()

    asyncio.run(body())


def test_decision_timeout_marks_the_backends_group_broken(tiny_model: Path) -> None:
    """The kit's one normalisation: a GroupError becomes UpdateFailed naming the version still
    served, the group is reported broken, generation was never held."""
    from pipelinerl_sdk.errors import UpdateFailed

    async def body() -> None:
        backend, trainer = await _joined_backend(tiny_model)
        try:
            req, _ = _request(backend, 1)
            req = req.model_copy(update={"timeout_s": 0.2})
            with pytest.raises(UpdateFailed, match="version 0 still serving: no decision"):
                await backend.update_weights(req, "direct", lambda: None)  # type: ignore[attr-defined]
            state = backend.group_state()  # type: ignore[attr-defined]
            assert state.broken and "no decision" in state.reason
            assert backend.engine.gate.holds == 0  # type: ignore[attr-defined]
        finally:
            await backend.stop()  # type: ignore[attr-defined]
            trainer.close()

    asyncio.run(body())


# --- chat preparation and assembly ---------------------------------------------------------------


def test_prepare_chat_raises_typed_errors_naming_the_field(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    hi = [{"role": "user", "content": "hello"}]
    plan = prepare_chat(tok, ChatCompletionRequest(messages=hi, max_tokens=5), 64)
    assert plan.max_tokens == 5 and plan.top == 0 and len(plan.prompt_ids) > 1
    room = 64 - len(plan.prompt_ids)
    assert prepare_chat(tok, ChatCompletionRequest(messages=hi), 64).max_tokens == room
    with pytest.raises(PromptTooLong, match=r"exceeds the context \(64\)") as e:
        prepare_chat(tok, ChatCompletionRequest(messages=hi, max_tokens=room + 1), 64)
    assert e.value.field == "max_tokens"
    with pytest.raises(PromptTooLong) as e:
        prepare_chat(tok, ChatCompletionRequest(messages=hi, max_completion_tokens=room + 1), 64)
    assert e.value.field == "max_completion_tokens"
    with pytest.raises(PromptTooLong, match="no room to generate") as e:
        prepare_chat(tok, ChatCompletionRequest(messages=hi), len(plan.prompt_ids))
    assert e.value.field == "messages"
    with pytest.raises(InvalidRequest, match="requires logprobs") as e:
        prepare_chat(tok, ChatCompletionRequest(messages=hi, top_logprobs=2), 64)
    assert e.value.field == "top_logprobs"


#: Text pieces of the tokenizer property: ASCII, 2-, 3- and 4-byte characters, special tokens.
PIECES = [*"ab 1+\n\u00e9\u4e2d\U0001f600", "<|im_end|>", "<|im_start|>", "  ", "the", " cat"]


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["user", "assistant", "system"]),
            st.lists(st.sampled_from(PIECES), max_size=40).map("".join),
        ),
        min_size=1,
        max_size=4,
    ),
    st.booleans(),
)
def test_the_rust_tokenizer_gives_the_ids_apply_chat_template_gives(
    tiny_tokenizer: Any, messages: list[tuple[str, str]], generation_prompt: bool
) -> None:
    """The direct ``encode_batch`` path (GIL released, length checked before the ids exist) and
    the transformers call agree, special tokens in the text included."""
    assert rust_tokenizer(tiny_tokenizer) is not None  # the path under test is the fast one
    msgs = [{"role": r, "content": c} for r, c in messages]
    req = ChatCompletionRequest(messages=msgs, add_generation_prompt=generation_prompt)
    expected = tiny_tokenizer.apply_chat_template(
        msgs, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
    )
    assert render_prompt(tiny_tokenizer, req) == list(expected)


def test_a_prompt_past_the_context_is_refused_by_its_length(tiny_tokenizer: Any) -> None:
    """Refused at exactly the length that leaves no room (on both paths), field ``messages``."""
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "ab " * 50}])
    n = len(render_prompt(tiny_tokenizer, req))
    assert render_prompt(tiny_tokenizer, req, n + 1) == render_prompt(tiny_tokenizer, req)
    with pytest.raises(PromptTooLong, match=rf"prompt \({n} tokens\) leaves no room") as e:
        render_prompt(tiny_tokenizer, req, n)
    assert e.value.field == "messages"
    slow = copy.deepcopy(tiny_tokenizer)
    slow.backend_tokenizer.enable_truncation(8)  # a configured truncation: the transformers call
    assert rust_tokenizer(slow) is None
    assert render_prompt(slow, req, n + 1) == render_prompt(tiny_tokenizer, req)
    with pytest.raises(PromptTooLong, match=rf"prompt \({n} tokens\)"):
        render_prompt(slow, req, n)


def test_a_long_prompt_is_counted_in_pieces_within_the_slack(tiny_tokenizer: Any) -> None:
    """A prompt of several pieces: their count is within the cuts' slack of the exact count; far
    past the context it is refused by it ("at least"), within it the ids are exact."""
    text = "the cat adds 12+7=  and  answers 19; " * 20_000  # 740k characters: 3 pieces
    backend = rust_tokenizer(tiny_tokenizer)
    counted, cuts = count_in_pieces(backend, text)
    exact = len(backend.encode_batch([text], add_special_tokens=False)[0])
    print(f"\n{cuts} cuts: counted {counted}, exact {exact}; slack {cuts * CUT_SLACK_TOKENS}")
    assert cuts == len(text) // COUNT_CHUNK_CHARS and abs(counted - exact) <= cuts * CUT_SLACK_TOKENS
    req = ChatCompletionRequest(messages=[{"role": "user", "content": text}])
    with pytest.raises(PromptTooLong, match=r"prompt \(at least \d+ tokens\) leaves no room") as e:
        render_prompt(tiny_tokenizer, req, 4096)
    assert e.value.field == "messages"
    expected = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert render_prompt(tiny_tokenizer, req, len(expected) + 1) == list(expected)
    # with a bound, counting stops at the first piece whose sum reaches it
    few, one_cut = count_in_pieces(backend, text, enough=4096)
    assert one_cut == 1 and 4096 + CUT_SLACK_TOKENS <= few < counted, (few, one_cut, counted)
    assert count_in_pieces(backend, text, enough=10**9) == (counted, cuts)


def test_trim_heap_returns_freed_memory_to_the_system() -> None:
    """glibc keeps freed memory below a live block in the process (the heap is trimmed at its
    top only); ``trim_heap`` hands those pages back."""

    def rss_mb() -> float:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    held = [bytes(100_000) for _ in range(2000)]  # 200 MB of blocks under the mmap threshold
    pin = held.pop()  # the last block stays: the free space is not at the heap's top
    held.clear()
    before = rss_mb()
    assert trim_heap()
    after = rss_mb()
    print(f"\nRSS {before:.0f} MB with 200 MB freed, {after:.0f} MB after trim_heap")
    assert before - after > 100, (before, after)
    del pin


@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 5)), max_size=8))
def test_version_spans_expand_to_one_version_per_token(spans: list[tuple[int, int]]) -> None:
    triples, start = [], 0
    for version, length in spans:
        triples.append((version, start, start + length))
        start += length
    expected = [v for v, n in spans for _ in range(n)]
    assert versions_from_spans(triples, start, engine="e") == expected
    with pytest.raises(RuntimeError, match=f"spans for {start} of {start + 1} tokens"):
        versions_from_spans(triples, start + 1, engine="e")


# --- errors and serving an engine-owned app ------------------------------------------------------

ENGINE_APP = textwrap.dedent(
    """
    import sys
    from fastapi import FastAPI
    from pipelinerl_sdk.contracts import ServeConfig
    from pipelinerl_sdk.kit.inference.serve import run
    from pipelinerl_sdk.reference.backend import ReferenceInferenceBackend

    class Crashes(ReferenceInferenceBackend):
        async def chat_completion(self, req):
            if req.user == "crash":
                raise RuntimeError("engine fell over")
            return await super().chat_completion(req)

    app = FastAPI()

    @app.get("/engine/own")
    async def own() -> dict:
        return {"engine": "own route"}

    @app.get("/health")
    async def shadowed() -> dict:
        return {"status": "the engine's own, shadowed by the SDK's"}

    config = ServeConfig(model=sys.argv[1], port=0, control_token="ctl", ready_file=sys.argv[2],
                         options={"threads": "1", "max_model_len": "64"})
    run(app, Crashes(config), config)
    """
)


def test_an_engine_owned_app_is_served_with_the_contract_and_json_errors(tmp_path: Path, tiny_model: Path) -> None:
    """``kit.inference.serve.run`` on an app of the engine's own: port 0, the ready file, the
    engine's routes kept, the SDK's routes in front, the backend started by the lifespan, typed
    errors as 400 naming the field, an unexpected exception as a JSON 500, SIGTERM stops it."""
    ready = tmp_path / "ready.json"
    script = tmp_path / "engine_app.py"
    script.write_text(ENGINE_APP)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tiny_model), str(ready)], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 180
        while not ready.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "no ready file"
            time.sleep(0.1)
        info = json.loads(ready.read_text())
        assert info["pid"] == proc.pid and info["backend"] == "reference" and info["port"] > 0
        with httpx.Client(base_url=info["url"], timeout=60) as http:
            assert http.get("/engine/own").json() == {"engine": "own route"}
            assert http.get("/health").json() == {"status": "ok", "version": 0}
            msgs = [{"role": "user", "content": "hi"}]
            ok = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "temperature": 0})
            assert ok.status_code == 200, ok.text
            assert len(ChatCompletionResponse.model_validate(ok.json()).choices[0].weight_versions) == 2
            long = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 64})
            assert long.status_code == 400
            assert long.json()["error"] == {
                "type": "invalid_request",
                "message": long.json()["error"]["message"],
                "param": "max_tokens",
                "code": 400,
            }
            assert "exceeds the context (64)" in long.json()["error"]["message"]
            crash = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "user": "crash"})
            assert crash.status_code == 500 and crash.headers["content-type"] == "application/json"
            assert crash.json()["error"]["type"] == "internal_error"
            assert crash.json()["error"]["message"] == "RuntimeError: engine fell over"
            probe = http.post(
                "/probe_broadcast",
                json={"nbytes": 8, "probe_id": 0, "group_id": "0" * 32},
                headers={"authorization": "Bearer ctl"},
            )
            assert probe.status_code == 409 and probe.json()["error"]["type"] == "update_rejected"
            assert probe.json()["error"]["param"] == "group"
            assert "init_process_group" in probe.json()["error"]["message"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# --- the engine card: declared once, registered by the plugin, read by the class ----------------------


def test_engine_card_is_what_the_registry_and_the_backend_class_both_read(tiny_model: Path) -> None:
    """The reference backend's card, registered by its plugin: the registry lists the card's
    capabilities and description, creating the backend passes the registry's agreement check, and
    the constructor refuses an option the card does not name (naming the card's options) or a
    missing engine (naming what to install). A subclass that changes its capabilities is refused."""
    import dataclasses

    from pipelinerl_sdk.contracts import LOGPROBS_MODES
    from pipelinerl_sdk.errors import PluginError
    from pipelinerl_sdk.kit.inference import full_capabilities
    from pipelinerl_sdk.plugins import load_registry
    from pipelinerl_sdk.reference import plugin
    from pipelinerl_sdk.reference.backend import ReferenceInferenceBackend
    from pipelinerl_sdk.reference.capabilities import INFERENCE_CARD as CARD

    registry = load_registry(autoload=False, plugins={"reference": plugin})
    entry = registry.get("inference", "reference")
    assert (entry.capabilities, entry.description, entry.factory) == (CARD.capabilities, CARD.description, CARD.factory)
    full = dataclasses.replace(
        full_capabilities("direct", "staged"),
        streaming=True,
        completions=True,
        structured_outputs=True,
        logprobs_modes=frozenset(LOGPROBS_MODES),
        pause_generation=True,
    )
    assert ReferenceInferenceBackend.capabilities == CARD.capabilities == full
    assert CARD.capabilities.prompt_logprobs and CARD.capabilities.group_backends == {"gloo", "nccl"}
    config = ServeConfig(model=tiny_model, options={"threads": "1"})
    backend = registry.create_inference("reference", config)
    assert backend.name == "reference" and backend.capabilities == CARD.capabilities
    known = r"\['max_batch_size', 'max_model_len', 'threads', 'tool_call_parser'\]"
    with pytest.raises(
        ValueError, match=rf"unknown option\(s\) for the reference backend: \['bad'\] \(known: {known}\)"
    ):
        ReferenceInferenceBackend(ServeConfig(model=tiny_model, options={"bad": "1"}))

    class Drifted(ReferenceInferenceBackend):
        capabilities = full_capabilities("direct")

    registry.entries["inference", "reference"] = dataclasses.replace(entry, factory=Drifted)
    with pytest.raises(PluginError, match="capabilities differ from those it registered"):
        registry.create_inference("reference", config)

    class Missing(ReferenceInferenceBackend):
        card = dataclasses.replace(CARD, name="missing", engine=("no_such_engine_xyz", "NoSuch 1.0"))

    with pytest.raises(PluginError, match=r"the missing backend needs NoSuch 1\.0"):
        Missing(config)


@given(rank_offset=st.integers(1, 64), index=st.integers(0, 7), timeout=st.floats(1, 3600))
def test_group_config_invitation_and_joining_round_trip(rank_offset: int, index: int, timeout: float) -> None:
    """The trainer's config invites a server (``/init_process_group`` body); a worker of that
    server joins with the trainer's config but its own rank: nothing else may differ."""
    trainer = GroupConfig("tcp://127.0.0.1:29500", 0, 72, "gloo", "g-1", timeout, new_group_secret())
    req = trainer.invitation(rank_offset)
    assert req.rank_offset == rank_offset and req.group_secret == trainer.secret
    worker = GroupConfig.joining(
        InitProcessGroupRequest.model_validate(req.model_dump(mode="json")), rank_offset + index
    )
    assert worker == GroupConfig(trainer.init_method, rank_offset + index, 72, "gloo", "g-1", timeout, trainer.secret)
