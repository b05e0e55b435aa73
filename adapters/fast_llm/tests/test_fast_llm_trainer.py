"""The ``fast-llm`` trainer backend on real Fast-LLM over real gloo ranks (spawned, and torchrun).

Checks: gathered weights after init equal the safetensors source bit for bit (Qwen2 and Llama, world
size 1 and 2); steps with micro-batches equal plain torch AdamW on the HF model (fp32, <= 1e-6, clipping
active for Qwen2, off for Llama); the SDK's simplified GRPO objective (unclamped ratios far outside
PPO's clip range) steps exactly as plain torch does; world size 2 and ZeRO-3 at world size 2 equal
world size 1; a rank with an empty batch takes part; bf16 (Fast-LLM's mixed precision) trains; torchrun
gives what the spawned ranks give.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from pipelinerl_sdk.contracts import TrainerSpec
from pipelinerl_sdk.testing.ranks import SEQS, Job, Run, check_steps_like_plain, max_diff, plain_adamw, train
from pipelinerl_sdk.trainer_group import run_ranks

pytestmark = pytest.mark.integration

BACKEND = "fast-llm"
TOL = 1e-6


# lr 1e-5 and eps 1e-6 keep elements whose true gradient is ~0 (rounding noise) damped, so 1e-6 tests
# the math, not the summation order (see tests/test_fsdp_adapter.py). Clipping at 300 is active (~500).
def _spec(model: Path, **kw: Any) -> TrainerSpec:
    base: dict[str, Any] = {"lr": 1e-5, "eps": 1e-6, "weight_decay": 0.01, "grad_clip": 300.0, "seed": 0}
    return TrainerSpec(model=str(model), **{**base, **kw})


@pytest.fixture(scope="module")
def runs(qwen2_model: Path, llama_model: Path) -> dict[str, dict[str, Any]]:
    qwen2, llama = _spec(qwen2_model), _spec(llama_model, grad_clip=None)
    grpo = _spec(qwen2_model, lr=1e-4, eps=1e-3)
    one = run_ranks(
        1, train, Job((Run(BACKEND, qwen2), Run(BACKEND, llama), Run(BACKEND, grpo, "grpo"))), timeout_s=600
    )[0]
    job = Job(
        (
            Run(BACKEND, qwen2),
            Run(BACKEND, replace(qwen2, dtype="bfloat16")),
            Run(BACKEND, qwen2, all_on_rank0=True),
            Run(BACKEND, replace(qwen2, options={"zero_stage": 3})),
            Run(BACKEND, grpo, "grpo"),
        )
    )
    two = run_ranks(2, train, job, timeout_s=600)[0]
    keys = ("qwen2", "llama", "grpo"), ("qwen2-2", "bf16-2", "uneven-2", "zero3-2", "grpo-2")
    return dict(zip(keys[0] + keys[1], one + two, strict=True))


@pytest.mark.parametrize("key", ["qwen2", "llama", "qwen2-2", "zero3-2"])
def test_gathered_weights_equal_source(
    runs: dict[str, dict[str, Any]], qwen2_model: Path, llama_model: Path, key: str
) -> None:
    from safetensors.torch import load_file

    source = load_file(str((llama_model if key == "llama" else qwen2_model) / "model.safetensors"))
    assert max_diff(runs[key]["initial"], source) == 0.0
    assert runs[key]["order"] == [n for n, _, _ in runs[key]["specs"]]


@pytest.mark.parametrize("key", ["qwen2", "llama"])
def test_steps_equal_plain_torch_adamw(
    runs: dict[str, dict[str, Any]], qwen2_model: Path, llama_model: Path, key: str
) -> None:
    model = llama_model if key == "llama" else qwen2_model
    spec = _spec(model, grad_clip=None) if key == "llama" else _spec(model)
    check_steps_like_plain(runs[key], model, spec, TOL)


@pytest.mark.parametrize("key", ["grpo", "grpo-2"])
def test_grpo_objective_steps_like_plain_torch(runs: dict[str, dict[str, Any]], qwen2_model: Path, key: str) -> None:
    """Simplified GRPO (unclamped importance weights, summed over tokens, / number of sequences)
    through Fast-LLM's head: the same step as plain torch on the HF model, at world size 1 and 2."""
    want, norms = plain_adamw(qwen2_model, _spec(qwen2_model, lr=1e-4, eps=1e-3), steps=2, objective="grpo")
    run = runs[key]
    assert max_diff(run["final"], want) <= TOL
    assert max(abs(m.grad_norm - n) for m, n in zip(run["metrics"], norms, strict=True)) <= 1e-5 * max(norms)
    # the objective's own metrics come back from backward: the ratios were far from 1
    assert all("loss" in m for m in run["backward"])


def test_world_size_2_equals_world_size_1(runs: dict[str, dict[str, Any]]) -> None:
    assert max_diff(runs["qwen2-2"]["final"], runs["qwen2"]["final"]) <= TOL
    assert runs["qwen2-2"]["specs"] == runs["qwen2"]["specs"]
    for i, lp in runs["qwen2-2"]["logprobs"].items():
        assert float((lp - runs["qwen2"]["logprobs"][i]).abs().max()) <= 1e-5


def test_zero_stage_3_equals_world_size_1(runs: dict[str, dict[str, Any]]) -> None:
    assert max_diff(runs["zero3-2"]["final"], runs["qwen2"]["final"]) <= TOL


def test_rank_with_empty_batch_takes_part(runs: dict[str, dict[str, Any]]) -> None:
    """Rank 1 has no sequences (its backward/forward only join the collectives): same result."""
    assert max_diff(runs["uneven-2"]["final"], runs["qwen2"]["final"]) <= TOL
    assert len(runs["uneven-2"]["logprobs"]) == len(SEQS)


def test_bf16_mixed_precision_trains(runs: dict[str, dict[str, Any]]) -> None:
    out, fp32 = runs["bf16-2"], runs["qwen2-2"]
    assert all(d == "bfloat16" for _, d, _ in out["specs"])
    assert all(t.dtype == torch.bfloat16 for t in out["final"].values())
    assert max_diff(out["final"], out["initial"]) > 1e-5  # it stepped
    # (the update itself, 2e-5 per element, is mostly below bf16's resolution of the exported weights;
    # the first step's grad norm, on the same weights, shows that bf16 compute gives the fp32 gradient)
    for i, lp in out["logprobs"].items():  # bf16 logits: close to fp32, returned as float32
        assert lp.dtype == torch.float32
        assert float((lp - fp32["logprobs"][i]).abs().max()) < 0.1
    assert abs(out["metrics"][0].grad_norm - fp32["metrics"][0].grad_norm) < 0.05 * fp32["metrics"][0].grad_norm


TORCHRUN_JOB = Path(__file__).with_name("torchrun_job.py")


def test_torchrun_two_ranks_equal_spawned(runs: dict[str, dict[str, Any]], qwen2_model: Path, tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2``: the same job as the spawned ranks, the same weights."""
    from pipelinerl_sdk.weights.publisher import free_port

    out = tmp_path / "params.pt"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        str(TORCHRUN_JOB), json.dumps({"model": str(qwen2_model), "out": str(out)}),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(out)
    assert max_diff(got, runs["qwen2"]["final"]) <= TOL
