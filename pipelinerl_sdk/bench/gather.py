"""``pipelinerl bench gather``: what a trainer's ``gather_and_broadcast`` costs, in one run.

Setup: a reference inference server child process (``ServerProcess``, one torch thread) is the
receiver; the trainer runs as ``world_size`` spawned ranks (:func:`run_ranks`, gloo), every rank
building it by its registered name. Rank 0 joins the server in a weight-update group
(``WeightPublisher``, ``staged`` receive, ``bucket_mb`` buckets) and publishes; the other ranks
only take part in the trainer's own gathers. The model is the ``bench`` preset (~103 MB fp32,
8 decoder layers of ~12.6 MB) unless one is given.

Figures (medians over ``repeats`` timed rounds after one warm-up round). A round measures, back
to back, so that a change in the machine's load moves all three alike: the all-gather floor,
the flat broadcast, then one update:

- ``gather_broadcast_s``: rank 0's ``gather_and_broadcast`` into the SDK's bucketed sender,
  from the sender's creation (every server accepted) until the last bucket's broadcast completed
  (``PublishResult.stats.seconds``): gathering, copying into buckets and broadcasting, overlapped
  as the trainer and sender manage;
- ``flat_broadcast_s``: one broadcast of a single flat buffer of the same bytes to the same
  server (``publisher.probe``): the floor for the line above; ``update_over_flat_broadcast`` is
  the median of the rounds' ratios of the two (target <= 1.25);
- ``allgather_floor_s``: the trainer ranks' all-gather of every gather unit alone (a decoder
  layer; each param outside the layers), one ``all_gather_single`` of the unit's bytes per unit,
  in the trainer's default group, no sink: the floor of the gather side;
  ``update_over_floor`` is the median of the rounds' ``gather_broadcast_s`` over
  (``allgather_floor_s`` + ``flat_broadcast_s``) (target <= 1.1 on a CPU machine, where both
  share the cores);
- ``gather_alone_s``: the trainer's own ``gather_and_broadcast(None)`` on every rank (no sink);
- ``collectives``: collectives rank 0 issued in one ``gather_and_broadcast`` (``trainer``: the
  profiler's ``gloo:``/``nccl:`` events in the trainer's gather alone; ``floor``: one per unit;
  ``sender``: the sender's broadcasts, one per bucket);
- ``update_wall_s``: the whole publish as the pipeline sees it (validation round trip, gather,
  broadcast, the server's apply and reply), for context;
- ``peak_extra_bytes``: rank 0's extra peak of torch allocations during one more update
  (:class:`~pipelinerl_sdk.memory.AllocationPeak`, the gather run on the profiled thread), with
  the sender's two bucket buffers already allocated (they are allocated once per publisher and
  reused: ``sender_buffer_bytes``); ``peak_over_layer`` is it over the largest decoder layer
  (target <= 2.5: two units in flight plus a bucket).

Noise: the machine may be shared and has few cores (server receive + ``world_size`` ranks);
``samples`` keeps every timing so a reader can see the spread.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pipelinerl_sdk.bench.model import bench_model
from pipelinerl_sdk.contracts import TrainerBackend, TrainerSpec
from pipelinerl_sdk.launch import ServerProcess
from pipelinerl_sdk.memory import AllocationPeak, gather_units
from pipelinerl_sdk.trainer_group import RankContext, run_ranks

__all__ = ["TARGETS", "AllgatherFloor", "GatherJob", "run_gather_bench"]

#: Bounds a trainer should meet (ratios at most these).
TARGETS: dict[str, float] = {"update_over_floor": 1.1, "peak_over_layer": 2.5}


@dataclass(frozen=True, slots=True)
class GatherJob:
    """What every rank needs (pickled to the spawned ranks)."""

    trainer: str
    model: str
    server_url: str
    control_token: str
    bucket_bytes: int
    repeats: int
    options: dict[str, Any] = field(default_factory=dict)
    torch_threads: int | None = 1


def run_gather_bench(
    *,
    trainer: str,
    world_size: int = 2,
    model: str | os.PathLike[str] | None = None,
    bucket_mb: int = 64,
    repeats: int = 3,
    options: dict[str, Any] | None = None,
    torch_threads: int | None = 1,
    timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """Run the benchmark (see the module doc) and return its figures as a JSON-ready dict.

    ``model``: an HF model directory; None builds the ``bench`` preset into a temporary
    directory, removed afterwards. ``options``: the trainer's ``TrainerSpec.options``."""
    if world_size < 1 or repeats < 1 or bucket_mb < 1:
        raise ValueError("world_size, repeats and bucket_mb must be >= 1")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pipelinerl-bench-gather-") as tmp:
        path, model_label = bench_model(tmp, model)
        with ServerProcess("reference", path, options={"threads": 1}) as server:
            job = GatherJob(
                trainer=trainer,
                model=str(path),
                server_url=server.url,
                control_token=server.control_token,
                bucket_bytes=bucket_mb << 20,
                repeats=repeats,
                options=dict(options or {}),
                torch_threads=torch_threads,
            )
            results = run_ranks(world_size, gather_rank, job, timeout_s=timeout_s)
    result: dict[str, Any] = results[0]
    result["collectives"]["floor"] = result.pop("floor_units")
    result["collectives"]["sender"] = result.pop("buckets")
    result["meets_targets"] = {k: result[k] is not None and result[k] <= v for k, v in TARGETS.items()}
    result["targets"] = dict(TARGETS)
    result["config"] = {
        "trainer": trainer,
        "world_size": world_size,
        "model": model_label,
        "bucket_mb": bucket_mb,
        "repeats": repeats,
        "options": dict(options or {}),
        "receiver": "reference server, staged receive, 1 torch thread",
        "torch_threads": torch_threads,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "wall_s": time.perf_counter() - started,
    }
    return result


