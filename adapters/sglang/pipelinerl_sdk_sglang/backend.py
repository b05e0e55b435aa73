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
  weights and version.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipelinerl_sdk.contracts import InferenceBackend, ServeConfig, UpdateReport
from pipelinerl_sdk.errors import GroupError, PluginError, UpdateFailed, UpdateRejected
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
from pipelinerl_sdk.weights.auth import group_id, store_name
from pipelinerl_sdk_sglang.engine import (
    SGLangClient,
    SGLangError,
    SGLangProcess,
    free_port,
    launch_args,
    launch_env,
    new_api_key,
)
from pipelinerl_sdk_sglang.plugin import CAPABILITIES

log = logging.getLogger("pipelinerl_sdk_sglang")

DEFAULT_MAX_TOKENS = 256

OPTIONS = {
    "context_length": "context length, prompt + completion (default 2048)",
    "device": "cuda or cpu (default: cuda when torch sees a GPU)",
    "tp": "tensor-parallel size (default 1)",
    "max_total_tokens": "KV pool size in tokens on CPU (default 8192)",
    "mem_fraction_static": "SGLang's static memory fraction (CPU default 0.05)",
    "atomic": "1 (default): snapshot the weights before a multi-bucket update, restore on failure",
    "startup_timeout_s": "seconds SGLang may take to start (default 600)",
    "log_level": "SGLang's log level (default warning)",
    "sglang_args": "extra sglang.launch_server arguments, space-separated",
    "sglang_url": "attach to this running SGLang server instead of starting one (benchmarks; not stopped)",
    "sglang_api_key": "the attached server's --api-key",
}


def _spans_to_versions(meta: dict[str, Any], n: int) -> list[int]:
    """One version per completion token from SGLang's ``weight_versions`` spans (or its single
    ``weight_version`` when no update happened during the request). Never guesses."""
    spans = meta.get("weight_versions")
    if spans is None:
        return [int(meta["weight_version"])] * n
    versions: list[int] = []
    for s in spans:
        versions.extend([int(s["version"])] * (int(s["end"]) - int(s["start"])))
    if len(versions) != n:
        raise RuntimeError(f"SGLang reported weight-version spans for {len(versions)} of {n} tokens: {spans}")
    return versions


