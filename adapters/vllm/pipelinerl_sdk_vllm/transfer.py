"""The SDK's weight-sync protocol as a vLLM 0.32 weight-transfer engine (worker side).

vLLM creates one instance in every worker (registered as ``pipelinerl`` by
:mod:`pipelinerl_sdk_vllm.vllm_plugin`, selected with ``--weight-transfer-config
'{"backend": "pipelinerl"}'``). The API server drives it through vLLM's own four phases:

- ``init_weight_transfer_engine``: join the SDK's :class:`WeightSyncGroup` (gloo on CPU, NCCL on
  GPU) as rank ``rank_offset + worker rank``;
- ``start_weight_update``: nothing to prepare (the model is untouched until the apply);
- ``update_weights({"op": "receive", ...})``: *arm* the receive and return at once. A background
  thread waits for the trainer's ``go`` in the group's store, then receives every bucket into a
  staging buffer. vLLM runs ``update_weights`` on the engine core's only RPC thread, between
  scheduler steps; a receive on that thread would stop generation for the whole broadcast, so it
  never blocks there. The job reports ``deciding`` until the ``go``, then ``receiving``, and stamps
  (and pushes) ``worker_first_bucket`` once the first bucket arrived, so the API server holds
  generation (``direct``) only once bytes flow: nothing live is written before the apply;
- ``finish_weight_update``: if the staged update arrived complete, apply it in one go through vLLM's
  layerwise reload (``initialize_layerwise_reload`` / ``model.load_weights`` /
  ``finalize_layerwise_reload``: on CPU the linear weights are repacked for oneDNN, so writing
  parameters in place would not reach the kernels). If the receive failed, nothing is applied: the
  model never saw a byte of it, so the old weights keep serving.

The API server learns how the receive went with :func:`PipelineRLWorkerExtension.pipelinerl_status`
(a worker extension method reached by ``collective_rpc``): it polls that, pauses generation (mode
``keep``) only once every worker holds the whole update, and calls ``finish``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from pipelinerl_sdk.errors import DecisionTimeout, UpdateAborted
from pipelinerl_sdk.protocol import InitProcessGroupRequest, ParamSpec, probe_key, update_key
from pipelinerl_sdk.weights.buckets import BucketPlan
from pipelinerl_sdk.weights.group import GroupConfig, WeightSyncGroup
from pipelinerl_sdk.weights.receive import NonFiniteWeights, StagedWeights, WeightReceiver
from pipelinerl_sdk_vllm.status_push import push

logger = init_logger(__name__)

BACKEND_NAME = "pipelinerl"
#: How long closing a session waits for its dropped job's thread to reach the decision wait (to
#: cancel it there), and how long arming waits for a dropped job's thread to end.
CALL_OFF_S = 5.0


@dataclass
class PipelineRLInitInfo(WeightTransferInitInfo):
    """``request``: the server's ``/init_process_group`` body (an ``InitProcessGroupRequest`` as
    JSON; it holds the group's secret, hence no repr). Each worker joins at ``rank_offset`` plus
    its own rank among the server's workers."""

    request: dict[str, Any] = field(repr=False)


@dataclass
class PipelineRLUpdateInfo(WeightTransferUpdateInfo):
    """``op``: ``receive`` (arm the staged receive of ``version``), ``probe`` (receive one flat
    broadcast of ``nbytes`` and discard it), ``discard`` (drop a staged update) or ``await``
    (block until the armed receive ended; raise if it failed: vLLM's flow calls it before
    ``finish_weight_update``).

    ``blocking``: receive on the calling (RPC) thread and return once every bucket arrived, as
    vLLM's built-in engines do (generation stops meanwhile). Only the benchmark's native-flow
    anchor asks for it; the SDK's own updates never block the engine loop."""

    op: str
    version: int = 0
    params: list[list[Any]] = field(default_factory=list)
    bucket_bytes: int = 0
    timeout_s: float = 120.0
    nbytes: int = 0
    probe_id: int = 0
    blocking: bool = False
    #: Sent by the SDK's trainer side of vLLM's flow (``pipelinerl_sdk.http.vllm_flow``): checked
    #: before the receive is armed (an update for another group or another bucket plan is refused).
    group_id: str | None = None
    plan_digest: str | None = None
    #: The SDK's receive mode; this engine always stages (``staged``), so any is accepted.
    mode: str | None = None


