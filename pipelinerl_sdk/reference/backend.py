"""The reference inference backend: transformers + the continuous-batching engine, one receiving
worker (the server process itself), both receive modes.

Update path (see :mod:`pipelinerl_sdk.weights.receive`): the broadcast lands in a staging buffer
on a worker thread; the engine is held only while the staged bytes are copied into the live
parameters (``staged``), or for the whole receive (``direct``). Either way nothing touches the
model until every byte has arrived, so a failed update leaves the old weights serving.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from pipelinerl_sdk.contracts import InferenceBackend, ServeConfig, UpdateReport
from pipelinerl_sdk.errors import GroupError, UpdateAborted, UpdateFailed
from pipelinerl_sdk.logprobs import choice_logprobs
from pipelinerl_sdk.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    GroupState,
    InitProcessGroupRequest,
    InitProcessGroupResponse,
    ParamSpec,
    ProbeBroadcastRequest,
    ReceiveMode,
    Usage,
    WeightUpdateRequest,
)
from pipelinerl_sdk.reference import capabilities
from pipelinerl_sdk.reference.engine import (
    ContinuousBatchingEngine,
    GenerationResult,
    SamplingParams,
)
from pipelinerl_sdk.reference.tiny import load_model
from pipelinerl_sdk.weights.buckets import BucketPlan
from pipelinerl_sdk.weights.group import GroupConfig, WeightSyncGroup
from pipelinerl_sdk.weights.receive import StagedWeights, WeightReceiver, update_key
from pipelinerl_sdk.weights.swap import DoubleBuffer
from pipelinerl_sdk.weights.tensors import spec_of

CAPABILITIES = capabilities.INFERENCE

DEFAULT_MAX_TOKENS = 256


class ReferenceInferenceBackend(InferenceBackend):
    """Options (``--option k=v``): ``max_batch_size`` (32), ``max_model_len`` (2048),
    ``threads`` (torch intra-op threads; default torch's)."""

    capabilities = CAPABILITIES

    def __init__(self, config: ServeConfig) -> None:
        opts = dict(config.options)
        unknown = set(opts) - {"max_batch_size", "max_model_len", "threads"}
        if unknown:
            raise ValueError(f"unknown option(s) for the reference backend: {sorted(unknown)}")
        if not Path(config.model, "config.json").is_file():
            raise FileNotFoundError(f"model: no HF model at {config.model!r} (config.json missing)")
        if "threads" in opts:
            torch.set_num_threads(int(opts["threads"]))
        self._config = config
        self._model_name = str(config.model)
        self.model, self.tokenizer = load_model(config.model, dtype=config.dtype)
        eos = {
            t
            for t in (
                self.tokenizer.eos_token_id,
                self.tokenizer.convert_tokens_to_ids("<|im_end|>"),
            )
            if isinstance(t, int) and t >= 0
        }
        self.engine = ContinuousBatchingEngine(
            self.model,
            eos_token_ids=sorted(eos),
            max_batch_size=int(opts.get("max_batch_size", 32)),
            max_model_len=int(opts.get("max_model_len", 2048)),
        )
        self._params = dict(self.model.named_parameters())
        self._specs = [spec_of(name, p) for name, p in self._params.items()]
        #: A full update is received into the spare buffer and swapped in (no copy in the pause).
        self._weights = DoubleBuffer()
        self._default_mode: ReceiveMode = config.receive_mode or "staged"
        self._group: WeightSyncGroup | None = None
        self._receiver: WeightReceiver | None = None

    # --- identity -------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return "reference"

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def receiving_workers(self) -> int:
        return 1

    @property
    def default_mode(self) -> ReceiveMode:
        return self._default_mode

    def param_specs(self) -> list[ParamSpec]:
        return list(self._specs)

    def group_state(self) -> GroupState | None:
        g = self._group
        if g is None:
            return None
        c = g.config
        return GroupState(
            group_name=c.group_name,
            group_id=c.group_id,
            ranks=[c.rank],
            world_size=c.world_size,
            backend=c.backend,
            broken=g.broken is not None,
            reason=g.broken,
        )

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()
        if self._group is not None:
            self._group.close()

    # --- weight sync ----------------------------------------------------------------------------

    async def init_process_group(self, req: InitProcessGroupRequest) -> InitProcessGroupResponse:
        if req.backend == "nccl" and not torch.cuda.is_available():
            raise GroupError("backend 'nccl' needs CUDA; this server runs on CPU (use 'gloo')")
        old, self._group, self._receiver = self._group, None, None
        if old is not None:
            old.close()
        cfg = GroupConfig(
            req.init_method,
            req.rank_offset,
            req.world_size,
            req.backend,
            req.group_name,
            req.timeout_s,
            req.group_secret,
        )
        group = await asyncio.to_thread(WeightSyncGroup, cfg)
        self._group, self._receiver = group, WeightReceiver(group)
        return InitProcessGroupResponse(
            group_name=req.group_name,
            group_id=cfg.group_id,
            ranks=[req.rank_offset],
            world_size=req.world_size,
            backend=req.backend,
        )

    async def update_weights(
        self, req: WeightUpdateRequest, mode: ReceiveMode, on_accepted: Callable[[], None]
    ) -> UpdateReport:
        receiver = self._receiver
        if receiver is None:
            raise GroupError("no weight-update group")
        plan = BucketPlan.build(req.params, req.bucket_bytes)
        key = update_key(req.version)
        t0 = time.perf_counter()

        spare = self._weights.spare(plan.total_bytes, receiver.group.device)

        def receive() -> StagedWeights:
            return receiver.receive(plan, key, decision_timeout_s=req.timeout_s, into=spare)

        def make_live(staged: StagedWeights) -> float:
            """Inside the pause: the new weights and their version; returns the apply seconds."""
            t_apply = time.perf_counter()
            self._weights.apply(staged, self._params)
            self.engine.set_version(req.version)
            return time.perf_counter() - t_apply

        try:
            on_accepted()
            if mode == "staged":
                staged = await asyncio.to_thread(receive)
                async with self.engine.paused() as hold:
                    apply_s = make_live(staged)
            else:
                async with self.engine.paused() as hold:
                    staged = await asyncio.to_thread(receive)
                    apply_s = make_live(staged)
        except UpdateAborted:
            raise
        except GroupError as e:
            raise UpdateFailed(f"receive failed, version {self.version} still serving: {e}") from e
        return UpdateReport(
            version=req.version,
            mode=mode,
            pause_s=hold.held_s,
            receive_s=staged.receive_s,
            apply_s=apply_s,
            total_s=time.perf_counter() - t0,
        )

    def cancel_waiting_update(self, reason: str) -> bool:
        return self._group is not None and self._group.cancel_decision_wait(reason)

    async def probe_broadcast(self, req: ProbeBroadcastRequest) -> float:
        receiver = self._receiver
        if receiver is None:
            raise GroupError("no weight-update group: call /init_process_group first")
        return await asyncio.to_thread(
            receiver.receive_flat,
            req.nbytes,
            f"probe/{req.probe_id}",
            decision_timeout_s=req.timeout_s,
        )

    # --- generation -----------------------------------------------------------------------------

    async def chat_completion(self, req: ChatCompletionRequest) -> ChatCompletionResponse:
        messages = [m.model_dump() for m in req.messages]
        encoded = self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=req.add_generation_prompt,
            tokenize=True,
            return_dict=False,
        )
        prompt_ids = [int(t) for t in encoded]  # type: ignore[arg-type]
        room = self.engine.max_model_len - len(prompt_ids)
        max_tokens = req.token_budget or min(DEFAULT_MAX_TOKENS, room)
        if max_tokens > room:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                f"({self.engine.max_model_len})"
            )
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        results = await asyncio.gather(
            *(
                self.engine.generate(
                    prompt_ids,
                    SamplingParams(
                        max_tokens=max_tokens,
                        temperature=req.temperature,
                        top_p=req.top_p,
                        seed=None if req.seed is None else req.seed + i,
                        top_logprobs=top,
                        prompt_logprobs=req.prompt_logprobs and i == 0,
                        ignore_eos=req.ignore_eos,
                    ),
                )
                for i in range(req.n)
            )
        )
        choices = [self._choice(i, r, req) for i, r in enumerate(results)]
        completion_tokens = sum(len(r.token_ids) for r in results)
        return ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self._model_name,
            choices=choices,
            usage=Usage(
                prompt_tokens=len(prompt_ids),
                completion_tokens=completion_tokens,
                total_tokens=len(prompt_ids) + completion_tokens,
            ),
            prompt_token_ids=list(prompt_ids) if req.return_token_ids else None,
            prompt_logprobs=results[0].prompt_logprobs if req.prompt_logprobs else None,
        )

    def _choice(self, index: int, r: GenerationResult, req: ChatCompletionRequest) -> ChatChoice:
        text = str(self.tokenizer.decode(r.token_ids, skip_special_tokens=True))
        logprobs = None
        if req.logprobs:
            logprobs = choice_logprobs(self.tokenizer, r.token_ids, r.logprobs, r.top_logprobs or None)
        return ChatChoice(
            index=index,
            message=AssistantMessage(content=text),
            finish_reason=r.finish_reason,  # type: ignore[arg-type]
            logprobs=logprobs,
            token_ids=list(r.token_ids) if req.return_token_ids else None,
            weight_versions=list(r.versions),
        )
