"""A trainer backend's steps on its ranks, and the same steps in plain torch, for a trainer
adapter's own tests.

A :class:`Job` is a tuple of :class:`Run` (backend, spec, objective, how the batch is split),
trained one after the other in the same ranks (process start-up and imports dominate on a small
machine). :func:`train` is the rank function for :func:`pipelinerl_sdk.trainer_group.run_ranks` (or
for each rank of a torchrun job): per run, init, gather, ``steps`` x (``micro_batches`` backwards,
step), forward, gather, close. It returns, per run, a dict:

- ``init_s``; ``specs``: ``(name, dtype, shape)`` of each param; ``backward``: each backward's
  metrics; ``metrics``: the ``StepMetrics`` of each step; ``logprobs``: sequence index -> its
  logprobs after the steps, for this rank's sequences;
- rank 0 only: ``initial`` and ``final`` (the gathered params by HF name, after init and after the
  steps) and ``order`` (the gather order);
- whatever ``job.probe(trainer)`` returns, read right after init.

Rank ``r`` of ``w`` takes sequences ``r, r + w, ...``; with ``all_on_rank0`` rank 0 takes all and
the others an empty batch (they only join the collectives). Objectives: ``"nll"``
(:class:`~pipelinerl_sdk.rl.objectives.CompletionNLL`) and ``"grpo"``
(:class:`~pipelinerl_sdk.rl.grpo.GRPOObjective` with :data:`ADVANTAGES`, and behaviour logprobs
the initial ones shifted by +-:data:`SHIFT`: importance weights far outside PPO's clip range).
Both divide by the global number of sequences, so their sum over ranks and micro-batches is the
whole batch's objective: any split must step exactly as :func:`plain_adamw` does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from pipelinerl_sdk.contracts import Objective, TokenBatch, TrainerBackend, TrainerSpec
from pipelinerl_sdk.trainer_group import RankContext

__all__ = [
    "ADVANTAGES",
    "SEQS",
    "SHIFT",
    "STARTS",
    "CollectSink",
    "Job",
    "Run",
    "adamw_steps",
    "check_steps_like_plain",
    "full_batch",
    "hf_logprobs",
    "make_objective",
    "max_diff",
    "plain_adamw",
    "shard",
    "take",
    "train",
]

#: Eight sequences of different lengths: prompt + completion token ids (the tiny model's vocab: 512).
SEQS: list[list[int]] = [[1 + (7 * i + 3 * j) % 500 for j in range(5 + (i % 4) * 3)] for i in range(8)]
#: Where each sequence's completion starts.
STARTS: list[int] = [2 + i % 3 for i in range(8)]
ADVANTAGES: list[float] = [1.0, -0.5, 0.25, -1.0, 0.75, -0.25, 0.5, -0.75]
#: Behaviour logprobs are the initial ones shifted by +-0.4 per token: importance weights e^{-+0.4}
#: (0.67 and 1.49), far outside PPO's [0.8, 1.2], so a clipped loss would step differently.
SHIFT = 0.4

ObjectiveName = Literal["nll", "grpo"]


class CollectSink:
    """A weight sink that keeps a copy of every tensor, and the order they came in."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.order: list[str] = []

    def send(self, name: str, tensor: torch.Tensor) -> None:
        self.order.append(name)
        self.tensors[name] = tensor.detach().clone()


@dataclass(frozen=True)
class Run:
    backend: str
    spec: TrainerSpec
    objective: ObjectiveName = "nll"
    #: Rank 0 takes every sequence; the others get empty batches (they only join collectives).
    all_on_rank0: bool = False


@dataclass(frozen=True)
class Job:
    runs: tuple[Run, ...]
    steps: int = 2
    micro_batches: int = 2
    #: Extra results of each run, read from the trainer right after init; a module-level function
    #: (spawned ranks import it by name).
    probe: Callable[[TrainerBackend], dict[str, Any]] | None = None
    seqs: Sequence[Sequence[int]] = field(default_factory=lambda: SEQS)
    starts: Sequence[int] = field(default_factory=lambda: STARTS)


