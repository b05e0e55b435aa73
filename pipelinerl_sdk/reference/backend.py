"""The reference inference backend: transformers + the continuous-batching engine, one receiving
worker (the server process itself), both receive modes, on the inference kit.

Update path (:func:`pipelinerl_sdk.kit.inference.update.local_steps`): the broadcast lands in the
spare buffer of a :class:`~pipelinerl_sdk.weights.swap.DoubleBuffer` on a worker thread; the engine
is held only while the params are re-pointed at it (``staged``), or, once the trainer said ``go``,
for the whole receive (``direct``). Either way nothing touches the model until every byte has
arrived, so a failed update leaves the old weights serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import AsyncIterator
from typing import Any

import torch

from pipelinerl_sdk import protocol as wire
from pipelinerl_sdk.contracts import ServeConfig
from pipelinerl_sdk.kit.inference import KitBackend, UpdateSteps, local_steps
from pipelinerl_sdk.kit.inference.chat import (
    ChatPlan,
    StopRule,
    assemble_choice,
    assemble_response,
    plan_chat,
    prompt_entries,
    sampling_args,
)
from pipelinerl_sdk.kit.inference.completion import assemble_completion, completion_choice, plan_completion
from pipelinerl_sdk.kit.inference.hold import EnginePause
from pipelinerl_sdk.kit.inference.stream import TokenStep
from pipelinerl_sdk.kit.inference.structured import Grammars
from pipelinerl_sdk.reference import capabilities
from pipelinerl_sdk.reference.engine import ContinuousBatchingEngine, GenerationResult, SamplingParams
from pipelinerl_sdk.reference.tiny import load_model
from pipelinerl_sdk.weights.buckets import DEFAULT_BUCKET_BYTES, BucketPlan
from pipelinerl_sdk.weights.group import GroupConfig, WeightSyncGroup
from pipelinerl_sdk.weights.receive import WeightReceiver
from pipelinerl_sdk.weights.swap import DoubleBuffer
from pipelinerl_sdk.weights.tensors import spec_of

CAPABILITIES = capabilities.INFERENCE


class ReferenceInferenceBackend(KitBackend):
    """Options (``--option k=v``): see :data:`~pipelinerl_sdk.reference.capabilities.INFERENCE_CARD`."""

    card = capabilities.INFERENCE_CARD

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        if "threads" in self.opts:
            torch.set_num_threads(int(self.opts["threads"]))
        self.model, self.tokenizer = load_model(config.model, dtype=config.dtype)
        eos = {self.tokenizer.eos_token_id, self.tokenizer.convert_tokens_to_ids("<|im_end|>")}
        self.engine = ContinuousBatchingEngine(
            self.model,
            eos_token_ids=sorted(t for t in eos if isinstance(t, int) and t >= 0),
            max_batch_size=int(self.opts.get("max_batch_size", 32)),
            max_model_len=int(self.opts.get("max_model_len", 2048)),
            logprobs_mode=config.logprobs_mode,
        )
        self.vocab_size = int(self.model.config.vocab_size)
        self._params = dict(self.model.named_parameters())
        self.specs = [spec_of(name, p) for name, p in self._params.items()]
        #: A full update is received into the spare buffer and swapped in (no copy in the pause).
        self._weights = DoubleBuffer()
        self._receiver: WeightReceiver | None = None
        self._bucket_bytes = DEFAULT_BUCKET_BYTES  # the last update's (the spare buffer's layout)
        #: Structured output: the grammars of this tokenizer over the model's logits.
        self._grammars = Grammars(self.tokenizer, int(self.model.config.vocab_size), sorted(self.engine.eos_token_ids))

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def start(self) -> None:
        await self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()
        if self.book.group is not None:
            self.book.group.close()

    # --- weight sync ----------------------------------------------------------------------------

    @property
    def signs_rendezvous(self) -> bool:
        return True  # its engine joins through the SDK's WeightSyncGroup

    async def init_process_group(self, req: wire.InitProcessGroupRequest) -> wire.InitProcessGroupResponse:
        self.refuse_nccl_on_cpu(req, not torch.cuda.is_available())
        old, self._receiver = self.book.group, None
        self.book.leave()
        if old is not None:
            old.close()
        group = await asyncio.to_thread(WeightSyncGroup, GroupConfig.joining(req, req.rank_offset))
        self._receiver = WeightReceiver(group)
        return self.book.join(req, 1, group)

    def update_steps(self, req: wire.WeightUpdateRequest, mode: wire.ReceiveMode) -> UpdateSteps:
        self.book.version = self.engine.version  # the engine's is the truth (tests swap engines)
        assert self._receiver is not None  # validate_update checked the group
        self._bucket_bytes = req.bucket_bytes
        return local_steps(self._receiver, self._weights, self._params, req, self.engine)

    def engine_pause(self) -> EnginePause:
        return self.engine.paused

    def cancel_waiting_update(self, reason: str) -> bool:
        group = self.book.group
        return group is not None and group.cancel_decision_wait(reason)

    async def apply_floor(self, repeats: int) -> wire.ApplyFloorResponse:
        """The served params copied into the spare buffer (unpaused), then made live by the
        same :meth:`DoubleBuffer.apply <pipelinerl_sdk.weights.swap.DoubleBuffer.apply>` as an
        update's (a swap), the engine parked as for an update; each apply timed alone."""
        plan = BucketPlan.build(self.specs, self._bucket_bytes)  # the last update's layout: no realloc
        seconds, swapped = [], True
        for _ in range(repeats):
            staged = await asyncio.to_thread(self._weights.restage, self._params, plan)
            hold = self.generation_hold()
            async with (hold.around(self.engine.paused) if hold is not None else self.engine.paused)():
                t0 = time.perf_counter()
                swapped = self._weights.apply(staged, self._params).swapped and swapped
                seconds.append(time.perf_counter() - t0)
        how = "a swap (params re-pointed)" if swapped else "a copy"
        return wire.ApplyFloorResponse(seconds=seconds, detail=f"DoubleBuffer.apply of the served weights: {how}")

    async def probe_broadcast(self, req: wire.ProbeBroadcastRequest) -> float:
        self.require_group()
        assert self._receiver is not None
        return await asyncio.to_thread(
            self._receiver.receive_flat, req.nbytes, wire.probe_key(req.probe_id), decision_timeout_s=req.timeout_s
        )

    # --- generation -----------------------------------------------------------------------------

    def _sampling(self, plan: ChatPlan, req: wire.SamplingRequest, i: int) -> SamplingParams:
        """The engine's settings for sample ``i`` of ``req`` (prompt logprobs on the first)."""
        prompt_top = req.prompt_top
        if plan.structured is not None and plan.constraint is None:
            raise RuntimeError("a structured plan must be prepared (its grammar compiled) before it is sampled")
        constraint = None if plan.constraint is None else functools.partial(self._grammars.constraint, plan.constraint)
        return SamplingParams(
            constraint=constraint,
            max_tokens=plan.max_tokens,
            logit_bias=tuple((req.logit_bias or {}).items()),
            **sampling_args(plan, req, i),
            stop_token_ids=plan.stop_token_ids,
            stop_check=StopRule(self.tokenizer, req).hit if plan.stop else None,
            top_logprobs=plan.top,
            prompt_logprobs=prompt_top is not None and i == 0,
            prompt_top=prompt_top or 0,
            ignore_eos=req.ignore_eos,
        )

    async def prepare(self, plan: ChatPlan) -> ChatPlan:
        """``plan`` with its grammar compiled (xgrammar, cached by its compiler) on a worker thread."""
        if plan.structured is None:
            return plan
        return dataclasses.replace(plan, constraint=await asyncio.to_thread(self._grammars.compile, plan.structured))

    def sample_steps(self, plan: ChatPlan, req: wire.SamplingRequest, i: int) -> AsyncIterator[TokenStep]:
        return self.engine.stream(plan.prompt_ids, self._sampling(plan, req, i))

    def ending_ids(self, req: wire.SamplingRequest) -> frozenset[int]:
        return frozenset(req.stop_token_ids or ()) | (frozenset() if req.ignore_eos else self.engine.eos_token_ids)

    async def chat_completion(self, req: wire.ChatCompletionRequest) -> wire.ChatCompletionResponse:
        plan = await self.prepare(await plan_chat(self.tokenizer, req, self.engine.max_model_len, structured=True))
        results = await asyncio.gather(
            *(self.engine.generate(plan.prompt_ids, self._sampling(plan, req, i)) for i in range(req.n))
        )
        first = results[0]
        return assemble_response(
            self.model_name,
            req,
            plan,
            [self._choice(i, r, req) for i, r in enumerate(results)],
            completion_tokens=sum(len(r.token_ids) for r in results),
            prompt_logprobs=None
            if first.prompt_logprobs is None
            else prompt_entries(
                self.tokenizer, plan.prompt_ids, first.prompt_logprobs, first.prompt_ranks, first.prompt_tops
            ),
        )

    def _outcome(self, r: GenerationResult, req: wire.SamplingRequest) -> dict[str, Any]:
        """A result's text by vLLM's stop rule (:class:`StopRule`) over the engine's ids, with
        its tokens, versions, logprobs, finish and stop reason (the assembly's keywords)."""
        finish = r.finish_reason if r.finish_reason in ("stop", "length", "abort") else "abort"
        text, stop_reason = StopRule(self.tokenizer, req).finish(r.token_ids, finish, self.ending_ids(req))  # type: ignore[arg-type]
        return {
            "text": text,
            "token_ids": r.token_ids,
            "versions": r.versions,
            "finish_reason": finish,
            "logprobs": r.logprobs,
            "top_logprobs": r.top_logprobs or None,
            "stop_reason": stop_reason,
        }

    def _choice(self, index: int, r: GenerationResult, req: wire.ChatCompletionRequest) -> wire.ChatChoice:
        """One choice (:meth:`_outcome`)."""
        return assemble_choice(self.tokenizer, index, req, **self._outcome(r, req), tool_parser=self.tool_parser)

    async def completion(self, req: wire.CompletionRequest) -> wire.CompletionResponse:
        plans = await plan_completion(self.tokenizer, req, self.engine.max_model_len, self.vocab_size)
        n = req.n
        results = await asyncio.gather(
            *(self.engine.generate(plan.prompt_ids, self._sampling(plan, req, i)) for plan in plans for i in range(n))
        )
        # a prompt's logprobs come with its first sample, and are made into entries once per prompt
        firsts = results[::n]
        prompt_lps = [
            None
            if first.prompt_logprobs is None
            else prompt_entries(
                self.tokenizer, plan.prompt_ids, first.prompt_logprobs, first.prompt_ranks, first.prompt_tops
            )
            for plan, first in zip(plans, firsts, strict=True)
        ]
        choices = [
            completion_choice(
                self.tokenizer, k, req, plans[k // n], prompt_logprobs=prompt_lps[k // n], **self._outcome(r, req)
            )
            for k, r in enumerate(results)
        ]
        return assemble_completion(
            self.model_name, plans, choices, completion_tokens=sum(len(r.token_ids) for r in results)
        )
