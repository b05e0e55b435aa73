"""The bucket plan (weights/buckets.py) and the byte views (weights/tensors.py).

Properties of the layout for any list of specs and any bucket size, exact layouts for hand-computed
cases, digest sensitivity, and a bitwise round trip of real tensors through a flat staging buffer
read back by the receiver's :class:`StagedWeights`.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelinerl_sdk.protocol import DTYPE_SIZES, ParamSpec
from pipelinerl_sdk.weights.buckets import ALIGN, BucketPlan, flat_layout
from pipelinerl_sdk.weights.receive import StagedWeights
from pipelinerl_sdk.weights.tensors import TORCH_DTYPES, as_bytes, dtype_name, from_bytes, spec_of

DTYPES: list[str] = sorted(DTYPE_SIZES)

names_st = st.text(alphabet="abcdefghijklmnopqrstuvwxyz._0123456789", min_size=1, max_size=24)
shapes_st: st.SearchStrategy[tuple[int, ...]] = st.lists(
    st.integers(min_value=0, max_value=40), min_size=0, max_size=3
).map(tuple)


@st.composite
def spec_lists(draw: st.DrawFn, max_size: int = 12) -> list[ParamSpec]:
    """A non-empty list of uniquely named specs: every dtype, scalars ``()`` and zero-sized shapes."""
    names = draw(st.lists(names_st, min_size=1, max_size=max_size, unique=True))
    return [ParamSpec(name=name, dtype=draw(st.sampled_from(DTYPES)), shape=draw(shapes_st)) for name in names]


bucket_bytes_st = st.integers(min_value=1024, max_value=4 << 20)


def spec(name: str, dtype: str, shape: tuple[int, ...]) -> ParamSpec:
    return ParamSpec(name=name, dtype=dtype, shape=shape)  # type: ignore[arg-type]


# --- layout properties ----------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(specs=spec_lists(), bucket_bytes=bucket_bytes_st)
def test_plan_layout_properties(specs: list[ParamSpec], bucket_bytes: int) -> None:
    plan = BucketPlan.build(specs, bucket_bytes)

    assert plan.bucket_bytes == bucket_bytes
    assert plan.params == specs
    assert [b.index for b in plan.buckets] == list(range(len(plan.buckets)))

    start = 0
    for b in plan.buckets:
        assert b.entries, "no empty bucket"
        assert b.offset == start, "buckets lie back to back"
        assert b.offset % ALIGN == 0
        assert b.nbytes % ALIGN == 0
        end = 0
        for e in b.entries:
            assert e.offset % ALIGN == 0
            assert e.offset >= end, "entries in order, no overlap"
            end = e.offset + e.spec.nbytes
            assert end <= b.nbytes, "entry fits in its bucket"
        if b.nbytes > bucket_bytes:
            assert len(b.entries) == 1, f"bucket {b.index} of {b.nbytes} > {bucket_bytes} holds several params"
        start += b.nbytes
    assert plan.total_bytes == start
    assert plan.max_bucket_bytes == max(b.nbytes for b in plan.buckets)


@settings(max_examples=200, deadline=None)
@given(specs=spec_lists(), bucket_bytes=bucket_bytes_st)
def test_plan_is_greedy(specs: list[ParamSpec], bucket_bytes: int) -> None:
    """A bucket is closed only when the next param would overflow it: the first param of every
    bucket after the first would not have fitted (aligned) behind the previous bucket's last one."""
    plan = BucketPlan.build(specs, bucket_bytes)
    for prev, b in zip(plan.buckets, plan.buckets[1:], strict=False):
        last = prev.entries[-1]
        used = last.offset + last.spec.nbytes
        first = b.entries[0].spec
        start = (used + ALIGN - 1) // ALIGN * ALIGN
        padded_end = (start + first.nbytes + ALIGN - 1) // ALIGN * ALIGN
        assert padded_end > bucket_bytes


@given(specs=spec_lists(), bucket_bytes=bucket_bytes_st)
def test_staging_layout_does_not_depend_on_bucket_bytes(specs: list[ParamSpec], bucket_bytes: int) -> None:
    """What lets a trainer keep its params in one buffer that any plan can broadcast from."""
    plan = BucketPlan.build(specs, bucket_bytes)
    offsets, total = flat_layout(specs)
    assert [b.offset + e.offset for b in plan.buckets for e in b.entries] == offsets
    assert plan.total_bytes == total


