"""Deliberately broken inference backends: the conformance suite must report each of them.

A test-only plugin, never installed: load it with ``PIPELINERL_EXTRA_PLUGINS=tests.broken_backends``
(and the repository root on ``PYTHONPATH``), then ``pipelinerl serve --backend broken-...`` or
``pytest conformance --backend=broken-...`` finds these backends.

Each backend is the reference backend wrong in exactly ONE way; its docstring names the standard
check that must catch it. ``tests/test_conformance_catches_broken_inference.py`` runs those checks
against each backend and asserts they fail with a message naming the problem.

The ``GAP_BACKENDS`` are broken too, but (at the time of writing) no standard check catches them:
they document where the suite is too weak, and the test module marks them strict xfail, so the day
the suite catches one, the xfail turns into a failure and the backend moves to the caught list.

Importing this module imports torch (the classes subclass the reference backend); the plugin hook
itself registers dotted paths only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import torch

from pipelinerl_sdk.conformance.stats import sampling_distribution
from pipelinerl_sdk.contracts import (
    InferenceCapabilities,
    ServeConfig,
    UpdateReport,
    validate_update_request,
)
from pipelinerl_sdk.errors import GroupError, PipelineRLError, UpdateAborted, UpdateFailed, UpdateRejected
from pipelinerl_sdk.http.vllm_rl import VLLMRLFront
from pipelinerl_sdk.kit.inference.chat import ChatPlan, StopRule, plan_chat
from pipelinerl_sdk.kit.inference.hold import EnginePause, GenerationHold
from pipelinerl_sdk.kit.inference.stream import TokenStep, chat_chunks
from pipelinerl_sdk.plugins import BackendRegistry, hookimpl
from pipelinerl_sdk.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ParamSpec,
    ReceiveMode,
    SamplingRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    WeightUpdateRequest,
)
from pipelinerl_sdk.reference.backend import ReferenceInferenceBackend
from pipelinerl_sdk.reference.capabilities import INFERENCE
from pipelinerl_sdk.reference.engine import ContinuousBatchingEngine, GenerationResult, SamplingParams, _Request
from pipelinerl_sdk.weights.buckets import BucketPlan
from pipelinerl_sdk.weights.group import WeightSyncGroup
from pipelinerl_sdk.weights.receive import update_key
from pipelinerl_sdk.weights.tensors import TORCH_DTYPES, from_bytes

#: The shift of ``broken-wrong-logprobs``: far above the float32 tolerance (1e-4), small enough
#: that every logprob stays <= 0 and the tokens are unchanged.
LOGPROB_SHIFT = -0.05

#: Receive modes of ``broken-half-applies`` (it has no staging, so it cannot honour ``staged``).
DIRECT_ONLY = dataclasses.replace(INFERENCE, receive_modes=frozenset({"direct"}))

#: Capabilities of ``correct-no-seeds``: the reference's, without per-request seeds.
NO_SEEDS = dataclasses.replace(INFERENCE, seeds=False)


def _rebuild_engine(
    old: ContinuousBatchingEngine, cls: type[ContinuousBatchingEngine], *, version: int
) -> ContinuousBatchingEngine:
    """A new, not yet started engine over ``old``'s model with ``old``'s settings."""
    return cls(
        old.model,
        eos_token_ids=sorted(old._eos_ids),
        max_batch_size=old._max_batch_size,
        max_model_len=old._max_model_len,
        version=version,
        logprobs_mode=old._logprobs_mode,
    )


# --- caught by the standard checks ---------------------------------------------------------------


class IgnoresUpdates(ReferenceInferenceBackend):
    """Receives every broadcast and bumps the version, but copies the new weights into a detached
    copy of the params, so the model keeps serving its initial weights.

    Caught by ``test_update_serves_exactly_the_new_weights``: after the update its logprobs are
    the old weights' ("completion logprobs differ from the weights the server should hold")."""

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self._params = {
            name: torch.nn.Parameter(p.detach().clone(), requires_grad=False) for name, p in self._params.items()
        }


class WrongLogprobs(ReferenceInferenceBackend):
    """Generates exactly the reference's tokens, but reports every completion logprob shifted by
    ``LOGPROB_SHIFT`` (still <= 0).

    Caught by ``test_logprobs_match_the_served_weights`` (on the fresh server): "completion
    logprobs differ from the weights the server should hold: max |diff| 0.05"."""

    def _choice(self, index: int, r: GenerationResult, req: ChatCompletionRequest) -> ChatChoice:
        choice = super()._choice(index, r, req)
        if choice.logprobs is None:
            return choice
        shifted = [t.model_copy(update={"logprob": t.logprob + LOGPROB_SHIFT}) for t in choice.logprobs.content]
        return choice.model_copy(update={"logprobs": ChoiceLogprobs(content=shifted)})


class AbortsInFlight(ReferenceInferenceBackend):
    """Applies every update correctly, then restarts its engine: ``engine.stop()`` aborts every
    running request, which returns its partial output with ``finish_reason="abort"``; a fresh
    engine over the same (updated) model serves the new version from then on.

    Caught by ``test_requests_in_flight_survive_updates``: "request cut short: abort, N tokens"."""

    async def update_weights(
        self, req: WeightUpdateRequest, mode: ReceiveMode, on_accepted: Callable[[], None]
    ) -> UpdateReport:
        report = await super().update_weights(req, mode, on_accepted)
        new = _rebuild_engine(self.engine, ContinuousBatchingEngine, version=req.version)
        await new.start()
        old, self.engine = self.engine, new  # new requests go to the new engine from here on
        await old.stop()  # the old engine's running requests end as "abort", cut short
        return report


class HalfApplies(ReferenceInferenceBackend):
    """No staging: in ``direct`` mode (its only mode) it receives bucket after bucket and copies
    each bucket's tensors into the live params as soon as the bucket arrives. A broadcast that
    dies half-way leaves the first half of the params changed while the old version is reported.

    Caught by ``test_interrupted_broadcast_keeps_old_weights_serving``: after the trainer is
    killed, "completion logprobs differ from the weights the server should hold"."""

    capabilities = DIRECT_ONLY

    @property
    def default_mode(self) -> ReceiveMode:
        return "direct"

    async def update_weights(
        self, req: WeightUpdateRequest, mode: ReceiveMode, on_accepted: Callable[[], None]
    ) -> UpdateReport:
        receiver = self._receiver
        if receiver is None:
            raise GroupError("no weight-update group")
        plan = BucketPlan.build(req.params, req.bucket_bytes)
        t0 = time.perf_counter()
        try:
            on_accepted()
            async with self.engine.paused() as hold:
                receive_s = await asyncio.to_thread(
                    _receive_applying_each_bucket,
                    receiver.group,
                    plan,
                    update_key(req.version),
                    req.timeout_s,
                    self._params,
                )
                self.engine.set_version(req.version)
        except UpdateAborted:
            raise
        except GroupError as e:
            raise UpdateFailed(f"receive failed, version {self.version} still serving: {e}") from e
        return UpdateReport(req.version, mode, hold.held_s, receive_s, 0.0, time.perf_counter() - t0)


