"""The inference contract served by SGLang 0.5.23 through a thin gateway process.

- Process layout: ``pipelinerl serve --backend sglang`` runs the SDK's router (uvicorn) in this
  process and starts ``sglang.launch_server`` as a child on a private loopback port
  (:mod:`.engine`). Chosen by measurement over mounting the routes inside SGLang's server: see
  the adapter's README (throughput within the 3 % budget, and SGLang's server internals are
  left untouched).
- Generation: SGLang's ``/generate`` on token ids (the model's chat template applied here), with
  SGLang's raw logprobs (``SGLANG_RETURN_ORIGINAL_LOGPROB=1``); per-token weight versions are
  SGLang's own ``weight_versions`` spans, expanded to one int per token.
- Group: SGLang's ``init_weights_update_group`` (gloo on CPU, NCCL on GPU) joins the SDK's group
  (the SDK's group uses torch's standard store layout, see ``weights.group.torch_group_store``);
  the gateway itself only reads the trainer's decisions from the group's store.
- Update (``direct``): ``accepted`` -> wait for the trainer's ``go`` (here, never inside SGLang)
  -> ``pause_generation(in_place)`` -> ``begin_weight_update`` -> snapshot (multi-bucket plans)
  -> one ``update_weights_from_distributed(load_format="flattened_bucket")`` per bucket, the last
  one with ``weight_version`` -> ``end_weight_update`` -> ``continue_generation``. Any failure:
  the snapshot is restored before ``end_weight_update`` and generation continues on the old
  weights and version. These are the steps of the kit's
  :func:`~pipelinerl_sdk.kit.inference.update.run_update`, which orders them and normalises errors.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from pipelinerl_sdk import protocol as wire
from pipelinerl_sdk.contracts import ServeConfig
from pipelinerl_sdk.errors import GroupError, InvalidRequest, PluginError, UpdateFailed, UpdateRejected
from pipelinerl_sdk.kit.inference import KitBackend, UpdateSteps
from pipelinerl_sdk.kit.inference.chat import (
    assemble_choice,
    assemble_response,
    plan_chat,
    prompt_entries,
    versions_from_spans,
)
from pipelinerl_sdk.weights.auth import store_name
from pipelinerl_sdk_sglang.engine import (
    SGLangClient,
    SGLangError,
    SGLangProcess,
    free_port,
    launch_args,
    launch_env,
    new_api_key,
)
from pipelinerl_sdk_sglang.plugin import CARD

log = logging.getLogger("pipelinerl_sdk_sglang")

#: Request fields SGLang's native sampling parameters have no counterpart for (a 400 naming them).
UNSUPPORTED = {"logit_bias": "not served on SGLang (its native sampling parameters have no logit bias)"}


def _spans_to_versions(meta: dict[str, Any], n: int) -> list[int]:
    """One version per completion token from SGLang's ``weight_versions`` spans (or its single
    ``weight_version`` when no update happened during the request). Never guesses."""
    spans = meta.get("weight_versions")
    if spans is None:
        return [int(meta["weight_version"])] * n
    return versions_from_spans(((int(s["version"]), int(s["start"]), int(s["end"])) for s in spans), n, engine="SGLang")


class SGLangInferenceBackend(KitBackend):
    """``pipelinerl serve --backend sglang --model PATH [--dtype float32|bfloat16]``; options
    (``--option k=v``): see the plugin's :data:`~pipelinerl_sdk_sglang.plugin.CARD`."""

    card = CARD

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self._context = int(self.opts.get("context_length", "2048"))
        self.workers = self._tp = int(self.opts.get("tp", "1"))
        self._atomic = self.opts.get("atomic", "1") == "1"
        self._device = self.opts.get("device", "")
        self._proc: SGLangProcess | None = None
        self._sgl: SGLangClient | None = None
        #: The group's name inside SGLang and the store (``weights.auth.store_name``).
        self._engine_group = ""
        self._decisions: Any = None  # weights.group.DecisionBoard

    @property
    def max_model_len(self) -> int | None:
        return self._context

    @property
    def sglang(self) -> SGLangClient:
        if self._sgl is None:
            raise PluginError("the sglang backend is not started")
        return self._sgl

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start SGLang, wait until it answers, run one generation (pays CPU kernel set-up)."""
        import torch

        device = self._device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._device = device
        self.read_model_files()
        api_key = new_api_key()
        port = free_port()
        args = launch_args(
            self.model_name,
            dtype=self.config.dtype,
            port=port,
            api_key=api_key,
            device=device,
            context_length=self._context,
            options=self.opts,
        )
        env = launch_env(device)
        t0 = time.perf_counter()
        if "sglang_url" in self.opts:  # attached: someone else runs (and stops) SGLang
            self._sgl = SGLangClient(self.opts["sglang_url"], self.opts.get("sglang_api_key", ""))
        else:
            self._proc = SGLangProcess(args, port=port, env=env)
            self._sgl = SGLangClient(self._proc.url, api_key)
            self._proc.start()
            print(f"pipelinerl: starting SGLang ({device}); log {self._proc.log_path}", flush=True)
        try:
            if self._proc is not None:
                await self._proc.wait_ready(self._sgl, float(self.opts.get("startup_timeout_s", "600")))
            await self._sgl.generate(
                {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
            )
        except BaseException:
            await self.stop()
            raise
        print(f"pipelinerl: SGLang up in {time.perf_counter() - t0:.1f}s", flush=True)

    async def stop(self) -> None:
        if self._sgl is not None:
            await self._sgl.close()
        if self._proc is not None:
            await asyncio.to_thread(self._proc.stop)

    # --- weight sync ------------------------------------------------------------------------------

    async def init_process_group(self, req: wire.InitProcessGroupRequest) -> wire.InitProcessGroupResponse:
        from pipelinerl_sdk.protocol import parse_init_method
        from pipelinerl_sdk.weights.group import DecisionBoard

        self.refuse_nccl_on_cpu(req, self._device == "cpu")
        host, port = parse_init_method(req.init_method)
        old, self._decisions = self.book.leave(), None
        if old is not None:  # SGLang refuses a second group of the same name
            try:
                await self.sglang.control("/destroy_weights_update_group", {"group_name": self._engine_group})
            except SGLangError as e:
                log.warning("destroying the old weight-update group failed: %s", e)
        # The secret-derived name: SGLang's own group call then uses the trainer's store layout.
        self._engine_group = name = store_name(req.group_name, req.group_secret)
        body = {
            "master_address": host,
            "master_port": port,
            "rank_offset": req.rank_offset,
            "world_size": req.world_size,
            "group_name": name,
            "backend": req.backend,
        }
        try:
            joined = asyncio.create_task(self.sglang.control("/init_weights_update_group", body))
            decisions = await asyncio.to_thread(
                DecisionBoard.connect, req.init_method, name, req.timeout_s, req.group_secret
            )
            await asyncio.wait_for(joined, req.timeout_s + 30)
        except (SGLangError, TimeoutError) as e:
            raise GroupError(f"SGLang could not join {req.group_name!r} at {req.init_method}: {e}") from e
        self._decisions = decisions
        return self.book.join(req, self._tp)

    def cancel_waiting_update(self, reason: str) -> bool:
        """An update still waiting for its trainer's decision (read here, never inside SGLang, so
        nothing was asked of SGLang yet) ends at once with UpdateAborted naming ``reason``."""
        return self._decisions is not None and bool(self._decisions.cancel_wait(reason))

    def validate_update(self, req: wire.WeightUpdateRequest) -> None:
        """The SDK's checks, then one of SGLang's: each bucket must be the plain concatenation of
        its params (a flattened bucket carries no alignment padding), true whenever every param's
        byte size is a multiple of 64."""
        super().validate_update(req)
        from pipelinerl_sdk.weights.buckets import BucketPlan

        for b in BucketPlan.build(req.params, req.bucket_bytes).buckets:
            end = 0
            for e in b.entries:
                if e.offset != end:
                    raise UpdateRejected(
                        f"param {e.spec.name!r} sits after {e.offset - end} bytes of alignment padding: SGLang's "
                        "flattened-bucket receive needs params whose byte sizes are multiples of 64",
                        status=422,
                        field="params",
                    )
                end += e.spec.nbytes
            if end != b.nbytes:
                raise UpdateRejected(
                    f"bucket {b.index} ends in {b.nbytes - end} bytes of padding: SGLang's flattened-bucket "
                    "receive needs params whose byte sizes are multiples of 64",
                    status=422,
                    field="params",
                )

    async def _await_go(self, key: str, timeout_s: float) -> None:
        """The trainer's decision for ``key``, read here (never inside SGLang): UpdateAborted
        leaves the group healthy, GroupError (a timeout, a lost store) means it is broken."""
        if self._decisions is None:
            raise GroupError("no weight-update group: call /init_process_group first")
        await asyncio.to_thread(self._decisions.wait, key, timeout_s)
        self._decisions.clear(key)

    @asynccontextmanager
    async def _paused(self) -> AsyncIterator[None]:
        await self.sglang.control("/pause_generation", {"mode": "in_place"})
        try:
            yield
        finally:
            await self.sglang.control("/continue_generation", {})

    def update_steps(self, req: wire.WeightUpdateRequest, mode: wire.ReceiveMode) -> UpdateSteps:
        from pipelinerl_sdk.weights.buckets import BucketPlan

        self.require_group()
        sgl, group_name = self.sglang, self._engine_group
        plan = BucketPlan.build(req.params, req.bucket_bytes)
        state = {"session": False, "snapshot": False, "loaded": False}

        async def await_go() -> None:
            await self._await_go(wire.update_key(req.version), req.timeout_s)

        async def receive() -> float:
            """Inside the pause: SGLang loads each bucket as it arrives (the apply is in here)."""
            await sgl.control("/begin_weight_update", {})
            state["session"] = True
            if self._atomic and len(plan.buckets) > 1:
                await sgl.call_hook("snapshot", [], self._tp)
                state["snapshot"] = True
            t_recv = time.perf_counter()
            last = len(plan.buckets) - 1
            for b in plan.buckets:
                body: dict[str, Any] = {
                    "names": [e.spec.name for e in b.entries],
                    "dtypes": [e.spec.dtype for e in b.entries],
                    "shapes": [list(e.spec.shape) for e in b.entries],
                    "group_name": group_name,
                    "flush_cache": False,
                    "load_format": "flattened_bucket",
                }
                if b.index == last:
                    body["weight_version"] = str(req.version)
                try:
                    await sgl.control("/update_weights_from_distributed", body)
                except SGLangError as e:
                    if "receive" in str(e).lower():
                        raise GroupError(f"bucket {b.index}/{last + 1} receive failed: {e}") from e
                    raise UpdateFailed(f"bucket {b.index}/{last + 1}: {e}") from e
                state["loaded"] = True
            return time.perf_counter() - t_recv

        async def apply() -> None:
            if state["snapshot"]:
                await sgl.call_hook("discard", [], self._tp)
            await sgl.control("/end_weight_update", {})
            state["session"] = False

        async def abandon() -> None:
            await self._roll_back(state["snapshot"], state["loaded"], state["session"])

        return UpdateSteps(await_go, receive, apply, self._paused, abandon=abandon)

    async def _roll_back(self, snapshot: bool, loaded: bool, session: bool) -> None:
        """After a failed update: put the old weights back (if any bucket was loaded) and close
        SGLang's session. Raises PluginError if old weights cannot be guaranteed."""
        sgl = self.sglang
        try:
            if loaded and snapshot:
                await sgl.call_hook("restore", [], self._tp)
            elif snapshot:
                await sgl.call_hook("discard", [], self._tp)
            if session:
                await sgl.control("/end_weight_update", {})
        except SGLangError as e:
            raise PluginError(f"update failed and rolling back failed too: {e}") from e
        if loaded and not snapshot:
            raise PluginError("update failed after some buckets were loaded (option atomic=0)")

    async def probe_broadcast(self, req: wire.ProbeBroadcastRequest) -> float:
        from pipelinerl_sdk_sglang.scheduler_hooks import probe_request

        self.require_group()
        group_name, sgl = self._engine_group, self.sglang
        with self.book.breaking():
            await self._await_go(wire.probe_key(req.probe_id), req.timeout_s)
            try:
                async with self._paused():
                    await sgl.control("/begin_weight_update", {})
                    try:
                        t0 = time.perf_counter()
                        await sgl.call_hook("probe", probe_request(group_name, req.nbytes), self._tp)
                        return time.perf_counter() - t0
                    finally:
                        await sgl.control("/end_weight_update", {})
            except SGLangError as e:
                raise GroupError(f"probe receive failed: {e}") from e

    # --- generation -------------------------------------------------------------------------------

    async def chat_completion(self, req: wire.ChatCompletionRequest) -> wire.ChatCompletionResponse:
        plan = await plan_chat(self.tokenizer, req, self._context, unsupported=UNSUPPORTED)
        if req.prompt_top:
            raise InvalidRequest(
                "prompt_logprobs: alternatives (a count above 0) are not served on SGLang; use true or 0",
                field="prompt_logprobs",
            )

        async def one(i: int) -> dict[str, Any]:
            sampling: dict[str, Any] = {
                "max_new_tokens": plan.max_tokens,
                "temperature": plan.temperature,
                "top_p": plan.top_p,
                "top_k": req.top_k or -1,
                "min_p": req.min_p,
                "presence_penalty": req.presence_penalty,
                "frequency_penalty": req.frequency_penalty,
                "repetition_penalty": req.repetition_penalty,
                "ignore_eos": req.ignore_eos,
                "skip_special_tokens": req.skip_special_tokens,
                "no_stop_trim": req.include_stop_str_in_output,
            }
            if plan.stop:
                sampling["stop"] = list(plan.stop)
            if plan.stop_token_ids:
                sampling["stop_token_ids"] = list(plan.stop_token_ids)
            if req.seed is not None:
                sampling["sampling_seed"] = req.seed + i
            prompt_lps = req.prompt_top is not None and i == 0
            body: dict[str, Any] = {
                "input_ids": plan.prompt_ids,
                "sampling_params": sampling,
                "return_logprob": bool(req.logprobs or prompt_lps),
                "logprob_start_len": 0 if prompt_lps else -1,
                "top_logprobs_num": plan.top,
                "rid": f"chatcmpl-{uuid.uuid4().hex}",
            }
            return await self.sglang.generate(body)

        outs = await asyncio.gather(*(one(i) for i in range(req.n)))
        prompt_lps: list[dict[int, wire.PromptLogprob] | None] | None = None
        if req.prompt_top is not None:
            raw = outs[0]["meta_info"].get("input_token_logprobs") or []
            if len(raw) != len(plan.prompt_ids):
                raise RuntimeError(
                    f"SGLang returned {len(raw)} prompt logprobs for {len(plan.prompt_ids)} prompt tokens"
                )
            prompt_lps = prompt_entries(
                self.tokenizer, plan.prompt_ids, [None, *(None if e[0] is None else float(e[0]) for e in raw[1:])]
            )
        return assemble_response(
            self.model_name,
            req,
            plan,
            [self._choice(i, o, req, plan.top) for i, o in enumerate(outs)],
            completion_tokens=sum(len(o["output_ids"]) for o in outs),
            prompt_logprobs=prompt_lps,
        )

    def _choice(self, index: int, out: dict[str, Any], req: wire.ChatCompletionRequest, top: int) -> wire.ChatChoice:
        meta = out["meta_info"]
        token_ids = [int(t) for t in out["output_ids"]]
        entries = (meta.get("output_token_logprobs") or []) if req.logprobs else []
        if req.logprobs and len(entries) != len(token_ids):
            raise RuntimeError(f"SGLang returned {len(entries)} logprobs for {len(token_ids)} tokens")
        tops = meta.get("output_top_logprobs") or [[] for _ in token_ids]
        reason = (meta.get("finish_reason") or {}).get("type", "stop")
        if reason == "abort":
            raise RuntimeError(f"SGLang aborted the request: {meta.get('finish_reason')}")
        return assemble_choice(
            self.tokenizer,
            index,
            req,
            text=str(out.get("text", "")),
            token_ids=token_ids,
            versions=_spans_to_versions(meta, len(token_ids)),
            finish_reason="length" if reason == "length" else "stop",
            logprobs=[lp for lp, _tid, _ in entries],
            top_logprobs=[[(int(a[1]), float(a[0])) for a in (alts or [])[:top]] for alts in tops],
            tool_parser=self.tool_parser,
        )


__all__ = ["SGLangInferenceBackend"]
