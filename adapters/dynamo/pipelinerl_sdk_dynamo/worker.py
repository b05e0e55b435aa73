"""One Dynamo vLLM worker with what the SDK needs: ``python -m pipelinerl_sdk_dynamo.worker ARGS``
takes ``python -m dynamo.vllm``'s arguments and runs Dynamo's own worker (``dynamo.vllm.main``),
with two additions made before it starts:

- **Per-token weight versions.** Dynamo reports one weight version per worker (the label its RL
  routes set); a request that an update overtook mixes two. vLLM itself knows the version of every
  token (``CompletionOutput.weight_versions``, spans over the output, on the final output only: the
  engine core stamps each step with the version ``finish_weight_update`` set). A subclass of
  Dynamo's decode handler (:class:`PipelineRLDecodeHandler`, put in place of
  ``DecodeWorkerHandler`` in Dynamo's worker factory) taps vLLM's outputs for each request and
  puts, on its final chunk, ``engine_data["pipelinerl"]``: token ids, raw logprobs, top logprobs
  by token id and those spans. Dynamo's frontend returns ``engine_data`` as it is
  (``nvext.extra_fields: ["engine_data"]``). Chosen over a Python ``LLMEngine`` worker around the
  kit's engine because the engine then stays vLLM, and Dynamo's vLLM worker (its routing, its
  pause, its KV events) stays Dynamo's.
- **The ``pipelinerl`` engine route** (``POST /engine/pipelinerl`` on the worker's system port,
  registered like Dynamo's RL routes): the weight-transfer calls of vLLM's engine client with
  their answers. Dynamo's ``update_weights_from_distributed`` calls ``collective_rpc`` and drops
  its result, so it can only drive a blocking receive; with the answers, the SDK's staged receive
  (a worker thread receives while vLLM keeps generating; see ``pipelinerl_sdk_vllm.transfer``)
  is drivable too. Pause and resume stay Dynamo's own routes.

Imported only inside a Dynamo worker (Dynamo and vLLM are there); nothing else imports it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

log = logging.getLogger("pipelinerl_sdk_dynamo.worker")

#: The ops of the ``pipelinerl`` route, each one call of vLLM's engine client.
OPS = ("status", "init", "start", "update", "finish", "set_version", "warm_up")


class _Tap:
    """What vLLM reported for one request, per output index."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.outputs: dict[int, dict[str, Any]] = {}

    def add(self, res: Any) -> None:
        for o in res.outputs:
            entry = self.outputs.setdefault(
                int(getattr(o, "index", 0) or 0), {"token_ids": [], "logprobs": [], "top": [], "versions": None}
            )
            ids = [int(t) for t in (o.token_ids or [])]
            entry["token_ids"].extend(ids)
            for tid, lps in zip(ids, o.logprobs or [], strict=False):
                entry["logprobs"].append(float(lps[tid].logprob) if tid in lps else None)
                if self.top:
                    best = sorted(lps.items(), key=lambda kv: kv[1].rank)[: self.top]
                    entry["top"].append([[int(t), float(lp.logprob)] for t, lp in best])
            if getattr(o, "weight_versions", None) is not None:
                entry["versions"] = [[str(s.version), int(s.start), int(s.end)] for s in o.weight_versions]