def shard(ctx: RankContext, run: Run, n: int) -> list[int]:
    """The indices of the ``n`` sequences this rank takes."""
    if run.all_on_rank0:
        return list(range(n)) if ctx.is_main else []
    return list(range(ctx.rank, n, ctx.world_size))


def take(batch: TokenBatch, idx: Sequence[int]) -> TokenBatch:
    """The sequences ``idx`` of ``batch`` (with their advantages and behaviour logprobs, if any)."""
    return TokenBatch(
        [batch.input_ids[i] for i in idx],
        [batch.completion_start[i] for i in idx],
        [batch.advantages[i] for i in idx] if batch.advantages else (),
        [batch.behaviour_logprobs[i] for i in idx] if batch.behaviour_logprobs else (),
    )


def full_batch(
    objective: ObjectiveName,
    initial: Sequence[torch.Tensor] | None,
    seqs: Sequence[Sequence[int]] = SEQS,
    starts: Sequence[int] = STARTS,
) -> TokenBatch:
    """The whole batch; for ``"grpo"`` with :data:`ADVANTAGES` and behaviour logprobs from the
    ``initial`` logprobs (every sequence's, before any step)."""
    if objective != "grpo":
        return TokenBatch(seqs, starts)
    assert initial is not None, "grpo needs the initial logprobs"
    behaviour = [
        [float(x) + (SHIFT if j % 2 else -SHIFT) for j, x in enumerate(lp[s - 1 :])]
        for lp, s in zip(initial, starts, strict=True)
    ]
    return TokenBatch(seqs, starts, ADVANTAGES[: len(seqs)], behaviour)


def make_objective(objective: ObjectiveName, n_sequences: int = len(SEQS)) -> Objective:
    from pipelinerl_sdk.rl.grpo import GRPOObjective
    from pipelinerl_sdk.rl.objectives import CompletionNLL

    return GRPOObjective(n_sequences) if objective == "grpo" else CompletionNLL(n_sequences)


def train(ctx: RankContext, job: Job) -> list[dict[str, Any]]:
    """The rank function: every run of ``job`` in turn (see the module docstring)."""
    return [_train_one(ctx, job, run) for run in job.runs]


def _train_one(ctx: RankContext, job: Job, run: Run) -> dict[str, Any]:
    from pipelinerl_sdk.plugins import load_registry

    trainer: TrainerBackend = load_registry().factory("trainer", run.backend)()
    t0 = time.perf_counter()
    trainer.init(run.spec)
    out: dict[str, Any] = {"init_s": time.perf_counter() - t0}
    out.update(job.probe(trainer) if job.probe is not None else {})
    out["specs"] = [(p.name, p.dtype, tuple(p.shape)) for p in trainer.param_specs()]
    sink = CollectSink() if ctx.is_main else None
    trainer.gather_and_broadcast(sink)
    if sink is not None:
        out["initial"], out["order"] = sink.tensors, sink.order
    mine = shard(ctx, run, len(job.seqs))
    # GRPO's behaviour logprobs: every rank scores the whole batch first
    initial = trainer.forward(TokenBatch(job.seqs, job.starts)) if run.objective == "grpo" else None
    batch = full_batch(run.objective, initial, job.seqs, job.starts)
    objective = make_objective(run.objective, len(job.seqs))
    out["metrics"], out["backward"] = [], []
    for _ in range(job.steps):
        for m in range(job.micro_batches):
            out["backward"].append(trainer.backward(take(batch, mine[m :: job.micro_batches]), objective))
        out["metrics"].append(trainer.step())
    logprobs = trainer.forward(take(batch, mine))
    out["logprobs"] = dict(zip(mine, logprobs, strict=True))
    sink = CollectSink() if ctx.is_main else None
    trainer.gather_and_broadcast(sink)
    if sink is not None:
        out["final"] = sink.tensors
    trainer.close()
    return out


