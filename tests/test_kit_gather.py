"""The trainer kit's unit gather (:func:`stream_units`, :class:`UnitGather`) on two real gloo ranks:
every tensor equals its full value (uneven shards, padded partitions, params it cannot flatten),
in order; small and uneven params share one all-gather per unit, a large param with whole shards
is all-gathered on its own straight into its destination (a sink's slot, or a new tensor); the
next unit of a pass reuses the shared all-gather's output."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from pipelinerl_sdk.kit.trainer import (
    DIRECT_MIN_BYTES,
    FlatShard,
    UnitBuffers,
    UnitGather,
    UnitGathers,
    full_tensor,
    stream_units,
)
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


#: Per unit: a large param with whole shards (rows divide by 2), a large uneven one, two small ones.
BIG = [(640, 512), (641, 512), (3, 5), (7,)]


def _big_values(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in BIG]


def _gather_into(ctx: RankContext, _: None) -> tuple[list[bool], list[bool], list[bool], int, int]:
    """Two units of :data:`BIG` params; every second param has a destination (``into``), the
    others get new tensors. Returns (exact values, each destination used, each large whole
    param's tensor where its collective wrote it (no copy: its storage is the destination's or
    its own), collectives, shared outputs allocated)."""
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    full = _big_values(0) + _big_values(1)
    assert full[0].numel() * 4 >= DIRECT_MIN_BYTES
    params = [(f"p{i}", distribute_tensor(t, mesh, [Shard(0)])) for i, t in enumerate(full)]
    slots = {f"p{i}": torch.empty_like(t) for i, t in enumerate(full) if i % 2 == 0}
    gathers = UnitGathers(into=slots.get)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = list(stream_units([params[:4], params[4:]], gathers))
    collectives = sum(1 for e in prof.events() if e.name.startswith("gloo:"))
    equal = [torch.equal(t, e) for (_, t), e in zip(got, full, strict=True)]
    placed = [t.data_ptr() == slots[n].data_ptr() for n, t in got if n in slots]
    whole = [got[0][1].data_ptr() == slots["p0"].data_ptr(), got[4][1].data_ptr() == slots["p4"].data_ptr()]
    return equal, placed, whole, collectives, gathers.buffers.allocations


def test_large_whole_params_are_gathered_into_place_the_rest_share_one_all_gather() -> None:
    for equal, placed, whole, collectives, allocations in run_ranks(2, _gather_into, None, timeout_s=300):
        assert all(equal), equal
        assert placed == [True] * 4 and whole == [True, True]
        # per unit: the large whole param alone, the uneven one and the two small ones together
        assert collectives == 4, collectives
        assert allocations == 1  # gloo: no prefetch, the second unit reuses the first's shared output


def _gather_into_a_wrong_slot(ctx: RankContext, _: None) -> str:
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    params = [("p0", distribute_tensor(_values()[0], mesh, [Shard(0)]))]
    try:
        list(stream_units([params], UnitGathers(into=lambda name: torch.empty(3, 5))))
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_slot_of_the_wrong_shape_is_refused_naming_the_param() -> None:
    for message in run_ranks(2, _gather_into_a_wrong_slot, None, timeout_s=300):
        assert message.startswith("'p0': slot torch.float32 (3, 5), param torch.float32 (5, 3)"), message


def test_unit_buffers_hand_out_a_free_buffer_that_fits() -> None:
    buffers, cpu = UnitBuffers(), torch.device("cpu")
    a = buffers.take(100, cpu)
    buffers.give(a)
    b = buffers.take(60, cpu)  # a view of the free one
    assert b.numel() == 60 and b.data_ptr() == a.data_ptr() and buffers.allocations == 1
    c = buffers.take(60, cpu)  # none free: a new one
    buffers.give(b)
    buffers.give(c)
    d = buffers.take(100, cpu)  # b's whole buffer again, c kept
    assert d.data_ptr() == a.data_ptr() and buffers.allocations == 2
    e = buffers.take(500, cpu)  # nothing fits: c is dropped, a new one
    assert buffers.allocations == 3 and e.numel() == 500
    buffers.give(e)
    assert buffers.take(500, cpu).data_ptr() == e.data_ptr()


def test_full_tensor_of_a_plain_tensor_is_itself() -> None:
    t = torch.ones(2)
    assert torch.equal(full_tensor(t), t)
