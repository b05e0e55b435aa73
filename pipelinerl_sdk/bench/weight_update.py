"""``pipelinerl bench weight-update``: what an in-flight weight update costs, in one run.

Setup: one inference server child process (``ServerProcess``) and, in this process, the reference
trainer (world size 1, fp32) as rank 0 of a gloo weight-update group with it. One server serves
both receive modes: each update names its mode (``WeightPublisher.mode``). Baselines, measured
once:

- ``memcpy_s``: one in-process ``dst.copy_(src)`` of a flat buffer of all param bytes (median of
  5 after a warm-up, with the server's torch thread count): the floor for a pause;
- ``flat_broadcast_s``: one flat broadcast of all param bytes through the same group
  (``publisher.probe``; send seconds): the floor for an update. Measured interleaved with the
  timed idle updates of each mode (probe, update, probe, update, ...), so a ratio compares the
  two under the same conditions: this machine's loopback broadcast alone varies by up to 1.8x
  between minutes. Each mode reports the median of its own probes; the top level, of all probes.

- ``engine_apply_floor_s``: the engine's own apply of the same tensors, no transfer
  (``POST /bench/apply_floor``: ``InferenceBackend.apply_floor``, timed where the apply runs: in
  vLLM's worker its layerwise reload of the last update's staged tensors; in the reference
  server its ``DoubleBuffer`` swap): the floor for a pause, and with the flat broadcast, for an
  update (``update_over_floor`` = update wall / (flat broadcast + apply floor),
  ``pause_over_apply_floor``). One apply after each timed idle update (interleaved like the
  probes); None, with ``engine_apply_floor_error``, where the backend does not offer it.

Each mode also gives ``timeline_ms`` (one idle update, the one of median wall time) and
``timeline_median_ms`` (per phase, the median over its idle updates): every phase the trainer
and the server stamped, in ms since the trainer sent its request (``trainer.*`` and
``server.*``: see :mod:`pipelinerl_sdk.bench.timeline`; one clock, ``time.time()``, both sides on
this machine).

Then, per receive mode (``staged``, ``direct``) and, when the backend registered one as its
``bench_anchor``, for the engine's own documented flow (``native``, the anchor:
:mod:`pipelinerl_sdk.bench.anchor`): one warm-up update, ``updates`` timed updates
on an idle server, each after a flat probe (``update_wall_s`` = ``publisher.last.wall_s``,
``pause_s`` = the server's reported pause; medians), then a chat load (``concurrency`` workers, ``max_tokens`` 32,
temperature 1.0, ``ignore_eos``; see :mod:`pipelinerl_sdk.bench.load`) measured over two
back-to-back windows of ``seconds``: without updates, then with one update published every
second. Tokens count only requests that finish inside a window. ``under_load`` holds the figures
of the updates published during the second window. Updates resend the trainer's unchanged weights
(the transfer and apply are the same work); versions increase strictly across the whole run.

Last, where the server declares ``vllm_rl_api``: mode ``vllm_rl_api``, the same updates driven
through vLLM's RL routes the SDK serves (:mod:`pipelinerl_sdk.http.vllm_flow`, its own group), in
the server's default mode, with ``vs_sdk`` (its update wall, pause and tokens/s over that mode's)
and the target ``VLLM_RL_API_TARGET`` (1.05) on the first two.

Anchors (registered with the backend, ``bench_anchor``), two shapes: an engine flow that can
drive the SDK's own server and group (a ``NativeUpdateFlow``, vLLM's) is measured as mode
``native``, exactly like the SDK's modes (idle updates and tokens/s under load); an engine flow
that needs its own plain server and group (a standalone anchor, SGLang's
``/update_weights_from_distributed`` sequence) runs after the server above has stopped, on the
same model, idle only, and every mode gains ``update_over_native_anchor`` (the SDK's update wall
time over the engine's own).

Threads: 2 cores are shared by the server's engine, its receiver, the trainer's sender and the
load generator. By default this process runs with ``torch.set_num_threads(1)`` and the reference
server with ``--option threads=1``, so the two sides do not oversubscribe the cores, and
``memcpy_s`` is measured with the server's thread count, so it is the same kind of copy as the
server's apply. On the 2-core development machine, torch's default (2 threads each side) made
the flat memcpy faster but not the apply (99 separate copies) and lowered tokens/s while
updating, i.e. it only made the ratios worse through oversubscription. ``server_threads=None`` /
``torch_threads=None`` keep torch's defaults.

Noise: the windows are short and the machine may be shared; CPU work of other processes moves
tokens/s by several percent between windows. Each window therefore reports
``foreign_cpu_frac_*`` (share of all cores used by processes other than this benchmark and its
server); trust a ratio only when both are near 0. A ratio slightly above 1.0 means "no
measurable loss", not a gain.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipelinerl_sdk.bench.anchor import FlowTarget, NativeUpdateFlow, load_anchor
from pipelinerl_sdk.bench.load import SUPPORTS_IGNORE_EOS, ChatLoad
from pipelinerl_sdk.bench.model import bench_model
from pipelinerl_sdk.bench.timeline import median_timeline, timeline, to_ms
from pipelinerl_sdk.contracts import TrainerSpec
from pipelinerl_sdk.errors import ServerError
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.launch import ServerProcess
from pipelinerl_sdk.plugins import load_registry
from pipelinerl_sdk.protocol import ParamSpec, ReceiveMode
from pipelinerl_sdk.reference.trainer import ReferenceTrainer
from pipelinerl_sdk.weights.buckets import BucketPlan
from pipelinerl_sdk.weights.publisher import PublishResult, WeightPublisher

__all__ = ["MODES", "TARGETS", "run_weight_update_bench"]

MODES: tuple[ReceiveMode, ...] = ("staged", "direct")

#: Bounds each mode should meet: ratios at most (pause, update) or at least (tokens/s) these.
TARGETS: dict[str, float] = {
    "pause_over_memcpy": 1.5,
    "update_over_flat_broadcast": 1.25,
    "update_over_floor": 1.2,
    "pause_over_apply_floor": 1.1,
    "tokens_per_s_ratio_updating": 0.95,
}
#: The modes each target applies to (``direct`` pauses for the whole receive by design).
TARGET_MODES: dict[str, tuple[ReceiveMode, ...]] = {
    "pause_over_memcpy": ("staged",),
    "update_over_flat_broadcast": MODES,
    "update_over_floor": MODES,
    "pause_over_apply_floor": ("staged",),
    "tokens_per_s_ratio_updating": MODES,
}
#: The update wall time and pause through vLLM's RL API over the SDK's own routes' (same server,
#: same mode): at most this.
VLLM_RL_API_TARGET = 1.05
#: Targets bounded from below; the others from above.
AT_LEAST = frozenset({"tokens_per_s_ratio_updating"})

UPDATE_INTERVAL_S = 1.0
MAX_TOKENS = 32
TEMPERATURE = 1.0
#: Load runs this long after its phase requests before the first window (steady state).
RAMP_S = 1.0


@dataclass(frozen=True, slots=True)
class _Budget:
    """How long each way of updating is measured: ``updates`` timed idle updates, then chat load
    from ``concurrency`` workers in two windows of ``seconds`` (see the module doc)."""

    seconds: float
    updates: int
    concurrency: int


def run_weight_update_bench(
    *,
    backend: str = "reference",
    model: str | os.PathLike[str] | None = None,
    seconds: float = 8.0,
    updates: int = 9,
    concurrency: int = 16,
    bucket_mb: int = 64,
    torch_threads: int | None = 1,
    server_threads: int | None = 1,
    native: bool = True,
) -> dict[str, Any]:
    """Run the benchmark (see the module doc) and return its figures as a JSON-ready dict.

    ``model``: an HF model directory; None builds the ``bench`` preset (~100 MB fp32) into a
    temporary directory, removed afterwards. ``native``: also measure the backend's own flow,
    if it names one."""
    if seconds <= 0 or updates < 1 or concurrency < 1 or bucket_mb < 1:
        raise ValueError("seconds must be > 0; updates, concurrency and bucket_mb >= 1")
    started = time.perf_counter()
    previous_threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="pipelinerl-bench-") as tmp:
        path, model_label = bench_model(tmp, model)
        if backend != "reference":
            server_threads = None  # the thread option is the reference server's
        options: dict[str, object] = {} if server_threads is None else {"threads": server_threads}
        registry = load_registry()
        registry.factory("inference", backend)  # an import error before anything starts
        anchor = load_anchor(backend, registry) if native else None
        flow = anchor.flow if anchor is not None else None
        try:
            if torch_threads is not None:
                torch.set_num_threads(torch_threads)
            memcpy_threads = server_threads if server_threads is not None else previous_threads
            env = dict(flow.server_env) if flow is not None else None
            with ServerProcess(backend, path, options=options, env=env) as server:
                result = asyncio.run(
                    _bench(
                        server,
                        path,
                        _Budget(seconds, updates, concurrency),
                        bucket_mb=bucket_mb,
                        memcpy_threads=memcpy_threads,
                        flow=flow,
                    )
                )
            # The engine's own update flow, when its adapter registers one (after the server
            # above has stopped: one engine at a time).
            if anchor is not None and anchor.standalone is not None:
                result["native_anchor"] = anchor.standalone(path, dtype="float32", updates=updates)
                native_s = result["native_anchor"]["update_wall_s"]
                for figures in result["modes"].values():
                    if "update_wall_s" in figures:
                        figures["update_over_native_anchor"] = figures["update_wall_s"] / native_s
        finally:
            torch.set_num_threads(previous_threads)
    result["config"].update(
        backend=backend,
        model=model_label,
        torch_threads=torch_threads if torch_threads is not None else previous_threads,
        server_threads=server_threads,
        cpu_count=os.cpu_count(),
        torch=torch.__version__,
        wall_s=time.perf_counter() - started,
    )
    return result


async def _bench(
    server: ServerProcess,
    path: Path,
    budget: _Budget,
    *,
    bucket_mb: int,
    memcpy_threads: int,
    flow: NativeUpdateFlow | None,
) -> dict[str, Any]:
    bucket_bytes = bucket_mb << 20
    client = InferenceClient(server.url, control_token=server.control_token)
    publisher = WeightPublisher([client], bucket_bytes=bucket_bytes)
    trainer = ReferenceTrainer()
    try:
        await asyncio.to_thread(trainer.init, TrainerSpec(model=str(path), dtype="float32"))
        specs = trainer.param_specs()
        plan = BucketPlan.build(specs, bucket_bytes)
        model_bytes = sum(s.nbytes for s in specs)
        info = await client.info()
        await publisher.connect()

        memcpy_s = _memcpy_seconds(model_bytes, memcpy_threads)  # nothing else runs yet: block the loop
        await publisher.probe(model_bytes)  # warm-up
        probes: list[tuple[float, dict[str, float]]] = []
        floors = _Floors(client)

        async def probe() -> float:
            probes.append(await publisher.probe(model_bytes))
            return probes[-1][0]

        versions = itertools.count(info.version + 1)
        # Every way of updating (the SDK's modes, the engine's own flow) is timed the same way.
        bench_mode = functools.partial(
            _bench_mode,
            client,
            budget=budget,
            versions=versions,
            memcpy_s=memcpy_s,
            probe=probe,
            floor=floors.sample,
            cpu=_CpuMeter([server.pid]),
        )
        modes: dict[str, Any] = {}
        for mode in MODES:
            if mode not in info.receive_modes:
                modes[mode] = {"skipped": f"server supports only {info.receive_modes}"}
                continue
            publisher.mode = mode

            async def sdk(version: int) -> UpdateRecord:
                return await _publish(publisher, trainer, specs, version)

            modes[mode] = await bench_mode(sdk)
            modes[mode]["meets_targets"] = _meets(mode, modes[mode])
        if flow is not None:
            native_flow, target = (
                flow,
                FlowTarget(server.url, publisher, trainer.gather_and_broadcast, specs, server.control_token),
            )

            async def native(version: int) -> UpdateRecord:
                done = await native_flow.update(target, version)
                return UpdateRecord(done.wall_s, done.pause_s, done.send_s, None, None, timeline(done.stamps))

            modes["native"] = await bench_mode(native)
            modes["native"]["flow"] = flow.description
            for mode in MODES:
                if "update_wall_s" in modes[mode]:
                    modes[mode]["vs_native"] = {
                        k: _ratio(modes[mode][k], modes["native"][k])
                        for k in ("update_wall_s", "pause_s", "tokens_per_s_updating")
                    }
                    modes[mode]["meets_targets"]["no_slower_than_native"] = (
                        modes[mode]["update_wall_s"] <= modes["native"]["update_wall_s"]
                    )
        if info.capabilities.get("vllm_rl_api") and info.default_mode in modes:
            flat_s = statistics.median(send for send, _ in probes)
            modes["vllm_rl_api"] = await _bench_vllm_rl_api(
                server, trainer, specs, info.receiving_workers, bucket_bytes, bench_mode, flat_s
            )
            sdk_figures: dict[str, Any] = modes[info.default_mode]
            front_figures: dict[str, Any] = modes["vllm_rl_api"]
            vs_sdk: dict[str, Any] = {"mode": info.default_mode}
            for key in ("update_wall_s", "pause_s", "tokens_per_s_updating"):
                vs_sdk[key] = _ratio(front_figures[key], sdk_figures[key])
            front_figures["vs_sdk"] = vs_sdk
            front_figures["meets_targets"] = {
                f"{key}_within_{VLLM_RL_API_TARGET}_of_sdk": (vs_sdk[key] or float("inf")) <= VLLM_RL_API_TARGET
                for key in ("update_wall_s", "pause_s")
            }
        return {
            "model_bytes": model_bytes,
            "memcpy_s": memcpy_s,
            "flat_broadcast_s": statistics.median(send for send, _ in probes),
            "flat_broadcast_receive_s": statistics.median(max(by_url.values()) for _, by_url in probes),
            "flat_broadcast_s_samples": [send for send, _ in probes],
            **floors.summary(),
            "modes": modes,
            "targets": {**TARGETS, "applies_to": {k: list(v) for k, v in TARGET_MODES.items()}},
            "config": {
                **asdict(budget),
                "bucket_mb": bucket_mb,
                "bucket_bytes": bucket_bytes,
                "buckets": len(plan.buckets),
                "params": len(specs),
                "max_tokens": MAX_TOKENS,
                "temperature": TEMPERATURE,
                "ignore_eos": SUPPORTS_IGNORE_EOS,
                "update_interval_s": UPDATE_INTERVAL_S,
                "ramp_s": RAMP_S,
                "memcpy_threads": memcpy_threads,
            },
        }
    finally:
        await publisher.close()
        await client.aclose()
        trainer.close()


async def _bench_vllm_rl_api(
    server: ServerProcess,
    trainer: ReferenceTrainer,
    specs: Sequence[ParamSpec],
    receiving_workers: int,
    bucket_bytes: int,
    bench_mode: Callable[..., Awaitable[dict[str, Any]]],
    flat_s: float,
) -> dict[str, Any]:
    """The same updates through vLLM's RL API on the same server (:mod:`pipelinerl_sdk.http.vllm_flow`:
    ``start_weight_update``, ``update_weights`` receive, the broadcast, ``await``,
    ``finish_weight_update``), in the server's default mode. It forms its own group (the server
    leaves the SDK publisher's), so it runs last; its flat broadcast is the SDK modes' median."""
    from pipelinerl_sdk.http.vllm_flow import ControlTokenClient, VLLMFlowLink

    client = ControlTokenClient(server.url, server.control_token)
    front = WeightPublisher([VLLMFlowLink(client, receiving_workers=receiving_workers)], bucket_bytes=bucket_bytes)
    try:
        await front.connect()

        async def via_front(version: int) -> UpdateRecord:
            return await _publish(front, trainer, specs, version)

        async def same_flat() -> float:
            return flat_s

        figures = await bench_mode(via_front, probe=same_flat)
    finally:
        await front.close()
        client.close()
    figures["flow"] = "vLLM 0.32's RL routes served by the SDK: start, update_weights receive, broadcast, await, finish"
    return figures


def _memcpy_seconds(nbytes: int, threads: int, repeats: int = 5) -> float:
    """Median seconds of one ``dst.copy_(src)`` of ``nbytes`` with ``threads`` torch threads
    (both buffers touched by a warm-up copy first)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        torch.set_num_threads(previous)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


