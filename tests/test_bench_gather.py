"""``pipelinerl bench gather`` on real ranks and a real server: its figures are consistent with
the model, and its memory figure tells a streaming gather from one that copies the whole model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pipelinerl_sdk.bench.gather import run_gather_bench
from pipelinerl_sdk.contracts import TrainerSpec
from pipelinerl_sdk.memory import gather_units
from pipelinerl_sdk.protocol import ParamSpec
from pipelinerl_sdk.reference.trainer import ReferenceTrainer
from pipelinerl_sdk.weights.buckets import BucketPlan

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def specs(tiny_model: Path) -> list[ParamSpec]:
    trainer = ReferenceTrainer()
    trainer.init(TrainerSpec(model=str(tiny_model), dtype="float32"))
    try:
        return trainer.param_specs()
    finally:
        trainer.close()


def test_reference_trainer_figures(tiny_model: Path, specs: list[ParamSpec]) -> None:
    out = run_gather_bench(trainer="reference", world_size=2, model=tiny_model, bucket_mb=1, repeats=2)
    model_bytes = sum(s.nbytes for s in specs)
    units = gather_units(specs)
    assert out["model_bytes"] == model_bytes and out["params"] == len(specs)
    assert out["largest_layer_bytes"] == max(n for k, n in units.items() if ".layers." in k)
    # It lends params that lie in one buffer in the plan's layout: every bucket goes out in place,
    # so the sender never allocates its two bucket buffers.
    assert out["sender_buffer_bytes"] == 0
    samples = out["samples"]
    assert [len(samples[k]) for k in ("gather_broadcast_s", "flat_broadcast_s", "allgather_floor_s")] == [2, 2, 2]
    # each round's ratio from its own three measurements; the figure is their median
    rounds = list(
        zip(samples["gather_broadcast_s"], samples["allgather_floor_s"], samples["flat_broadcast_s"], strict=True)
    )
    assert out["update_over_floor"] == pytest.approx(sum(g / (a + f) for g, a, f in rounds) / 2)
    assert out["update_over_flat_broadcast"] == pytest.approx(sum(g / f for g, _, f in rounds) / 2)
    # the reference trainer is replicated: no collective of its own; the floor's, one per unit
    buckets = len(BucketPlan.build(specs, 1 << 20).buckets)
    assert out["collectives"] == {"trainer": 0, "floor": len(units), "sender": buckets}
    assert 0 < out["gather_broadcast_s"] <= out["update_wall_s"]
    # The reference trainer hands its own parameters to the sender: no gather allocation at all.
    assert out["peak_extra_bytes"] < 64 << 10, out["peak_extra_bytes"]
    assert out["meets_targets"]["peak_over_layer"] is True
    assert out["config"]["world_size"] == 2 and out["config"]["trainer"] == "reference"


def test_a_whole_model_gather_shows_in_the_peak(
    tiny_model: Path,
    specs: list[ParamSpec],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PIPELINERL_EXTRA_PLUGINS", "tests.broken_trainers")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.syspath_prepend(str(ROOT))
    sys.modules.pop("tests.broken_trainers", None)
    out = run_gather_bench(trainer="broken-whole-model-gather", world_size=1, model=tiny_model, repeats=1)
    assert out["peak_extra_bytes"] >= sum(s.nbytes for s in specs)
    assert out["peak_over_layer"] > 2 and out["meets_targets"]["peak_over_layer"] is False
    # it sends (copies) its tensors: the sender packs them into its two bucket buffers
    assert out["sender_buffer_bytes"] == 2 * BucketPlan.build(specs, out["config"]["bucket_mb"] << 20).max_bucket_bytes
