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
- Update (``staged``, the default): ``accepted`` -> the trainer's ``go`` and ``sending`` mark ->
  each TP rank's staged receiver (:mod:`.staged_receiver`, a thread in SGLang's scheduler
  process) receives the update on SGLang's group while SGLang generates ->
  ``pause_generation(in_place)`` -> ``begin_weight_update`` -> the ``apply_staged`` hook
  (``model.load_weights``, with ``weight_version``) -> ``end_weight_update`` ->
  ``continue_generation``.
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
import dataclasses
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, aclosing, asynccontextmanager
from typing import Any

import httpx

from pipelinerl_sdk import protocol as wire
from pipelinerl_sdk.contracts import ServeConfig
from pipelinerl_sdk.errors import GroupError, InvalidRequest, PluginError, UpdateFailed, UpdateRejected
from pipelinerl_sdk.kit.inference import KitBackend, UpdateSteps
from pipelinerl_sdk.kit.inference.chat import (
    ChatPlan,
    FinishReason,
    StopRule,
    assemble_choice,
    assemble_response,
    plan_chat,
    prompt_entries,
    refuse,
    version_label,
    versions_from_spans,
)
from pipelinerl_sdk.kit.inference.completion import (
    assemble_completion,
    completion_choice,
    plan_completion,
    vocabulary_bound,
)
from pipelinerl_sdk.kit.inference.hold import EnginePause
from pipelinerl_sdk.kit.inference.stream import TokenStep
from pipelinerl_sdk.kit.inference.structured import StructuredOutput, choice_grammar
from pipelinerl_sdk.weights.auth import store_name
from pipelinerl_sdk_sglang.engine import (
    SGLangClient,
    SGLangError,
    SGLangProcess,
    SGLangRefused,
    cpu_threads,
    free_port,
    launch_args,
    launch_env,
    new_api_key,
)
from pipelinerl_sdk_sglang.plugin import CARD

log = logging.getLogger("pipelinerl_sdk_sglang")