@dataclass(frozen=True, slots=True)
class UpdateRecord:
    """One timed update, whichever way it was done. ``pause_s``: the fleet's pause (the longest
    any server held generation); ``receive_s``/``apply_s``: the servers' own figures (the slowest
    server), None when the flow does not report them; ``timeline``: its phases, seconds since
    the trainer's request (:func:`~pipelinerl_sdk.bench.timeline.timeline`)."""

    wall_s: float
    pause_s: float
    send_s: float
    receive_s: float | None
    apply_s: float | None
    timeline: dict[str, float] = field(default_factory=dict)


async def _publish(
    publisher: WeightPublisher, trainer: ReferenceTrainer, specs: Sequence[ParamSpec], version: int
) -> UpdateRecord:
    async with publisher.update(version, specs) as sink:
        await asyncio.to_thread(trainer.gather_and_broadcast, sink)
    last = publisher.last
    assert last is not None and last.version == version
    return _record(last)


def _record(result: PublishResult) -> UpdateRecord:
    events = result.events.values()
    return UpdateRecord(
        wall_s=result.wall_s,
        pause_s=max(e.timings["pause_s"] for e in events),
        send_s=result.send.seconds,
        receive_s=max(e.timings["receive_s"] for e in events),
        apply_s=max(e.timings["apply_s"] for e in events),
        # the first server's side (the benchmark runs one)
        timeline=timeline(result.stamps, next(iter(events), None)),
    )


