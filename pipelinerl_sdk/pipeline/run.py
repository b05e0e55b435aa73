"""``pipelinerl run``: one PipelineRL run on the contracts only (any inference x trainer backend).

The orchestrator is trainer rank 0. It launches (or connects to) the inference servers, forms
the weight-update group, starts the actors, and runs the trainer loop: take ``groups_per_step``
groups, micro-batch them through ``backward`` with the GRPO objective, ``step``, publish the new
weights to every server (requests in flight keep running), let the actors advance. It writes one
JSON line per step to ``out_dir/metrics.jsonl``, plots at the end, and returns a summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelinerl_sdk.contracts import TokenBatch, TrainerBackend, TrainerSpec
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.pipeline.actors import Actors, Admission, Group
from pipelinerl_sdk.pipeline.config import PipelineConfig
from pipelinerl_sdk.pipeline.publish import publish_weights
from pipelinerl_sdk.pipeline.tasks import DigitSum, Task, build_base_model, get_task
from pipelinerl_sdk.plugins import load_registry
from pipelinerl_sdk.rl.grpo import GRPOObjective
from pipelinerl_sdk.weights.publisher import WeightPublisher


@dataclass(frozen=True, slots=True)
class RunSummary:
    mode: str
    steps: int
    seconds: float
    reached_target: bool
    #: Wall seconds from the first step to the step where the moving mean reward hit the target.
    time_to_target_s: float | None
    initial_reward: float
    final_reward: float
    mean_lag: float
    max_lag: int
    median_pause_s: float
    tokens_per_s: float
    metrics_path: str
    inference_backend: str = ""
    trainer_backend: str = ""
    #: Trainer ranks that took part (spawned or started by torchrun).
    trainer_world_size: int = 1

    def line(self) -> str:
        target = f"target reached in {self.time_to_target_s:.0f}s" if self.reached_target else "target NOT reached"
        return (
            f"{self.mode}: {self.steps} steps in {self.seconds:.0f}s; reward {self.initial_reward:.2f} -> "
            f"{self.final_reward:.2f} ({target}); lag mean {self.mean_lag:.2f} max {self.max_lag}; "
            f"pause/update {1e3 * self.median_pause_s:.1f} ms; {self.tokens_per_s:.0f} tokens/s"
        )


def build_batch(groups: Sequence[Group]) -> TokenBatch:
    seqs, starts, adv, behaviour = [], [], [], []
    for g in groups:
        for s in g.samples:
            if not s.completion_ids:
                continue
            seqs.append(s.prompt_ids + s.completion_ids)
            starts.append(len(s.prompt_ids))
            adv.append(s.advantage)
            behaviour.append(s.logprobs)
    return TokenBatch(input_ids=seqs, completion_start=starts, advantages=adv, behaviour_logprobs=behaviour)


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else 0.0


class Run:
    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.out = Path(config.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.task: Task = get_task(config.task)
        self.rows: list[dict[str, Any]] = []

    def base_model(self) -> Path:
        if self.config.model:
            return Path(self.config.model)
        if not isinstance(self.task, DigitSum):
            raise ValueError("model: required for tasks other than the built-in digit-sum")
        return build_base_model(
            self.out.parent / f"base-model-{self.task.name}-seed{self.config.seed}", self.task, seed=self.config.seed
        )

    def make_trainer(self, model: Path) -> TrainerBackend:
        """The trainer backend; with several ranks, rank 0's leader that mirrors every call."""
        import torch
        import torch.distributed as dist

        from pipelinerl_sdk.pipeline.ranks import LeaderTrainer

        torch.set_num_threads(self.config.trainer_threads)
        trainer: TrainerBackend = load_registry().create_trainer(self.config.trainer_backend)
        if dist.is_initialized() and dist.get_world_size() > 1:
            trainer = LeaderTrainer(trainer)
        trainer.init(
            TrainerSpec(model=str(model), lr=self.config.lr, grad_clip=self.config.grad_clip, seed=self.config.seed)
        )
        return trainer

    async def run(self) -> RunSummary:
        cfg = self.config
        model = self.base_model()
        trainer = self.make_trainer(model)
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(trainer.close)
            clients = await self._servers(stack, model)
            publisher = WeightPublisher(clients, mode=cfg.receive_mode)
            await publisher.connect(host=cfg.group_host, backend=cfg.group_backend)
            stack.push_async_callback(publisher.close)
            return await self._loop(trainer, clients, publisher)
        raise AssertionError("unreachable")

    async def _servers(self, stack: contextlib.AsyncExitStack, model: Path) -> list[InferenceClient]:
        cfg = self.config
        if cfg.server_urls:
            clients = [InferenceClient(u, control_token=cfg.control_token) for u in cfg.server_urls]
        else:
            from pipelinerl_sdk.launch import ServerProcess

            procs = [
                ServerProcess(cfg.inference_backend, model, options=cfg.server_options, receive_mode=cfg.receive_mode)
                for _ in range(cfg.num_servers)
            ]
            for p in procs:
                await asyncio.to_thread(p.start)
                stack.callback(p.stop)
            clients = [InferenceClient(p.url, control_token=p.control_token) for p in procs]
        for c in clients:
            stack.push_async_callback(c.aclose)
        return clients

    async def _loop(
        self, trainer: TrainerBackend, clients: list[InferenceClient], publisher: WeightPublisher
    ) -> RunSummary:
        cfg = self.config
        admission = Admission(cfg.groups_per_step, cfg.max_lag)
        queue: asyncio.Queue[Group] = asyncio.Queue()
        actors = Actors(
            clients, self.task, admission, queue, group_size=cfg.group_size, max_tokens=cfg.max_tokens,
            temperature=cfg.temperature, normalize_std=cfg.normalize_std, seed=cfg.seed,
        )  # fmt: skip
        workers = actors.start(cfg.actors)
        specs = trainer.param_specs()
        metrics_file = (self.out / "metrics.jsonl").open("w")
        progress = _progress(cfg)
        t_start = time.monotonic()
        time_to_target: float | None = None
        rewards: list[float] = []
        try:
            pending: dict[int, Group] = {}
            for step in range(cfg.max_steps):
                # Groups are trained in start order (a reorder buffer): step k takes exactly the
                # groups admitted for it, so the admission rule bounds every group's lag.
                wanted = range(step * cfg.groups_per_step, (step + 1) * cfg.groups_per_step)
                while any(i not in pending for i in wanted):
                    g = await _get(queue, workers)
                    pending[g.index] = g
                groups = [pending.pop(i) for i in wanted]
                t_batch = time.monotonic()
                lags = [step - g.min_version for g in groups]
                batch = build_batch(groups)
                objective = GRPOObjective(num_sequences=len(batch), kl_coef=cfg.kl_coef)
                train_metrics: dict[str, float] = {}
                for i in range(0, len(groups), cfg.micro_batch_groups):
                    mb = build_batch(groups[i : i + cfg.micro_batch_groups])
                    if len(mb):
                        train_metrics = await asyncio.to_thread(trainer.backward, mb, objective)
                stepped = await asyncio.to_thread(trainer.step)
                await publish_weights(trainer, publisher, step + 1, specs)
                await admission.publish(step + 1)
                assert publisher.last is not None
                pauses = [e.timings.get("pause_s", 0.0) for e in publisher.last.events.values()]
                reward = sum(g.mean_reward for g in groups) / len(groups)
                rewards.append(reward)
                window = rewards[-cfg.target_window :]
                moving = sum(window) / len(window)
                now = time.monotonic() - t_start
                row = {
                    "step": step + 1,
                    "time_s": round(now, 3),
                    "reward": reward,
                    "reward_moving": moving,
                    "lag_mean": sum(lags) / len(lags),
                    "lag_max": max(lags),
                    "lags": lags,
                    "too_old": sum(1 for lag in lags if lag > cfg.max_lag),
                    "pause_s": max(pauses) if pauses else 0.0,
                    "update_s": publisher.last.wall_s,
                    "train_s": time.monotonic() - t_batch,
                    "grad_norm": stepped.grad_norm,
                    "tokens": actors.tokens_generated,
                    "admission_wait_s": admission.waited_s,
                    **{
                        k: v
                        for k, v in train_metrics.items()
                        if k in ("kl_new_old", "mean_abs_log_ratio", "ess", "loss")
                    },
                }
                self.rows.append(row)
                metrics_file.write(json.dumps(row) + "\n")
                metrics_file.flush()
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(reward=f"{moving:.2f}", lag=f"{row['lag_mean']:.1f}")
                if cfg.reward_target is not None and len(window) == cfg.target_window and moving >= cfg.reward_target:
                    time_to_target = now
                    break
                if now > cfg.max_seconds:
                    break
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            metrics_file.close()
            if progress is not None:
                progress.close()
        seconds = time.monotonic() - t_start
        all_lags = [lag for r in self.rows for lag in r["lags"]]
        summary = RunSummary(
            mode=cfg.mode,
            steps=len(self.rows),
            seconds=seconds,
            reached_target=time_to_target is not None,
            time_to_target_s=time_to_target,
            initial_reward=rewards[0] if rewards else 0.0,
            final_reward=sum(rewards[-cfg.target_window :]) / max(1, len(rewards[-cfg.target_window :])),
            mean_lag=sum(all_lags) / max(1, len(all_lags)),
            max_lag=max(all_lags, default=0),
            median_pause_s=_median([r["pause_s"] for r in self.rows]),
            tokens_per_s=actors.tokens_generated / seconds if seconds else 0.0,
            metrics_path=str(self.out / "metrics.jsonl"),
            inference_backend=cfg.inference_backend,
            trainer_backend=cfg.trainer_backend,
            trainer_world_size=_world_size(),
        )
        (self.out / "summary.json").write_text(json.dumps(_asdict(summary), indent=2))
        if cfg.plots:
            from pipelinerl_sdk.pipeline.plots import write_plots

            write_plots(self.rows, self.out, title=f"{cfg.task} ({cfg.mode})")
        return summary


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _asdict(summary: RunSummary) -> dict[str, Any]:
    return {f: getattr(summary, f) for f in summary.__slots__}


