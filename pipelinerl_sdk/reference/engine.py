"""Continuous-batching inference over a transformers causal LM, with in-flight weight updates.

One dedicated thread runs the engine loop. Each iteration admits waiting requests (prefilled one
at a time, batch 1, no padding), merges them into the running batch, then decodes every running
sequence with a single forward. The batch keeps one left-padded ``DynamicCache`` (padding slots
hold zero K/V and are masked out by a 2D attention mask; positions are passed explicitly),
rebuilt only when the batch composition changes.

In-flight weight updates: ``async with engine.paused()`` parks the loop between two iterations (no
forward running; the SDK's :class:`~pipelinerl_sdk.kit.inference.gate.StepGate`). The caller may
then change the weights in place and ``set_version``; on exit the
loop resumes. Running requests keep their KV cache (computed by the old weights) and continue with
the new weights; every generated token records the weight version of the forward that produced it.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, suppress
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from pipelinerl_sdk.contracts import LOGPROBS_MODES
from pipelinerl_sdk.errors import InvalidRequest
from pipelinerl_sdk.kit.inference.chat import FinishReason
from pipelinerl_sdk.kit.inference.gate import PauseHandle, StepGate
from pipelinerl_sdk.kit.inference.stream import TokenStep
from pipelinerl_sdk.kit.inference.structured import GrammarConstraint
from pipelinerl_sdk.reference.sampling import LOGPROB_FLOOR, process_logits, processed_logits, sample

__all__ = [
    "ContinuousBatchingEngine",
    "EngineStats",
    "GenerationResult",
    "PauseHandle",
    "SamplingParams",
]

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings.

    ``temperature == 0`` is greedy; ``seed`` gives the request its own ``torch.Generator``.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    #: Generate exactly ``max_tokens`` (or up to ``max_model_len``): EOS ids do not stop;
    #: ``stop_token_ids`` still do.
    ignore_eos: bool = False
    #: The first ``min_tokens`` tokens are never a stop token or an EOS id (those ids are masked,
    #: ``ignore_eos`` or not, as vLLM masks its ``all_stop_token_ids``); ``stop_check`` is not
    #: asked before more than ``min_tokens`` tokens (it applies the same floor to stop strings).
    min_tokens: int = 0
    #: Alternatives reported with each prompt logprob (with ``prompt_logprobs``).
    prompt_top: int = 0
    #: ``<= 0``: off.
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    #: ``(token id, bias)`` pairs added to the logits before sampling.
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: Called on the output ids after every token; True stops the request (``"stop"``): the
    #: stop strings (:class:`~pipelinerl_sdk.kit.inference.chat.StopRule`).
    stop_check: Callable[[Sequence[int]], bool] | None = None
    #: Makes the sample's grammar constraint (structured output,
    #: :class:`~pipelinerl_sdk.kit.inference.structured.GrammarConstraint`): tokens it forbids are
    #: never drawn, and their logprobs are those of the masked distribution (as vLLM's); the
    #: request stops (``"stop"``) once its text is complete.
    constraint: Callable[[], GrammarConstraint] | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` (an InvalidRequest naming the field) on out-of-range settings,
        token ids outside ``vocab_size`` included."""
        if vocab_size is not None:
            for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", [t for t, _ in self.logit_bias])):
                bad = [t for t in ids if not 0 <= t < vocab_size]
                if bad:
                    raise InvalidRequest(
                        f"{name}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})", field=name
                    )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}", field="min_p")
        if self.repetition_penalty <= 0:
            raise InvalidRequest(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}", field="repetition_penalty"
            )
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}", field="min_tokens"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """Outcome of one request.

    ``logprobs[i]`` is the raw model log-probability (log_softmax of the logits, before
    temperature and top-p) of ``token_ids[i]``, or what the engine's ``logprobs_mode`` reports
    instead; ``versions[i]`` the weight version of the forward
    that produced it; ``top_logprobs[i]`` the best ``top_logprobs`` alternatives as
    ``(token_id, logprob)``, best first (empty lists when not requested). ``prompt_logprobs``
    (when requested) has one entry per prompt token, the first being ``None``. ``finish_reason``:
    ``"stop"`` (eos/stop token, included in ``token_ids``, or ``stop_check``), ``"length"`` (``max_tokens`` or
    ``max_model_len`` reached) or ``"abort"`` (engine stopped).
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    top_logprobs: list[list[tuple[int, float]]]
    prompt_logprobs: list[float | None] | None
    finish_reason: str
    #: With ``prompt_logprobs``: each prompt token's rank (1: the most likely; first None) and
    #: its ``prompt_top`` best alternatives ``(token id, logprob)``.
    prompt_ranks: list[int | None] | None = None
    prompt_tops: list[list[tuple[int, float]]] | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters: tokens generated and loop iterations since start; current running/waiting requests;
    ``paused`` is true while a ``paused()`` block holds the engine."""

    generated_tokens: int
    steps: int
    running: int
    waiting: int
    paused: bool


@dataclass(eq=False, slots=True)
class _Request:
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[GenerationResult]
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    #: Masked while fewer than ``params.min_tokens`` tokens are out: every stop and EOS id.
    held_ids: torch.Tensor | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_ranks: list[int | None] | None = None
    prompt_tops: list[list[tuple[int, float]]] | None = None
    bias: tuple[torch.Tensor, torch.Tensor] | None = None
    constraint: GrammarConstraint | None = None
    cancelled: bool = False
    finish_reason: str | None = None
    #: Streamed requests: set (on the event loop) after every token and when the request ends.
    progress: asyncio.Event | None = None

    @property
    def cached_len(self) -> int:
        """Tokens whose K/V are in the cache: all but the last sampled one."""
        return len(self.prompt) + len(self.token_ids) - 1


def _resolve(future: asyncio.Future[GenerationResult], outcome: GenerationResult | BaseException) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class ContinuousBatchingEngine:
    """Continuous-batching generation over ``model``.

    ``model`` is a full-attention decoder-only causal LM (Qwen2, Llama, ...) whose forward takes
    ``position_ids``, a 2D ``attention_mask`` and a ``DynamicCache``; logprobs are computed in
    fp32 whatever its dtype. The coroutines must run on an event loop; the model is only touched
    by the loop thread, except by callers inside ``paused()``.

    Up to ``max_batch_size`` requests run together; further ones wait FIFO. A request needs
    ``1 <= len(prompt) < max_model_len``; it stops with ``"length"`` when prompt plus output
    reach ``max_model_len``. ``eos_token_ids`` end every request (``"stop"``). ``logprobs_mode``
    (:data:`~pipelinerl_sdk.contracts.LOGPROBS_MODES`) says what every completion token's reported
    logprob and top alternatives are; prompt logprobs are always the raw model's.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: Sequence[int],
        max_batch_size: int = 32,
        max_model_len: int = 2048,
        version: int = 0,
        logprobs_mode: str = "raw_logprobs",
    ) -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self._logprobs_mode = logprobs_mode
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self._model = model
        self._eos_ids = frozenset(int(t) for t in eos_token_ids)
        self._max_batch_size = max_batch_size
        self._max_model_len = max_model_len
        self._vocab_size = int(model.config.get_text_config().vocab_size)
        self._device = next(model.parameters()).device
        self._generator = torch.Generator(device=self._device)
        self._generator.manual_seed(secrets.randbits(63))
        # Shared with the event loop; guarded by ``_cond``.
        self._cond = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._stopping = False
        self._generated_tokens = 0
        self._steps = 0
        self._n_running = 0
        self._thread: threading.Thread | None = None
        self.gate = StepGate(self._cond, lambda: self._thread is not None and self._thread.is_alive(), version=version)
        self._dead: BaseException | None = None
        # Owned by the loop thread.
        self._running: list[_Request] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # [rows, cache_len], 1 = real token, 0 = left padding

    # ---------------------------------------------------------------------------------- public

    @property
    def model(self) -> PreTrainedModel:
        """The served model; mutate its weights only inside ``paused()``."""
        return self._model

    @property
    def version(self) -> int:
        """Weight version recorded on tokens produced from now on."""
        return self.gate.version

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that end every request not ``ignore_eos``."""
        return self._eos_ids

    @property
    def max_model_len(self) -> int:
        """Prompt plus generated tokens never exceed this."""
        return self._max_model_len

    def set_version(self, v: int) -> None:
        """Set the weight version; only inside ``paused()`` (else ``RuntimeError``)."""
        self.gate.set_version(v)

    def stats(self) -> EngineStats:
        """A consistent snapshot of the counters."""
        with self._cond:
            return EngineStats(
                generated_tokens=self._generated_tokens,
                steps=self._steps,
                running=self._n_running,
                waiting=len(self._waiting),
                paused=self.gate.held_now,
            )

    async def start(self) -> None:
        """Start the loop thread. Must run inside an event loop; an engine starts at most once."""
        asyncio.get_running_loop()
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._thread = threading.Thread(target=self._run, name="continuous-batching-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort waiting and running requests (``"abort"``, partial output); join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        """Generate a completion of ``prompt_token_ids``; ``ValueError`` on an invalid request.

        Cancelling the awaiting task drops the request from the engine.
        """
        request = self._submit(prompt_token_ids, params)
        try:
            return await request.future
        except asyncio.CancelledError:
            self._cancel(request)
            raise

    def stream(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[TokenStep]:
        """:meth:`generate` token by token: the tokens produced since the last step (several
        when the consumer is slower than the engine), the last step with the finish reason
        (``"stop"``, ``"length"`` or ``"abort"``). ``ValueError`` on an invalid request here,
        at the call; the request is queued when the iterator is first read. Closing the
        iterator (or cancelling its consumer) drops the request from the engine."""
        self._check(prompt_token_ids, params)
        return self._follow(prompt_token_ids, params)

    async def _follow(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[TokenStep]:
        request = self._submit(prompt_token_ids, params, streamed=True)
        progress = request.progress
        assert progress is not None
        request.future.add_done_callback(lambda _: progress.set())
        sent = 0
        try:
            while not request.future.done():
                await progress.wait()
                progress.clear()
                n = len(request.top_logprobs)  # appended last of the four by _record
                if n > sent and not request.future.done():
                    yield self._step_of(request, sent, n, None)
                    sent = n
            result = request.future.result()
            finish = result.finish_reason if result.finish_reason in ("stop", "length", "abort") else "abort"
            yield self._step_of(request, sent, len(result.token_ids), finish)  # type: ignore[arg-type]
        finally:
            if not request.future.done():
                self._cancel(request)

    @staticmethod
    def _step_of(request: _Request, start: int, end: int, finish: FinishReason | None) -> TokenStep:
        return TokenStep(
            request.token_ids[start:end],
            request.logprobs[start:end],
            request.versions[start:end],
            request.top_logprobs[start:end] if request.params.top_logprobs else (),
            finish,
        )

    def _check(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as ints; ``ValueError`` (InvalidRequest naming the field) on an invalid request."""
        prompt = [int(t) for t in prompt_token_ids]
        params.validate(self._vocab_size)
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        if len(prompt) >= self._max_model_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens leaves no room to generate under max_model_len={self._max_model_len}"
            )
        if min(prompt) < 0 or max(prompt) >= self._vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self._vocab_size})")
        return prompt

    def _cancel(self, request: _Request) -> None:
        with self._cond:
            request.cancelled = True
            self._cond.notify_all()

    def _submit(self, prompt_token_ids: Sequence[int], params: SamplingParams, *, streamed: bool = False) -> _Request:
        """Check and queue a request (``ValueError`` on an invalid one)."""
        prompt = self._check(prompt_token_ids, params)
        loop = asyncio.get_running_loop()
        generator: torch.Generator | None = None
        if params.seed is not None:
            generator = torch.Generator(device=self._device)
            generator.manual_seed(params.seed)
        request = _Request(
            prompt=prompt,
            params=params,
            loop=loop,
            future=loop.create_future(),
            stop_ids=frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._eos_ids),
            generator=generator,
            progress=asyncio.Event() if streamed else None,
            constraint=params.constraint() if params.constraint is not None else None,
        )
        if params.min_tokens:
            held = sorted(frozenset(params.stop_token_ids) | self._eos_ids)
            request.held_ids = torch.tensor(held, dtype=torch.long, device=self._device)
        if params.logit_bias:
            ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=self._device)
            request.bias = (ids, torch.tensor([b for _, b in params.logit_bias], device=self._device))
        with self._cond:
            if self._dead is not None:
                raise RuntimeError("engine loop died") from self._dead
            if self._thread is None or self._stopping:
                raise RuntimeError("engine is not running (call start(); stop() is final)")
            self._waiting.append(request)
            self._cond.notify_all()
        return request

    def paused(self) -> AbstractAsyncContextManager[PauseHandle]:
        """Hold generation: entering waits until the loop is parked between iterations (no
        forward running); exiting resumes.

        Concurrent pause requests (other tasks) are serialised; a pause nested in the task that
        holds one enters at once. ``PauseHandle.held_s`` is filled in on exit.
        """
        return self.gate.paused()

    # ----------------------------------------------------------------------------- loop thread

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    admitted = self._wait_for_work()
                    if admitted is None:
                        break
                    self._step(admitted)
        except BaseException as exc:
            with self._cond:
                self._dead = exc
            self._finish_all(exc)
            raise
        else:
            self._finish_all(None)

    def _wait_for_work(self) -> list[_Request] | None:
        """Block until there is work; park while a pause is requested. ``None`` means stop."""
        with self._cond:
            while True:
                if self._stopping:
                    return None
                if self.gate.park():
                    self._cond.wait()
                    continue
                self._waiting = deque(r for r in self._waiting if not r.cancelled)
                if self._waiting or self._running:
                    break
                self._cond.wait()
            admitted: list[_Request] = []
            free = self._max_batch_size - sum(not r.cancelled for r in self._running)  # compacted: all live
            while self._waiting and len(admitted) < free:
                admitted.append(self._waiting.popleft())
            return admitted

    @staticmethod
    def _deliver(request: _Request, outcome: GenerationResult | BaseException) -> None:
        with suppress(RuntimeError):
            request.loop.call_soon_threadsafe(_resolve, request.future, outcome)

    def _result(self, request: _Request) -> GenerationResult:
        assert request.finish_reason is not None
        return GenerationResult(
            prompt_token_ids=request.prompt,
            token_ids=request.token_ids,
            logprobs=request.logprobs,
            versions=request.versions,
            top_logprobs=request.top_logprobs,
            prompt_logprobs=request.prompt_logprobs,
            finish_reason=request.finish_reason,
            prompt_ranks=request.prompt_ranks,
            prompt_tops=request.prompt_tops,
        )

    def _finish_all(self, exc: BaseException | None) -> None:
        """Terminate every request: with ``exc`` if given, else as ``"abort"``."""
        with self._cond:
            pending = [*self._running, *self._waiting]
            self._waiting.clear()
            self._n_running = 0
            self.gate.release_waiter()
        self._running, self._cache, self._mask = [], None, None
        for request in pending:
            if request.finish_reason is not None:
                continue
            if exc is not None:
                self._deliver(request, RuntimeError(f"engine loop died: {exc!r}"))
            else:
                request.finish_reason = "abort"
                self._deliver(request, self._result(request))

    def _step(self, admitted: list[_Request]) -> None:
        """One iteration: prefill and merge ``admitted``, decode all running rows, compact.

        A pause requested meanwhile cuts the prefills short (the rest go back to the queue head).

        Outcomes are delivered after the counters are updated, so ``stats()`` never lags a result.
        """
        version = self.gate.version
        self._compact()
        done: list[tuple[_Request, GenerationResult | BaseException]] = []
        prefilled: list[tuple[_Request, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        produced = 0
        for i, request in enumerate(admitted):
            if i and self.gate.requested:  # let a pending pause in: the rest wait at the front
                with self._cond:
                    self._waiting.extendleft(reversed(admitted[i:]))
                break
            try:
                kv = self._prefill(request, version)
            except Exception as exc:
                request.finish_reason = "error"
                done.append((request, exc))
                continue
            produced += 1
            if request.finish_reason is None:
                prefilled.append((request, kv))
            else:
                done.append((request, self._result(request)))
        if prefilled:
            self._merge(prefilled)
        if self._running:
            try:
                produced += self._decode(version, done)
            except Exception as exc:
                for request in self._running:
                    request.finish_reason = "error"
                    done.append((request, exc))
                self._running, self._cache, self._mask = [], None, None
        self._compact()
        with self._cond:
            self._generated_tokens += produced
            self._steps += 1
            self._n_running = len(self._running)
        for request, outcome in done:
            self._deliver(request, outcome)

    def _prefill(self, request: _Request, version: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Run the prompt alone; record the first token; return its per-layer (K, V)."""
        ids = torch.tensor([request.prompt], dtype=torch.long, device=self._device)
        positions = torch.arange(len(request.prompt), device=self._device).unsqueeze(0)
        cache = DynamicCache()
        out = self._model(
            input_ids=ids,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=0 if request.params.prompt_logprobs else 1,
        )
        logits = out.logits[0].float()
        if request.params.prompt_logprobs:
            logp = torch.log_softmax(logits[:-1], dim=-1)
            targets = ids[0, 1:].unsqueeze(-1)
            chosen = logp.gather(-1, targets)
            values: list[float | None] = [None]
            values.extend(chosen.squeeze(-1).tolist())
            request.prompt_logprobs = values
            ranks: list[int | None] = [None]
            ranks.extend((1 + (logp > chosen).sum(-1)).tolist())
            request.prompt_ranks = ranks
            k = request.params.prompt_top
            request.prompt_tops = [[]]
            if k:
                top = torch.topk(logp, k)
                request.prompt_tops.extend(
                    list(zip(i, v, strict=True)) for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)
                )
            else:
                request.prompt_tops.extend([] for _ in range(len(request.prompt) - 1))
        self._record(request, logits[-1], torch.log_softmax(logits[-1], dim=-1), version)
        return [(k, v) for k, v, _ in cache]

    def _merge(self, prefilled: list[tuple[_Request, list[tuple[torch.Tensor, torch.Tensor]]]]) -> None:
        """Left-pad the running cache and the new single-row caches to one length and stack them."""
        parts: list[tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]] = []
        if self._cache is not None and self._mask is not None:
            parts.append(([(k, v) for k, v, _ in self._cache], self._mask))
        for request, kv in prefilled:
            parts.append((kv, torch.ones(1, request.cached_len, dtype=torch.long, device=self._device)))
        length = max(mask.shape[1] for _, mask in parts)
        layers = []
        for i in range(len(parts[0][0])):
            keys = torch.cat([F.pad(kv[i][0], (0, 0, length - m.shape[1], 0)) for kv, m in parts])
            values = torch.cat([F.pad(kv[i][1], (0, 0, length - m.shape[1], 0)) for kv, m in parts])
            layers.append((keys, values))
        self._mask = torch.cat([F.pad(m, (length - m.shape[1], 0)) for _, m in parts])
        self._cache = DynamicCache(ddp_cache_data=layers)
        self._running = self._running + [request for request, _ in prefilled]

    def _compact(self) -> None:
        """Drop finished/cancelled rows and the leading padding columns no row needs."""
        keep = [i for i, r in enumerate(self._running) if r.finish_reason is None and not r.cancelled]
        if len(keep) == len(self._running):
            return
        if not keep or self._cache is None or self._mask is None:
            self._running, self._cache, self._mask = [], None, None
            return
        running = [self._running[i] for i in keep]
        index = torch.tensor(keep, device=self._device)
        start = self._mask.shape[1] - max(r.cached_len for r in running)
        self._mask = self._mask[index, start:]
        self._cache = DynamicCache(
            ddp_cache_data=[(k[index, :, start:], v[index, :, start:]) for k, v, _ in self._cache]
        )
        self._running = running

    def _decode(self, version: int, done: list[tuple[_Request, GenerationResult | BaseException]]) -> int:
        """One batched forward over all running rows; returns the number of tokens produced and
        appends finished requests to ``done``."""
        assert self._cache is not None and self._mask is not None
        rows = self._running
        ids = torch.tensor([[r.token_ids[-1]] for r in rows], dtype=torch.long, device=self._device)
        positions = torch.tensor([[r.cached_len] for r in rows], dtype=torch.long, device=self._device)
        mask = F.pad(self._mask, (0, 1), value=1)
        out = self._model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=self._cache,
            use_cache=True,
        )
        self._mask = mask
        logits = out.logits[:, -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        produced = 0
        for i, request in enumerate(rows):
            if request.cancelled:
                continue
            try:  # a request whose sampling fails ends alone: the batch's others go on
                self._record(request, logits[i], logp[i], version)
            except Exception as exc:
                request.finish_reason = "error"
                done.append((request, exc))
                continue
            produced += 1
            if request.finish_reason is not None:
                done.append((request, self._result(request)))
        return produced

    def _record(self, request: _Request, logits: torch.Tensor, logp: torch.Tensor, version: int) -> None:
        """Sample ``request``'s next token from its fp32 ``logits`` row; record it, its logprob."""
        params, constraint = request.params, request.constraint
        if constraint is not None:
            logits = logits.clone()
            constraint.mask_(logits)
            logp = torch.log_softmax(logits, dim=-1)
        processed = self._process(request, logits)
        token = self._sample(processed, params, request.generator)
        if constraint is not None:
            constraint.accept(token)
        if self._logprobs_mode != "raw_logprobs":
            logp = self._reported(logits, processed, params)
        request.token_ids.append(token)
        request.logprobs.append(float(logp[token]))
        request.versions.append(version)
        if params.top_logprobs:
            top = torch.topk(logp, params.top_logprobs)
            request.top_logprobs.append(list(zip(top.indices.tolist(), top.values.tolist(), strict=True)))
        else:
            request.top_logprobs.append([])
        total = len(request.prompt) + len(request.token_ids)
        if (
            token in request.stop_ids
            or (
                params.stop_check is not None
                and len(request.token_ids) > params.min_tokens
                and params.stop_check(request.token_ids)
            )
            or (constraint is not None and constraint.done)
        ):
            request.finish_reason = "stop"
        elif len(request.token_ids) >= params.max_tokens or total >= self._max_model_len:
            request.finish_reason = "length"
        if request.progress is not None and request.finish_reason is None:
            with suppress(RuntimeError):  # the loop closed: nobody reads the stream any more
                request.loop.call_soon_threadsafe(request.progress.set)

    def _reported(self, logits: torch.Tensor, processed: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """What this engine's logprobs mode reports for one token's row: the raw ``logits``, or
        the ``processed`` ones as drawn from (:func:`~.sampling.processed_logits`) or their
        ``log_softmax``; -inf (a cut token) reported as vLLM does, :data:`~.sampling.LOGPROB_FLOOR`."""
        mode = self._logprobs_mode
        if mode == "raw_logits":
            out = logits
        else:
            drawn = processed_logits(
                processed, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p
            )
            out = torch.log_softmax(drawn, dim=-1) if mode == "processed_logprobs" else drawn
        return out.clamp(min=LOGPROB_FLOOR)

    def _process(self, request: _Request, logits: torch.Tensor) -> torch.Tensor:
        """``request``'s fp32 ``logits`` row with its ``logit_bias`` and penalties applied
        (:func:`~.sampling.process_logits`, vLLM's rules), its stop and EOS ids masked while
        fewer than ``min_tokens`` tokens are out (under a grammar that allows nothing else, not: as
        vLLM restores them)."""
        out = process_logits(logits, request.prompt, request.token_ids, request.bias, request.params)
        if request.held_ids is not None and len(request.token_ids) < request.params.min_tokens:
            kept = out[request.held_ids]
            out[request.held_ids] = float("-inf")
            if request.constraint is not None and bool(torch.isneginf(out).all()):
                out[request.held_ids] = kept  # the grammar allows only its end: vLLM lets it through
        return out

    def _sample(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
        """One token from the processed fp32 ``logits`` row (:func:`~.sampling.sample`);
        ValueError (this request's alone) when the temperature leaves no finite distribution."""
        return sample(
            logits,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            generator=generator or self._generator,
        )