def _summary(results: Sequence[UpdateRecord]) -> dict[str, Any]:
    if not results:
        return {"count": 0}
    walls = [r.wall_s for r in results]
    pauses = [r.pause_s for r in results]
    receives = [r.receive_s for r in results if r.receive_s is not None]
    applies = [r.apply_s for r in results if r.apply_s is not None]
    one = sorted(results, key=lambda r: r.wall_s)[(len(results) - 1) // 2]  # the (lower) median wall
    return {
        "count": len(results),
        "update_wall_s": statistics.median(walls),
        "pause_s": statistics.median(pauses),
        "receive_s": statistics.median(receives) if receives else None,
        "apply_s": statistics.median(applies) if applies else None,
        "send_s": statistics.median(r.send_s for r in results),
        "update_wall_s_max": max(walls),
        "pause_s_max": max(pauses),
        "timeline_ms": to_ms(one.timeline),
        "timeline_median_ms": to_ms(median_timeline([r.timeline for r in results if r.timeline])),
    }


async def _bench_mode(
    client: InferenceClient,
    publish: Callable[[int], Awaitable[UpdateRecord]],
    versions: itertools.count[int],
    *,
    budget: _Budget,
    memcpy_s: float,
    probe: Callable[[], Awaitable[float]],
    floor: Callable[[], Awaitable[float | None]],
    cpu: _CpuMeter,
) -> dict[str, Any]:
    await publish(next(versions))  # warm-up
    flats, records, applies = [], [], []
    for _ in range(budget.updates):  # interleaved: each ratio compares like with like
        flats.append(await probe())
        records.append(await publish(next(versions)))
        applies.append(await floor())  # the engine's apply of what it serves now
    idle = _summary(records)
    flat_broadcast_s = statistics.median(flats)
    floors = [a for a in applies if a is not None]
    apply_floor_s = statistics.median(floors) if floors else None

    loop = asyncio.get_running_loop()
    under_load: list[UpdateRecord] = []
    async with ChatLoad(client, concurrency=budget.concurrency, max_tokens=MAX_TOKENS, temperature=TEMPERATURE) as load:
        await load.wait_phased()
        await asyncio.sleep(RAMP_S)
        t0 = loop.time()
        c0 = cpu.sample()
        await asyncio.sleep(budget.seconds)
        t1 = loop.time()
        c1 = cpu.sample()
        tick = 0
        while (due := t1 + tick * UPDATE_INTERVAL_S) < t1 + budget.seconds:
            await asyncio.sleep(max(0.0, due - loop.time()))
            under_load.append(await publish(next(versions)))
            # An update that overran its second skips the ticks it missed.
            tick = max(tick + 1, int((loop.time() - t1) // UPDATE_INTERVAL_S) + 1)
        t2 = t1 + budget.seconds
        await asyncio.sleep(max(0.0, t2 - loop.time()))
        c2 = cpu.sample()
        baseline, updating = load.window(t0, t1), load.window(t1, t2)
        errors = load.errors
    ratio = updating.tokens_per_s / baseline.tokens_per_s if baseline.tokens_per_s > 0 else float("nan")
    return {
        **idle,
        "pause_over_memcpy": idle["pause_s"] / memcpy_s,
        "update_over_flat_broadcast": idle["update_wall_s"] / flat_broadcast_s,
        "flat_broadcast_s": flat_broadcast_s,
        "flat_broadcast_s_samples": flats,
        **floor_ratios(idle["update_wall_s"], idle["pause_s"], flat_broadcast_s, apply_floor_s),
        "engine_apply_floor_s_samples": floors,
        "tokens_per_s_ratio_updating": ratio,
        "tokens_per_s_no_updates": baseline.tokens_per_s,
        "tokens_per_s_updating": updating.tokens_per_s,
        "requests_no_updates": baseline.requests,
        "requests_updating": updating.requests,
        "updates_in_updating_window": len(under_load),
        "under_load": _summary(under_load),
        "foreign_cpu_frac_no_updates": _CpuMeter.foreign_frac(c0, c1),
        "foreign_cpu_frac_updating": _CpuMeter.foreign_frac(c1, c2),
        "load_errors": len(errors),
        **({"load_error_sample": errors[0]} if errors else {}),
    }


class _CpuMeter:
    """Machine-wide busy CPU seconds vs. those of this benchmark's processes (Linux ``/proc``).
    The difference is foreign load; on a small shared machine it, not the update, can move a
    throughput window by several percent, so each window reports it."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    @staticmethod
    def _tree(pid: int) -> list[int]:
        """``pid`` and its descendants (a server may run its engine in child processes)."""
        found, todo = [], [pid]
        while todo:
            p = todo.pop()
            found.append(p)
            try:
                for task in os.listdir(f"/proc/{p}/task"):
                    with open(f"/proc/{p}/task/{task}/children") as f:
                        todo.extend(int(c) for c in f.read().split())
            except OSError:
                continue
        return found

    def sample(self) -> tuple[float, float, float] | None:
        """(monotonic time, machine busy CPU s, our CPU s), or None where /proc is unreadable.
        "Ours" is this process plus each server's whole process tree (CPU of exited children is
        lost, so keep windows free of process churn)."""
        try:
            with open("/proc/stat") as f:
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
            ours = time.process_time()
            for pid in {p for root in self.pids for p in self._tree(root)}:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                ours += (int(fields[11]) + int(fields[12])) / self.tick  # utime, stime
        except (OSError, ValueError, IndexError):
            return None
        busy = (user + nice + system + irq + softirq + steal) / self.tick
        return time.monotonic(), busy, ours

    @staticmethod
    def foreign_frac(a: tuple[float, float, float] | None, b: tuple[float, float, float] | None) -> float | None:
        """Share of all cores' time between two samples spent by other processes (None if unknown)."""
        if a is None or b is None or b[0] <= a[0]:
            return None
        foreign = (b[1] - a[1]) - (b[2] - a[2])
        return max(0.0, foreign) / ((b[0] - a[0]) * (os.cpu_count() or 1))


def floor_ratios(wall_s: float, pause_s: float, flat_broadcast_s: float, apply_floor_s: float | None) -> dict[str, Any]:
    """The floor figures of one mode: ``engine_apply_floor_s``, ``update_over_floor`` = wall /
    (flat broadcast + apply floor) and ``pause_over_apply_floor`` (None without a floor)."""
    if apply_floor_s is None or apply_floor_s <= 0:
        return {"engine_apply_floor_s": None, "update_over_floor": None, "pause_over_apply_floor": None}
    return {
        "engine_apply_floor_s": apply_floor_s,
        "update_over_floor": wall_s / (flat_broadcast_s + apply_floor_s),
        "pause_over_apply_floor": pause_s / apply_floor_s,
    }


def _meets(mode: ReceiveMode, figures: dict[str, Any]) -> dict[str, bool]:
    """Each target of ``mode`` met or not (a figure the run could not measure, None, is left out)."""
    met = {
        k: bool(figures[k] >= bound if k in AT_LEAST else figures[k] <= bound)
        for k, bound in TARGETS.items()
        if mode in TARGET_MODES[k] and figures.get(k) is not None
    }
    return {**met, "all": all(met.values())}


class _Floors:
    """The engine's apply floor (``POST /bench/apply_floor``), one apply per :meth:`sample`; a
    backend that does not offer it (501) is asked once."""

    def __init__(self, client: InferenceClient) -> None:
        self.client = client
        self.samples: list[float] = []
        self.detail: str | None = None
        self.error: str | None = None

    async def sample(self) -> float | None:
        if self.error is not None:
            return None
        try:
            got = await self.client.apply_floor(1)
        except ServerError as e:
            self.error = str(e)
            return None
        self.detail = got.detail
        self.samples.extend(got.seconds)
        return got.seconds[0]

    def summary(self) -> dict[str, Any]:
        return {
            "engine_apply_floor_s": statistics.median(self.samples) if self.samples else None,
            "engine_apply_floor_s_samples": self.samples,
            "engine_apply_floor": self.detail,
            **({"engine_apply_floor_error": self.error} if self.error else {}),
        }