@dataclass
class _Job:
    """One background receive (an update or a probe)."""

    kind: str
    key: str
    thread: threading.Thread | None = None
    state: str = "deciding"  # deciding (no go yet) | receiving | received | failed
    error: str | None = None
    aborted: bool = False
    #: Failed because no decision of the trainer's came in time (DecisionTimeout: a 408).
    timed_out: bool = False
    staged: StagedWeights | None = None
    receive_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    #: Set when its session was closed before it received (why): it must not enter a broadcast.
    called_off: str | None = None
    #: ``time.time()`` of what the receive thread saw: ``worker_go`` (the trainer's decision),
    #: ``worker_first_bucket``, ``worker_last_bucket``.
    stamps: dict[str, float] = field(default_factory=dict)


class PipelineRLWeightTransferEngine(WeightTransferEngine[PipelineRLInitInfo, PipelineRLUpdateInfo]):
    init_info_cls = PipelineRLInitInfo
    update_info_cls = PipelineRLUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: WeightSyncGroup | None = None
        self.receiver: WeightReceiver | None = None
        self.job: _Job | None = None
        #: Jobs dropped (session closed) whose thread had not ended yet.
        self.dropped: list[_Job] = []
        self.last_apply_s = 0.0
        #: ``worker_apply_start``/``worker_apply_end`` (``time.time()``) of the last apply.
        self.last_apply: dict[str, float] = {}
        #: The staged update whose bytes the model serves now (the last one applied), while its
        #: buffer still holds them: what :meth:`apply_floor` re-applies. Cleared as soon as any
        #: receive (an update's or a probe's) may write into the staging buffer.
        self.applied: StagedWeights | None = None
        #: The model's params under HF names, and their shapes: what an update may carry. Read
        #: from the model's config on the first receive (a harness without one sets it).
        self.expected_params: dict[str, tuple[int, ...]] | None = None
        self._lock = threading.Lock()

    # --- phase 1: the group -----------------------------------------------------------------------

    def worker_rank(self) -> int:
        pc = self.parallel_config
        return int(pc.data_parallel_index * pc.world_size + pc.rank)

    def init_transfer_engine(self, init_info: PipelineRLInitInfo) -> None:
        self._wait_idle()
        if self.group is not None:
            self.group.close()
        self.group, self.receiver, self.job = None, None, None
        req = InitProcessGroupRequest.model_validate(init_info.request)
        cfg = GroupConfig.joining(req, req.rank_offset + self.worker_rank())
        self.group = WeightSyncGroup(cfg)  # blocks until every rank joined (bounded by timeout_s)
        self.receiver = WeightReceiver(self.group)
        logger.info("pipelinerl: joined %s as rank %d/%d", cfg.group_name, cfg.rank, cfg.world_size)

    # --- phases 2-4 -------------------------------------------------------------------------------

    def start_weight_update(self) -> None:
        """Nothing to prepare: the model is untouched until :meth:`finish_weight_update`."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class calls torch.accelerator.synchronize() here, which raises on CPU; the
        # receive happens on a background thread and synchronizes there.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: PipelineRLUpdateInfo) -> None:
        op = update_info.op
        if op == "discard":
            self._wait_idle()
            self.job = None
            return
        if op == "await":
            self._await_job(update_info)
            return
        if self.receiver is None:
            raise RuntimeError("pipelinerl weight transfer: no group; call init_weight_transfer_engine first")
        if self.job is not None and self.job.state in ("deciding", "receiving"):
            raise RuntimeError(f"pipelinerl weight transfer: a receive is running ({self.job.key})")
        self._reap_dropped()
        receiver = self.receiver
        self.applied = None  # the staging buffer is about to be written
        if op == "receive":
            specs = [ParamSpec(name=n, dtype=d, shape=tuple(s)) for n, d, s in update_info.params]
            plan = BucketPlan.build(specs, update_info.bucket_bytes)
            self._check_ids(update_info, specs, plan)
            job = _Job("update", update_key(update_info.version))

            def work() -> None:
                receiver.prepare(plan)
                receiver.await_go(job.key, update_info.timeout_s)
                if job.called_off is not None:  # a go meant for a later arm of the same version
                    raise UpdateAborted(f"{job.key}: called off before the trainer's go: {job.called_off}")
                job.stamps["worker_go"] = time.time()
                job.state = "receiving"
                push(self.status())

                def first_bucket() -> None:  # bytes flow: the server may hold generation now
                    job.stamps["worker_first_bucket"] = time.time()
                    push(self.status())

                staged = receiver.receive_decided(plan, on_first_bucket=first_bucket)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                job.stamps["worker_last_bucket"] = time.time()
                job.staged, job.receive_s = staged, staged.receive_s

        elif op == "probe":
            job = _Job("probe", probe_key(update_info.probe_id))

            def work() -> None:  # (a probe's key is its own: no later go is meant for another)
                job.receive_s = receiver.receive_flat(
                    update_info.nbytes, job.key, decision_timeout_s=update_info.timeout_s
                )

        else:
            raise ValueError(f"pipelinerl weight transfer: unknown op {op!r}")

        def run() -> None:
            try:
                work()
                job.state = "received"
            except (UpdateAborted, NonFiniteWeights) as e:  # the group stays healthy
                job.error, job.aborted, job.state = str(e), True, "failed"
            except DecisionTimeout as e:  # the trainer never decided (the group is marked broken)
                job.error, job.timed_out, job.state = str(e), True, "failed"
            except BaseException as e:
                job.error, job.state = f"{type(e).__name__}: {e}", "failed"
            push(self.status())  # the server need not wait for its next poll

        self.job = job
        if update_info.blocking:
            run()
            if job.state != "received":
                raise RuntimeError(f"pipelinerl weight transfer: receive of {job.key} failed: {job.error}")
            return
        job.thread = threading.Thread(target=run, name=f"pipelinerl-receive-{job.key}", daemon=True)
        job.thread.start()

    def _check_ids(self, info: PipelineRLUpdateInfo, specs: list[ParamSpec], plan: BucketPlan) -> None:
        """Refuse (ValueError, before the receive is armed) an update for another group, whose
        sender planned other buckets, or naming a param the model does not hold (under HF names)
        or with another shape."""
        if self.expected_params is None:
            from pipelinerl_sdk.weights.tensors import hf_param_specs

            self.expected_params = {p.name: p.shape for p in hf_param_specs(self.model_config.model, "float32")}
        for i, p in enumerate(specs):
            want = self.expected_params.get(p.name)
            if want is None:
                raise ValueError(f"params[{i}].name: unknown param {p.name!r}")
            if tuple(p.shape) != tuple(want):
                raise ValueError(f"params[{i}].shape: param {p.name!r} has shape {list(want)}, got {list(p.shape)}")
        group = self.group
        if info.group_id is not None and group is not None and info.group_id != group.group_id:
            raise ValueError(f"group_id {info.group_id!r}: this worker is in group {group.group_id!r}")
        if info.plan_digest is not None and info.plan_digest != plan.digest():
            raise ValueError(f"plan_digest {info.plan_digest!r}: the params and bucket_bytes plan {plan.digest()!r}")

    def _await_job(self, info: PipelineRLUpdateInfo) -> None:
        """Block until the current receive ended (each bucket bounded by the group's timeout);
        RuntimeError if it failed, or none is armed, or it is another version's."""
        job = self.job
        if job is None or job.kind != "update":
            raise RuntimeError("pipelinerl weight transfer: 'await' with no receive armed")
        if info.version and job.key != update_key(info.version):
            raise RuntimeError(f"pipelinerl weight transfer: 'await' of version {info.version}, armed: {job.key}")
        if job.thread is not None:
            job.thread.join()
        if job.state != "received":
            raise RuntimeError(f"pipelinerl weight transfer: receive of {job.key} failed: {job.error}")

    def finish_weight_update(self) -> None:
        """Apply the staged update if it arrived complete; otherwise change nothing.

        Never raises for a failed receive: vLLM's worker keeps its update session open when
        ``finish`` raises, and the API server already knows the outcome from the status."""
        job = self.job
        if job is None or job.kind != "update" or job.state != "received" or job.staged is None:
            self.job = None
            if job is not None:
                self._call_off(job, "its weight-update session was closed")
            return
        staged, job.staged, self.job = job.staged, None, None  # applied at most once, even on error
        started = time.time()
        self.last_apply_s = self._apply(staged)
        self.last_apply = {"worker_apply_start": started, "worker_apply_end": time.time()}
        self.applied = staged

    def _apply(self, staged: StagedWeights) -> float:
        """Load ``staged`` into the model through vLLM's layerwise reload; returns its seconds."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        t0 = time.perf_counter()
        with torch.no_grad():
            initialize_layerwise_reload(self.model)
            cast(Any, self.model).load_weights(staged.tensors())  # vLLM models define load_weights
            finalize_layerwise_reload(self.model, self.model_config)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def apply_floor(self, repeats: int) -> list[float]:
        """The engine's apply alone: re-apply the last applied update (its staged bytes, still
        intact: the weights served now) ``repeats`` times through the same code as
        :meth:`finish_weight_update` (:meth:`_apply`), with no transfer; returns each apply's
        seconds. The served weights are unchanged (the same bytes loaded again). RuntimeError
        when no update was applied since the staging buffer was last written, or one is being
        received. The caller holds generation, as for an update's apply."""
        job, staged = self.job, self.applied
        if job is not None and job.state in ("deciding", "receiving"):
            raise RuntimeError(f"pipelinerl weight transfer: a receive is running ({job.key})")
        if staged is None:
            raise RuntimeError("pipelinerl weight transfer: no applied update to re-apply (apply one first)")
        return [self._apply(staged) for _ in range(repeats)]

    # --- status and shutdown ----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        job, group = self.job, self.group
        return {
            "rank": None if group is None else group.rank,
            "group_broken": None if group is None else group.broken,
            "job": None
            if job is None
            else {
                "kind": job.kind,
                "key": job.key,
                "state": job.state,
                "error": job.error,
                "aborted": job.aborted,
                "timed_out": job.timed_out,
                "receive_s": job.receive_s,
                "stamps": dict(job.stamps),
            },
            "last_apply_s": self.last_apply_s,
        }

    def cancel_decision(self, key: str, reason: str) -> bool:
        """End the receive job ``key``'s wait for the trainer's decision (its thread raises
        UpdateAborted naming ``reason``, the job fails, aborted) and return True; False if that
        job already has its decision, or is not the current job. Waits (up to :data:`CALL_OFF_S`)
        for a thread still building its views to reach the wait."""
        job, group = self.job, self.group
        if job is None or job.key != key or job.thread is None or group is None:
            return False
        deadline = time.monotonic() + CALL_OFF_S
        while job.thread.is_alive() and job.state == "deciding" and time.monotonic() < deadline:
            if group.cancel_decision_wait(reason):
                return True
            job.thread.join(0.005)
        return False

    def _call_off(self, job: _Job, reason: str) -> None:
        """Drop ``job``, whose session closed before it received: it never enters a broadcast.

        A dropped job still waiting for the trainer's decision would otherwise wait on: a later
        update of the same version (the publisher re-sends the version a refused update did not
        make live) posts ``go`` under the same key, and the dropped job would join that broadcast
        beside the new one, two receives on one member: the trainer's broadcast then times out.
        So its decision wait is cancelled (once its thread is in it: it may still be building its
        views) and it is marked called off (should the cancel miss, it stops at the ``go``)."""
        job.called_off = reason
        thread, group = job.thread, self.group
        if thread is None:
            return
        deadline = time.monotonic() + CALL_OFF_S
        while thread.is_alive() and job.state == "deciding" and time.monotonic() < deadline:
            if group is not None and group.cancel_decision_wait(f"{job.key}: {reason}"):
                break
            thread.join(0.005)
        if thread.is_alive():
            self.dropped.append(job)

    def _reap_dropped(self) -> None:
        """Before arming: every dropped job's thread has ended (waited for up to
        :data:`CALL_OFF_S`); RuntimeError if one still runs (a receive cut off mid-broadcast
        ends on the group's timeout), since two receives on one member would mix their buckets."""
        deadline = time.monotonic() + CALL_OFF_S
        for job in self.dropped:
            if job.thread is not None:
                job.thread.join(max(0.0, deadline - time.monotonic()))
        self.dropped = [j for j in self.dropped if j.thread is not None and j.thread.is_alive()]
        if self.dropped:
            j = self.dropped[0]
            raise RuntimeError(f"pipelinerl weight transfer: a dropped receive ({j.key}, {j.state}) has not ended yet")

    def _wait_idle(self, timeout_s: float = 5.0) -> None:
        job = self.job
        if job is not None and job.thread is not None and job.thread.is_alive():
            job.thread.join(timeout_s)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self.receiver, self.job = None, None, None