class SGLangInferenceBackend(InferenceBackend):
    """``pipelinerl serve --backend sglang --model PATH [--dtype float32|bfloat16]``; options
    (``--option k=v``): see :data:`OPTIONS`."""

    capabilities = CAPABILITIES

    def __init__(self, config: ServeConfig) -> None:
        unknown = set(config.options) - set(OPTIONS)
        if unknown:
            raise ValueError(f"unknown option(s) for the sglang backend: {sorted(unknown)} (known: {sorted(OPTIONS)})")
        if not Path(config.model, "config.json").is_file():
            raise FileNotFoundError(f"model: no HF model at {config.model!r} (config.json missing)")
        if config.dtype not in CAPABILITIES.dtypes:
            raise ValueError(
                f"dtype {config.dtype!r} not served by the sglang backend (use {sorted(CAPABILITIES.dtypes)})"
            )
        if config.receive_mode is not None and config.receive_mode not in CAPABILITIES.receive_modes:
            raise ValueError(f"receive mode {config.receive_mode!r}: the sglang backend receives 'direct' only")
        if importlib.util.find_spec("sglang") is None:
            raise PluginError(
                "the sglang backend needs SGLang 0.5.23 in this environment: pip install "
                "'pipelinerl-sdk-sglang[gpu]' on a GPU host, or run scripts/setup-sglang (CPU test harness)"
            )
        self._config = config
        self._opts = dict(config.options)
        self._model_name = str(config.model)
        self._context = int(self._opts.get("context_length", "2048"))
        self._tp = int(self._opts.get("tp", "1"))
        self._atomic = self._opts.get("atomic", "1") == "1"
        self._device = self._opts.get("device", "")
        self._proc: SGLangProcess | None = None
        self._sgl: SGLangClient | None = None
        self._tokenizer: Any = None
        self._specs: list[ParamSpec] = []
        self._version = 0
        self._group: GroupState | None = None
        #: The group's name inside SGLang and the store (``weights.auth.store_name``).
        self._engine_group = ""
        self._decisions: Any = None  # weights.group.DecisionBoard

    # --- identity ---------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return "sglang"

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int | None:
        return self._context

    @property
    def version(self) -> int:
        return self._version

    @property
    def receiving_workers(self) -> int:
        return self._tp

    def param_specs(self) -> list[ParamSpec]:
        return list(self._specs)

    def group_state(self) -> GroupState | None:
        return self._group

    @property
    def sglang(self) -> SGLangClient:
        if self._sgl is None:
            raise PluginError("the sglang backend is not started")
        return self._sgl

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start SGLang, wait until it answers, run one generation (pays CPU kernel set-up)."""
        import torch
        from transformers import AutoTokenizer

        from pipelinerl_sdk.weights.tensors import hf_param_specs

        device = self._device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._device = device
        self._tokenizer = AutoTokenizer.from_pretrained(self._config.model)
        self._specs = hf_param_specs(self._config.model, self._config.dtype)
        api_key = new_api_key()
        port = free_port()
        args = launch_args(
            self._model_name,
            dtype=self._config.dtype,
            port=port,
            api_key=api_key,
            device=device,
            context_length=self._context,
            options=self._opts,
        )
        env = launch_env(device)
        t0 = time.perf_counter()
        if "sglang_url" in self._opts:  # attached: someone else runs (and stops) SGLang
            self._sgl = SGLangClient(self._opts["sglang_url"], self._opts.get("sglang_api_key", ""))
        else:
            self._proc = SGLangProcess(args, port=port, env=env)
            self._sgl = SGLangClient(self._proc.url, api_key)
            self._proc.start()
            print(f"pipelinerl: starting SGLang ({device}); log {self._proc.log_path}", flush=True)
        try:
            if self._proc is not None:
                await self._proc.wait_ready(self._sgl, float(self._opts.get("startup_timeout_s", "600")))
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

    async def init_process_group(self, req: InitProcessGroupRequest) -> InitProcessGroupResponse:
        from pipelinerl_sdk.protocol import parse_init_method
        from pipelinerl_sdk.weights.group import DecisionBoard

        if req.backend == "nccl" and self._device == "cpu":
            raise GroupError("backend 'nccl' needs CUDA; this SGLang server runs on CPU (use 'gloo')")
        host, port = parse_init_method(req.init_method)
        old, self._group, self._decisions = self._group, None, None
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
        ranks = list(range(req.rank_offset, req.rank_offset + self._tp))
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

    def validate_update(self, req: WeightUpdateRequest) -> None:
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
        """The trainer's decision for ``key``; UpdateAborted leaves the group healthy, a timeout
        or a lost store marks it broken."""
        if self._decisions is None:
            raise GroupError("no weight-update group: call /init_process_group first")
        try:
            await asyncio.to_thread(self._decisions.wait, key, timeout_s)
        except GroupError as e:
            self._mark_broken(str(e))
            raise

    async def update_weights(
        self, req: WeightUpdateRequest, mode: ReceiveMode, on_accepted: Callable[[], None]
    ) -> UpdateReport:
        from pipelinerl_sdk.weights.buckets import BucketPlan
        from pipelinerl_sdk.weights.receive import update_key

        assert self._group is not None  # validate_update checked it
        sgl = self.sglang
        group_name = self._engine_group
        plan = BucketPlan.build(req.params, req.bucket_bytes)
        key = update_key(req.version)
        t0 = time.perf_counter()
        on_accepted()  # SGLang is in the group: the trainer may decide
        await self._await_go(key, req.timeout_s)
        self._decisions.clear(key)
        paused_at = time.perf_counter()
        session = snapshot = loaded = False
        receive_s = 0.0
        try:
            await sgl.control("/pause_generation", {"mode": "in_place"})
            await sgl.control("/begin_weight_update", {})
            session = True
            if self._atomic and len(plan.buckets) > 1:
                await sgl.call_hook("snapshot", [], self._tp)
                snapshot = True
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
                        self._mark_broken(f"bucket {b.index} receive failed: {e}")
                    raise UpdateFailed(f"bucket {b.index}/{last + 1}: {e}") from e
                loaded = True
            receive_s = time.perf_counter() - t_recv
            self._version = req.version
        except BaseException as e:
            await self._roll_back(snapshot, loaded, session, e)
            session = False
            raise
        finally:
            if session:
                if snapshot:
                    await sgl.call_hook("discard", [], self._tp)
                await sgl.control("/end_weight_update", {})
            await sgl.control("/continue_generation", {})
        pause_s = time.perf_counter() - paused_at
        return UpdateReport(
            version=req.version,
            mode=mode,
            pause_s=pause_s,
            receive_s=receive_s,
            apply_s=0.0,  # SGLang loads each bucket as it arrives: inside receive_s
            total_s=time.perf_counter() - t0,
        )

    async def _roll_back(self, snapshot: bool, loaded: bool, session: bool, cause: BaseException) -> None:
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
            raise PluginError(f"update failed ({cause}) and rolling back failed too: {e}") from e
        if loaded and not snapshot:
            raise PluginError(f"update failed after some buckets were loaded (option atomic=0): {cause}") from cause

    async def probe_broadcast(self, req: ProbeBroadcastRequest) -> float:
        from pipelinerl_sdk_sglang.scheduler_hooks import probe_request

        if self._group is None:
            raise GroupError("no weight-update group: call /init_process_group first")
        sgl = self.sglang
        await self._await_go(f"probe/{req.probe_id}", req.timeout_s)
        await sgl.control("/pause_generation", {"mode": "in_place"})
        try:
            await sgl.control("/begin_weight_update", {})
            try:
                t0 = time.perf_counter()
                await sgl.call_hook("probe", probe_request(self._engine_group, req.nbytes), self._tp)
                return time.perf_counter() - t0
            finally:
                await sgl.control("/end_weight_update", {})
        except SGLangError as e:
            self._mark_broken(f"probe failed: {e}")
            raise GroupError(f"probe receive failed: {e}") from e
        finally:
            await sgl.control("/continue_generation", {})

    # --- generation -------------------------------------------------------------------------------

    async def chat_completion(self, req: ChatCompletionRequest) -> ChatCompletionResponse:
        messages = [m.model_dump() for m in req.messages]
        encoded = self._tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, tokenize=True, return_dict=False
        )
        prompt_ids = [int(t) for t in encoded]
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        room = self._context - len(prompt_ids)
        max_tokens = req.token_budget or min(DEFAULT_MAX_TOKENS, room)
        if max_tokens > room:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the context ({self._context})"
            )

        async def one(i: int) -> dict[str, Any]:
            sampling: dict[str, Any] = {
                "max_new_tokens": max_tokens,
                "temperature": req.temperature,
                "top_p": req.top_p,
                "ignore_eos": req.ignore_eos,
                "skip_special_tokens": True,
            }
            if req.seed is not None:
                sampling["sampling_seed"] = req.seed + i
            prompt_lps = req.prompt_logprobs and i == 0
            body: dict[str, Any] = {
                "input_ids": prompt_ids,
                "sampling_params": sampling,
                "return_logprob": bool(req.logprobs or prompt_lps),
                "logprob_start_len": 0 if prompt_lps else -1,
                "top_logprobs_num": top,
                "rid": f"chatcmpl-{uuid.uuid4().hex}",
            }
            return await self.sglang.generate(body)

        outs = await asyncio.gather(*(one(i) for i in range(req.n)))
        choices = [self._choice(i, o, req, top) for i, o in enumerate(outs)]
        completion_tokens = sum(len(o["output_ids"]) for o in outs)
        prompt_lps: list[float | None] | None = None
        if req.prompt_logprobs:
            raw = outs[0]["meta_info"].get("input_token_logprobs") or []
            if len(raw) != len(prompt_ids):
                raise RuntimeError(f"SGLang returned {len(raw)} prompt logprobs for {len(prompt_ids)} prompt tokens")
            prompt_lps = [None, *(None if e[0] is None else float(e[0]) for e in raw[1:])]
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

    def _choice(self, index: int, out: dict[str, Any], req: ChatCompletionRequest, top: int) -> ChatChoice:
        meta = out["meta_info"]
        token_ids = [int(t) for t in out["output_ids"]]
        logprobs = None
        if req.logprobs:
            entries = meta.get("output_token_logprobs") or []
            if len(entries) != len(token_ids):
                raise RuntimeError(f"SGLang returned {len(entries)} logprobs for {len(token_ids)} tokens")
            tops = meta.get("output_top_logprobs") or [[] for _ in token_ids]
            logprobs = choice_logprobs(
                self._tokenizer,
                token_ids,
                [lp for lp, _tid, _ in entries],
                [[(int(a[1]), float(a[0])) for a in (alts or [])[:top]] for alts in tops],
            )
        reason = (meta.get("finish_reason") or {}).get("type", "stop")
        if reason == "abort":
            raise RuntimeError(f"SGLang aborted the request: {meta.get('finish_reason')}")
        return ChatChoice(
            index=index,
            message=AssistantMessage(content=str(out.get("text", ""))),
            finish_reason="length" if reason == "length" else "stop",
            logprobs=logprobs,
            token_ids=token_ids if req.return_token_ids else None,
            weight_versions=_spans_to_versions(meta, len(token_ids)),
        )


__all__ = ["OPTIONS", "SGLangInferenceBackend"]
