"""The inference contract served through NVIDIA Dynamo 1.6: the SDK's app in front of Dynamo's
frontend and N Dynamo vLLM workers (:mod:`.processes`), one weight-update group over all workers.

- Chat: prepared here (the kit's chat template and context check), generated through Dynamo's
  frontend (its router picks the worker) with the prompt as token ids (``nvext.token_data``:
  exactly the SDK's template, Dynamo's preprocessor does not re-template) and
  ``nvext.extra_fields: ["engine_data"]``; token ids, raw logprobs, top logprobs by id and
  vLLM's per-token weight versions come back in ``engine_data["pipelinerl"]``, put there by the
  worker's handler subclass (:mod:`.worker`). ``n > 1``: n requests, seeds ``seed + i``.
- Group: every worker joins the SDK's group (rank ``rank_offset + i``) at once, over its system
  port (``POST /engine/pipelinerl {"op": "init"}``); the trainer is rank 0.
- Update: the vLLM adapter's flow over every worker: arm = ``start`` + ``update(op=receive)`` on
  all workers (all must accept before the trainer is told to broadcast: any refusal closes every
  opened session and the update is refused); the trainer's ``go`` and the receive = poll every
  worker's status; pause = Dynamo's own ``pause_generation {"mode": "keep"}`` on every worker
  (``resume_generation`` on all on exit, also after a failure); apply = ``finish(version)`` on
  every worker once all hold every byte. A failure before the apply leaves every worker on its
  old weights (nothing is applied until all received), unpaused.
- ``/info``: every worker with its version and state; a worker whose process exited is ``dead``
  (with its log line) and breaks the group (a broadcast cannot complete without it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx

from pipelinerl_sdk import protocol as wire
from pipelinerl_sdk.contracts import ServeConfig
from pipelinerl_sdk.errors import GroupError, PluginError, UpdateFailed
from pipelinerl_sdk.http.client import KEEPALIVE_EXPIRY_S
from pipelinerl_sdk.kit.inference import KitBackend, UpdateSteps
from pipelinerl_sdk.kit.inference.chat import (
    assemble_choice,
    assemble_response,
    plan_chat,
    version_label,
    versions_from_spans,
)
from pipelinerl_sdk.kit.inference.hold import EnginePause
from pipelinerl_sdk_dynamo.plugin import CARD
from pipelinerl_sdk_dynamo.processes import ClusterConfig, DynamoCluster

log = logging.getLogger("pipelinerl_sdk_dynamo")
T = TypeVar("T")

#: Seconds between two polls of the workers' receive status.
POLL_S = 0.02

#: Request fields not carried through Dynamo's frontend yet (a 400 naming them).
UNSUPPORTED = {
    name: "not carried through Dynamo's frontend by this adapter yet"
    for name in (
        "stop",
        "stop_token_ids",
        "logit_bias",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "top_k",
        "min_p",
        "skip_special_tokens",
        "prompt_logprobs",
    )
}


class WorkerError(UpdateFailed):
    """A worker route answered an error, or its process is gone. Not a GroupError: a worker that
    refuses to arm leaves the group healthy; a dead worker breaks it through :meth:`group_state`."""


class DynamoInferenceBackend(KitBackend):
    """``pipelinerl serve --backend dynamo --model PATH [--workers N]``; options: see the
    plugin's :data:`~pipelinerl_sdk_dynamo.plugin.CARD`."""

    card = CARD

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self.workers = int(self.opts.get("workers", "2"))
        if self.workers < 1:
            raise ValueError(f"option workers: at least 1, got {self.workers}")
        if self.opts.get("worker_policy", "idle") not in ("idle", "normal"):
            raise ValueError(f"option worker_policy: 'idle' or 'normal', not {self.opts['worker_policy']!r}")
        cfg = json.loads(Path(config.model, "config.json").read_text())
        self._max_model_len = int(self.opts.get("max_model_len", cfg.get("max_position_embeddings", 2048)))
        self.cluster: DynamoCluster | None = None
        self._http: httpx.AsyncClient | None = None
        self._worker_versions = [0] * self.workers
        self._paused = [False] * self.workers

    @property
    def max_model_len(self) -> int | None:
        return self._max_model_len

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        self.read_model_files()
        o = self.opts
        cpu = _cpu_build()
        self.cluster = DynamoCluster(
            ClusterConfig(
                model=str(self.config.model),
                workers=self.workers,
                dtype=self.config.dtype,
                max_model_len=self._max_model_len,
                max_num_seqs=int(o.get("max_num_seqs", "64")),
                kv_cache_gib=o.get("kv_cache_gib", "1"),
                enforce_eager=o.get("enforce_eager", "1") == "1",
                prefix_caching=o.get("prefix_caching", "0") == "1",
                vllm_args=o.get("vllm_args", "").split(),
                env={"VLLM_CPU_KVCACHE_SPACE": o.get("kv_cache_gib", "1"), "VLLM_TARGET_DEVICE": "cpu"} if cpu else {},
                worker_nice=int(o.get("worker_nice", "0")),
            )
        )
        self._http = httpx.AsyncClient(  # idle connections dropped before a server's keep-alive closes them
            timeout=None, limits=httpx.Limits(max_connections=512, keepalive_expiry=KEEPALIVE_EXPIRY_S)
        )
        t0 = time.perf_counter()
        try:
            self.cluster.start()
            await self.cluster.wait_ready(float(o.get("startup_timeout_s", "600")))
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": "warm up"}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            # the first generation on CPU pays one-off kernel set-up: on every worker, before serving
            await self._all("pipelinerl", {"op": "warm_up", "prompt_token_ids": [int(t) for t in ids]})
            await self._all("pipelinerl", {"op": "set_version", "version": 0})
            status = await self._statuses()
            if o.get("worker_policy", "idle" if cpu else "normal") == "idle":
                print(f"pipelinerl: dynamo worker threads under SCHED_IDLE: {self.cluster.idle_workers()}", flush=True)
        except BaseException:
            await self.stop()
            raise
        if any("error" in s for s in status):
            await self.stop()
            raise PluginError(f"dynamo backend: weight-transfer engine not set up in the workers: {status}")
        print(
            f"pipelinerl: dynamo up ({self.workers} workers, frontend {self.cluster.frontend_url}) "
            f"in {time.perf_counter() - t0:.1f}s",
            flush=True,
        )

    async def stop(self) -> None:
        cluster, self.cluster = self.cluster, None
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if cluster is not None:
            await asyncio.to_thread(cluster.stop)

    # --- talking to the workers -------------------------------------------------------------------

    def _cluster(self) -> DynamoCluster:
        if self.cluster is None or self._http is None:
            raise PluginError("dynamo backend: not started")
        return self.cluster

    def _dead(self) -> list[str]:
        c = self.cluster
        return [] if c is None else [p.death() for p in c.procs() if p.exited() is not None]

    async def _call(self, i: int, route: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
        """``POST /engine/ROUTE`` on worker ``i``; WorkerError on an error answer or a dead worker."""
        c = self._cluster()
        assert self._http is not None
        proc = c.workers[i]
        try:
            r = await self._http.post(f"{c.worker_url(i)}/engine/{route}", json=body, timeout=timeout_s)
        except httpx.HTTPError as e:
            if proc.exited() is not None:
                raise WorkerError(f"dynamo worker {i}: {proc.death()}") from e
            raise WorkerError(f"dynamo worker {i}: /engine/{route} failed: {type(e).__name__}: {e}") from e
        try:
            answer: dict[str, Any] = r.json()
        except ValueError:
            answer = {"status": "error", "message": r.text[:500]}
        if r.status_code != 200 or answer.get("status") != "ok":
            raise WorkerError(
                f"dynamo worker {i}: /engine/{route} {body.get('op', '')}: {answer.get('message', answer)}"
            )
        return answer

    async def _all(self, route: str, body: dict[str, Any], timeout_s: float = 120.0) -> list[dict[str, Any]]:
        """The same call on every worker at once; the first error raises once all returned."""
        return await _gather_all([self._call(i, route, body, timeout_s) for i in range(self.workers)])

    async def _statuses(self) -> list[dict[str, Any]]:
        answers = await self._all("pipelinerl", {"op": "status"}, timeout_s=30.0)
        return [w for a in answers for w in a["workers"]]

    # --- /info ------------------------------------------------------------------------------------

    def worker_states(self) -> list[wire.WorkerState]:
        c = self.cluster
        states: list[wire.WorkerState] = []
        for i in range(self.workers):
            proc = None if c is None or i >= len(c.workers) else c.workers[i]
            if proc is not None and proc.exited() is not None:
                states.append(
                    wire.WorkerState(index=i, version=None, state="dead", pid=proc.pid, url=None, reason=proc.death())
                )
            else:
                states.append(
                    wire.WorkerState(
                        index=i,
                        version=self._worker_versions[i],
                        state="paused" if self._paused[i] else "serving",
                        pid=None if proc is None else proc.pid,
                        url=None if c is None or proc is None else c.worker_url(i),
                    )
                )
        return states

    def group_state(self) -> wire.GroupState | None:
        dead = self._dead()
        if dead:
            self.book.mark_broken(f"a Dynamo process died: {dead[0]}")
        return self.book.state()

    # --- weight sync ------------------------------------------------------------------------------

    @property
    def signs_rendezvous(self) -> bool:
        return True  # every worker's vLLM joins through the SDK's WeightSyncGroup

    async def init_process_group(self, req: wire.InitProcessGroupRequest) -> wire.InitProcessGroupResponse:
        self.refuse_nccl_on_cpu(req, _cpu_build())
        self.book.leave()
        body = req.model_dump(mode="json")
        # the vLLM weight-transfer engine's init info (PipelineRLInitInfo): the request, with each
        # worker's own rank offset (one vLLM worker per Dynamo worker)
        calls = [
            self._call(
                i,
                "pipelinerl",
                {"op": "init", "init_info": {"request": {**body, "rank_offset": req.rank_offset + i}}},
                timeout_s=req.timeout_s + 30,
            )
            for i in range(self.workers)
        ]
        try:
            await _gather_all(calls)
        except Exception as e:
            raise GroupError(f"Dynamo workers could not join {req.group_name!r} at {req.init_method}: {e}") from e
        return self.book.join(req, self.workers)

    async def _wait_jobs(self, key: str, deadline: float, *, received: bool) -> float:
        """:func:`~pipelinerl_sdk_vllm.jobs.wait_jobs` over every worker's status."""
        from pipelinerl_sdk_vllm.jobs import wait_jobs  # the vLLM adapter: imported with the engine, not the plugin

        return await wait_jobs(self._statuses, key, deadline, received=received, poll_s=POLL_S, engine="Dynamo")

    def update_steps(self, req: wire.WeightUpdateRequest, mode: wire.ReceiveMode) -> UpdateSteps:
        from pipelinerl_sdk_vllm.jobs import receive_deadline, receive_info

        key = wire.update_key(req.version)
        info = receive_info(req.version, req.params, req.bucket_bytes, req.timeout_s)
        deadline = receive_deadline(req.timeout_s, self.require_group().timeout_s)
        opened: set[int] = set()

        async def open_one(i: int) -> None:
            await self._call(i, "pipelinerl", {"op": "start"})
            opened.add(i)
            await self._call(i, "pipelinerl", {"op": "update", "update_info": info})

        async def arm() -> None:  # all workers accept before the trainer hears of it
            await _gather_all([open_one(i) for i in range(self.workers)])

        async def await_go() -> None:
            await self._wait_jobs(key, deadline, received=False)

        async def receive() -> float:
            return await self._wait_jobs(key, deadline, received=True)

        async def apply() -> None:
            await self._all("pipelinerl", {"op": "finish", "version": req.version})
            opened.clear()
            self._worker_versions = [req.version] * self.workers

        async def abandon() -> None:  # close every opened session without applying anything
            shut = sorted(opened)
            opened.clear()
            results = await asyncio.gather(
                *(self._call(i, "pipelinerl", {"op": "finish", "version": None}) for i in shut), return_exceptions=True
            )
            for i, r in zip(shut, results, strict=True):
                if isinstance(r, BaseException):
                    log.warning("closing worker %d's weight-update session failed: %s", i, r)

        return UpdateSteps(await_go, receive, apply, self._paused_all, arm=arm, abandon=abandon)

    def engine_pause(self) -> EnginePause:
        return self._paused_all

    @asynccontextmanager
    async def _paused_all(self) -> AsyncIterator[None]:
        """Dynamo's own pause (mode keep: requests stay, frozen) on every worker; resumed on all
        on exit, also when a pause or the body failed."""

        async def pause(i: int) -> None:
            await self._call(i, "pause_generation", {"mode": "keep"})
            self._paused[i] = True

        try:
            await _gather_all([pause(i) for i in range(self.workers)])
            yield
        finally:
            held = [i for i in range(self.workers) if self._paused[i]]
            results = await asyncio.gather(
                *(self._call(i, "resume_generation", {}) for i in held), return_exceptions=True
            )
            for i, r in zip(held, results, strict=True):
                if isinstance(r, BaseException):
                    log.warning("resuming worker %d failed: %s", i, r)
                else:
                    self._paused[i] = False

    async def probe_broadcast(self, req: wire.ProbeBroadcastRequest) -> float:
        self.require_group()
        info = {"op": "probe", "nbytes": req.nbytes, "probe_id": req.probe_id, "timeout_s": req.timeout_s}
        await self._all("pipelinerl", {"op": "start"})
        try:
            await self._all("pipelinerl", {"op": "update", "update_info": info})
            with self.book.breaking():
                deadline = time.monotonic() + 3 * req.timeout_s + 30
                return await self._wait_jobs(wire.probe_key(req.probe_id), deadline, received=True)
        finally:
            await self._all("pipelinerl", {"op": "finish", "version": None})

    # --- generation -------------------------------------------------------------------------------

    async def chat_completion(self, req: wire.ChatCompletionRequest) -> wire.ChatCompletionResponse:
        c = self._cluster()
        plan = await plan_chat(self.tokenizer, req, self._max_model_len, unsupported=UNSUPPORTED)

        async def one(i: int) -> dict[str, Any]:
            body: dict[str, Any] = {
                "model": str(self.config.model),
                "messages": [m.for_template() for m in req.messages],
                "max_tokens": plan.max_tokens,
                "temperature": plan.temperature,
                "top_p": plan.top_p,
                "logprobs": req.logprobs,
                "ignore_eos": req.ignore_eos,
                "nvext": {"token_data": plan.prompt_ids, "extra_fields": ["engine_data"]},
            }
            if req.logprobs and plan.top:
                body["top_logprobs"] = plan.top
            if req.seed is not None:
                body["seed"] = req.seed + i
            assert self._http is not None
            try:
                r = await self._http.post(f"{c.frontend_url}/v1/chat/completions", json=body)
            except httpx.HTTPError as e:
                c.check_alive()
                raise RuntimeError(f"Dynamo's frontend did not answer: {type(e).__name__}: {e}") from e
            if r.status_code != 200:
                raise RuntimeError(f"Dynamo's frontend answered {r.status_code}: {r.text[:500]}")
            answer: dict[str, Any] = r.json()
            return answer

        outs = await asyncio.gather(*(one(i) for i in range(req.n)))
        choices = [self._choice(i, o, req, plan.top) for i, o in enumerate(outs)]
        return assemble_response(
            self.model_name,
            req,
            plan,
            choices,
            completion_tokens=sum(len(ch.weight_versions) for ch in choices),
        )

    def _choice(self, index: int, out: dict[str, Any], req: wire.ChatCompletionRequest, top: int) -> wire.ChatChoice:
        choice = out["choices"][0]
        data = ((out.get("nvext") or {}).get("engine_data") or {}).get("pipelinerl")
        if data is None:
            raise RuntimeError(
                "Dynamo's answer has no engine_data.pipelinerl: is the worker pipelinerl_sdk_dynamo.worker?"
            )
        token_ids = [int(t) for t in data["token_ids"]]
        reason = str(choice.get("finish_reason") or "stop")
        finish: Literal["stop", "length", "abort"] = reason if reason in ("stop", "length", "abort") else "abort"  # type: ignore[assignment]
        if req.logprobs and any(lp is None for lp in data["logprobs"]):
            raise RuntimeError("vLLM reported no logprob for a sampled token")
        return assemble_choice(
            self.tokenizer,
            index,
            req,
            text=str((choice.get("message") or {}).get("content") or ""),
            token_ids=token_ids,
            versions=versions_from_spans(
                ((version_label(v), int(s), int(e)) for v, s, e in data["versions"] or []),
                len(token_ids),
                engine="vLLM (through Dynamo)",
            ),
            finish_reason=finish,
            logprobs=[float(lp) for lp in data["logprobs"]] if req.logprobs else (),
            top_logprobs=[[(int(t), float(lp)) for t, lp in entry[:top]] for entry in data["top"]] if top else None,
            tool_parser=self.tool_parser,
        )


async def _gather_all(calls: Sequence[Awaitable[T]]) -> list[T]:
    """Await every call (none is left running); raise the first error once all returned."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return [r for r in results if not isinstance(r, BaseException)]


def _cpu_build() -> bool:
    from pipelinerl_sdk_vllm.server import is_cpu_build  # imports neither vLLM nor its server

    return is_cpu_build()


__all__ = ["UNSUPPORTED", "DynamoInferenceBackend", "WorkerError"]
