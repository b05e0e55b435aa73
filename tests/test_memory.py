"""The peak-memory meter the gather checks and ``bench gather`` rely on: it must see real torch
allocations, their frees, and the order they happened in."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from pipelinerl_sdk.memory import AllocationPeak, _replay, gather_units, unit_of
from pipelinerl_sdk.protocol import ParamSpec

MB = 1_000_000
#: torch allocates a few bytes for Python scalars in ops (``x + 1``, ``add_(1)``).
SCALARS = 64


def test_peak_is_the_highest_point_not_the_sum() -> None:
    with AllocationPeak() as peak:
        a = torch.empty(10 * MB, dtype=torch.uint8)
        del a
        b = torch.empty(4 * MB, dtype=torch.uint8)
        c = torch.empty(3 * MB, dtype=torch.uint8)
        del b, c
    assert peak.bytes == 10 * MB
    assert peak.allocated == 17 * MB


def test_overlapping_lifetimes_add_up() -> None:
    with AllocationPeak() as peak:
        x = torch.zeros(1000, 1000)  # 4 MB
        y = x + 1  # 4 MB more while x lives
        del x, y
    assert 8 * MB <= peak.bytes <= 8 * MB + SCALARS


def test_memory_held_before_the_window_is_not_extra() -> None:
    held = torch.zeros(5 * MB, dtype=torch.uint8)
    with AllocationPeak() as peak:
        held.add_(1)  # in place: no allocation
    assert peak.bytes <= SCALARS
    assert int(held[0]) == 1


@given(st.lists(st.integers(1, 1000), min_size=1, max_size=30))
def test_replay_of_alloc_free_pairs(sizes: list[int]) -> None:
    """Each buffer freed before the next is allocated: the peak is the largest one; all alive at
    once: the sum."""
    serial = [e for i, n in enumerate(sizes) for e in ((2 * i, n), (2 * i + 1, -n))]
    assert _replay(serial) == (max(sizes), sum(sizes))
    nested = [(i, n) for i, n in enumerate(sizes)] + [(len(sizes) + i, -n) for i, n in enumerate(sizes)]
    assert _replay(nested) == (sum(sizes), sum(sizes))


def test_replay_counts_allocations_first_at_equal_times() -> None:
    assert _replay([(5, 100), (5, -100)])[0] == 100


def test_units_are_decoder_layers_or_single_params() -> None:
    def spec(name: str, n: int) -> ParamSpec:
        return ParamSpec(name=name, shape=(n,), dtype="float32")

    specs = [
        spec("model.embed_tokens.weight", 10),
        spec("model.layers.0.self_attn.q_proj.weight", 3),
        spec("model.layers.0.mlp.up_proj.weight", 4),
        spec("model.layers.10.mlp.up_proj.weight", 5),
        spec("model.norm.weight", 1),
        spec("lm_head.weight", 10),
    ]
    assert gather_units(specs) == {
        "model.embed_tokens.weight": 40,
        "model.layers.0": 28,
        "model.layers.10": 20,
        "model.norm.weight": 4,
        "lm_head.weight": 40,
    }
    assert unit_of("model.language_model.layers.2.mlp.down_proj.weight") == "model.language_model.layers.2"
