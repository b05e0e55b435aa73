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
  status; first bytes = every worker's first bucket arrived (the worker pushes its status then);
  pause = ``pause_generation(mode="keep")``/``resume_generation``; apply =
  ``finish_weight_update(version)`` (apply + version); abandon = ``finish_weight_update(None)``.
  ``direct`` mode pauses once every worker's first bucket arrived (the workers receive into a
  staging buffer of their own, so nothing live is written before the apply: a trainer stuck after
  its ``go`` holds no generation), ``staged`` only for the apply.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import aclosing, asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from pipelinerl_sdk import protocol as wire
from pipelinerl_sdk.contracts import ServeConfig
from pipelinerl_sdk.errors import GroupError, InvalidRequest, PipelineRLError, PluginError, UpdateRejected
from pipelinerl_sdk.kit.inference import KitBackend, UpdateSteps
from pipelinerl_sdk.kit.inference.chat import (
    ChatPlan,
    assemble_choice,
    assemble_response,
    plan_chat,
    sampling_args,
    version_label,
    versions_from_spans,
)
from pipelinerl_sdk.kit.inference.completion import assemble_completion, completion_choice, plan_completion
from pipelinerl_sdk.kit.inference.procs import idle_descendants
from pipelinerl_sdk.kit.inference.stream import TokenStep
from pipelinerl_sdk.kit.inference.structured import StructuredOutput
from pipelinerl_sdk.logprobs import LOGPROB_FLOOR
from pipelinerl_sdk_vllm.jobs import receive_deadline, receive_info, settled, wait_jobs
from pipelinerl_sdk_vllm.plugin import CARD
from pipelinerl_sdk_vllm.status_push import StatusInbox

log = logging.getLogger("pipelinerl_sdk_vllm")

#: Seconds between two polls of the workers' receive status (a cheap RPC between engine steps).
POLL_S = 0.01
#: The same once the workers' pushes (:mod:`.status_push`) were seen to arrive: polling is then
#: only the fallback, and each poll costs the engine core and the worker (busy-waiting for each
#: other's answer) CPU that the receive shares.
PUSHED_POLL_S = 0.1


@dataclass
class _Deciding:
    """An update armed and not yet past its trainer's decision: ``cancel`` is why it is to end
    (set by :meth:`VLLMInferenceBackend.cancel_waiting_update`), ``sent`` once the workers were
    asked to."""

    key: str
    cancel: str | None = None
    sent: bool = False