def test_plan_exact_layout() -> None:
    specs = [
        spec("a", "float32", (3,)),  # 12 bytes
        spec("b", "bfloat16", (5,)),  # 10 bytes
        spec("c", "int64", (200,)),  # 1600 bytes: larger than a bucket
        spec("d", "bool", ()),  # 1 byte
        spec("e", "float64", (0, 7)),  # 0 bytes
    ]
    plan = BucketPlan.build(specs, 1024)
    layout = [(b.index, b.offset, b.nbytes, [(e.spec.name, e.offset) for e in b.entries]) for b in plan.buckets]
    assert layout == [
        (0, 0, 128, [("a", 0), ("b", 64)]),
        (1, 128, 1600, [("c", 0)]),
        (2, 1728, 64, [("d", 0), ("e", 64)]),
    ]
    assert plan.total_bytes == 1792
    assert plan.max_bucket_bytes == 1600


def test_plan_one_bucket_when_everything_fits() -> None:
    specs = [spec(f"p{i}", "float32", (16,)) for i in range(4)]  # 64 bytes each
    plan = BucketPlan.build(specs, 256)
    assert len(plan.buckets) == 1
    assert [e.offset for e in plan.buckets[0].entries] == [0, 64, 128, 192]
    assert plan.total_bytes == 256
    # One byte less and the last param moves to a second bucket.
    plan = BucketPlan.build(specs, 255)
    assert [len(b.entries) for b in plan.buckets] == [3, 1]
    assert [b.offset for b in plan.buckets] == [0, 192]


def test_padding_never_pushes_a_shared_bucket_over_bucket_bytes() -> None:
    """10 + 936 bytes end at byte 1000 (the second param starts at 64): the bucket would be padded
    to 1024 > bucket_bytes, so the second param must start a bucket of its own."""
    specs = [spec("a", "uint8", (10,)), spec("b", "uint8", (936,))]
    plan = BucketPlan.build(specs, 1000)
    assert [len(b.entries) for b in plan.buckets] == [1, 1]
    assert all(b.nbytes <= 1000 or len(b.entries) == 1 for b in plan.buckets)


# --- digest ---------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(specs=spec_lists(), bucket_bytes=bucket_bytes_st)
def test_digest_is_deterministic(specs: list[ParamSpec], bucket_bytes: int) -> None:
    digest = BucketPlan.build(specs, bucket_bytes).digest()
    copies = [ParamSpec.model_validate(p.model_dump()) for p in specs]
    assert BucketPlan.build(copies, bucket_bytes).digest() == digest
    assert len(digest) == 64
    assert int(digest, 16) >= 0


@settings(max_examples=200, deadline=None)
@given(specs=spec_lists(), bucket_bytes=bucket_bytes_st, data=st.data())
def test_digest_changes_with_any_field(specs: list[ParamSpec], bucket_bytes: int, data: st.DataObject) -> None:
    digest = BucketPlan.build(specs, bucket_bytes).digest()
    i = data.draw(st.integers(0, len(specs) - 1), label="i")
    p = specs[i]

    def with_param(q: ParamSpec) -> str:
        return BucketPlan.build([*specs[:i], q, *specs[i + 1 :]], bucket_bytes).digest()

    names = {s.name for s in specs}
    new_name = data.draw(names_st.filter(lambda n: n not in names), label="new_name")
    assert with_param(spec(new_name, p.dtype, p.shape)) != digest
    new_dtype = data.draw(st.sampled_from([d for d in DTYPES if d != p.dtype]), label="new_dtype")
    assert with_param(spec(p.name, new_dtype, p.shape)) != digest
    new_shape = data.draw(shapes_st.filter(lambda s: s != p.shape), label="new_shape")
    assert with_param(spec(p.name, p.dtype, new_shape)) != digest
    new_bb = data.draw(bucket_bytes_st.filter(lambda b: b != bucket_bytes), label="new_bucket_bytes")
    assert BucketPlan.build(specs, new_bb).digest() != digest
    if len(specs) > 1:
        j = data.draw(st.integers(0, len(specs) - 1).filter(lambda j: j != i), label="j")
        swapped = list(specs)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        assert BucketPlan.build(swapped, bucket_bytes).digest() != digest


def test_digest_shape_reshape_and_swap_examples() -> None:
    specs = [spec("w", "float32", (4, 6)), spec("b", "float32", (6,))]
    digest = BucketPlan.build(specs, 1024).digest()
    # Same numel and bytes, different shape.
    assert BucketPlan.build([spec("w", "float32", (6, 4)), specs[1]], 1024).digest() != digest
    assert BucketPlan.build([specs[1], specs[0]], 1024).digest() != digest
    assert BucketPlan.build(specs, 1024).digest() == digest


# --- build errors ---------------------------------------------------------------------------------


def test_build_refuses_empty_params() -> None:
    with pytest.raises(ValueError, match=r"params: at least one param"):
        BucketPlan.build([], 1024)


