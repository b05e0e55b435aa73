"""DoubleBuffer: a full update received into the spare buffer is swapped in (no copy); anything
else is copied; the buffer that was live becomes the next spare."""

from __future__ import annotations

import torch

from pipelinerl_sdk.weights.buckets import BucketPlan
from pipelinerl_sdk.weights.receive import StagedWeights
from pipelinerl_sdk.weights.swap import DoubleBuffer
from pipelinerl_sdk.weights.tensors import as_bytes, spec_of


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 11, bias=True))
    m[1].weight = m[0].weight  # tied, as HF ties lm_head to the embedding
    return m


def staged_update(
    params: dict[str, torch.Tensor], buffer: torch.Tensor, values: dict[str, torch.Tensor], bucket_bytes: int = 128
) -> StagedWeights:
    """Write ``values`` into ``buffer`` in the plan's layout (what a receive does)."""
    plan = BucketPlan.build([spec_of(n, v) for n, v in values.items()], bucket_bytes)
    for b in plan.buckets:
        for e in b.entries:
            start = b.offset + e.offset
            buffer[start : start + e.spec.nbytes].copy_(as_bytes(values[e.spec.name]))
    return StagedWeights(plan, buffer, 0.0)


def test_full_update_swaps_and_keeps_parameter_objects_and_ties() -> None:
    m = model()
    params = dict(m.named_parameters())
    objects = {n: id(p) for n, p in params.items()}
    db = DoubleBuffer()
    new = {n: torch.randn_like(p) for n, p in params.items()}
    plan_bytes = BucketPlan.build([spec_of(n, v) for n, v in new.items()], 128).total_bytes
    spare = db.spare(plan_bytes, torch.device("cpu"))
    applied = db.apply(staged_update(params, spare, new), params)
    assert applied.swapped and applied.nbytes == sum(v.numel() * 4 for v in new.values())
    after = dict(m.named_parameters())
    assert {n: id(p) for n, p in after.items()} == objects
    for n, p in after.items():
        assert torch.equal(p, new[n])
        # live in the received buffer: no copy was made
        assert p.untyped_storage().data_ptr() == spare.untyped_storage().data_ptr()
    assert m[1].weight is m[0].weight
    out = m[1](m[0](torch.tensor([3])))
    assert torch.allclose(out, torch.nn.functional.linear(new["0.weight"][3], new["0.weight"], new["1.bias"]))


def test_buffers_alternate_and_a_receive_never_lands_in_live_weights() -> None:
    m = model()
    params = dict(m.named_parameters())
    db = DoubleBuffer()
    nbytes = BucketPlan.build([spec_of(n, p) for n, p in params.items()], 128).total_bytes
    first = db.spare(nbytes, torch.device("cpu"))
    db.apply(staged_update(params, first, {n: torch.full_like(p, 1.0) for n, p in params.items()}), params)
    # before the first swap the model had its own storages: the next spare is a new buffer
    second = db.spare(nbytes, torch.device("cpu"))
    assert second.data_ptr() != first.data_ptr()
    db.apply(staged_update(params, second, {n: torch.full_like(p, 2.0) for n, p in params.items()}), params)
    # from now on the two buffers alternate; the spare is always the one not live
    third = db.spare(nbytes, torch.device("cpu"))
    assert third.data_ptr() == first.data_ptr()
    third.fill_(255)  # a receive half done (or failed) into the spare ...
    assert all(torch.equal(p, torch.full_like(p, 2.0)) for p in m.parameters())  # ... leaves the live weights


def test_partial_update_or_foreign_buffer_is_copied_not_swapped() -> None:
    m = model()
    params = dict(m.named_parameters())
    db = DoubleBuffer()
    storages = {n: p.untyped_storage().data_ptr() for n, p in params.items()}
    bias = {"1.bias": torch.full((11,), 7.0)}
    nbytes = BucketPlan.build([spec_of(n, v) for n, v in bias.items()], 128).total_bytes
    applied = db.apply(staged_update(params, db.spare(nbytes, torch.device("cpu")), bias), params)
    assert not applied.swapped and torch.equal(m[1].bias, bias["1.bias"])
    full = BucketPlan.build([spec_of(n, p) for n, p in params.items()], 128)
    foreign = torch.empty(full.total_bytes, dtype=torch.uint8)
    new = {n: torch.full_like(p, 3.0) for n, p in params.items()}
    applied = db.apply(staged_update(params, foreign, new), params)
    assert not applied.swapped
    assert all(torch.equal(p, new[n]) for n, p in m.named_parameters())
    assert {n: p.untyped_storage().data_ptr() for n, p in m.named_parameters()} == storages


def test_dtype_mismatch_is_not_swapped() -> None:
    m = model()
    params = dict(m.named_parameters())
    db = DoubleBuffer()
    new = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    nbytes = BucketPlan.build([spec_of(n, v) for n, v in new.items()], 128).total_bytes
    assert not db.can_swap(staged_update(params, db.spare(nbytes, torch.device("cpu")), new), params)