async def _get(queue: asyncio.Queue[Group], workers: Sequence[asyncio.Task[None]]) -> Group:
    """The next group; raises the first actor failure instead of waiting forever."""
    while True:
        try:
            return await asyncio.wait_for(queue.get(), timeout=1.0)
        except TimeoutError:
            for w in workers:
                if w.done() and not w.cancelled() and w.exception() is not None:
                    raise RuntimeError(f"actor {w.get_name()} failed: {w.exception()}") from w.exception()


def _progress(cfg: PipelineConfig) -> Any:
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.max_steps, desc=f"{cfg.mode}", unit="step", dynamic_ncols=True)


def run_pipeline(config: PipelineConfig) -> RunSummary:
    """One run. Trainer ranks: under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) this
    process is one of them; else ``trainer_world_size`` > 1 spawns them. Rank 0 returns the
    summary; the other ranks follow rank 0's trainer calls."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from pipelinerl_sdk.trainer_group import init_from_env

        ctx = init_from_env()
        if ctx.rank != 0:
            _follower(config)
            raise SystemExit(0)
        return asyncio.run(Run(config).run())
    if config.trainer_world_size > 1:
        from pipelinerl_sdk.trainer_group import run_ranks

        results = run_ranks(config.trainer_world_size, _spawned_rank, config.model_dump_json(), timeout_s=24 * 3600)
        return RunSummary(**json.loads(results[0]))
    return asyncio.run(Run(config).run())


def _follower(config: PipelineConfig) -> int:
    import torch

    from pipelinerl_sdk.pipeline.ranks import follow

    torch.set_num_threads(config.trainer_threads)
    return follow(load_registry().create_trainer(config.trainer_backend))


def _spawned_rank(ctx: Any, config_json: str) -> str:
    """One spawned trainer rank (module level: pickled by spawn)."""
    config = PipelineConfig.model_validate_json(config_json)
    if ctx.rank == 0:
        return json.dumps(_asdict(asyncio.run(Run(config).run())))
    return json.dumps({"steps": _follower(config)})
