"""vLLM 0.32's RL API (``vllm/entrypoints/rl/online/api_router.py``) on any SDK server, mapped
onto the SDK's own update path (:class:`~pipelinerl_sdk.http.update_door.UpdateDoor`), so a
trainer written for vLLM's weight-transfer flow updates every backend and gets what the SDK
promises: refusal before any byte, old weights kept on any failure, the new version live at once,
requests in flight kept, every token's version true.

Routes, paths and success bodies as vLLM's (control token required on every one: vLLM serves them
unauthenticated under ``VLLM_SERVER_DEV_MODE``; the SDK never does):

- ``POST /init_weight_transfer_engine {"init_info": {"request": <InitProcessGroupRequest>}}``:
  join the group of vLLM's ``pipelinerl`` weight transfer (the SDK's group; trainer side:
  ``pipelinerl_sdk.http.vllm_flow`` or the vllm adapter's ``PipelineRLTrainerInitInfo``).
  vLLM's ``nccl`` transfer (``init_info.master_address`` ...) and any other are refused (400
  naming ``init_info``): the SDK's servers receive the SDK's group only.
- ``POST /start_weight_update``: open the update session (409 while one is open, as vLLM raises);
- ``POST /update_weights {"update_info": {...}}``, ``op``:

  - ``receive`` (``version``, ``params`` as ``[name, dtype, shape]``, ``bucket_bytes``,
    ``timeout_s``; optional ``group_id``, ``plan_digest``, ``mode``, ``blocking``): validated, then
    armed; answers once armed (``blocking``: once the update is live). A refused update is a 4xx
    before any byte, as on ``/request_weight_update``, and closes the session (as vLLM's worker
    does when ``update_weights`` raises);
  - ``await``: answers once the armed update is live, or with its error (old weights serving).

  Answered ``{"message": "Weights updated"}`` as vLLM; once the update is live (``await``, or
  ``receive`` with ``blocking``) also its ``version``, ``mode`` and ``timings`` (the SDK's ``done``
  event's).

- ``POST /finish_weight_update {"weight_version": str | null}``: waits for the session's update to
  end (one still waiting for the trainer's decision is called off), closes the session; the
  version label is set if the update is live (or there was none);
- ``POST /update_weight_version {"new_version": str}``, ``GET /weight_info``: the label vLLM keeps
  beside the weights (``"default"`` before any update); the SDK's integer version tags the tokens,
  the label only names the weights it was set for;
- ``GET /get_world_size``: the workers that join the group (``/info``'s ``receiving_workers``);
- ``POST /shutdown_weight_transfer_engine``: 501 (the group stays until a new init replaces it).

- ``POST /pause?mode=keep`` (``clear_cache`` read and ignored, as vLLM ignores it with
  ``keep``), ``POST /resume``, ``GET /is_paused``, where the backend declares
  ``pause_generation``: generation held (requests in flight frozen and kept, new ones waiting)
  until ``/resume``; updates through either door run inside the hold, their tokens after it
  tagged with the new version. ``{"status": "paused"}``, ``{"status": "resumed"}``,
  ``{"is_paused": bool}`` as vLLM; both idempotent. Modes ``abort`` (vLLM's default: drops the
  requests in flight) and ``wait`` are refused (400 naming ``mode``), as is a backend without
  the capability (501). A hold never released holds generation until the server stops, as on
  vLLM.

Not served yet: ``/abort_requests``, draft updates, ``/weight_checker``. The SDK keeps requests
in flight through an update without a pause.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import ValidationError

from pipelinerl_sdk.contracts import GenerationHoldLike, InferenceBackend, UpdateReport
from pipelinerl_sdk.errors import InvalidRequest
from pipelinerl_sdk.http.update_door import ControlRefused, UpdateDoor, UpdateRun
from pipelinerl_sdk.protocol import InitProcessGroupRequest, ParamSpec, WeightUpdateRequest
from pipelinerl_sdk.weights.buckets import BucketPlan

__all__ = ["PAUSE_MODES", "ROUTES", "VLLMRLFront", "serve_vllm_rl"]

#: The paths this front serves, and who may call them (as :data:`pipelinerl_sdk.http.server.ROUTES`).
ROUTES: dict[str, Literal["read", "control"]] = {
    "/init_weight_transfer_engine": "control",
    "/start_weight_update": "control",
    "/update_weights": "control",
    "/finish_weight_update": "control",
    "/update_weight_version": "control",
    "/shutdown_weight_transfer_engine": "control",
    "/pause": "control",
    "/resume": "control",
    "/weight_info": "read",
    "/get_world_size": "read",
    "/is_paused": "read",
}

#: ``/pause`` modes of vLLM 0.32; the SDK's servers serve ``keep`` (the one async RL uses).
PAUSE_MODES = ("abort", "wait", "keep")

#: ``init_info`` keys of vLLM's own transfers, named in the refusal.
_NCCL_KEYS = ("master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64", "packed")
_IPC_KEYS = ("ipc_handles", "ipc_handles_pickled")
_RECEIVE_KEYS = {
    "op",
    "version",
    "params",
    "bucket_bytes",
    "timeout_s",
    "group_id",
    "plan_digest",
    "mode",
    "blocking",
    "nbytes",
    "probe_id",
}


def _conflict(message: str) -> ControlRefused:
    return ControlRefused(409, message, kind="conflict")


@dataclass
class _Session:
    """The update session between ``start_weight_update`` and ``finish_weight_update``."""

    run: UpdateRun | None = None


class VLLMRLFront:
    """The state of vLLM's RL API on one server: the session and the version label."""

    def __init__(self, backend: InferenceBackend, door: UpdateDoor) -> None:
        self.backend, self.door = backend, door
        self.session: _Session | None = None
        #: (the SDK version it was set at, the label)
        self.label: tuple[int, str] | None = None

    # --- the group ------------------------------------------------------------------------------

    async def init(self, body: Any) -> dict[str, Any]:
        init_info = _embedded(body, "init_info")
        if not isinstance(init_info, dict):
            raise InvalidRequest("init_info: an object", field="init_info")
        if "request" not in init_info:
            theirs = [k for k in (*_NCCL_KEYS, *_IPC_KEYS) if k in init_info]
            what = f"vLLM's own transfer (init_info.{theirs[0]})" if theirs else f"keys {sorted(init_info)}"
            raise InvalidRequest(
                f"init_info: the {self.backend.name} server receives vLLM's 'pipelinerl' weight transfer only "
                "(init_info.request: the SDK's group, as pipelinerl_sdk.http.vllm_flow sends it), not "
                f"{what}; vLLM's 'nccl' and 'ipc' transfers are received by vLLM's own server",
                field="init_info",
            )
        extra = sorted(set(init_info) - {"request"})
        if extra:
            raise InvalidRequest(f"init_info.{extra[0]}: unknown key (only 'request')", field=f"init_info.{extra[0]}")
        try:
            req = InitProcessGroupRequest.model_validate(init_info["request"])
        except ValidationError as e:
            raise _invalid(e, "init_info.request") from None
        if self.session is not None and self.session.run is not None and not self.session.run.task.done():
            raise _conflict("init_weight_transfer_engine during a weight update; call finish_weight_update first")
        await self.door.join(req)
        self.session = None
        return {"message": "Weight transfer initialized"}

    # --- the session ----------------------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        if self.backend.group_state() is None:
            raise _conflict("no weight transfer group: POST /init_weight_transfer_engine first")
        if self.session is not None:
            raise _conflict(
                "start_weight_update called while a weight update is already active. Call finish_weight_update first."
            )
        self.session = _Session()
        return {"message": "Weight update started"}

    async def update(self, body: Any) -> dict[str, Any]:
        session = self.session
        if session is None:
            raise _conflict("start_weight_update must be called before update_weights.")
        try:
            info = self._one_info(_embedded(body, "update_info"))
            op = info.get("op")
            if op == "receive":
                if session.run is not None:
                    raise _conflict("update_weights: this session already received an update; finish it first")
                session.run = self.door.start(self._request(info))
                if not await session.run.wait_accepted():
                    await asyncio.shield(session.run.task)  # raises why it was refused
                    raise InvalidRequest("update_info: the update ended before it was armed", field="update_info")
                if info.get("blocking"):
                    return _done(session.run, await asyncio.shield(session.run.task))
            elif op == "await":
                run = session.run
                if run is None:
                    raise InvalidRequest(
                        "update_info.op: 'await' with no update armed in this session", field="update_info.op"
                    )
                if "version" in info and info["version"] != run.version:
                    raise InvalidRequest(
                        f"update_info.version: {info['version']!r}, the armed update is version {run.version}",
                        field="update_info.version",
                    )
                return _done(run, await asyncio.shield(run.task))
            else:
                raise InvalidRequest(
                    f"update_info.op: {op!r}; this server serves 'receive' and 'await'", field="update_info.op"
                )
        except BaseException:
            # vLLM's worker closes the session when update_weights raises; so does this front
            # (a failed update has ended: the old weights serve)
            if self.session is session and (session.run is None or session.run.task.done()):
                self.session = None
            raise
        return {"message": "Weights updated"}

    async def finish(self, body: Any) -> dict[str, Any]:
        version = _embedded(body, "weight_version", required=False)
        if version is not None and not isinstance(version, str):
            raise InvalidRequest("weight_version: a string or null", field="weight_version")
        session = self.session
        if session is None:
            raise _conflict("finish_weight_update called without a matching start_weight_update.")
        self.session = None
        run = session.run
        if run is not None and not run.task.done():
            # a trainer that finishes before its go abandons the update
            self.backend.cancel_waiting_update("finish_weight_update closed the session before the trainer's go")
            await asyncio.shield(run.task)
        elif run is not None:
            run.task.result()  # raises a failed update's error
        if version is not None:
            self.label = (self.backend.version, version)
        return {"message": "Weight update finished"}

    def set_label(self, body: Any) -> dict[str, Any]:
        label = _embedded(body, "new_version")
        if not isinstance(label, str):
            raise InvalidRequest("new_version: a string", field="new_version")
        self.label = (self.backend.version, label)
        return {"success": True, "new_version": label}

    def weight_version(self) -> str:
        """The label set for the weights now served, else ``"default"`` for the initial weights
        (as vLLM) and the SDK version's decimal string after an update."""
        version = self.backend.version
        if self.label is not None and self.label[0] == version:
            return self.label[1]
        return "default" if version == 0 else str(version)

    # --- pause ----------------------------------------------------------------------------------

    def declared_hold(self) -> GenerationHoldLike | None:
        """The backend's hold on generation where it declares ``pause_generation``, else None."""
        return self.backend.generation_hold() if self.backend.capabilities.pause_generation else None

    def hold(self) -> GenerationHoldLike:
        """The backend's hold on generation; ControlRefused (501) where it has none."""
        hold = self.declared_hold()
        if hold is None:
            raise ControlRefused(
                501,
                f"/pause, /resume: the {self.backend.name} backend does not declare pause_generation "
                "(an update keeps requests in flight without a pause)",
                kind="not_implemented",
            )
        return hold

    async def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise InvalidRequest(f"mode: {mode!r} is not one of {list(PAUSE_MODES)}", field="mode")
        if mode != "keep":
            what = "drops the requests in flight" if mode == "abort" else "is not served"
            raise InvalidRequest(
                f"mode: {mode!r} {what}; this server pauses with mode=keep (requests in flight frozen, kept, "
                "and finished after /resume)",
                field="mode",
            )
        await self.hold().hold()

    # --- parsing --------------------------------------------------------------------------------

    def _one_info(self, payload: Any) -> dict[str, Any]:
        """One update info: a dict, or vLLM's list indexed by worker rank, whose entries must
        then be equal (this server receives as one member set)."""
        if isinstance(payload, list):
            if not payload or any(p != payload[0] for p in payload):
                raise InvalidRequest(
                    "update_info: a list must hold one entry per worker, all equal (the server receives as one)",
                    field="update_info",
                )
            payload = payload[0]
        if not isinstance(payload, dict):
            raise InvalidRequest("update_info: an object", field="update_info")
        unknown = sorted(set(payload) - _RECEIVE_KEYS)
        if unknown:
            raise InvalidRequest(f"update_info.{unknown[0]}: unknown key", field=f"update_info.{unknown[0]}")
        return payload

    def _request(self, info: dict[str, Any]) -> WeightUpdateRequest:
        """The SDK update ``info`` asks for. Without ``group_id`` the update is for the group
        now joined; without ``plan_digest`` the plan is the one its params and buckets make."""
        group = self.backend.group_state()
        try:
            raw = info.get("params")
            if not isinstance(raw, list) or not all(isinstance(p, list | tuple) and len(p) == 3 for p in raw):
                raise InvalidRequest("update_info.params: a list of [name, dtype, shape]", field="update_info.params")
            params = [ParamSpec(name=n, dtype=d, shape=tuple(s)) for n, d, s in raw]
            bucket_bytes = info.get("bucket_bytes")
            digest = info.get("plan_digest")
            if digest is None and isinstance(bucket_bytes, int) and bucket_bytes > 0:
                digest = BucketPlan.build(params, bucket_bytes).digest()
            fields: dict[str, Any] = {
                "version": info.get("version"),
                "group_id": info.get("group_id", group.group_id if group is not None else None),
                "params": params,
                "bucket_bytes": bucket_bytes,
                "plan_digest": digest,
            }
            for name in ("mode", "timeout_s"):
                if name in info:
                    fields[name] = info[name]
            return WeightUpdateRequest.model_validate(fields)
        except ValidationError as e:
            raise _invalid(e, "update_info") from None
        except (TypeError, ValueError) as e:  # a shape that is no list of ints, a duplicate name
            raise InvalidRequest(f"update_info.params: {e}", field="update_info.params") from None