class PipelineRLWorkerExtension:
    """Mixed into vLLM's worker (``--worker-extension-cls``): lets the API server read the
    engine's receive status with ``collective_rpc("pipelinerl_status")`` without blocking, and end
    a receive still waiting for its trainer's decision (``pipelinerl_cancel_decision``)."""

    def pipelinerl_status(self) -> dict[str, Any]:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, PipelineRLWeightTransferEngine):
            return {"error": "the pipelinerl weight-transfer engine is not configured"}
        return engine.status()

    def pipelinerl_cancel_decision(self, key: str, reason: str) -> bool:
        """:meth:`PipelineRLWeightTransferEngine.cancel_decision` of this worker's engine."""
        engine = getattr(self, "weight_transfer_engine", None)
        return isinstance(engine, PipelineRLWeightTransferEngine) and engine.cancel_decision(key, reason)

    def pipelinerl_arm(self, update_info: dict[str, Any]) -> None:
        """vLLM's own ``start_weight_update`` then ``update_weights(update_info)`` of this worker,
        in one RPC (the engine's start prepares nothing; the receive is armed and returns at
        once): one round trip from the API server instead of two."""
        worker = cast(Any, self)  # the vLLM worker (this class is mixed in)
        worker.start_weight_update()
        worker.update_weights(update_info)

    def pipelinerl_finish(self) -> dict[str, float]:
        """vLLM's own ``finish_weight_update`` of this worker (the apply, then the session
        closed), returning the apply's stamps (``worker_apply_start``/``worker_apply_end``) so the
        server learns them without another round trip."""
        cast(Any, self).finish_weight_update()  # the vLLM worker's method (this class is mixed in)
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(engine.last_apply) if isinstance(engine, PipelineRLWeightTransferEngine) else {}

    def pipelinerl_apply_floor(self, repeats: int) -> list[float] | dict[str, str]:
        """:meth:`PipelineRLWeightTransferEngine.apply_floor` of this worker's engine (with vLLM's
        config current, as its own weight-update calls have it), or ``{"error": ...}``."""
        from vllm.config import set_current_vllm_config

        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, PipelineRLWeightTransferEngine):
            return {"error": "the pipelinerl weight-transfer engine is not configured"}
        try:
            with set_current_vllm_config(cast(Any, self).vllm_config):
                return engine.apply_floor(repeats)
        except RuntimeError as e:
            return {"error": str(e)}