#: Seconds SGLang may take to exit on SIGTERM before it (and every process it started) is
#: killed: its interpreter's teardown took 5 s and more here, past the server's shutdown bound
#: (``kit.inference.serve.EXIT_MARGIN_S`` after the drain), which then ended the gateway with
#: status 1. Nothing of SGLang's needs a graceful exit: the weights live in the trainer.
STOP_S = 2.0

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
        cpu_threads(self.opts)  # a bad cpu_threads is refused here, before anything starts
        self._proc: SGLangProcess | None = None
        self._sgl: SGLangClient | None = None
        #: The group's name inside SGLang and the store (``weights.auth.store_name``).
        self._engine_group = ""
        self._decisions: Any = None  # weights.group.DecisionBoard
        #: Aborts of streams closed early, still being sent to SGLang.
        self._aborts: set[asyncio.Future[None]] = set()
        #: Watches the SGLang child (:meth:`_watch_engine`); set once it is up, ended by stop().
        self._watch: asyncio.Task[None] | None = None
        #: The private directory (mode 0700) of the staged receivers' sockets, and their stem
        #: (each TP rank's socket is ``STEM.RANK``): set by start().
        self._staged_dir: str | None = None
        self._staged_stem = ""

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
        env = launch_env(device, self.opts)
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
            await self._serve_staged()
        except BaseException:
            await self.stop()
            raise
        print(f"pipelinerl: SGLang up in {time.perf_counter() - t0:.1f}s", flush=True)
        if self._proc is not None:
            self._watch = asyncio.create_task(self._watch_engine(self._proc))

    async def _watch_engine(self, proc: SGLangProcess, every_s: float = 1.0) -> None:
        """Once SGLang exits while serving (its scheduler died: e.g. an input it could not
        handle), the gateway exits too, with status 1 and SGLang's log tail on its output:
        alive without its engine it answered ``/health`` "ok" and every generation a 500, so
        neither a launcher nor a health check could tell."""
        while True:
            await asyncio.sleep(every_s)
            try:
                proc.check_alive()
            except PluginError as e:
                log.error("%s\nthe gateway exits: it cannot serve without SGLang", e)
                print(f"pipelinerl: {e}\npipelinerl: the gateway exits: it cannot serve without SGLang", flush=True)
                logging.shutdown()
                os._exit(1)

    async def _serve_staged(self) -> None:
        """Start each TP rank's staged receiver in SGLang's scheduler
        (:func:`~pipelinerl_sdk_sglang.scheduler_hooks.serve_staged`), its socket in a private
        directory: what the ``staged`` receive mode talks to."""
        import tempfile

        self._staged_dir = tempfile.mkdtemp(prefix="pipelinerl-sglang-staged-")  # mode 0700
        self._staged_stem = os.path.join(self._staged_dir, "receiver")
        await self._in_session("serve_staged", self._staged_stem)

    async def _in_session(self, hook: str, *args: object) -> list[dict[str, Any]]:
        """A scheduler hook with generation held and a weight-update session open for it (the
        state a hook runs in); each TP rank's result."""
        sgl = self.sglang
        async with self._paused():
            await sgl.control("/begin_weight_update", {})
            try:
                return await sgl.call_hook(hook, *args, tp_size=self._tp)
            finally:
                await sgl.control("/end_weight_update", {})

    async def stop(self) -> None:
        if self._staged_dir is not None:
            import shutil

            shutil.rmtree(self._staged_dir, ignore_errors=True)
            self._staged_dir = None
        if self._watch is not None:  # SGLang is stopped on purpose from here
            self._watch.cancel()
            self._watch = None
        if self._sgl is not None:
            await self._sgl.close()
        if self._proc is not None:  # killed if slow: the server's whole shutdown is bounded
            await asyncio.to_thread(self._proc.stop, STOP_S)

    # --- weight sync ------------------------------------------------------------------------------

    @property
    def signs_rendezvous(self) -> bool:
        return True  # SGLang's own group call, its rendezvous signed in its scheduler (scheduler_hooks)

    async def _sign_next_rendezvous(self, req: wire.InitProcessGroupRequest) -> None:
        """Arm SGLang's scheduler (:func:`~pipelinerl_sdk_sglang.scheduler_hooks.sign_rendezvous`)
        so that its next group formation at ``req.init_method`` signs and verifies every
        rendezvous value under the group's secret (a hook runs inside a weight-update session,
        generation held for the moment it takes)."""
        await self._in_session("sign_rendezvous", req.init_method, req.group_secret)

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
        # The store first: SGLang joins with torch's default timeout (30 min), blocking its
        # scheduler (every generation) meanwhile, so it is asked only once the store answers.
        try:
            decisions = await asyncio.to_thread(
                DecisionBoard.connect, req.init_method, name, req.timeout_s, req.group_secret
            )
        except GroupError as e:
            raise GroupError(
                f"could not form group {req.group_name!r} at {req.init_method}: its store did not answer within "
                f"timeout_s={req.timeout_s:g} (SGLang was not asked to join): {e}"
            ) from e
        try:
            if req.signed_rendezvous:
                await self._sign_next_rendezvous(req)
            await asyncio.wait_for(self.sglang.control("/init_weights_update_group", body), req.timeout_s + 30)
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
    async def _engine_paused(self) -> AsyncIterator[None]:
        """SGLang's own pause (``in_place``: requests in flight stay, frozen), resumed on exit."""
        await self.sglang.control("/pause_generation", {"mode": "in_place"})
        try:
            yield
        finally:
            await self.sglang.control("/continue_generation", {})

    def engine_pause(self) -> EnginePause:
        return self._engine_paused

    def _paused(self) -> AbstractAsyncContextManager[Any]:
        """Generation held for a hook's work (not an update's: the kit wraps those), sharing a
        client's hold (``/pause?mode=keep``): inside one at once, else SGLang's pause."""
        hold = self.generation_hold()
        assert hold is not None
        return hold.around(self._engine_paused)()

    def _await_go_and_sending(
        self, req: wire.WeightUpdateRequest, seen: dict[str, float]
    ) -> Callable[[], Awaitable[None]]:
        """The step that waits for the trainer's go, then its sending mark: whatever receives
        enters the broadcast only once the trainer is sending (a trainer stuck after its go
        holds nothing; one whose gather failed before its first param ends the update here)."""

        async def await_go() -> None:
            deadline = time.monotonic() + req.timeout_s
            await self._await_go(wire.update_key(req.version), req.timeout_s)
            seen["go"] = time.time()
            await self._await_go(wire.sending_key(req.version), max(deadline - time.monotonic(), 1.0))

        return await_go

    def update_steps(self, req: wire.WeightUpdateRequest, mode: wire.ReceiveMode) -> UpdateSteps:
        if mode == "staged":
            return self._staged_steps(req)
        from pipelinerl_sdk.weights.buckets import BucketPlan

        self.require_group()
        sgl, group_name = self.sglang, self._engine_group
        plan = BucketPlan.build(req.params, req.bucket_bytes)
        state = {"session": False, "snapshot": False, "loaded": False}
        seen: dict[str, float] = {}  # SGLang's own phases (time.time()): its session open, each bucket loaded
        # SGLang receives in place, so generation is held from the moment this returns
        await_go = self._await_go_and_sending(req, seen)

        async def receive() -> float:
            """Inside the pause: SGLang loads each bucket as it arrives (the apply is in here)."""
            await sgl.control("/begin_weight_update", {})
            state["session"] = True
            seen["session_open"] = time.time()
            if self._atomic and len(plan.buckets) > 1:
                await sgl.call_hook("snapshot", tp_size=self._tp)
                state["snapshot"] = True
                seen["snapshot_taken"] = time.time()
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
                seen.setdefault("first_bucket", time.time())  # received and loaded by SGLang
            return time.perf_counter() - t_recv

        async def apply() -> None:
            if state["snapshot"]:
                await sgl.call_hook("discard", tp_size=self._tp)
            await sgl.control("/end_weight_update", {})
            state["session"] = False

        async def abandon() -> None:
            await self._roll_back(state["snapshot"], state["loaded"], state["session"])

        return UpdateSteps(await_go, receive, apply, self._engine_paused, abandon=abandon, stamps=lambda: seen)

    def _staged_steps(self, req: wire.WeightUpdateRequest) -> UpdateSteps:
        """``staged``: after the trainer's go and sending mark, each TP rank's staged receiver
        (:mod:`.staged_receiver`, a thread in SGLang's scheduler process) receives the whole
        update into its staging buffer while SGLang keeps generating; inside the pause one
        session applies it (:func:`~pipelinerl_sdk_sglang.scheduler_hooks.apply_staged`: SGLang's
        ``model.load_weights``) and SGLang records the new version with the same call. Nothing
        is written to the model before that apply, so any failure before it leaves the old
        weights serving untouched, with no snapshot."""
        self.require_group()
        sgl = self.sglang
        seen: dict[str, float] = {}  # SGLang's side (time.time()): first and last bucket staged, its load
        state = {"session": False}
        command = {
            "group": self._engine_group,
            "params": [p.model_dump(mode="json") for p in req.params],
            "bucket_bytes": req.bucket_bytes,
            "timeout_s": req.timeout_s,
        }

        async def receive() -> float:
            seconds = await asyncio.gather(
                *(self._receive_staged(path, command, seen) for path in self._staged_paths())
            )
            return max(seconds)

        async def apply() -> None:
            await sgl.control("/begin_weight_update", {})
            state["session"] = True
            try:
                results = await sgl.call_hook(
                    "apply_staged", self._staged_stem, tp_size=self._tp, weight_version=str(req.version)
                )
            except SGLangError as e:
                # SGLang recorded the version with the call: the old one goes back, generation
                # stays paused until then (no token is tagged with a version it was not made by)
                await sgl.control(
                    "/update_weight_version", {"new_version": str(self.version), "abort_all_requests": False}
                )
                raise PluginError(f"SGLang's load of the staged update failed (the weights may be mixed): {e}") from e
            seen["engine_apply_start"] = min(float(r["start"]) for r in results)  # SGLang's load_weights
            seen["engine_apply_end"] = max(float(r["end"]) for r in results)
            await sgl.control("/end_weight_update", {})
            state["session"] = False

        async def abandon() -> None:
            if state["session"]:
                try:
                    await sgl.control("/end_weight_update", {})
                except SGLangError as e:
                    raise PluginError(f"staged update failed and closing SGLang's session failed too: {e}") from e

        return UpdateSteps(
            self._await_go_and_sending(req, seen),
            receive,
            apply,
            self._engine_paused,
            abandon=abandon,
            stamps=lambda: seen,
        )

    def _staged_paths(self) -> list[str]:
        return [f"{self._staged_stem}.{rank}" for rank in range(self._tp)]

    async def _receive_staged(self, path: str, command: dict[str, Any], seen: dict[str, float]) -> float:
        """One TP rank's staged receive (the protocol in :mod:`.staged_receiver`); its receive
        seconds. GroupError where the broadcast failed (the group is then broken),
        NonFiniteWeights for a NaN or an infinity, UpdateFailed otherwise."""
        from pipelinerl_sdk.weights.receive import NonFiniteWeights

        try:
            reader, writer = await asyncio.open_unix_connection(path, limit=1 << 20)
        except OSError as e:
            raise UpdateFailed(f"SGLang's staged receiver at {path} is not reachable: {e}") from e
        try:
            writer.write(json.dumps(command).encode() + b"\n")
            await writer.drain()
            while True:
                try:
                    line = await asyncio.wait_for(reader.readline(), float(command["timeout_s"]) + 30)
                except TimeoutError as e:
                    raise GroupError(f"SGLang's staged receiver at {path} said nothing for the update's timeout") from e
                if not line:
                    raise GroupError(f"SGLang's staged receiver at {path} closed before the update arrived")
                event = json.loads(line)
                if event["event"] == "first_bucket":
                    seen.setdefault("first_bucket", float(event["t"]))
                elif event["event"] == "received":
                    seen["last_bucket_staged"] = max(seen.get("last_bucket_staged", 0.0), float(event["t"]))
                    return float(event["seconds"])
                else:
                    message = f"SGLang's staged receive: {event.get('message')}"
                    if event.get("kind") == "group":
                        raise GroupError(message)
                    if event.get("kind") == "non_finite":
                        raise NonFiniteWeights(message)
                    raise UpdateFailed(message)
        finally:
            writer.close()

    async def _roll_back(self, snapshot: bool, loaded: bool, session: bool) -> None:
        """After a failed update: put the old weights back (if any bucket was loaded) and close
        SGLang's session. Raises PluginError if old weights cannot be guaranteed."""
        sgl = self.sglang
        try:
            if loaded and snapshot:
                await sgl.call_hook("restore", tp_size=self._tp)
            elif snapshot:
                await sgl.call_hook("discard", tp_size=self._tp)
            if session:
                await sgl.control("/end_weight_update", {})
        except SGLangError as e:
            raise PluginError(f"update failed and rolling back failed too: {e}") from e
        if loaded and not snapshot:
            raise PluginError("update failed after some buckets were loaded (option atomic=0)")

    async def apply_floor(self, repeats: int) -> wire.ApplyFloorResponse:
        """SGLang's own apply of the model's tensors, no transfer, timed inside its scheduler
        (:func:`~pipelinerl_sdk_sglang.scheduler_hooks.apply_floor`), generation held and a
        weight-update session open as for an update; the served weights are put back. Per
        repeat, the slowest TP rank's seconds."""
        sgl = self.sglang
        async with self._paused():
            await sgl.control("/begin_weight_update", {})
            try:
                results = await sgl.call_hook("apply_floor", self.config.model, repeats, tp_size=self._tp)
            except SGLangError as e:
                raise UpdateRejected(f"apply floor: {e}", status=422) from e
            finally:
                await sgl.control("/end_weight_update", {})
        return wire.ApplyFloorResponse(
            seconds=[max(float(r["seconds"][i]) for r in results) for i in range(repeats)],
            detail="SGLang in its scheduler: restore_weights_before_loading, model.load_weights(checkpoint "
            "tensors), postprocess_weights (one update's session), served weights put back",
        )

    async def probe_broadcast(self, req: wire.ProbeBroadcastRequest) -> float:
        self.require_group()
        group_name, sgl = self._engine_group, self.sglang
        with self.book.breaking():
            await self._await_go(wire.probe_key(req.probe_id), req.timeout_s)
            try:
                async with self._paused():
                    await sgl.control("/begin_weight_update", {})
                    try:
                        t0 = time.perf_counter()
                        await sgl.call_hook("probe", group_name, req.nbytes, tp_size=self._tp)
                        return time.perf_counter() - t0
                    finally:
                        await sgl.control("/end_weight_update", {})
            except SGLangError as e:
                raise GroupError(f"probe receive failed: {e}") from e

    # --- generation -------------------------------------------------------------------------------

    def _refuse(self, req: wire.SamplingRequest) -> None:
        """What SGLang cannot do, refused before anything is sent (400 naming the field): the
        kit's :func:`~pipelinerl_sdk.kit.inference.chat.refuse` of :data:`UNSUPPORTED` (a logit
        bias), ``stop_token_ids`` outside the vocabulary (as the reference refuses them), prompt
        logprob alternatives (SGLang's one ``top_logprobs_num`` is shared by the prompt and the
        completion), a ``repetition_penalty`` past SGLang's 2."""
        refuse(req, UNSUPPORTED)
        bound = vocabulary_bound(self.tokenizer, self.vocab_size)
        bad = [t for t in req.stop_token_ids or () if not 0 <= t < bound]
        if bad:  # (SGLang's scheduler takes them as they come)
            raise InvalidRequest(
                f"stop_token_ids: token ids {bad[:5]} outside the vocabulary [0, {bound})", field="stop_token_ids"
            )
        if req.prompt_top:
            raise InvalidRequest(
                "prompt_logprobs: alternatives (a count above 0) are not served on SGLang; use true or 0",
                field="prompt_logprobs",
            )
        if req.repetition_penalty > 2:  # the protocol's (vLLM's) range is (0, 10]
            raise InvalidRequest(
                f"repetition_penalty: SGLang takes (0, 2], got {req.repetition_penalty:g}", field="repetition_penalty"
            )

    def _body(self, plan: ChatPlan, req: wire.SamplingRequest, i: int, *, stream: bool = False) -> dict[str, Any]:
        """SGLang's ``/generate`` body for sample ``i`` of ``req`` on ``plan``'s prompt (prompt
        logprobs on the first sample if asked; ``stream``: SGLang's streamed events), with the
        constraint :meth:`prepare` made (a spec that does not compile was a 400 naming its field
        there, before SGLang saw it)."""
        sampling: dict[str, Any] = {
            "max_new_tokens": plan.max_tokens,
            "temperature": plan.temperature,
            "top_p": plan.top_p,
            # off past the vocabulary (keeps every token, as asked): SGLang makes an int32 tensor
            # of the batch's top_k, and one past 2^31 killed its scheduler
            "top_k": req.top_k
            if req.top_k and 0 < req.top_k < vocabulary_bound(self.tokenizer, self.vocab_size)
            else -1,
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
            sampling["sampling_seed"] = (req.seed + i) % (1 << 63)  # an int64, as SGLang's tensors hold it
        if plan.structured is not None:
            if plan.constraint is None:
                raise RuntimeError("a structured plan must be prepared (its constraint checked) before it is sampled")
            sampling.update(plan.constraint)
        prompt_lps = req.prompt_top is not None and i == 0 and not stream
        body: dict[str, Any] = {
            "input_ids": plan.prompt_ids,
            "sampling_params": sampling,
            "return_logprob": _wants_logprobs(req) or prompt_lps,
            "logprob_start_len": 0 if prompt_lps else -1,
            "top_logprobs_num": plan.top,
            "rid": f"cmpl-{uuid.uuid4().hex}",
        }
        if stream:
            body["stream"] = True
        return body

    def _prompt_entries(self, out: dict[str, Any], plan: ChatPlan) -> list[dict[int, wire.PromptLogprob] | None]:
        """SGLang's prompt logprobs of ``out`` (its first sample) in the protocol's shape."""
        raw = out["meta_info"].get("input_token_logprobs") or []
        if len(raw) != len(plan.prompt_ids):
            raise RuntimeError(f"SGLang returned {len(raw)} prompt logprobs for {len(plan.prompt_ids)} prompt tokens")
        return prompt_entries(
            self.tokenizer, plan.prompt_ids, [None, *(None if e[0] is None else float(e[0]) for e in raw[1:])]
        )

    async def chat_completion(self, req: wire.ChatCompletionRequest) -> wire.ChatCompletionResponse:
        self._refuse(req)
        plan = await self.prepare(await plan_chat(self.tokenizer, req, self._context, structured=True))  # refused above
        field = plan.structured.field if plan.structured is not None else None
        outs = await self._generate_all([self._body(plan, req, i) for i in range(req.n)], field)
        return assemble_response(
            self.model_name,
            req,
            plan,
            [
                assemble_choice(self.tokenizer, i, req, **self._outcome(o, req, plan), tool_parser=self.tool_parser)
                for i, o in enumerate(outs)
            ],
            completion_tokens=sum(len(o["output_ids"]) for o in outs),
            prompt_logprobs=self._prompt_entries(outs[0], plan) if req.prompt_top is not None else None,
        )

    async def _generate_all(self, bodies: list[dict[str, Any]], field: str | None) -> list[dict[str, Any]]:
        """SGLang's ``/generate`` of every body at once, in order. The first failure cancels the
        others (their connections close, so SGLang aborts them: no orphan keeps decoding) and is
        raised; SGLang refusing one (its 400) is InvalidRequest naming ``field`` where known."""
        try:
            async with asyncio.TaskGroup() as tasks:
                running = [tasks.create_task(self.sglang.generate(b)) for b in bodies]
        except BaseExceptionGroup as group:
            first = group.exceptions[0]
            if isinstance(first, SGLangRefused):
                raise InvalidRequest(f"SGLang refused the request: {first}", field=field) from first
            raise first from None
        return [t.result() for t in running]

    async def completion(self, req: wire.CompletionRequest) -> wire.CompletionResponse:
        """``/v1/completions``: every prompt's ``n`` samples on SGLang at once, prompt logprobs
        from each prompt's first sample."""
        self._refuse(req)
        plans = await plan_completion(self.tokenizer, req, self._context, self.vocab_size)
        n = req.n
        outs = await self._generate_all([self._body(plan, req, i) for plan in plans for i in range(n)], None)
        choices = [
            completion_choice(
                self.tokenizer,
                k,
                req,
                plans[k // n],
                prompt_logprobs=self._prompt_entries(outs[k - k % n], plans[k // n])
                if req.prompt_top is not None
                else None,
                **self._outcome(o, req, plans[k // n]),
            )
            for k, o in enumerate(outs)
        ]
        return assemble_completion(
            self.model_name, plans, choices, completion_tokens=sum(len(o["output_ids"]) for o in outs)
        )

    def _outcome(self, out: dict[str, Any], req: wire.SamplingRequest, plan: ChatPlan) -> dict[str, Any]:
        """One finished SGLang output as the assembly's keywords: SGLang's text (its stop rule),
        tokens, per-token versions (SGLang's spans), raw logprobs, finish and stop reason."""
        meta = out["meta_info"]
        token_ids = [int(t) for t in out["output_ids"]]
        finish, stop_reason = _finish(meta, req, plan)
        if finish is None:
            raise RuntimeError(f"SGLang's output of {meta.get('id')} carries no finish reason")
        logprobs, tops = _token_logprobs(meta, req, plan.top, 0, len(token_ids))
        # a partial UTF-8 character ending SGLang's text (U+FFFD) is dropped, as vLLM and the kit's
        # stream drop it: streamed and non-streamed texts stay equal
        text = str(out.get("text", "")).rstrip("\ufffd")
        versions = _spans_to_versions(meta, len(token_ids))
        k = _stop_token_at(token_ids, req)
        if k is not None:  # SGLang ran past a stop token under ignore_eos: vLLM stops there
            token_ids, versions, logprobs = token_ids[: k + 1], versions[: k + 1], logprobs[: k + 1]
            tops = None if tops is None else tops[: k + 1]
            finish, stop_reason = "stop", token_ids[k]
            text, _ = StopRule(self.tokenizer, req).finish(token_ids, "stop", frozenset(req.stop_token_ids or ()))
        return {
            "text": text,
            "token_ids": token_ids,
            "versions": versions,
            "finish_reason": finish,
            "stop_reason": stop_reason,
            "logprobs": logprobs,
            "top_logprobs": tops,
        }

    async def prepare(self, plan: ChatPlan) -> ChatPlan:
        """``plan`` with SGLang's constraint parameter (:func:`sglang_constraint`: its spec
        parsed by xgrammar, which grows with the spec) made on a worker thread, once per request."""
        if plan.structured is None:
            return plan
        return dataclasses.replace(plan, constraint=await asyncio.to_thread(sglang_constraint, plan.structured))

    def sample_steps(self, plan: ChatPlan, req: wire.SamplingRequest, i: int) -> AsyncIterator[TokenStep]:
        # refusals here, before the stream starts: still a 400
        self._refuse(req)
        return self._steps(plan, req, self._body(plan, req, i, stream=True))

    async def _steps(self, plan: ChatPlan, req: wire.SamplingRequest, body: dict[str, Any]) -> AsyncIterator[TokenStep]:
        """SGLang's streamed events of one sample as the kit's steps (SGLang 0.5.23 sends each
        event's ids and logprobs cumulatively by default, as deltas with
        ``--incremental-streaming-output``: both are read). A step's versions are the
        ``weight_version`` SGLang's tokenizer manager stamps on the event it forwards: the
        adapter changes versions only inside ``pause_generation`` .. ``continue_generation``,
        so a token computed after an update is stamped with its version. The last event's
        ``weight_versions`` spans (SGLang's exact per-token record) are checked against every
        version streamed: RuntimeError (the stream's error event) where they disagree, never a
        silently wrong tag. Closing the iterator early aborts the request in SGLang."""
        rid = str(body["rid"])
        done = 0  # tokens already stepped
        sent: list[int] = []  # their versions
        finished = False
        events = self.sglang.generate_stream(body)
        try:
            async with aclosing(events):  # type: ignore[type-var]
                async for out in events:
                    meta = out["meta_info"]
                    ids = [int(t) for t in out["output_ids"]]
                    total = int(meta.get("completion_tokens", len(ids)))
                    if len(ids) == total:  # cumulative
                        ids = ids[done:]
                    elif done + len(ids) != total:
                        raise RuntimeError(f"SGLang streamed {len(ids)} ids for a request at {done} of {total} tokens")
                    finish, _ = _finish(meta, req, plan)
                    logprobs, tops = _token_logprobs(meta, req, plan.top, done, total)
                    if finish is not None:
                        finished = True
                        exact = _spans_to_versions(meta, total)
                        if exact[:done] != sent:
                            raise RuntimeError(
                                f"SGLang's final weight-version spans {meta.get('weight_versions')} disagree with "
                                f"the versions streamed for request {rid}: {sent}"
                            )
                        versions = exact[done:]
                    else:
                        versions = [version_label(str(meta["weight_version"]))] * len(ids)
                    sent.extend(versions)
                    done = total
                    if not ids and finish is None:
                        continue
                    k = _stop_token_at(ids, req)
                    if k is not None:  # a stop token SGLang ignores under ignore_eos: vLLM stops on it
                        ids, versions, logprobs = ids[: k + 1], versions[: k + 1], (logprobs or [])[: k + 1]
                        tops, finish = (tops or [])[: k + 1], "stop"
                    yield TokenStep(ids, logprobs or [0.0] * len(ids), versions, tops or (), finish)
                    if finish is not None:
                        return  # a sample cut here is still running in SGLang: the finally aborts it
        finally:
            if not finished:  # closed early (the client left) or failed: SGLang stops the sample
                task = asyncio.ensure_future(self._abort(rid))
                self._aborts.add(task)
                task.add_done_callback(self._aborts.discard)
        if not finished:
            raise RuntimeError(f"SGLang's stream of request {rid} ended without a finish reason")

    async def _abort(self, rid: str) -> None:
        try:
            await self.sglang.abort(rid)
        except (SGLangError, httpx.HTTPError, PluginError) as e:
            log.warning("aborting SGLang request %s failed: %s", rid, e)


def _stop_token_at(ids: list[int], req: wire.SamplingRequest) -> int | None:
    """Where ``ids`` first hold one of ``req``'s ``stop_token_ids`` when it also asks
    ``ignore_eos`` (SGLang 0.5.23 then ignores its stop token ids as well; vLLM ignores only
    end-of-sequence), else None."""
    if not (req.ignore_eos and req.stop_token_ids):
        return None
    stops = set(req.stop_token_ids)
    return next((j for j, t in enumerate(ids) if t in stops), None)


def _wants_logprobs(req: wire.SamplingRequest) -> bool:
    """Chat asks with ``logprobs: true``, completions with ``logprobs: N`` (0 included)."""
    asked = getattr(req, "logprobs", None)
    return asked is not None and asked is not False


def _finish(
    meta: dict[str, Any], req: wire.SamplingRequest, plan: ChatPlan
) -> tuple[FinishReason | None, str | int | None]:
    """(finish reason, vLLM's stop reason) of an SGLang output (None while it runs): the stop
    string or ``stop_token_ids`` id that ended it, None for end-of-sequence. An abort SGLang
    made itself is an error: InvalidRequest naming the constraint's field where SGLang refused
    the constraint, RuntimeError otherwise."""
    reason = meta.get("finish_reason")
    if reason is None:
        return None, None
    kind = reason.get("type", "stop") if isinstance(reason, dict) else str(reason)
    if kind == "abort":
        message = str(reason.get("message", "")) if isinstance(reason, dict) else ""
        so = plan.structured
        if so is not None and "grammar" in message.lower():
            raise InvalidRequest(f"{so.field}: SGLang refused the constraint: {message}", field=so.field)
        raise RuntimeError(f"SGLang aborted the request: {reason}")
    if kind == "length":
        return "length", None
    matched = reason.get("matched") if isinstance(reason, dict) else None
    if isinstance(matched, str):
        return "stop", matched
    if isinstance(matched, int) and matched in (req.stop_token_ids or ()):
        return "stop", matched
    return "stop", None


def _token_logprobs(
    meta: dict[str, Any], req: wire.SamplingRequest, top: int, done: int, total: int
) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
    """The raw logprobs of output tokens ``done`` to ``total`` and (``top`` > 0) their best
    ``top`` alternatives from SGLang's ``output_token_logprobs`` / ``output_top_logprobs``
    (``(logprob, id, text)`` entries; all of the request's or only those tokens'); nothing where
    the request did not ask. RuntimeError where SGLang's count is neither."""
    if not _wants_logprobs(req):
        return [], None

    def part(key: str) -> list[Any]:
        entries = list(meta.get(key) or [])
        if len(entries) == total:
            return entries[done:]
        if len(entries) == total - done:
            return entries
        raise RuntimeError(f"SGLang returned {len(entries)} {key} for tokens {done}..{total}")

    logprobs = [float(e[0]) for e in part("output_token_logprobs")]
    tops = (
        [[(int(a[1]), float(a[0])) for a in (alts or [])[:top]] for alts in part("output_top_logprobs")]
        if top
        else None
    )
    return logprobs, tops


def sglang_constraint(so: StructuredOutput) -> dict[str, str]:
    """SGLang's sampling parameter for ``so`` (compiled by its grammar backend, xgrammar):
    ``json_schema`` for JSON with any whitespace (``{"type": "object"}`` for ``json_object``),
    ``regex``, ``ebnf`` for a grammar and for a choice (an alternation of escaped string
    literals). SGLang reads whitespace only from its server-wide
    ``--constrained-json-disable-any-whitespace``: JSON without optional whitespace
    (``disable_any_whitespace``) is sent as the EBNF grammar xgrammar makes of the schema with
    compact separators. Each spec is compiled here first (xgrammar, the library SGLang
    compiles with): InvalidRequest naming the field where it does not compile."""
    import xgrammar as xgr

    try:
        if so.kind in ("json_object", "json_schema"):
            schema = '{"type": "object"}' if so.kind == "json_object" else (so.spec or "{}")
            _sglang_checks_schema(schema)
            if so.any_whitespace:
                xgr.Grammar.from_json_schema(schema)
                return {"json_schema": schema}
            grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=(",", ":"))
            return {"ebnf": str(grammar)}
        if so.kind == "regex":
            xgr.Grammar.from_regex(so.spec or "")
            return {"regex": so.spec or ""}
        ebnf = (so.spec or "") if so.kind == "grammar" else choice_grammar(so.spec)
        xgr.Grammar.from_ebnf(ebnf)
        return {"ebnf": ebnf}
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidRequest(f"{so.field}: does not compile to a grammar: {e}", field=so.field) from e


def _sglang_checks_schema(schema: str) -> None:
    """SGLang's own check of a JSON schema before it compiles one (keywords xgrammar would
    ignore, such as ``not``: SGLang refuses them), where this SGLang has it; raises ValueError."""
    import json

    try:
        from sglang.srt.constrained.json_schema_validation import validate_xgrammar_json_schema
    except ImportError:  # an SGLang without the check compiles what xgrammar compiles
        return
    try:
        validate_xgrammar_json_schema(json.loads(schema))
    except Exception as e:  # SGLang's UnsupportedJSONSchemaFeature, or not JSON
        raise ValueError(str(e)) from e


__all__ = ["SGLangInferenceBackend"]