@torch.no_grad()
def _receive_applying_each_bucket(
    group: WeightSyncGroup, plan: BucketPlan, key: str, timeout_s: float, params: Mapping[str, torch.Tensor]
) -> float:
    """The bug of ``HalfApplies``: apply each bucket as soon as it arrived."""
    group.await_decision(key, timeout_s)
    t0 = time.perf_counter()
    for b in plan.buckets:
        buf = torch.empty(b.nbytes, dtype=torch.uint8, device=group.device)
        group.broadcast(buf, 0, what=f"receive of bucket {b.index}")
        for e in b.entries:
            params[e.spec.name].copy_(from_bytes(buf[e.offset : e.offset + e.spec.nbytes], e.spec))
    return time.perf_counter() - t0


class AcceptsUnknownNames(ReferenceInferenceBackend):
    """Its ``validate_update`` does not check param names against the model: an update carrying a
    param the model does not have is accepted, its bytes are received, and that param is silently
    dropped (the update "succeeds"). The other checks (missing params, shapes, dtypes, version,
    digest) are the standard ones.

    Caught by ``test_bad_updates_are_refused_before_any_receive``: the ``unknown-extra-name`` case
    is not refused with 422."""

    def validate_update(self, req: WeightUpdateRequest) -> None:
        known = {s.name for s in self.param_specs()}
        validate_update_request(
            req,
            expected=[*self.param_specs(), *(p for p in req.params if p.name not in known)],  # the bug
            current_version=self.version,
            modes=self.capabilities.receive_modes,
            group=self.group_state(),
        )

    async def update_weights(
        self, req: WeightUpdateRequest, mode: ReceiveMode, on_accepted: Callable[[], None]
    ) -> UpdateReport:
        live = self._params
        self._params = {**live, **{p.name: _scratch(p) for p in req.params if p.name not in live}}
        try:
            return await super().update_weights(req, mode, on_accepted)
        finally:
            self._params = live


def _scratch(spec: ParamSpec) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(spec.shape, dtype=TORCH_DTYPES[spec.dtype]), requires_grad=False)


class StaleVersions(ReferenceInferenceBackend):
    """Tags every token of a completion with the version served when the request started, not
    with the version of the forward that produced it: tokens generated after an in-flight update
    keep the old version.

    Caught by ``test_requests_in_flight_survive_updates``: "no request carried tokens of two versions"."""

    async def chat_completion(self, req: ChatCompletionRequest) -> ChatCompletionResponse:
        at_start = self.version
        resp = await super().chat_completion(req)
        choices = [c.model_copy(update={"weight_versions": [at_start] * len(c.weight_versions)}) for c in resp.choices]
        return resp.model_copy(update={"choices": choices})


class StaleStreamVersions(ReferenceInferenceBackend):
    """Streams each chunk's tokens tagged with the version served when the request started (a
    streaming path that copies the request's first version into every chunk); non-streamed
    responses stay right.

    Caught by ``test_streamed_version_tags_are_true``: "a version tag lies"."""

    def sample_steps(self, plan: ChatPlan, req: SamplingRequest, i: int) -> AsyncIterator[TokenStep]:
        at_start, steps = self.version, super().sample_steps(plan, req, i)

        async def stale() -> AsyncIterator[TokenStep]:
            async for step in steps:
                yield dataclasses.replace(step, versions=[at_start] * len(step.token_ids))

        return stale()


class WriteTimeStreamVersions(ReferenceInferenceBackend):
    """Streams each chunk's tokens tagged with the version live when the chunk is written (a
    streaming path that reads the server's current version as it serialises): right while the
    client keeps up, wrong for tokens that waited in the server across an update (a slow reader).

    Caught by ``test_streamed_version_tags_are_true``: "a version tag lies"."""

    async def chat_completion_stream(self, req: ChatCompletionRequest) -> AsyncIterator[ChatCompletionChunk]:
        chunks = await super().chat_completion_stream(req)

        async def written() -> AsyncIterator[ChatCompletionChunk]:
            async for chunk in chunks:  # pulled when the previous chunk has gone to the socket
                parts = [p.model_copy(update={"weight_versions": [self.version] * len(p.weight_versions)})
                         for p in chunk.choices]  # fmt: skip
                yield chunk.model_copy(update={"choices": parts})  # the bug

        return written()