def adamw_steps(
    params: Sequence[torch.nn.Parameter],
    spec: TrainerSpec,
    steps: int,
    loss: Callable[[], torch.Tensor],
    *,
    foreach: bool | None = None,
) -> list[float]:
    """``steps`` x (backward of ``loss()``, clip to ``spec.grad_clip`` (None: no clipping), torch
    AdamW with the spec's hyper-parameters, one param group); returns each step's grad norm.
    ``foreach``: how ``clip_grad_norm_`` computes the norm (None: torch's default)."""
    opt = torch.optim.AdamW(
        params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay, foreach=False
    )
    clip = spec.grad_clip if spec.grad_clip is not None else float("inf")
    norms = []
    for _ in range(steps):
        loss().backward()  # type: ignore[no-untyped-call]
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip, foreach=foreach)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


_PLAIN: dict[str, tuple[dict[str, torch.Tensor], list[float]]] = {}


def plain_adamw(
    model_dir: Path, spec: TrainerSpec, steps: int, objective: ObjectiveName = "nll"
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same steps in plain torch on the HF model, the whole batch in one backward: its
    parameters after the steps and the grad norms. Cached per process (treat as read-only)."""
    key = repr((model_dir, spec, steps, objective))
    if key not in _PLAIN:
        from pipelinerl_sdk.hf import load_model, token_logprobs

        model, tok = load_model(model_dir, dtype="float32")
        model.train()
        with torch.no_grad():
            initial = token_logprobs(model, SEQS, tok.pad_token_id) if objective == "grpo" else None
        batch, loss_of = full_batch(objective, initial), make_objective(objective)

        def loss() -> torch.Tensor:
            return loss_of(token_logprobs(model, SEQS, tok.pad_token_id), batch)[0]

        norms = adamw_steps(list(model.parameters()), spec, steps, loss)
        _PLAIN[key] = {k: v.detach().clone() for k, v in model.state_dict().items()}, norms
    return _PLAIN[key]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts of the same names."""
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def hf_logprobs(model_dir: Path, params: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The HF model of ``model_dir`` with ``params`` loaded: every sequence's logprobs (fp32)."""
    from pipelinerl_sdk.hf import load_model, token_logprobs

    model, tok = load_model(model_dir, dtype="float32")
    model.load_state_dict(params, strict=False)
    with torch.no_grad():
        return token_logprobs(model, SEQS, tok.pad_token_id)


def check_steps_like_plain(run: dict[str, Any], model_dir: Path, spec: TrainerSpec, tol: float) -> None:
    """Assert that rank 0's ``run`` (a result of :func:`train`, objective ``"nll"``) stepped as
    :func:`plain_adamw` does: final params within ``tol``; grad norms within 1e-5 relative, and
    above ``spec.grad_clip`` when it clips (so clipping was exercised); steps numbered from 1 with
    the spec's lr; logprobs after the steps fp32, one per token but the first, within 1e-5 of the
    plain model's."""
    want, norms = plain_adamw(model_dir, spec, steps=len(run["metrics"]))
    diff = max_diff(run["final"], want)
    assert diff <= tol, f"params differ from plain torch AdamW by {diff:.3g} > {tol}"
    got = [m.grad_norm for m in run["metrics"]]
    assert max(abs(g - n) for g, n in zip(got, norms, strict=True)) <= 1e-5 * max(norms), (got, norms)
    assert spec.grad_clip is None or min(norms) > spec.grad_clip, f"clipping at {spec.grad_clip} not exercised: {norms}"
    assert [m.step for m in run["metrics"]] == list(range(1, len(norms) + 1)), run["metrics"]
    assert run["metrics"][0].lr == spec.lr, run["metrics"][0]
    ref = hf_logprobs(model_dir, want)
    for i, lp in run["logprobs"].items():
        assert lp.dtype == torch.float32 and lp.shape == (len(SEQS[i]) - 1,), (i, lp.dtype, lp.shape)
        assert float((lp - ref[i]).abs().max()) <= 1e-5, f"sequence {i}: logprobs differ from the plain model's"