def _done(run: UpdateRun, report: UpdateReport) -> dict[str, Any]:
    """vLLM's answer, plus what the SDK's ``done`` event carries (a client ignores keys it does
    not know): the version now served, the receive mode it ran in and the update's ``timings``."""
    return {
        "message": "Weights updated",
        "version": report.version,
        "mode": report.mode,
        "timings": {**report.timings(), **run.at},
    }


def _embedded(body: Any, name: str, *, required: bool = True) -> Any:
    """``body[name]`` of a FastAPI ``Body(embed=True)`` parameter, as vLLM reads it."""
    if body is None and not required:
        return None
    if not isinstance(body, dict):
        raise InvalidRequest(f"the body must be a JSON object with {name!r}", field=name)
    if name not in body:
        if required:
            raise InvalidRequest(f"{name}: required", field=name)
        return None
    return body[name]


def _invalid(e: ValidationError, prefix: str) -> InvalidRequest:
    first = e.errors(include_url=False)[0]
    where = ".".join([prefix, *(str(p) for p in first.get("loc", ()))])
    return InvalidRequest(f"{where}: {first.get('msg')}", field=where)


async def _json(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError as e:
        raise InvalidRequest(f"the body is not JSON: {e}") from None


def serve_vllm_rl(
    router: APIRouter, backend: InferenceBackend, door: UpdateDoor, *, front_class: type[VLLMRLFront] = VLLMRLFront
) -> VLLMRLFront:
    """Add vLLM's RL routes (:data:`ROUTES`) to ``router``, served by a ``front_class`` (an
    adapter may extend :class:`VLLMRLFront`); the caller guards them."""
    front = front_class(backend, door)

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> dict[str, Any]:
        return await front.init(await _json(request))

    @router.post("/start_weight_update")
    async def start_weight_update() -> dict[str, Any]:
        return front.start()

    @router.post("/update_weights")
    async def update_weights(request: Request) -> dict[str, Any]:
        return await front.update(await _json(request))

    @router.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> dict[str, Any]:
        return await front.finish(await _json(request))

    @router.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict[str, Any]:
        return front.set_label(await _json(request))

    @router.post("/pause")
    async def pause(mode: str = "abort", clear_cache: bool = True) -> dict[str, Any]:
        await front.pause(mode)
        return {"status": "paused"}

    @router.post("/resume")
    async def resume() -> dict[str, Any]:
        await front.hold().release()
        return {"status": "resumed"}

    @router.get("/is_paused")
    async def is_paused() -> dict[str, Any]:
        hold = front.declared_hold()
        return {"is_paused": hold is not None and hold.held}

    @router.get("/weight_info")
    async def weight_info() -> dict[str, Any]:
        return {"weight_version": front.weight_version()}

    @router.get("/get_world_size")
    async def get_world_size(include_dp: bool = True) -> dict[str, Any]:
        return {"world_size": backend.receiving_workers}

    @router.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine() -> dict[str, Any]:
        if front.session is not None:
            raise _conflict("Cannot release a trainer connection during a weight update")
        raise ControlRefused(
            501,
            "shutdown_weight_transfer_engine: not served; the group stays joined until a new "
            "/init_weight_transfer_engine replaces it",
            kind="not_implemented",
        )

    return front