class _GreedyEngine(ContinuousBatchingEngine):
    def _sample(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
        return int(torch.argmax(logits))  # the bug: temperature and top_p never reach the sampler


class GreedySampling(ReferenceInferenceBackend):
    """Decodes greedily whatever the request's temperature (an adapter that drops the sampling
    settings on an engine whose default is greedy): every group has zero variance.

    Caught by ``test_samples_follow_the_model_distribution``: "do not follow the model's
    distribution"."""

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self.engine = _rebuild_engine(self.engine, _GreedyEngine, version=0)


class _NoTopPEngine(ContinuousBatchingEngine):
    def _sample(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
        return super()._sample(logits, dataclasses.replace(params, top_p=1.0), generator)  # the bug


class IgnoresTopP(ReferenceInferenceBackend):
    """Samples at the requested temperature but from the whole vocabulary: ``top_p`` is ignored.

    Caught by ``test_samples_follow_the_model_distribution[top_p-0.7]``: "sampled tokens lie
    outside the top_p=0.7 nucleus"."""

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self.engine = _rebuild_engine(self.engine, _NoTopPEngine, version=0)


class _NoTemperatureEngine(ContinuousBatchingEngine):
    def _sample(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
        if params.temperature > 0:
            params = dataclasses.replace(params, temperature=1.0)  # the bug
        return super()._sample(logits, params, generator)


class IgnoresTemperature(ReferenceInferenceBackend):
    """Samples at temperature 1 whenever the request asks for any positive temperature (greedy at
    0 still works).

    Caught by ``test_samples_follow_the_model_distribution[temperature-2]`` (and ``[temperature-0.5]``): "do not
    follow the model's distribution"."""

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self.engine = _rebuild_engine(self.engine, _NoTemperatureEngine, version=0)


class _CutsBeforeTemperatureEngine(ContinuousBatchingEngine):
    def _sample(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
        if params.temperature == 0 or (params.top_p >= 1.0 and params.top_k <= 0 and params.min_p <= 0):
            return super()._sample(logits, params, generator)
        # the bug: top-p, top-k and min-p cut the untempered distribution; the temperature comes after
        kept = sampling_distribution(logits, 1.0, params.top_p, top_k=params.top_k, min_p=params.min_p) > 0
        plain = dataclasses.replace(params, top_p=1.0, top_k=0, min_p=0.0)
        return super()._sample(logits.masked_fill(~kept, float("-inf")), plain, generator)


class CutsBeforeTemperature(ReferenceInferenceBackend):
    """Applies top-p, top-k and min-p to softmax(logits) and the temperature afterwards (the wrong
    order; the two agree at temperature 1 only): at temperature 0.5 the untempered nucleus is
    wider than the tempered one.

    Caught by ``test_samples_follow_the_model_distribution[top_p-0.7-temperature-0.5]``: "sampled
    tokens lie outside the top_p=0.7 nucleus (temperature 0.5"."""

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self.engine = _rebuild_engine(self.engine, _CutsBeforeTemperatureEngine, version=0)


class _NoTopKEngine(ContinuousBatchingEngine):
    def _sample(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
        return super()._sample(logits, dataclasses.replace(params, top_k=0), generator)  # the bug


class IgnoresTopK(ReferenceInferenceBackend):
    """Takes ``top_k`` and samples from the whole vocabulary (an adapter that forgets to map it).

    Caught by ``test_samples_follow_the_model_distribution[top_k-5-temperature-2]``: "sampled
    tokens lie outside the top_k=5 set"."""

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self.engine = _rebuild_engine(self.engine, _NoTopKEngine, version=0)


class _NoMinPEngine(ContinuousBatchingEngine):
    def _sample(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
        return super()._sample(logits, dataclasses.replace(params, min_p=0.0), generator)  # the bug


class IgnoresMinP(ReferenceInferenceBackend):
    """Takes ``min_p`` and samples from the whole vocabulary.

    Caught by ``test_samples_follow_the_model_distribution[min_p-0.1-temperature-2]``: "sampled
    tokens lie outside the min_p=0.1 set"."""

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self.engine = _rebuild_engine(self.engine, _NoMinPEngine, version=0)


class _UnseededEngine(ContinuousBatchingEngine):
    def _sample(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
        return super()._sample(logits, params, None)  # the bug: the request's own generator is dropped


class IgnoresSeed(ReferenceInferenceBackend):
    """Accepts ``seed`` and declares ``seeds``, but samples every request from the engine's one
    generator, so a seeded request does not replay.

    Caught by ``test_a_seed_fixes_the_samples``: "seed 11 sent again gave other samples"."""

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self.engine = _rebuild_engine(self.engine, _UnseededEngine, version=0)


class NoSeeds(IgnoresSeed):
    """Not broken: the same engine, declaring no ``seeds`` (as SGLang on CPU): the streaming check
    compares greedy streams and the seed check is skipped for the capability."""

    capabilities = NO_SEEDS


class CopiedGroupSamples(ReferenceInferenceBackend):
    """Generates one sample per request and returns ``n`` copies of it (an adapter that fans a
    group out after generation): GRPO's group advantages are all zero.

    Caught by ``test_samples_of_one_request_are_independent``: "samples are copies"."""

    async def chat_completion(self, req: ChatCompletionRequest) -> ChatCompletionResponse:
        one = await super().chat_completion(req.model_copy(update={"n": 1}))
        choices = [one.choices[0].model_copy(update={"index": i}) for i in range(req.n)]
        tokens = one.usage.completion_tokens * req.n
        usage = one.usage.model_copy(
            update={"completion_tokens": tokens, "total_tokens": one.usage.prompt_tokens + tokens}
        )
        return one.model_copy(update={"choices": choices, "usage": usage})


class DropsEos(ReferenceInferenceBackend):
    """A completion that stopped on end-of-sequence is returned without that token (its id,
    logprob and version stripped, as the text strips special tokens): the trainer never learns
    to stop.

    Caught by ``test_completions_end_as_they_say``: "does not carry its end-of-sequence token"."""

    def _choice(self, index: int, r: GenerationResult, req: ChatCompletionRequest) -> ChatChoice:
        if r.finish_reason == "stop":
            r = dataclasses.replace(
                r,
                token_ids=r.token_ids[:-1],
                logprobs=r.logprobs[:-1],
                versions=r.versions[:-1],
                top_logprobs=r.top_logprobs[:-1],
            )
        return super()._choice(index, r, req)


class LengthForStop(ReferenceInferenceBackend):
    """Reports ``finish_reason: length`` for a completion that stopped on end-of-sequence (an
    adapter that maps every engine finish reason but "stop string" to "length").

    Caught by ``test_completions_end_as_they_say``: "finish_reason 'length' for a completion that
    ended on end-of-sequence"."""

    def _choice(self, index: int, r: GenerationResult, req: ChatCompletionRequest) -> ChatChoice:
        choice = super()._choice(index, r, req)
        return choice.model_copy(update={"finish_reason": "length"}) if r.finish_reason == "stop" else choice


class EarlyTags(ReferenceInferenceBackend):
    """Tags tokens with the new version as soon as an update is accepted, while the old weights
    still serve during the receive (a version label bumped on the update request, not when the
    new weights go live); restores the old label if the update fails.

    Caught by ``test_every_version_tag_is_true``: "a version tag lies"."""

    async def update_weights(
        self, req: WeightUpdateRequest, mode: ReceiveMode, on_accepted: Callable[[], None]
    ) -> UpdateReport:
        old = self.version
        async with self.engine.paused():
            self.engine.set_version(req.version)  # the bug
        try:
            return await super().update_weights(req, mode, on_accepted)
        except BaseException:
            async with self.engine.paused():
                self.engine.set_version(old)
            raise


#: How long ``LateTags`` leaves the new weights serving under the old label.
LATE_TAG_S = 0.3


class _DeferredVersionEngine(ContinuousBatchingEngine):
    pending: int | None = None

    def set_version(self, v: int) -> None:
        self.pending = v  # the bug: the label waits for a later call


class LateTags(ReferenceInferenceBackend):
    """Makes the new weights live, resumes generation, and moves the version label only a moment
    later (a label set by a separate call after resume, as with an engine's own
    ``update_weight_version`` route): tokens of the new weights carry the old version.

    Caught by ``test_every_version_tag_is_true``: "a version tag lies"."""

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self.engine = _rebuild_engine(self.engine, _DeferredVersionEngine, version=0)

    async def update_weights(
        self, req: WeightUpdateRequest, mode: ReceiveMode, on_accepted: Callable[[], None]
    ) -> UpdateReport:
        report = await super().update_weights(req, mode, on_accepted)
        engine = self.engine
        assert isinstance(engine, _DeferredVersionEngine) and engine.pending is not None
        await asyncio.sleep(LATE_TAG_S)
        async with engine.paused():
            ContinuousBatchingEngine.set_version(engine, engine.pending)
        return report


class _RetagLastStepEngine(ContinuousBatchingEngine):
    def set_version(self, v: int) -> None:
        if v != self.version:
            for request in self._running:  # the bug: the last step's tokens take the new label
                if request.versions:
                    request.versions[-1] = v
        super().set_version(v)


class InFlightTags(ReferenceInferenceBackend):
    """Tags the tokens of the last step before an update, computed by the old weights, with the
    new version: one token per running sequence per update (an overlap scheduler that appends a
    step's tokens only after launching the next step, and counts appended tokens when the version
    moves: SGLang 0.5.23's with its overlap schedule on).

    Caught by ``test_every_version_tag_is_true``: "a version tag lies"."""

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self.engine = _rebuild_engine(self.engine, _RetagLastStepEngine, version=0)


class _StaticBatchEngine(ContinuousBatchingEngine):
    def _wait_for_work(self) -> list[_Request] | None:
        admitted = super()._wait_for_work()
        if admitted and any(not r.cancelled for r in self._running):
            with self._cond:  # a batch is running: the new requests wait until it has ended
                self._waiting.extendleft(reversed(admitted))
            return []
        return admitted


class StaticBatching(ReferenceInferenceBackend):
    """Not broken: static batching (requests that arrive while a batch decodes wait until every
    sequence of it has ended, as with ``transformers.generate()`` engines), with the reference's
    correct in-flight updates. The in-flight checks must prove its updates in flight without
    assuming a continuous-batching scheduler (a barrier request would wait behind the batch)."""

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self.engine = _rebuild_engine(self.engine, _StaticBatchEngine, version=0)


class RefusesPastBatch(ReferenceInferenceBackend):
    """Refuses (503) a request whose sequences do not fit in the engine's batch beside the
    sequences it has already admitted, instead of queueing it (an admission counter with no
    queue behind it).

    Caught by ``test_more_sequences_than_the_batch_are_queued``: "were refused, not queued"."""

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self._admitted = 0

    async def chat_completion(self, req: ChatCompletionRequest) -> ChatCompletionResponse:
        from pipelinerl_sdk.http.server import HTTPError

        if self._admitted + req.n > self.engine._max_batch_size:
            raise HTTPError(503, f"server busy: {self._admitted} sequences admitted", kind="server_busy")
        self._admitted += req.n
        try:
            return await super().chat_completion(req)
        finally:
            self._admitted -= req.n


class _ControlGuardBug:
    """ASGI middleware that lets ``accepts(given)`` bearer values through to the control routes
    (rewritten to the control token) in front of the SDK's router: an adapter's own guard."""

    def __init__(self, app: Any, *, token: str, accepts: Callable[[str], bool]) -> None:
        self.app, self.token, self.accepts = app, token, accepts

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in CONTROL_PATHS:
            headers = []
            for k, v in scope["headers"]:
                if k == b"authorization" and v.startswith(b"Bearer ") and self.accepts(v[7:].decode()):
                    v = f"Bearer {self.token}".encode()
                headers.append((k, v))
            scope = {**scope, "headers": headers}
        await self.app(scope, receive, send)


CONTROL_PATHS = ("/init_process_group", "/request_weight_update", "/probe_broadcast")


def _serve_with_guard(backend: ReferenceInferenceBackend, config: ServeConfig, accepts: Callable[[str], bool]) -> None:
    """Serve ``backend`` like ``pipelinerl serve`` does (the kit's engine-owned-app path), with
    the broken guard in front of the SDK's router."""
    from fastapi import FastAPI

    from pipelinerl_sdk.kit.inference.serve import run

    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(_ControlGuardBug, token=config.control_token, accepts=accepts)
    run(app, backend, config)


class ApiKeyOpensControl(ReferenceInferenceBackend):
    """Its control routes accept the OpenAI API key as well as the control token (one guard for
    every route): any client of the OpenAI API can push weights.

    Caught by ``test_control_routes_need_the_control_token``: "opened without the exact control
    token ... with the OpenAI API key"."""

    def serve(self, config: ServeConfig) -> None:
        key = config.api_key
        _serve_with_guard(self, config, lambda given: key is not None and given == key)


class TokenPrefixOpensControl(ReferenceInferenceBackend):
    """Compares only the first 8 characters of the bearer token with the control token's.

    Caught by ``test_control_routes_need_the_control_token``: "opened without the exact control
    token ... with the token plus one character"."""

    def serve(self, config: ServeConfig) -> None:
        token = config.control_token
        _serve_with_guard(self, config, lambda given: len(given) >= 8 and given[:8] == token[:8])


class KeepsStopString(ReferenceInferenceBackend):
    """Stops on a stop string but keeps it in the text, as if ``include_stop_str_in_output`` were
    always set (an off-by-the-stop cut).

    Caught by ``test_stop_strings_cut_where_they_should``: "is not the greedy text before the stop
    string"."""

    def _choice(self, index: int, r: GenerationResult, req: ChatCompletionRequest) -> ChatChoice:
        return super()._choice(index, r, req.model_copy(update={"include_stop_str_in_output": True}))  # the bug


class StopWithinAToken(ReferenceInferenceBackend):
    """Stops on a stop string only when one token's own text holds it (an engine that scans each
    new token's text alone): a stop string spanning two tokens does not stop generation (the
    non-streamed text is still cut, by the kit's rule over the whole text).

    Caught by ``test_stop_strings_at_token_edges``: "spanning two tokens ...: finish_reason
    'length'"."""

    def _sampling(self, plan: ChatPlan, req: SamplingRequest, i: int) -> SamplingParams:
        params = super()._sampling(plan, req, i)
        if params.stop_check is None:
            return params
        stops, decode = req.stop_strings, self.tokenizer.decode
        return dataclasses.replace(params, stop_check=lambda ids: any(s in decode(ids[-1:]) for s in stops))  # the bug


class IncludesTheWholeToken(ReferenceInferenceBackend):
    """With ``include_stop_str_in_output``, ends the text with the whole token that completed the
    stop string, past the stop string when it ends inside that token (vLLM cuts right after it).

    Caught by ``test_stop_strings_at_token_edges``: "ending inside a token ...,
    include_stop_str_in_output=True: text"."""

    def _outcome(self, r: GenerationResult, req: SamplingRequest) -> dict[str, Any]:
        out = super()._outcome(r, req)
        if req.include_stop_str_in_output and isinstance(out.get("stop_reason"), str):
            out["text"] = self.tokenizer.decode(r.token_ids, skip_special_tokens=req.skip_special_tokens)  # the bug
        return out


class IgnoreEosIgnoresStopTokens(ReferenceInferenceBackend):
    """With ``ignore_eos``, ignores ``stop_token_ids`` too (an engine that keeps them in its EOS
    set): vLLM's ``ignore_eos`` ignores end-of-sequence only.

    Caught by ``test_stop_token_ids_end_as_vllm``: "ignore_eos=True, include=False: tokens"."""

    def _sampling(self, plan: ChatPlan, req: SamplingRequest, i: int) -> SamplingParams:
        params = super()._sampling(plan, req, i)
        return dataclasses.replace(params, stop_token_ids=()) if req.ignore_eos else params  # the bug


class IgnoresMinTokens(ReferenceInferenceBackend):
    """Declares ``min_tokens`` and drops it before the engine (an adapter that forgets to map it).

    Caught by ``test_min_tokens_holds_the_end_off``: "ignore_eos=True: stop or end-of-sequence ids"."""

    async def chat_completion(self, req: ChatCompletionRequest) -> ChatCompletionResponse:
        return await super().chat_completion(req.model_copy(update={"min_tokens": 0}))  # the bug


class MinTokensCountsEarlyStops(ReferenceInferenceBackend):
    """Masks the stop ids for ``min_tokens`` tokens, but a stop string inside those tokens' text
    still counts once they are out (SGLang's ``min_new_tokens``: its stop-string check knows no
    floor; vLLM counts only a stop string that ends past their text).

    Caught by ``test_min_tokens_holds_the_end_off``: "a stop string counts only where it ends past"."""

    def _sampling(self, plan: ChatPlan, req: SamplingRequest, i: int) -> SamplingParams:
        params = super()._sampling(plan, req, i)
        if params.stop_check is None:
            return params
        blind = StopRule(self.tokenizer, req.model_copy(update={"min_tokens": 0}))  # the bug
        return dataclasses.replace(params, stop_check=blind.hit)

    def _outcome(self, r: GenerationResult, req: SamplingRequest) -> dict[str, Any]:
        return super()._outcome(r, req.model_copy(update={"min_tokens": 0}))  # the bug, in the text too


class TokenizeWithoutTemplate(ReferenceInferenceBackend):
    """``/tokenize`` of a chat tokenizes its messages' text, not the chat template's rendering (a
    front that forgets the template: the ids a client counts are not those generated from).

    Caught by ``test_tokenize_gives_the_ids_generation_uses``: "/tokenize of the chat gave"."""

    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        if isinstance(req, TokenizeChatRequest):  # the bug
            text = "".join(str(m.content) for m in req.messages)
            strs = req.return_token_strs
            req = TokenizeCompletionRequest(prompt=text, add_special_tokens=False, return_token_strs=strs)
        return await super().tokenize(req)


class DetokenizeSkipsSpecial(ReferenceInferenceBackend):
    """``/detokenize`` drops special tokens (``skip_special_tokens=True``, the generation default,
    where vLLM's decode keeps them).

    Caught by ``test_tokenize_gives_the_ids_generation_uses``: "/detokenize of"."""

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens, skip_special_tokens=True))  # the bug


class IgnoresLogitBias(ReferenceInferenceBackend):
    """Accepts ``logit_bias`` and drops it before the engine (an adapter that forgets to map it).

    Caught by ``test_logit_bias_forces_a_token``: "logit_bias +100 on token"."""

    async def chat_completion(self, req: ChatCompletionRequest) -> ChatCompletionResponse:
        return await super().chat_completion(req.model_copy(update={"logit_bias": None}))  # the bug


class IgnoresPenalties(ReferenceInferenceBackend):
    """Accepts the presence, frequency and repetition penalties and drops them.

    Caught by ``test_penalties_follow_vllms_rules``: "greedy tokens differ from vLLM's rules"."""

    async def chat_completion(self, req: ChatCompletionRequest) -> ChatCompletionResponse:
        dropped = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
        return await super().chat_completion(req.model_copy(update=dropped))  # the bug


def _penalised(logits: torch.Tensor, seen: list[int], counted: list[int], params: SamplingParams) -> torch.Tensor:
    """``logits`` with the repetition penalty over ``seen``, then the frequency and presence
    penalties over ``counted``."""
    out = logits.clone()
    if params.repetition_penalty != 1.0 and seen:
        idx = torch.tensor(sorted(set(seen)))
        x = out[idx]
        out[idx] = torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty)
    if counted:
        counts = torch.bincount(torch.tensor(counted), minlength=out.shape[0]).to(out.dtype)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(out.dtype)
    return out


class _RepetitionOverOutputEngine(ContinuousBatchingEngine):
    def _process(self, request: _Request, logits: torch.Tensor) -> torch.Tensor:
        # the bug (SGLang 0.5's rule): the repetition penalty counts the output's tokens only
        return _penalised(logits, request.token_ids, request.token_ids, request.params)


class RepetitionOverOutputOnly(ReferenceInferenceBackend):
    """Applies the repetition penalty to the tokens of the output only, not the prompt's (vLLM
    counts both; SGLang 0.5 counts the output's).

    Caught by ``test_penalties_follow_vllms_rules``: "repetition_penalty=1.6: greedy tokens differ
    from vLLM's rules"."""

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self.engine = _rebuild_engine(self.engine, _RepetitionOverOutputEngine, version=0)


class _PenaltiesOverPromptEngine(ContinuousBatchingEngine):
    def _process(self, request: _Request, logits: torch.Tensor) -> torch.Tensor:
        seen = [*request.prompt, *request.token_ids]
        return _penalised(logits, seen, seen, request.params)  # the bug: the prompt's tokens are counted


class PenaltiesOverPrompt(ReferenceInferenceBackend):
    """Counts the prompt's tokens in the frequency and presence penalties too (vLLM, like OpenAI,
    counts the output's only).

    Caught by ``test_penalties_follow_vllms_rules``: "presence_penalty=1.5: greedy tokens differ
    from vLLM's rules"."""

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self.engine = _rebuild_engine(self.engine, _PenaltiesOverPromptEngine, version=0)


class RetokenizesPrompts(ReferenceInferenceBackend):
    """Decodes a ``/v1/completions`` prompt of token ids to text and tokenizes that (an adapter
    that hands its engine text only): the ids the engine sees are not the ones sent.

    Caught by ``test_completion_token_ids_are_used_as_given``: "prompt_token_ids ... are not the
    ids sent"."""

    async def completion(self, req: CompletionRequest) -> CompletionResponse:
        prompts = [self.tokenizer.decode(p) if isinstance(p, list) else p for p in req.prompts()]  # the bug
        return await super().completion(req.model_copy(update={"prompt": prompts if len(prompts) > 1 else prompts[0]}))


class AddsBos(ReferenceInferenceBackend):
    """Puts a BOS token before a ``/v1/completions`` prompt of token ids (vLLM uses such a prompt
    as given).

    Caught by ``test_completion_token_ids_are_used_as_given``: "prompt_token_ids ... are not the
    ids sent"."""

    async def completion(self, req: CompletionRequest) -> CompletionResponse:
        bos = self.tokenizer.bos_token_id
        bos = self.tokenizer.eos_token_id if bos is None else bos
        prompts = [[bos, *p] if isinstance(p, list) else p for p in req.prompts()]  # the bug
        return await super().completion(req.model_copy(update={"prompt": prompts if len(prompts) > 1 else prompts[0]}))


class IgnoresStructuredOutput(ReferenceInferenceBackend):
    """Takes ``response_format``, ``structured_outputs`` and a forced ``tool_choice``, and samples
    free text (an adapter that forgets to map them onto its engine's grammar).

    Caught by ``test_structured_output_follows_its_constraint``: "0 of 6 sampled choices follow
    the constraint"."""

    def _sampling(self, plan: ChatPlan, req: Any, i: int) -> SamplingParams:
        return dataclasses.replace(super()._sampling(plan, req, i), constraint=None)  # the bug


class ToolCallsAsText(ReferenceInferenceBackend):
    """Constrains a forced tool call's text, then answers it as content with no ``tool_calls``
    (an adapter that maps the grammar but not the answer).

    Caught by ``test_forced_tool_choice_gives_tool_calls``: "0 of 6 choices are one valid call"."""

    def _choice(self, index: int, r: GenerationResult, req: ChatCompletionRequest) -> ChatChoice:
        return super()._choice(index, r, req.model_copy(update={"tool_choice": None}))  # the bug


# --- not caught by any standard check (gaps of the suite) ----------------------------------------


class _TemperatureEngine(ContinuousBatchingEngine):
    """Records logprobs of the temperature-scaled distribution (vLLM's "processed" logprobs)."""

    def _record(self, request: object, logits: torch.Tensor, logp: torch.Tensor, version: int) -> None:
        params: SamplingParams = request.params  # type: ignore[attr-defined]
        if params.temperature > 0:
            logp = torch.log_softmax(logits / params.temperature, dim=-1)
        super()._record(request, logits, logp, version)  # type: ignore[arg-type]


class TemperatureLogprobs(ReferenceInferenceBackend):
    """Samples like the reference, but reports the logprobs of the *temperature-scaled*
    distribution instead of the raw model's (the contract: "the raw model log-probability ...
    before temperature"). An RL trainer would then compute wrong importance ratios.

    Should be caught by a logprob check, but every logprob the suite compares comes from a greedy
    (``temperature=0``) request, and the only sampled requests use the default ``temperature=1``,
    where scaling is the identity: no standard check catches it."""

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self.engine = _rebuild_engine(self.engine, _TemperatureEngine, version=0)


class NotAtomicOnAbort(ReferenceInferenceBackend):
    """When the trainer calls an accepted update off (its ``abort`` decision: another server of
    the fleet refused), it still advances its version: the old weights are then served and tagged
    as the new version.

    Should be caught by a check of the trainer's abort, but the suite runs one server, whose own
    refusals happen in ``validate_update`` before ``update_weights`` starts: no standard check
    ever makes ``update_weights`` see an ``abort`` decision."""

    async def update_weights(
        self, req: WeightUpdateRequest, mode: ReceiveMode, on_accepted: Callable[[], None]
    ) -> UpdateReport:
        try:
            return await super().update_weights(req, mode, on_accepted)
        except UpdateAborted:
            async with self.engine.paused():
                self.engine.set_version(req.version)  # the bug
            raise


#: How long ``broken-holds-after-refusal`` holds generation after a refused or called-off update.
HOLD_S = 3.0


class HoldsAfterRefusal(ReferenceInferenceBackend):
    """Refuses a bad update and honours a called-off one, but leaves generation paused for
    ``HOLD_S`` afterwards (a pause taken before validation, lifted only by a watchdog).

    Caught by ``test_a_refused_or_called_off_update_holds_no_generation``: "generation held
    after a refused update"."""

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self._holds: set[asyncio.Task[None]] = set()

    def _hold(self) -> None:
        async def hold() -> None:
            async with self.engine.paused():
                await asyncio.sleep(HOLD_S)

        task = asyncio.get_running_loop().create_task(hold())  # the bug
        self._holds.add(task)
        task.add_done_callback(self._holds.discard)

    def validate_update(self, req: WeightUpdateRequest) -> None:
        try:
            super().validate_update(req)
        except UpdateRejected:
            self._hold()
            raise

    async def update_weights(
        self, req: WeightUpdateRequest, mode: ReceiveMode, on_accepted: Callable[[], None]
    ) -> UpdateReport:
        try:
            return await super().update_weights(req, mode, on_accepted)
        except UpdateAborted:
            self._hold()
            raise


class DropsAChunk(ReferenceInferenceBackend):
    """Streams every sample but loses its second step (a relay that drops an event under load):
    the non-streamed answer is right, the streamed one misses a token and its text.

    Caught by ``test_streamed_deltas_add_up_to_the_non_streamed_text``: "streamed deltas add up
    to"."""

    def sample_steps(self, plan: ChatPlan, req: SamplingRequest, i: int) -> AsyncIterator[TokenStep]:
        async def dropping() -> AsyncIterator[TokenStep]:
            k = 0
            async for step in super(DropsAChunk, self).sample_steps(plan, req, i):
                k += 1
                if k != 2 or step.finish_reason is not None:  # the bug
                    yield step

        return dropping()


class StreamsStopStrings(ReferenceInferenceBackend):
    """Stops on stop strings, but streams text as if there were none (no hold back, no cut):
    the stop string's text goes out before the stream ends.

    Caught by ``test_streamed_deltas_add_up_to_the_non_streamed_text``: "with stop="."""

    async def chat_completion_stream(self, req: ChatCompletionRequest) -> AsyncIterator[ChatCompletionChunk]:
        plan = await plan_chat(self.tokenizer, req, self.engine.max_model_len)
        samples = [self.sample_steps(plan, req, i) for i in range(req.n)]
        blind = req.model_copy(update={"stop": None})  # the bug: the text rule never sees the stop strings
        return chat_chunks(self.tokenizer, self.model_name, blind, plan, samples, self.ending_ids(req))


class StreamsToolCallsAsText(ReferenceInferenceBackend):
    """Answers a forced tool call right when not streamed, but streams its text as content with
    no tool-call parts (a relay that passes the engine's text through).

    Caught by ``test_streamed_tool_calls_add_up_to_the_non_streamed_calls``: "streamed calls []"."""

    async def chat_completion_stream(self, req: ChatCompletionRequest) -> AsyncIterator[ChatCompletionChunk]:
        plan = await self.prepare(await plan_chat(self.tokenizer, req, self.engine.max_model_len, structured=True))
        samples = [self.sample_steps(plan, req, i) for i in range(req.n)]
        blind = req.model_copy(update={"tool_choice": "none"})  # the bug: the stream never sees the tool choice
        return chat_chunks(self.tokenizer, self.model_name, blind, plan, samples, self.ending_ids(req))


# --- vLLM's RL API in front of a correct engine: the front alone is wrong ---------------------
#
# These serve the reference engine, right through the SDK's routes, with a front
# (:class:`~pipelinerl_sdk.http.vllm_rl.VLLMRLFront`) wrong in one way: only the checks run
# through the ``vllm_rl`` door can see it (their ``sdk`` runs pass).


def _serve_with_front(backend: ReferenceInferenceBackend, config: ServeConfig, front: type[VLLMRLFront]) -> None:
    """Serve ``backend`` like ``pipelinerl serve`` does, vLLM's RL API served by ``front``."""
    from fastapi import FastAPI

    from pipelinerl_sdk.kit.inference.serve import run

    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    run(app, backend, config, vllm_rl_front=front)


class _SkipsUnknownNamesFront(VLLMRLFront):
    def _request(self, info: dict[str, Any]) -> WeightUpdateRequest:
        known = {p.name for p in self.backend.param_specs()}
        params = info.get("params")
        if isinstance(params, list):  # the bug: what the engine does not serve is left out
            info = {k: v for k, v in info.items() if k != "plan_digest"}
            info["params"] = [p for p in params if not isinstance(p, list) or p[0] in known]
        return super()._request(info)


class VLLMFrontSkipsUnknownNames(ReferenceInferenceBackend):
    """Its vLLM front leaves out of an update the params the engine does not serve (and plans
    the buckets without them), so an update naming a param nobody serves is accepted.

    Caught by ``test_bad_updates_are_refused_before_any_receive[vllm_rl]``: "unknown-extra-name:
    got 200"."""

    def serve(self, config: ServeConfig) -> None:
        _serve_with_front(self, config, _SkipsUnknownNamesFront)


class _DrainsFront(VLLMRLFront):
    async def update(self, body: Any) -> dict[str, Any]:
        info = body.get("update_info") if isinstance(body, dict) else None
        if isinstance(info, dict) and info.get("op") == "receive":
            engine = self.backend.engine  # type: ignore[attr-defined]
            while engine.stats().running or engine.stats().waiting:  # the bug: vLLM's pause mode "wait"
                await asyncio.sleep(0.01)
        return await super().update(body)


class VLLMFrontDrains(ReferenceInferenceBackend):
    """Its vLLM front arms an update only once no request runs (as vLLM's ``/pause?mode=wait``
    would), so no request in flight ever crosses an update made through vLLM's routes.

    Caught by ``test_requests_in_flight_survive_updates[vllm_rl]``: "no request carried tokens
    of two versions"."""

    def serve(self, config: ServeConfig) -> None:
        _serve_with_front(self, config, _DrainsFront)


class _AlwaysUpdatedFront(VLLMRLFront):
    async def update(self, body: Any) -> dict[str, Any]:
        info = body.get("update_info") if isinstance(body, dict) else None
        session = self.session
        if isinstance(info, dict) and info.get("op") == "await" and session is not None and session.run is not None:
            with contextlib.suppress(PipelineRLError):  # the bug: how the update ended is not looked at
                await asyncio.shield(session.run.task)
            return {"message": "Weights updated"}
        return await super().update(body)

    async def finish(self, body: Any) -> dict[str, Any]:
        try:
            return await super().finish(body)
        except (UpdateFailed, GroupError):
            return {"message": "Weight update finished"}  # the bug, again


class VLLMFrontAlwaysUpdated(ReferenceInferenceBackend):
    """Its vLLM front answers "Weights updated" once an update ended, however it ended: a
    called-off or failed update looks done to a trainer using vLLM's routes (the engine itself
    kept its old weights, rightly).

    Caught by ``test_called_off_update_changes_nothing[vllm_rl]``: "a called-off update was
    answered as a success"."""

    def serve(self, config: ServeConfig) -> None:
        _serve_with_front(self, config, _AlwaysUpdatedFront)


class _DefaultModeFront(VLLMRLFront):
    def _request(self, info: dict[str, Any]) -> WeightUpdateRequest:
        return super()._request({k: v for k, v in info.items() if k != "mode"})  # the bug


class VLLMFrontIgnoresMode(ReferenceInferenceBackend):
    """Its vLLM front drops ``update_info.mode``: every update through vLLM's routes runs in
    the server's default receive mode, whatever the trainer asked for.

    Caught by ``test_update_serves_exactly_the_new_weights[..-vllm_rl]`` (the mode other than
    the default): "the update ran in mode"."""

    def serve(self, config: ServeConfig) -> None:
        _serve_with_front(self, config, _DefaultModeFront)


class _MomentHold(GenerationHold):
    def __init__(self, paused: EnginePause) -> None:
        super().__init__(paused)
        self._claimed = False

    @property
    def held(self) -> bool:
        return self._claimed

    def around(self, paused: EnginePause) -> EnginePause:
        return paused

    async def hold(self) -> None:
        async with self._engine_paused():  # the bug: a moment's pause, not a hold
            pass
        self._claimed = True

    async def release(self) -> None:
        self._claimed = False


class PauseDoesNotHold(ReferenceInferenceBackend):
    """Its ``/pause?mode=keep`` parks the engine for a moment (as an update's own pause does)
    and answers "paused"; ``/is_paused`` says true until ``/resume``, but generation runs on.

    Caught by ``test_a_keep_pause_holds_generation_and_an_update_inside_it``: "tokens arrived
    while the server said it was paused"."""

    def generation_hold(self) -> GenerationHold:
        if self._client_hold is None:
            self._client_hold = _MomentHold(self.engine.paused)
        return self._client_hold


#: Backend name -> (class name, capabilities); the standard checks catch each of these.
CAUGHT_BACKENDS: dict[str, tuple[str, InferenceCapabilities]] = {
    "broken-ignores-updates": ("IgnoresUpdates", INFERENCE),
    "broken-wrong-logprobs": ("WrongLogprobs", INFERENCE),
    "broken-aborts-in-flight": ("AbortsInFlight", INFERENCE),
    "broken-half-applies": ("HalfApplies", DIRECT_ONLY),
    "broken-accepts-unknown-names": ("AcceptsUnknownNames", INFERENCE),
    "broken-stale-versions": ("StaleVersions", INFERENCE),
    "broken-stale-stream-versions": ("StaleStreamVersions", INFERENCE),
    "broken-write-time-stream-versions": ("WriteTimeStreamVersions", INFERENCE),
    "broken-temperature-logprobs": ("TemperatureLogprobs", INFERENCE),
    "broken-not-atomic-on-abort": ("NotAtomicOnAbort", INFERENCE),
    "broken-holds-after-refusal": ("HoldsAfterRefusal", INFERENCE),
    "broken-greedy-sampling": ("GreedySampling", INFERENCE),
    "broken-ignores-top-p": ("IgnoresTopP", INFERENCE),
    "broken-ignores-temperature": ("IgnoresTemperature", INFERENCE),
    "broken-copied-group-samples": ("CopiedGroupSamples", INFERENCE),
    "broken-cuts-before-temperature": ("CutsBeforeTemperature", INFERENCE),
    "broken-ignores-top-k": ("IgnoresTopK", INFERENCE),
    "broken-ignores-min-p": ("IgnoresMinP", INFERENCE),
    "broken-ignores-seed": ("IgnoresSeed", INFERENCE),
    "broken-drops-eos": ("DropsEos", INFERENCE),
    "broken-length-for-stop": ("LengthForStop", INFERENCE),
    "broken-early-tags": ("EarlyTags", INFERENCE),
    "broken-late-tags": ("LateTags", INFERENCE),
    "broken-in-flight-tags": ("InFlightTags", INFERENCE),
    "broken-refuses-past-batch": ("RefusesPastBatch", INFERENCE),
    "broken-api-key-opens-control": ("ApiKeyOpensControl", INFERENCE),
    "broken-token-prefix-opens-control": ("TokenPrefixOpensControl", INFERENCE),
    "broken-keeps-stop-string": ("KeepsStopString", INFERENCE),
    "broken-stop-within-a-token": ("StopWithinAToken", INFERENCE),
    "broken-ignore-eos-ignores-stop-tokens": ("IgnoreEosIgnoresStopTokens", INFERENCE),
    "broken-includes-the-whole-token": ("IncludesTheWholeToken", INFERENCE),
    "broken-ignores-min-tokens": ("IgnoresMinTokens", INFERENCE),
    "broken-min-tokens-counts-early-stops": ("MinTokensCountsEarlyStops", INFERENCE),
    "broken-tokenize-without-template": ("TokenizeWithoutTemplate", INFERENCE),
    "broken-detokenize-skips-special": ("DetokenizeSkipsSpecial", INFERENCE),
    "broken-ignores-logit-bias": ("IgnoresLogitBias", INFERENCE),
    "broken-ignores-penalties": ("IgnoresPenalties", INFERENCE),
    "broken-repetition-over-output-only": ("RepetitionOverOutputOnly", INFERENCE),
    "broken-penalties-over-prompt": ("PenaltiesOverPrompt", INFERENCE),
    "broken-drops-a-chunk": ("DropsAChunk", INFERENCE),
    "broken-streams-stop-strings": ("StreamsStopStrings", INFERENCE),
    "broken-ignores-structured-output": ("IgnoresStructuredOutput", INFERENCE),
    "broken-retokenizes-prompts": ("RetokenizesPrompts", INFERENCE),
    "broken-adds-bos": ("AddsBos", INFERENCE),
    "broken-tool-calls-as-text": ("ToolCallsAsText", INFERENCE),
    "broken-streams-tool-calls-as-text": ("StreamsToolCallsAsText", INFERENCE),
    "broken-vllm-front-skips-unknown-names": ("VLLMFrontSkipsUnknownNames", INFERENCE),
    "broken-vllm-front-drains": ("VLLMFrontDrains", INFERENCE),
    "broken-vllm-front-always-updated": ("VLLMFrontAlwaysUpdated", INFERENCE),
    "broken-vllm-front-ignores-mode": ("VLLMFrontIgnoresMode", INFERENCE),
    "broken-pause-does-not-hold": ("PauseDoesNotHold", INFERENCE),
}

#: Correct backends built otherwise than the reference: every standard check must pass on them.
CORRECT_BACKENDS: dict[str, tuple[str, InferenceCapabilities]] = {
    "correct-static-batching": ("StaticBatching", INFERENCE),
    "correct-no-seeds": ("NoSeeds", NO_SEEDS),
}

#: Broken backends no standard check catches yet.
GAP_BACKENDS: dict[str, tuple[str, InferenceCapabilities]] = {}


@hookimpl
def register_backends(registry: BackendRegistry) -> None:
    for name, (cls, caps) in {**CAUGHT_BACKENDS, **GAP_BACKENDS, **CORRECT_BACKENDS}.items():
        summary = re.split(r"\.\s", " ".join((globals()[cls].__doc__ or "").split()))[0]
        registry.register_inference_backend(name, f"{__name__}:{cls}", caps, summary)
