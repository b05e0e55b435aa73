"""The inference contract served by vLLM 0.32: one process, vLLM's OpenAI server with the SDK's
router mounted in front of it.

- Routes: the SDK's router (``/health``, ``/info``, ``/init_process_group``,
  ``/request_weight_update``, ``/probe_broadcast``, ``/v1/models``, ``/v1/chat/completions``) is
  mounted on the app vLLM builds (``vllm.entrypoints.launchers.app.build_app``) and replaces vLLM's
  routes of the same path and method, as vLLM's own endpoint plugins do; vLLM's other routes
  (``/v1/completions``, ``/metrics``, ...) stay. vLLM's dev-mode RL routes (``/pause``,
  ``/update_weights``...) are *not* enabled: they are not guarded by any token.
- Generation: ``AsyncLLM.generate`` on token ids; per-token weight versions come from vLLM's own
  ``CompletionOutput.weight_versions`` spans (the engine core stamps every step's output with its
  current version, set by ``finish_weight_update(weight_version)``).
- Updates: the kit's :func:`~pipelinerl_sdk.kit.inference.update.run_update` over vLLM's
  weight-transfer machinery with the SDK's engine (:mod:`.transfer`): arm =
  ``start_weight_update`` + ``update_weights(op=receive)`` (returns at once; the worker waits for
  the trainer's ``go``, then receives on a background thread); go and receive = poll the workers'
  status; pause = ``pause_generation(mode="keep")``/``resume_generation``; apply =
  ``finish_weight_update(version)`` (apply + version); abandon = ``finish_weight_update(None)``.
  ``direct`` mode pauses once every worker has the ``go``, ``staged`` only for the apply.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

from pipelinerl_sdk import protocol as wire
from pipelinerl_sdk.contracts import ServeConfig
from pipelinerl_sdk.errors import GroupError, PluginError
from pipelinerl_sdk.kit.inference import KitBackend, UpdateSteps
from pipelinerl_sdk.kit.inference.chat import (
    assemble_choice,
    assemble_response,
    plan_chat,
    sampling_args,
    version_label,
    versions_from_spans,
)
from pipelinerl_sdk.kit.inference.procs import idle_descendants
from pipelinerl_sdk_vllm.jobs import receive_deadline, receive_info, wait_jobs
from pipelinerl_sdk_vllm.plugin import CARD

log = logging.getLogger("pipelinerl_sdk_vllm")

#: Seconds between two polls of the workers' receive status (a cheap RPC between engine steps).
POLL_S = 0.01


class VLLMInferenceBackend(KitBackend):
    """``pipelinerl serve --backend vllm --model PATH [--dtype float32|bfloat16]``; options
    (``--option k=v``): see the plugin's :data:`~pipelinerl_sdk_vllm.plugin.CARD`."""

    card = CARD

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self._engine: Any = None
        self._cpu = True
        if self.opts.get("engine_policy", "idle") not in ("idle", "normal"):
            raise ValueError(f"option engine_policy: 'idle' or 'normal', not {self.opts['engine_policy']!r}")

    @property
    def max_model_len(self) -> int | None:
        return None if self._engine is None else int(self._engine.model_config.max_model_len)

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Called by :meth:`serve` once vLLM's engine client is up."""
        engine = self._engine
        self.read_model_files()
        self.workers = int(engine.vllm_config.parallel_config.world_size_across_dp)
        await engine.update_weight_version("0")
        t0 = time.perf_counter()
        await self._warm_up()
        print(
            f"pipelinerl: vllm engine up; first generation (warm-up) took {time.perf_counter() - t0:.1f}s", flush=True
        )
        status = await engine.collective_rpc("pipelinerl_status")
        if any("error" in s for s in status):
            raise PluginError(f"vllm backend: weight-transfer engine not set up in the workers: {status}")
        # vLLM's engine core and workers out of the front's way on a CPU: pipelinerl_sdk.kit.inference.procs
        if self.opts.get("engine_policy", "idle" if self._cpu else "normal") == "idle":
            print(f"pipelinerl: vllm engine threads under SCHED_IDLE: {idle_descendants()}", flush=True)

    async def _warm_up(self) -> None:
        """The first generation on CPU pays one-off kernel set-up (~30 s on 2 busy cores): pay it
        before the server says it is ready, with every output option the contract uses."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        ids = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": "warm up"}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        params = SamplingParams(
            max_tokens=2, temperature=0, logprobs=2, prompt_logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY
        )
        async for _ in self._engine.generate({"prompt_token_ids": [int(t) for t in ids]}, params, "pipelinerl-warm-up"):
            pass

    async def stop(self) -> None:
        if self._engine is not None and self.book.request is not None:
            try:
                await self._engine.shutdown_weight_transfer_engine()
            except Exception:
                pass

    # --- weight sync ------------------------------------------------------------------------------

    async def init_process_group(self, req: wire.InitProcessGroupRequest) -> wire.InitProcessGroupResponse:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self.refuse_nccl_on_cpu(req, self._cpu)
        self.book.leave()
        info = {"request": req.model_dump(mode="json")}
        try:
            await self._engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
        except Exception as e:
            raise GroupError(f"vLLM workers could not join {req.group_name!r} at {req.init_method}: {e}") from e
        return self.book.join(req, self.workers)

    async def _wait_jobs(self, key: str, deadline: float, *, received: bool) -> float:
        """:func:`~pipelinerl_sdk_vllm.jobs.wait_jobs` over this engine's workers."""

        async def statuses() -> list[dict[str, Any]]:
            return list(await self._engine.collective_rpc("pipelinerl_status"))

        return await wait_jobs(statuses, key, deadline, received=received, poll_s=POLL_S)

    def update_steps(self, req: wire.WeightUpdateRequest, mode: wire.ReceiveMode) -> UpdateSteps:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        engine, key = self._engine, wire.update_key(req.version)
        info = receive_info(req.version, req.params, req.bucket_bytes, req.timeout_s)
        deadline = receive_deadline(req.timeout_s, self.require_group().timeout_s)
        session: list[bool] = []

        async def arm() -> None:
            await engine.start_weight_update()
            session.append(True)
            await engine.update_weights(WeightTransferUpdateRequest(update_info=info))

        async def await_go() -> None:
            await self._wait_jobs(key, deadline, received=False)

        async def receive() -> float:
            return await self._wait_jobs(key, deadline, received=True)

        async def apply() -> None:
            await engine.finish_weight_update(str(req.version))
            session.clear()

        async def abandon() -> None:
            if session:  # close vLLM's update session without applying anything
                session.clear()
                try:
                    await engine.finish_weight_update(None)
                except Exception as e:  # the session is closed even when finish raises
                    log.warning("closing the weight-update session failed: %s", e)

        return UpdateSteps(await_go, receive, apply, self._paused, arm=arm, abandon=abandon)

    @asynccontextmanager
    async def _paused(self) -> AsyncIterator[None]:
        await self._engine.pause_generation(mode="keep", clear_cache=False)
        try:
            yield
        finally:
            await self._engine.resume_generation()

    async def probe_broadcast(self, req: wire.ProbeBroadcastRequest) -> float:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self.require_group()
        engine = self._engine
        info = {"op": "probe", "nbytes": req.nbytes, "probe_id": req.probe_id, "timeout_s": req.timeout_s}
        await engine.start_weight_update()
        try:
            await engine.update_weights(WeightTransferUpdateRequest(update_info=info))
            with self.book.breaking():
                deadline = time.monotonic() + 3 * req.timeout_s + 30
                return await self._wait_jobs(wire.probe_key(req.probe_id), deadline, received=True)
        finally:
            await engine.finish_weight_update(None)

    # --- generation -------------------------------------------------------------------------------

    async def chat_completion(self, req: wire.ChatCompletionRequest) -> wire.ChatCompletionResponse:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        plan = await plan_chat(self.tokenizer, req, self._engine.model_config.max_model_len)

        async def one(i: int) -> Any:
            params = SamplingParams(
                n=1,
                logit_bias=dict(req.logit_bias) if req.logit_bias else None,
                **sampling_args(plan, req, i),
                max_tokens=plan.max_tokens,
                stop=list(plan.stop) or None,
                stop_token_ids=list(plan.stop_token_ids) or None,
                include_stop_str_in_output=req.include_stop_str_in_output,
                logprobs=plan.top if req.logprobs else None,
                prompt_logprobs=req.prompt_top if i == 0 else None,
                ignore_eos=req.ignore_eos,
                skip_special_tokens=req.skip_special_tokens,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            final = None
            async for out in self._engine.generate(
                {"prompt_token_ids": plan.prompt_ids}, params, f"chatcmpl-{uuid.uuid4().hex}"
            ):
                final = out
            if final is None:
                raise RuntimeError("vLLM returned no output")
            return final

        outs = await asyncio.gather(*(one(i) for i in range(req.n)))
        prompt_lps: list[dict[int, wire.PromptLogprob] | None] | None = None
        if req.prompt_top is not None:
            raw = outs[0].prompt_logprobs or []
            prompt_lps = [None]
            for entry in raw[1:]:
                prompt_lps.append(
                    None
                    if entry is None
                    else {
                        int(t): wire.PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
                        for t, lp in entry.items()
                    }
                )
        return assemble_response(
            self.model_name,
            req,
            plan,
            [self._choice(i, o.outputs[0], req, plan.top) for i, o in enumerate(outs)],
            completion_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
            prompt_logprobs=prompt_lps,
        )

    def _choice(self, index: int, c: Any, req: wire.ChatCompletionRequest, top: int) -> wire.ChatChoice:
        token_ids = [int(t) for t in c.token_ids]
        entries = list(c.logprobs or []) if req.logprobs else []
        finish: Literal["stop", "length", "abort"] = (
            c.finish_reason if c.finish_reason in ("stop", "length", "abort") else "stop"
        )
        return assemble_choice(
            self.tokenizer,
            index,
            req,
            text=str(c.text),
            token_ids=token_ids,
            versions=versions_from_spans(
                ((version_label(s.version), s.start, s.end) for s in c.weight_versions or []),
                len(token_ids),
                engine="vLLM",
            ),
            finish_reason=finish,
            stop_reason=c.stop_reason,
            logprobs=[entry[tid].logprob for tid, entry in zip(token_ids, entries, strict=True)]
            if req.logprobs
            else (),
            top_logprobs=[
                [(t, lp.logprob) for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)[:top]]
                for entry in entries
            ]
            if top
            else None,
        )

    # --- the server -------------------------------------------------------------------------------

    def serve(self, config: ServeConfig) -> None:
        """vLLM owns its HTTP server: see :mod:`.server`."""
        from pipelinerl_sdk_vllm.server import run

        run(self, config)


__all__ = ["VLLMInferenceBackend"]
