"""What SGLang's control plane alone costs one update, decided by measurement (not a test).

``python -m pipelinerl_sdk_sglang.control_bench --model PATH [--repeats 20] [--concurrency 8]``
starts one SGLang server as the adapter does (the adapter's backend, in this process) and times,
with nothing loaded, the control calls a staged update makes around SGLang's load:
``/pause_generation {mode: in_place}`` + ``/continue_generation``; ``/begin_weight_update`` +
``/end_weight_update``; a session with one scheduler hook call that does nothing (``discard``
with no snapshot: the dispatch ``apply_staged`` rides on, through ``update_weights_from_tensor``);
``/update_weight_version``; and the whole cycle (pause, begin, no-op hook, end, continue). Each
first on an idle server, then while ``concurrency`` streamed generations run, the cycle paused
as an update pauses it. What the cycle costs is what a staged update's pause spends beside the
load itself (the ``apply_floor`` the weight-update bench measures), so it bounds the pause over
apply floor ratio that SGLang allows from below.

A session opened while generation runs, unpaused, is timed too (``session_unpaused``): SGLang's
tokenizer manager takes its model-update writer lock for it, which waits for the requests in
flight, which is why the adapter pauses before it opens one. Prints one JSON object of median
and minimum milliseconds per phase.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def _timed(call: Callable[[], Awaitable[object]], repeats: int) -> dict[str, float]:
    """Median and minimum milliseconds of ``repeats`` sequential calls (after one warm-up)."""
    await call()
    ms = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await call()
        ms.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(ms), "min_ms": min(ms)}


async def _measure(model: str, dtype: str, repeats: int, concurrency: int) -> dict[str, Any]:
    from pipelinerl_sdk.contracts import ServeConfig
    from pipelinerl_sdk_sglang.backend import SGLangInferenceBackend

    backend = SGLangInferenceBackend(ServeConfig(model=model, dtype=dtype))
    await backend.start()
    sgl = backend.sglang

    async def pause_continue() -> None:
        async with backend._paused():  # the pause every update takes
            pass

    async def session() -> None:
        await sgl.control("/begin_weight_update", {})
        await sgl.control("/end_weight_update", {})

    async def session_with_hook() -> None:
        await sgl.control("/begin_weight_update", {})
        await sgl.call_hook("discard", tp_size=backend._tp)
        await sgl.control("/end_weight_update", {})

    async def version() -> None:
        await sgl.control("/update_weight_version", {"new_version": str(backend.version), "abort_all_requests": False})

    async def cycle() -> None:
        await backend._in_session("discard")  # pause, begin, hook, end, continue: a staged apply's calls

    async def generate(stop: asyncio.Event) -> None:
        body = {
            "input_ids": [1, 2, 3, 4],
            "stream": True,
            "sampling_params": {"max_new_tokens": 64, "temperature": 1.0, "ignore_eos": True},
        }
        while not stop.is_set():
            async for _ in sgl.generate_stream(dict(body)):
                pass

    result: dict[str, Any] = {}
    try:
        result["idle"] = {
            "pause_continue": await _timed(pause_continue, repeats),
            "session": await _timed(session, repeats),
            "session_with_noop_hook": await _timed(session_with_hook, repeats),
            "update_weight_version": await _timed(version, repeats),
            "cycle": await _timed(cycle, repeats),
        }
        stop = asyncio.Event()
        load = [asyncio.create_task(generate(stop)) for _ in range(concurrency)]
        try:
            await asyncio.sleep(1.0)  # every generation running
            result["generating"] = {
                "pause_continue": await _timed(pause_continue, repeats),
                "cycle": await _timed(cycle, repeats),
                "session_unpaused": await _timed(session, max(3, repeats // 4)),
            }
        finally:
            stop.set()
            await asyncio.gather(*load, return_exceptions=True)
    finally:
        await backend.stop()
    result["config"] = {"repeats": repeats, "concurrency": concurrency, "model": model}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelinerl_sdk_sglang.control_bench", description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args(argv)
    from pipelinerl_sdk.stdout_guard import stdout_to_stderr

    with stdout_to_stderr():  # SGLang's and the backend's start-up lines go to stderr
        result = asyncio.run(_measure(args.model, args.dtype, args.repeats, args.concurrency))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