def gather_rank(ctx: RankContext, job: GatherJob) -> dict[str, Any]:
    """One rank: init the trainer by its registered name; rank 0 publishes (and measures), the
    others gather along. Every rank runs the same collectives in the same order: the gathers
    alone, then ``repeats + 1`` rounds of (all-gather floor, ``gather_and_broadcast``), then one
    more ``gather_and_broadcast`` (rank 0 measures its peak memory)."""
    from pipelinerl_sdk.plugins import load_registry

    if job.torch_threads is not None:
        torch.set_num_threads(job.torch_threads)
    trainer: TrainerBackend = load_registry().create_trainer(job.trainer)
    try:
        trainer.init(TrainerSpec(model=job.model, dtype="float32", options=dict(job.options)))
        alone = measure_gather_alone(trainer, job.repeats, count=ctx.is_main)
        floor = AllgatherFloor(trainer)
        if not ctx.is_main:
            for _ in range(job.repeats + 1):
                _timed(floor, 1)
                trainer.gather_and_broadcast(None)
            trainer.gather_and_broadcast(None)
            return {}
        return {**alone, **asyncio.run(_publish_and_measure(trainer, job, floor))}
    finally:
        trainer.close()


def _collectives(prof: Any) -> int:
    """Collectives a profiled block issued: the process groups' own ``gloo:``/``nccl:`` events."""
    return sum(1 for e in prof.events() if e.name.startswith(("gloo:", "nccl:")))


def _timed(fn: Any, repeats: int) -> list[float]:
    """Seconds of ``fn()`` on every rank, from a barrier to the next (so the slowest rank counts)."""
    import torch.distributed as dist

    out = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        if dist.is_initialized():
            dist.barrier()
        out.append(time.perf_counter() - t0)
    return out


