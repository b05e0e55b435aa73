"""The trainer kit's unit gather (:func:`stream_units`, :class:`UnitGather`) on two real gloo ranks:
every tensor equals its full value (uneven shards, padded partitions, params it cannot flatten),
in order, with one all-gather per unit."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from pipelinerl_sdk.kit.trainer import FlatShard, UnitGather, full_tensor, stream_units
from pipelinerl_sdk.trainer_group import RankContext, run_ranks

SHAPES = [(5, 3), (7,), (1, 4), (2, 2, 3)]


def _values() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _gather_dtensors(ctx: RankContext, _: None) -> tuple[list[str], list[bool], int]:
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    full = _values()
    sharded = [(f"p{i}", distribute_tensor(t, mesh, [Shard(0)])) for i, t in enumerate(full)]
    replicated = ("r", distribute_tensor(torch.arange(6.0), mesh, [Replicate()]))
    plain = ("plain", torch.ones(3, dtype=torch.float64))
    units = [sharded[:2], [plain, sharded[2], replicated], sharded[3:]]
    expected = [*full[:2], plain[1], full[2], torch.arange(6.0), full[3]]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = list(stream_units(units, UnitGather))
    collectives = sum(1 for e in prof.events() if e.name.startswith("gloo:"))
    return [n for n, _ in got], [torch.equal(t, e) for (_, t), e in zip(got, expected, strict=True)], collectives


def test_one_all_gather_per_unit_and_exact_values() -> None:
    results = run_ranks(2, _gather_dtensors, None, timeout_s=300)
    for names, equal, collectives in results:
        assert names == ["p0", "p1", "plain", "p2", "r", "p3"]
        assert all(equal), equal
        # three units of shards, one all-gather each; the replicated DTensor needs none
        assert collectives == 3, collectives


def _partition(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """ZeRO-3's layout: the flattened tensor in equal parts, the last one zero-padded."""
    chunk = -(-t.numel() // world)
    flat = torch.zeros(chunk * world, dtype=t.dtype)
    flat[: t.numel()] = t.reshape(-1)
    return flat[rank * chunk : (rank + 1) * chunk].clone()


def _gather_partitions(ctx: RankContext, _: None) -> list[bool]:
    full = _values()
    parts = {id(p): (p, t) for p, t in ((_partition(t, ctx.world_size, ctx.rank), t) for t in full)}

    def shard_of(p: torch.Tensor) -> FlatShard | None:
        part, t = parts[id(p)]
        return FlatShard(part, part.numel(), t.numel(), t.element_size(), tuple(t.shape), t.dtype, dist.group.WORLD)

    units = [[(f"p{i}", p) for i, (p, _) in enumerate(parts.values())]]
    got = list(stream_units(units, lambda unit: UnitGather(unit, shard_of)))
    return [torch.equal(t, e) for (_, t), e in zip(got, full, strict=True)]


def test_padded_flat_partitions_are_cut_to_the_param() -> None:
    for equal in run_ranks(2, _gather_partitions, None, timeout_s=300):
        assert equal == [True] * len(SHAPES)


def test_full_tensor_of_a_plain_tensor_is_itself() -> None:
    t = torch.ones(2)
    assert torch.equal(full_tensor(t), t)