def _handler_class(base: type[Any]) -> type[Any]:
    class PipelineRLDecodeHandler(base):  # type: ignore[misc]
        """Dynamo's vLLM decode handler, plus the ``pipelinerl`` payload and route."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._pipelinerl_taps: dict[str, _Tap] = {}
            engine = self.engine_client
            generate = engine.generate
            taps = self._pipelinerl_taps

            async def tapped(
                prompt: Any, sampling_params: Any, request_id: str, *a: Any, **kw: Any
            ) -> AsyncIterator[Any]:
                tap = taps.get(request_id)
                async for res in generate(prompt, sampling_params, request_id, *a, **kw):
                    if tap is not None:
                        tap.add(res)
                    yield res

            engine.generate = tapped  # this worker's engine client only

        async def generate_tokens(self, prompt: Any, sampling_params: Any, request_id: str, *a: Any, **kw: Any) -> Any:
            tap = _Tap(int(sampling_params.logprobs or 0))
            self._pipelinerl_taps[request_id] = tap
            try:
                async for tok in super().generate_tokens(prompt, sampling_params, request_id, *a, **kw):
                    if tok.get("finish_reason") is not None:
                        entry = tap.outputs.get(int(tok.get("index") or 0))
                        if entry is not None:
                            tok.setdefault("engine_data", {})["pipelinerl"] = entry
                    yield tok
            finally:
                self._pipelinerl_taps.pop(request_id, None)

        async def pipelinerl(self, body: dict[str, Any] | None) -> dict[str, Any]:
            """``POST /engine/pipelinerl {"op": ...}``: see :data:`OPS`. Answers ``{"status":
            "ok", ...}`` or ``{"status": "error", "message": ...}``."""
            body = body if isinstance(body, dict) else {}
            op = body.get("op")
            if op not in OPS:
                return {"status": "error", "message": f"unknown op {op!r} (known: {list(OPS)})"}
            try:
                return {"status": "ok", **(await self._pipelinerl_op(str(op), body))}
            except Exception as e:
                log.warning("pipelinerl %s failed: %s", op, e)
                return {"status": "error", "message": f"{type(e).__name__}: {e}"}

        async def _pipelinerl_op(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
            from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

            engine = self.engine_client
            if op == "status":
                return {"workers": list(await engine.collective_rpc("pipelinerl_status"))}
            if op == "init":
                await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=body["init_info"]))
            elif op == "start":
                await engine.start_weight_update()
            elif op == "update":
                await engine.update_weights(WeightTransferUpdateRequest(update_info=body["update_info"]))
            elif op == "finish":
                version = body.get("version")
                await engine.finish_weight_update(None if version is None else str(version))
                if version is not None:
                    self._weight_version = str(version)  # what Dynamo's get_weight_version reports
            elif op == "set_version":
                await engine.update_weight_version(str(body["version"]))
                self._weight_version = str(body["version"])
            elif op == "warm_up":
                await self._warm_up([int(t) for t in body["prompt_token_ids"]])
            return {}

        async def _warm_up(self, ids: list[int]) -> None:
            """The first generation on CPU pays one-off kernel set-up: pay it before serving."""
            from vllm import SamplingParams
            from vllm.sampling_params import RequestOutputKind

            params = SamplingParams(max_tokens=2, temperature=0, logprobs=2, output_kind=RequestOutputKind.FINAL_ONLY)
            async for _ in self.engine_client.generate({"prompt_token_ids": ids}, params, "pipelinerl-warm-up"):
                pass

    return PipelineRLDecodeHandler


def install() -> None:
    """Put the handler subclass and the route into Dynamo's vLLM worker factory."""
    import dynamo.vllm.worker_factory as factory

    factory.DecodeWorkerHandler = _handler_class(factory.DecodeWorkerHandler)
    register = factory.WorkerFactory.register_engine_routes

    def register_engine_routes(self: Any, runtime: Any, endpoint: Any, handler: Any, *a: Any, **kw: Any) -> None:
        register(self, runtime, endpoint, handler, *a, **kw)
        if hasattr(handler, "pipelinerl"):
            runtime.register_engine_route("pipelinerl", handler.pipelinerl)
            log.info("pipelinerl: registered engine route pipelinerl")

    factory.WorkerFactory.register_engine_routes = register_engine_routes


def main() -> None:
    """``python -m dynamo.vllm`` with :func:`install` applied first."""
    import os

    os.environ.setdefault("PYTHONHASHSEED", "0")  # as dynamo.vllm.__main__ does
    install()
    from dynamo.vllm.main import main as dynamo_main

    sys.argv[0] = "dynamo.vllm"
    dynamo_main()


if __name__ == "__main__":
    main()