def test_build_refuses_duplicate_names() -> None:
    specs = [spec("x", "float32", (1,)), spec("y", "int8", ()), spec("x", "bool", (2,))]
    with pytest.raises(ValueError, match=r"params: duplicate name 'x'"):
        BucketPlan.build(specs, 1024)


@pytest.mark.parametrize("bucket_bytes", [0, -1, -(1 << 20)])
def test_build_refuses_non_positive_bucket_bytes(bucket_bytes: int) -> None:
    with pytest.raises(ValueError, match=rf"bucket_bytes must be positive, got {bucket_bytes}"):
        BucketPlan.build([spec("x", "float32", (1,))], bucket_bytes)


# --- byte views and the staging round trip --------------------------------------------------------


def random_tensor(p: ParamSpec, gen: torch.Generator) -> torch.Tensor:
    dtype = TORCH_DTYPES[p.dtype]
    if dtype == torch.bool:
        return torch.randint(0, 2, p.shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(p.shape, generator=gen, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(1 << 62)), min(info.max, (1 << 62) - 1)
    return torch.randint(low, high + 1, p.shape, generator=gen, dtype=torch.int64).to(dtype)


@settings(max_examples=60, deadline=None)
@given(specs=spec_lists(max_size=8), bucket_bytes=bucket_bytes_st, seed=st.integers(0, 2**31 - 1))
def test_round_trip_through_staging_buffer(specs: list[ParamSpec], bucket_bytes: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors = [random_tensor(p, gen) for p in specs]
    plan = BucketPlan.build(specs, bucket_bytes)
    # Fill with a pattern so that a read from padding or a wrong offset cannot pass by accident.
    buffer = torch.full((plan.total_bytes,), 0xA5, dtype=torch.uint8)
    by_name = dict(zip((p.name for p in specs), tensors, strict=True))
    for b in plan.buckets:
        for e in b.entries:
            start = b.offset + e.offset
            raw = as_bytes(by_name[e.spec.name])
            assert raw.dtype == torch.uint8
            assert raw.numel() == e.spec.nbytes
            buffer[start : start + e.spec.nbytes] = raw

    got = list(StagedWeights(plan, buffer, 0.0).tensors())

    assert [name for name, _ in got] == [p.name for p in specs]
    for (name, t), p, want in zip(got, specs, tensors, strict=True):
        assert t.dtype == TORCH_DTYPES[p.dtype], name
        assert tuple(t.shape) == p.shape, name
        assert torch.equal(t, want), name
        assert torch.equal(as_bytes(t), as_bytes(want)), name
        if t.numel():  # a view into the staging buffer, not a copy
            assert t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_as_bytes_of_special_values_and_non_contiguous() -> None:
    t = torch.tensor([[0.0, -0.0], [float("nan"), float("-inf")]], dtype=torch.bfloat16)
    raw = as_bytes(t.T)  # non-contiguous: copied in the transposed (logical) order
    assert raw.tolist() == as_bytes(t.T.contiguous()).tolist()
    assert raw.numel() == 8
    back = from_bytes(raw, spec("t", "bfloat16", (2, 2)))
    assert torch.equal(as_bytes(back), raw)
    assert torch.equal(back.isnan(), t.T.isnan())
    assert torch.signbit(back).tolist() == [[False, False], [True, True]]


def test_as_bytes_little_endian_values() -> None:
    assert as_bytes(torch.tensor([1, 256], dtype=torch.int16)).tolist() == [1, 0, 0, 1]
    assert as_bytes(torch.tensor(True)).tolist() == [1]
    assert as_bytes(torch.tensor(1.0, dtype=torch.float32)).tolist() == [0, 0, 128, 63]
    assert as_bytes(torch.zeros(0, 3, dtype=torch.float64)).numel() == 0


def test_from_bytes_reads_only_its_prefix() -> None:
    raw = torch.arange(16, dtype=torch.uint8)
    t = from_bytes(raw, spec("x", "int16", (2, 2)))
    assert t.tolist() == [[0x0100, 0x0302], [0x0504, 0x0706]]
    assert from_bytes(raw, spec("s", "uint8", ())).item() == 0


def test_dtype_names_round_trip_and_refusal() -> None:
    for name, dtype in TORCH_DTYPES.items():
        assert dtype_name(dtype) == name
        assert torch.empty((), dtype=dtype).element_size() == DTYPE_SIZES[name]
    with pytest.raises(ValueError, match=r"torch.complex64 is not carried"):
        dtype_name(torch.complex64)
    assert spec_of("layer.w", torch.zeros(2, 3, dtype=torch.bfloat16)) == spec("layer.w", "bfloat16", (2, 3))