class AllgatherFloor:
    """The all-gather floor, run on every rank (collectives): one ``all_gather_single`` of each
    gather unit's bytes into one preallocated buffer, no sink. ``units``: the collectives one run
    issues (none at world size 1)."""

    def __init__(self, trainer: TrainerBackend) -> None:
        import torch.distributed as dist

        self._units = list(gather_units(trainer.param_specs()).values())
        self._world = dist.get_world_size() if dist.is_initialized() else 1
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        chunk = max(-(-n // self._world) for n in self._units)
        self._out = torch.ones(self._world * chunk, dtype=torch.uint8)
        self.units = len(self._units) if self._world > 1 else 0

    def __call__(self) -> None:
        import torch.distributed as dist

        if self._world == 1:
            return
        for n in self._units:
            c = -(-n // self._world)
            dist.all_gather_single(self._out[: self._world * c], self._out[self._rank * c : (self._rank + 1) * c])


def measure_gather_alone(trainer: TrainerBackend, repeats: int, *, count: bool) -> dict[str, Any]:
    """On every rank (collectives): the trainer's own gather alone (no sink), once to warm up,
    then ``repeats`` timed; with ``count``, the collectives of one gather alone, under the
    profiler, beside the floor's count (one per unit)."""

    def alone() -> None:
        trainer.gather_and_broadcast(None)

    alone_s = _timed(alone, repeats + 1)[1:]
    if count:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            alone()
        trainer_collectives = _collectives(prof)
    else:
        alone()
    return {
        "gather_alone_s": statistics.median(alone_s),
        "collectives": {"trainer": trainer_collectives if count else None},
        "floor_samples": {"gather_alone_s": alone_s},
    }


async def _publish_and_measure(trainer: TrainerBackend, job: GatherJob, floor: AllgatherFloor) -> dict[str, Any]:
    from pipelinerl_sdk.http.client import InferenceClient
    from pipelinerl_sdk.weights.publisher import WeightPublisher

    specs = trainer.param_specs()
    model_bytes = sum(s.nbytes for s in specs)
    units = gather_units(specs)
    layers = [n for k, n in units.items() if ".layers." in k + "."]
    client = InferenceClient(job.server_url, control_token=job.control_token)
    publisher = WeightPublisher([client], bucket_bytes=job.bucket_bytes, mode="staged")
    try:
        version = (await client.info()).version
        await publisher.connect()
        await publisher.probe(model_bytes)  # warm-up
        floor_s: list[float] = []
        flat: list[float] = []
        gather_s: list[float] = []
        wall_s: list[float] = []
        for i in range(job.repeats + 1):  # the first round is a warm-up
            allgather = (await asyncio.to_thread(_timed, floor, 1))[0]
            probe = (await publisher.probe(model_bytes))[0]
            version += 1
            async with publisher.update(version, specs) as sender:
                await asyncio.to_thread(trainer.gather_and_broadcast, sender)
            assert publisher.last is not None
            if i:
                floor_s.append(allgather)
                flat.append(probe)
                gather_s.append(publisher.last.send.seconds)
                wall_s.append(publisher.last.wall_s)

        version += 1
        async with publisher.update(version, specs) as sender:
            with AllocationPeak() as peak:
                trainer.gather_and_broadcast(sender)  # on this thread: the profiler sees it
        buffers = publisher.buffer_bytes
        assert publisher.last is not None
        buckets = publisher.last.send.buckets
    finally:
        await publisher.close()
        await client.aclose()

    gather_med = statistics.median(gather_s)
    largest_layer = max(layers) if layers else None
    return {
        "model_bytes": model_bytes,
        "params": len(specs),
        "largest_layer_bytes": largest_layer,
        "largest_unit_bytes": max(units.values()),
        "gather_broadcast_s": gather_med,
        "flat_broadcast_s": statistics.median(flat),
        "allgather_floor_s": statistics.median(floor_s),
        "update_over_flat_broadcast": statistics.median(g / f for g, f in zip(gather_s, flat, strict=True)),
        "update_over_floor": statistics.median(g / (a + f) for g, a, f in zip(gather_s, floor_s, flat, strict=True)),
        "floor_units": floor.units,
        "buckets": buckets,
        "update_wall_s": statistics.median(wall_s),
        "peak_extra_bytes": peak.bytes,
        "allocated_bytes": peak.allocated,
        "peak_over_layer": peak.bytes / largest_layer if largest_layer else None,
        "sender_buffer_bytes": buffers,
        "samples": {
            "gather_broadcast_s": gather_s,
            "flat_broadcast_s": flat,
            "allgather_floor_s": floor_s,
            "update_wall_s": wall_s,
        },
    }