class VLLMInferenceBackend(KitBackend):
    """``pipelinerl serve --backend vllm --model PATH [--dtype float32|bfloat16]``; options
    (``--option k=v``): see the plugin's :data:`~pipelinerl_sdk_vllm.plugin.CARD`."""

    card = CARD

    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self._engine: Any = None
        self._cpu = True
        self._deciding: _Deciding | None = None
        #: Where the workers push their receive status (:mod:`.status_push`); set by ``serve``.
        self._inbox: StatusInbox | None = None
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

    @property
    def signs_rendezvous(self) -> bool:
        return True  # every vLLM worker joins through the SDK's WeightSyncGroup (transfer.py)

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

    async def _wait_jobs(
        self,
        key: str,
        deadline: float,
        *,
        received: bool,
        deciding: _Deciding | None = None,
        seen: list[dict[str, Any]] | None = None,
        watch: Callable[[list[dict[str, Any]]], None] | None = None,
    ) -> float:
        """:func:`~pipelinerl_sdk_vllm.jobs.wait_jobs` over this engine's workers; with
        ``deciding``, once it is to be cancelled, the workers' decision waits are ended first
        (each worker's job then fails, aborted, naming why; one that already had the trainer's
        ``go`` goes on receiving). ``seen`` is replaced by the last statuses read; ``watch`` is
        called with every worker's statuses each time they are read (pushed or polled)."""

        async def statuses() -> list[dict[str, Any]]:
            if deciding is not None and deciding.cancel is not None and not deciding.sent:
                deciding.sent = True
                why = deciding.cancel
                ended = await self._engine.collective_rpc("pipelinerl_cancel_decision", args=(key, why))
                log.info("%s: decision wait ended in %d of %d worker(s): %s", key, sum(ended), len(ended), why)
            read = self._pushed(key, received, watch) or list(await self._engine.collective_rpc("pipelinerl_status"))
            if seen is not None:
                seen[:] = read
            if watch is not None:
                watch(read)
            return read

        inbox = self._inbox
        if inbox is None:
            return await wait_jobs(statuses, key, deadline, received=received, poll_s=POLL_S)
        poll_s = PUSHED_POLL_S if inbox.reached else POLL_S
        return await wait_jobs(statuses, key, deadline, received=received, poll_s=poll_s, nap=inbox.wait)

    def _pushed(
        self, key: str, received: bool, watch: Callable[[list[dict[str, Any]]], None] | None = None
    ) -> list[dict[str, Any]] | None:
        """The workers' pushed statuses (:mod:`.status_push`) when every worker's is about job
        ``key`` and it has settled there (or failed); else None (then poll). ``watch`` sees them
        whenever every worker's is about ``key``, settled or not."""
        inbox = self._inbox
        if inbox is None:
            return None
        inbox.mark_read()
        pushed = inbox.statuses(self.workers)
        if pushed is None or any((s.get("job") or {}).get("key") != key for s in pushed):
            return None
        if watch is not None:
            watch(pushed)
        try:
            return pushed if settled(pushed, key, received=received) is not None else None
        except PipelineRLError:
            return pushed  # wait_jobs raises it from these

    def cancel_waiting_update(self, reason: str) -> bool:
        """An update armed and not yet past its trainer's decision ends: its next poll asks the
        workers to end their decision waits (``pipelinerl_cancel_decision``), which then fail with
        UpdateAborted naming ``reason``; nothing was received, the old weights keep serving."""
        deciding = self._deciding
        if deciding is None:
            return False
        deciding.cancel = deciding.cancel or reason
        return True

    def update_steps(self, req: wire.WeightUpdateRequest, mode: wire.ReceiveMode) -> UpdateSteps:
        engine, key = self._engine, wire.update_key(req.version)
        info = receive_info(req.version, req.params, req.bucket_bytes, req.timeout_s)
        deadline = receive_deadline(req.timeout_s, self.require_group().timeout_s)
        session: list[bool] = []
        deciding = _Deciding(key)
        statuses: list[dict[str, Any]] = []  # the workers' last status (their receive's stamps)
        applied: list[dict[str, float]] = []  # each worker's apply stamps
        flowing: list[asyncio.Future[None]] = []  # done once every worker's first bucket arrived

        def first_bucket() -> asyncio.Future[None]:
            if not flowing:
                flowing.append(asyncio.get_running_loop().create_future())
            return flowing[0]

        def watch(read: list[dict[str, Any]]) -> None:
            if all(_bytes_flow(s, key) for s in read) and not first_bucket().done():
                first_bucket().set_result(None)

        def decided() -> None:
            if self._deciding is deciding:
                self._deciding = None

        async def arm() -> None:
            self._deciding = deciding
            if self._inbox is not None:
                self._inbox.clear()  # what is pushed from now on is about this receive
            session.append(True)  # (a failed arm leaves it closed: abandon's finish then only logs)
            # vLLM's start_weight_update and update_weights, in one round trip
            await engine.collective_rpc("pipelinerl_arm", args=(info,))

        async def await_go() -> None:
            try:
                await self._wait_jobs(key, deadline, received=False, deciding=deciding)
            finally:
                decided()

        async def receive() -> float:
            first_bucket()  # (made on the loop)
            return await self._wait_jobs(key, deadline, received=True, seen=statuses, watch=watch)

        async def first_bytes() -> None:
            """Every worker's first bucket arrived: read from the statuses ``receive`` reads (the
            workers push theirs at that moment; polling is the fallback)."""
            await first_bucket()

        async def apply() -> None:
            # vLLM's finish_weight_update(version): the workers' finish (ours returns its
            # stamps), then the engine's version
            applied[:] = await engine.collective_rpc("pipelinerl_finish")
            session.clear()
            await engine.update_weight_version(str(req.version))

        async def abandon() -> None:
            decided()
            if session:  # close vLLM's update session without applying anything
                session.clear()
                try:
                    await engine.finish_weight_update(None)
                except Exception as e:  # the session is closed even when finish raises
                    log.warning("closing the weight-update session failed: %s", e)

        def stamps() -> dict[str, float]:
            """The workers' own stamps: the first bucket in on the first worker, the rest on the
            slowest."""
            jobs = [s.get("job") or {} for s in statuses]
            seen = [j.get("stamps") or {} for j in jobs] + applied
            out = {k: max(d[k] for d in seen if k in d) for k in {k for d in seen for k in d}}
            firsts = [d["worker_first_bucket"] for d in seen if "worker_first_bucket" in d]
            if firsts:
                out["worker_first_bucket"] = min(firsts)
            return out

        return UpdateSteps(
            await_go, receive, apply, self._paused, arm=arm, abandon=abandon, first_bytes=first_bytes, stamps=stamps
        )

    @asynccontextmanager
    async def _paused(self) -> AsyncIterator[None]:
        """Generation held (mode ``keep``, KV kept) for the block. What vLLM 0.32's
        ``AsyncLLM.pause_generation(mode="keep", clear_cache=False)`` does, less its closing
        ``asyncio.sleep(0.02)`` (there, per its comment, only so that outputs already produced
        reach their callers first, "not required for correctness"): that sleep was 20 ms of every
        update's pause, inside the hold and outside the apply."""
        await self._engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
        try:
            yield
        finally:
            await self._engine.resume_generation()

    async def apply_floor(self, repeats: int) -> wire.ApplyFloorResponse:
        """Every worker re-applies its last applied update ``repeats`` times through the same
        layerwise reload as an update's apply (``pipelinerl_apply_floor``), generation held as
        for an apply; per repeat, the slowest worker's seconds (timed in the worker)."""
        async with self._paused():
            results = await self._engine.collective_rpc("pipelinerl_apply_floor", args=(repeats,))
        errors = [r["error"] for r in results if isinstance(r, dict)]
        if errors:
            raise UpdateRejected(f"apply floor: {errors[0]}", status=422)
        return wire.ApplyFloorResponse(
            seconds=[max(float(r[i]) for r in results) for i in range(repeats)],
            detail="vLLM layerwise reload in the worker: initialize_layerwise_reload, model.load_weights(staged), "
            "finalize_layerwise_reload",
        )

    async def probe_broadcast(self, req: wire.ProbeBroadcastRequest) -> float:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self.require_group()
        engine = self._engine
        info = {"op": "probe", "nbytes": req.nbytes, "probe_id": req.probe_id, "timeout_s": req.timeout_s}
        if self._inbox is not None:
            self._inbox.clear()
        await engine.start_weight_update()
        try:
            await engine.update_weights(WeightTransferUpdateRequest(update_info=info))
            with self.book.breaking():
                deadline = time.monotonic() + 3 * req.timeout_s + 30
                return await self._wait_jobs(wire.probe_key(req.probe_id), deadline, received=True)
        finally:
            await engine.finish_weight_update(None)

    # --- generation -------------------------------------------------------------------------------

    def _params(self, plan: ChatPlan, req: wire.SamplingRequest, i: int, *, stream: bool = False) -> Any:
        """vLLM's ``SamplingParams`` for sample ``i`` of ``req`` (prompt logprobs on the first);
        ``stream``: outputs as deltas, one per engine step."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        with _refused_by_vllm():
            return SamplingParams(
                n=1,
                structured_outputs=_structured(plan.structured),
                logit_bias=dict(req.logit_bias) if req.logit_bias else None,
                **sampling_args(plan, req, i),
                max_tokens=plan.max_tokens,
                stop=list(plan.stop) or None,
                stop_token_ids=list(plan.stop_token_ids) or None,
                include_stop_str_in_output=req.include_stop_str_in_output,
                logprobs=plan.top if _wants_logprobs(req) else None,
                prompt_logprobs=req.prompt_top if i == 0 else None,
                ignore_eos=req.ignore_eos,
                skip_special_tokens=req.skip_special_tokens,
                output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            )

    async def _generate(self, plan: ChatPlan, params: Any, rid: str) -> AsyncGenerator[Any, None]:
        """vLLM's outputs of request ``rid`` on ``plan``'s prompt; what vLLM refuses as the
        client's fault (its ``VLLMClientError``s: a token id out of the vocabulary, a sampling
        value it does not take) is an InvalidRequest naming vLLM's parameter (400), not a 500.
        Closing it early aborts the request in vLLM."""
        outputs = self._engine.generate({"prompt_token_ids": plan.prompt_ids}, params, rid)
        async with aclosing(outputs):
            with _refused_by_vllm():
                async for out in outputs:
                    yield out

    async def _final(self, plan: ChatPlan, req: wire.SamplingRequest, i: int) -> Any:
        """Sample ``i`` of ``req`` for ``plan``'s prompt, run to its end: vLLM's last output."""
        final = None
        async for out in self._generate(plan, self._params(plan, req, i), f"cmpl-{uuid.uuid4().hex}"):
            final = out
        if final is None:
            raise RuntimeError("vLLM returned no output")
        return final

    def _prompt_entries(self, out: Any, req: wire.SamplingRequest) -> list[dict[int, wire.PromptLogprob] | None] | None:
        """vLLM's prompt logprobs of ``out`` in the protocol's shape (the first token has none)."""
        if req.prompt_top is None:
            return None
        entries: list[dict[int, wire.PromptLogprob] | None] = [None]
        for entry in (out.prompt_logprobs or [])[1:]:
            entries.append(
                None
                if entry is None
                else {
                    int(t): wire.PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
                    for t, lp in entry.items()
                }
            )
        return entries

    async def chat_completion(self, req: wire.ChatCompletionRequest) -> wire.ChatCompletionResponse:
        plan = await plan_chat(self.tokenizer, req, self._engine.model_config.max_model_len, structured=True)
        outs = await asyncio.gather(*(self._final(plan, req, i) for i in range(req.n)))
        return assemble_response(
            self.model_name,
            req,
            plan,
            [
                assemble_choice(
                    self.tokenizer, i, req, **self._outcome(o.outputs[0], req, plan), tool_parser=self.tool_parser
                )
                for i, o in enumerate(outs)
            ],
            completion_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
            prompt_logprobs=self._prompt_entries(outs[0], req),
        )

    async def completion(self, req: wire.CompletionRequest) -> wire.CompletionResponse:
        plans = await plan_completion(self.tokenizer, req, self._engine.model_config.max_model_len, self.vocab_size)
        n = req.n
        outs = await asyncio.gather(*(self._final(plan, req, i) for plan in plans for i in range(n)))
        choices = [
            completion_choice(
                self.tokenizer,
                k,
                req,
                plans[k // n],
                prompt_logprobs=self._prompt_entries(outs[k - k % n], req),
                **self._outcome(o.outputs[0], req, plans[k // n]),
            )
            for k, o in enumerate(outs)
        ]
        return assemble_completion(
            self.model_name, plans, choices, completion_tokens=sum(len(o.outputs[0].token_ids) for o in outs)
        )

    def _outcome(self, c: Any, req: wire.SamplingRequest, plan: ChatPlan) -> dict[str, Any]:
        """One finished vLLM ``CompletionOutput`` as the assembly's keywords: its text (vLLM's
        stop rule), tokens, per-token versions (vLLM's spans), logprobs, finish and stop reason."""
        token_ids = [int(t) for t in c.token_ids]
        finish = _finish(c.finish_reason, plan)  # first: an engine error is never a choice
        logprobs, tops = _token_logprobs(token_ids, c.logprobs, req, plan.top)
        return {
            "text": str(c.text),
            "token_ids": token_ids,
            "versions": versions_from_spans(_spans(c.weight_versions), len(token_ids), engine="vLLM"),
            "finish_reason": finish,
            "stop_reason": c.stop_reason,
            "logprobs": logprobs,
            "top_logprobs": tops,
        }

    def sample_steps(self, plan: ChatPlan, req: wire.SamplingRequest, i: int) -> AsyncIterator[TokenStep]:
        # vLLM's params made here, before the stream starts: a refusal in them is still a 400
        return self._steps(plan, req, self._params(plan, req, i, stream=True))

    async def _steps(self, plan: ChatPlan, req: wire.SamplingRequest, params: Any) -> AsyncIterator[TokenStep]:
        """vLLM's delta outputs of one sample as the kit's steps. vLLM 0.32 reports weight-version
        spans only with a request's last output; a step's versions before that are read from the
        spans its output processor keeps for the request as each engine step's tokens arrive
        (the same record the final spans are made of)."""
        rid = f"cmpl-{uuid.uuid4().hex}"
        processor = self._engine.output_processor
        state: Any = None
        done = 0  # tokens already stepped
        outputs = self._generate(plan, params, rid)
        async with aclosing(outputs):  # closing early (the client left) aborts the request in vLLM
            async for out in outputs:
                c = out.outputs[0]
                ids = [int(t) for t in c.token_ids]
                end = done + len(ids)
                if c.finish_reason is not None:
                    versions = versions_from_spans(_spans(c.weight_versions), end, engine="vLLM")[done:]
                else:
                    if state is None:
                        state = next((s for s in processor.request_states.values() if s.external_req_id == rid), None)
                        if state is None:
                            raise RuntimeError(f"vLLM keeps no state for request {rid} while it streams")
                    versions = _versions_between(state.weight_version_starts, done, end)
                logprobs, tops = _token_logprobs(ids, c.logprobs, req, plan.top)
                yield TokenStep(
                    ids,
                    logprobs if logprobs else [0.0] * len(ids),
                    versions,
                    tops or (),
                    _finish(c.finish_reason, plan) if c.finish_reason is not None else None,
                )
                done = end

    # --- the server -------------------------------------------------------------------------------

    def serve(self, config: ServeConfig) -> None:
        """vLLM owns its HTTP server: see :mod:`.server`."""
        from pipelinerl_sdk_vllm.server import run

        run(self, config)


def _bytes_flow(status: dict[str, Any], key: str) -> bool:
    """Whether a worker's ``status`` says the receive job ``key`` has its first bucket (or all)."""
    job = status.get("job") or {}
    return job.get("key") == key and (
        job.get("state") == "received" or "worker_first_bucket" in (job.get("stamps") or {})
    )


@contextmanager
def _refused_by_vllm() -> Iterator[None]:
    """vLLM's ``VLLMClientError`` (a request vLLM refuses, its own 4xx) raised in the block as
    the SDK's InvalidRequest naming vLLM's ``parameter`` where it names one."""
    from vllm.exceptions import VLLMClientError

    try:
        yield
    except VLLMClientError as e:
        raise InvalidRequest(f"vLLM refused the request: {e}", field=getattr(e, "parameter", None)) from e


def _wants_logprobs(req: wire.SamplingRequest) -> bool:
    """Chat asks with ``logprobs: true``, completions with ``logprobs: N`` (0 included)."""
    asked = getattr(req, "logprobs", None)
    return asked is not None and asked is not False


def _finish(reason: str | None, plan: ChatPlan) -> Literal["stop", "length", "abort"]:
    """The choice's finish reason from vLLM's (``repetition`` is a stop). vLLM's ``error``
    (a request it failed: its invariant is a 500) raises, never a choice that looks finished
    (it was a 200 with no text): for a request with a grammar, InvalidRequest naming its field
    (vLLM fails a request whose grammar does not compile, e.g. a regex past its compile time
    limit, ``VLLM_REGEX_COMPILATION_TIMEOUT_S``, 5 s by default), else RuntimeError (a 500)."""
    if reason == "error":
        so = plan.structured
        if so is not None:
            raise InvalidRequest(
                f"{so.field}: vLLM failed the request; its grammar did not compile within vLLM's limits "
                "(VLLM_REGEX_COMPILATION_TIMEOUT_S for a regex; the server log has vLLM's reason)",
                field=so.field,
            )
        raise RuntimeError("vLLM failed the request (finish reason 'error'; the server log has vLLM's reason)")
    return reason if reason in ("stop", "length", "abort") else "stop"  # type: ignore[return-value]


def _spans(spans: Any) -> Iterator[tuple[int, int, int]]:
    return ((version_label(s.version), s.start, s.end) for s in spans or [])


def _versions_between(starts: list[tuple[str, int]], begin: int, end: int) -> list[int]:
    """The versions of output tokens ``begin`` to ``end`` (exclusive) from vLLM's running record
    of ``(version label, first token index)`` spans; RuntimeError where the record does not
    cover them (a version never guessed)."""
    if not starts or starts[0][1] > begin:
        raise RuntimeError(f"vLLM recorded no weight version for tokens {begin}..{end}: {starts}")
    out = []
    for j in range(begin, end):
        label = next(v for v, first in reversed(starts) if first <= j)
        out.append(version_label(label))
    return out


def _token_logprobs(
    token_ids: list[int], entries: Any, req: wire.SamplingRequest, top: int
) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
    """The sampled tokens' logprobs (what the server's ``--logprobs-mode`` makes them) and
    (``top`` > 0) their best ``top`` alternatives from vLLM's per-token logprob dicts; nothing
    where the request did not ask. -inf (a token a processed mode's filters cut) is reported as
    vLLM's own server does, :data:`~pipelinerl_sdk.logprobs.LOGPROB_FLOOR`."""
    if not _wants_logprobs(req):
        return [], None
    entries = list(entries or [])
    logprobs = [max(entry[tid].logprob, LOGPROB_FLOOR) for tid, entry in zip(token_ids, entries, strict=True)]
    tops = (
        [
            [(t, max(lp.logprob, LOGPROB_FLOOR)) for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)[:top]]
            for entry in entries
        ]
        if top
        else None
    )
    return logprobs, tops


__all__ = ["VLLMInferenceBackend"]


def _structured(so: StructuredOutput | None) -> Any:
    """vLLM's ``StructuredOutputsParams`` for ``so`` (None: free text): the same grammar kinds,
    compiled by vLLM's own structured-output backend (xgrammar by default). A request's
    ``disable_any_whitespace`` is refused (400): vLLM 0.32's backends read only the server's
    ``--structured-outputs-config.disable_any_whitespace`` and would ignore it."""
    if so is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if not so.any_whitespace:
        raise InvalidRequest(
            "structured_outputs.disable_any_whitespace: vLLM applies only its server-wide setting, not a request's",
            field="structured_outputs.disable_any_whitespace",
        )
    if so.kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if so.kind == "json_schema":
        return StructuredOutputsParams(json=so.spec)
    if so.kind == "choice":
        return StructuredOutputsParams(choice=json.loads(so.spec or "[]"))
    return StructuredOutputsParams(**{so.kind: so.spec})
