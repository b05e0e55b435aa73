"""Measure the margins of the trainer checks: every figure a check compares, on the controls and
on the broken twins of :mod:`tests.broken_trainers` (not a test: a measurement, one JSON line per
backend)::

    PIPELINERL_EXTRA_PLUGINS=tests.broken_trainers PYTHONPATH=. \\
        python tests/conformance_margins.py reference bf16-only broken-ignores-clip ...
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from pipelinerl_sdk.conformance import trainer as T
from pipelinerl_sdk.conformance.targets import resolve_targets
from pipelinerl_sdk.reference.tiny import build_tiny_model


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b, strict=True))


def measure(name: str, model: Path) -> dict[str, Any]:
    _, targets = resolve_targets([f"trainer:{name}"])
    t = targets[0]
    dtype = T.check_dtype(t)
    r: dict[str, Any] = {"dtype": dtype}
    batches = [T.fixed_batch(model, 0), T.fixed_batch(model, 1)]
    with T.open_trainer(t, T.TrainerSpec(model=str(model), dtype=dtype)) as tr:
        got = tr.forward(batches[0])
    with torch.no_grad():
        want = T.hf_logprobs(T.hf_model(model, dtype), batches[0].input_ids)
    r["forward_max"] = _max_diff(got, want)
    spec = T.step_spec(model, dtype)
    with T.open_trainer(t, spec) as tr:
        metrics = T.run_steps(tr, [(b, len(b)) for b in batches])
        params = T.gather(tr).tensors
    ref = T.reference_adamw(model, spec, batches)
    r["step_max"] = T.max_param_diff(params, ref.params)[0]
    r["step_err"] = T.step_error(params, ref.params, ref.initial)
    r["step_gn_rel"] = max(abs(m.grad_norm - w) / w for m, w in zip(metrics, ref.grad_norms, strict=True))
    plan = T.clip_plan(model, dtype)
    with T.open_trainer(t, plan.spec) as tr:
        metrics = T.run_steps(tr, plan.steps)
        params = T.gather(tr).tensors
    ref = T.reference_adamw(model, plan.spec, plan.steps)
    r["clip"], r["clip_ref_norms"] = plan.spec.grad_clip, ref.grad_norms
    r["clip_max"] = T.max_param_diff(params, ref.params)[0]
    r["clip_err"] = T.step_error(params, ref.params, ref.initial)
    r["clip_moved"] = T.max_param_diff(ref.params, ref.initial)[0]
    r["clip_gn_rel"] = max(abs(m.grad_norm - w) / w for m, w in zip(metrics, ref.grad_norms, strict=True))
    w = T.world_size_runs(t, model)
    ref = w.reference
    r["ws2_gn_rel"] = [max(abs(g - x) / x for g, x in zip(o["grad_norms"], ref.grad_norms, strict=True)) for o in w.ws2]
    r["ws2_rank0_max"] = T.max_param_diff(w.ws2[0]["params"], ref.params)[0]
    r["ws2_rank0_err"] = T.step_error(w.ws2[0]["params"], ref.params, ref.initial)
    r["ws2_rank1_vs_rank0_forward_max"] = _max_diff(w.ws2[1]["probe_after"], w.ws2[0]["probe_after"])
    return r


def main() -> None:
    model = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", preset="tiny", dtype="float32", seed=0)
    for name in sys.argv[1:]:
        print(name, json.dumps(measure(name, model)), flush=True)


if __name__ == "__main__":
    main()
