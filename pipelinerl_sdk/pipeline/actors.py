"""Actors: many generation requests in flight, each a group of samples of one prompt, scored by
the task's reward, with everything the trainer needs (token ids, behaviour logprobs, the weight
version of every token) kept from the server's answer.

Lag control: the i-th group (in start order) may start only once the published weight version is
at least ``i // groups_per_step - max_lag``. The trainer trains groups in start order, step k on
exactly the groups ``k*groups_per_step .. (k+1)*groups_per_step - 1``, so every group is trained
with weights at most ``max_lag`` versions newer than any that generated it: actors hold back
rather than produce older data.
With ``max_lag = 0`` this *is* conventional RL: a batch is generated with fixed weights, then
nothing is generated until the trainer has published the next version.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.pipeline.tasks import Prompt, Task
from pipelinerl_sdk.rl.grpo import group_advantages


@dataclass(frozen=True, slots=True)
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    advantage: float
    finish_reason: str


@dataclass(frozen=True, slots=True)
class Group:
    """The samples of one prompt, with group-relative advantages."""

    index: int
    prompt: Prompt
    samples: tuple[Sample, ...]
    server: str
    started_version: int
    started_at: float
    finished_at: float

    @property
    def min_version(self) -> int:
        return min((min(s.versions) for s in self.samples if s.versions), default=self.started_version)

    @property
    def mean_reward(self) -> float:
        return sum(s.reward for s in self.samples) / len(self.samples)


class Admission:
    """Admission control for the lag bound (see module doc)."""

    def __init__(self, groups_per_step: int, max_lag: int) -> None:
        self.groups_per_step = groups_per_step
        self.max_lag = max_lag
        self.published = 0
        self._next = 0
        self._cond = asyncio.Condition()
        self.waited_s = 0.0

    def allowed(self, index: int) -> bool:
        return self.published >= index // self.groups_per_step - self.max_lag

    async def admit(self) -> int:
        """Wait for the next group's turn; returns its index."""
        async with self._cond:
            index = self._next
            self._next += 1
            t0 = time.monotonic()
            await self._cond.wait_for(lambda: self.allowed(index))
            self.waited_s += time.monotonic() - t0
            return index

    async def publish(self, version: int) -> None:
        async with self._cond:
            self.published = version
            self._cond.notify_all()


class Actors:
    """``n`` concurrent workers looping: admit -> one chat request of ``group_size`` samples ->
    rewards -> advantages -> the group into ``queue``."""

    def __init__(
        self,
        clients: Sequence[InferenceClient],
        task: Task,
        admission: Admission,
        queue: asyncio.Queue[Group],
        *,
        group_size: int,
        max_tokens: int,
        temperature: float,
        normalize_std: bool,
        seed: int,
    ) -> None:
        self.clients = list(clients)
        self.task = task
        self.admission = admission
        self.queue = queue
        self.group_size = group_size
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.normalize_std = normalize_std
        self._rng = random.Random(seed)
        self.tokens_generated = 0
        self.requests = 0

    async def worker(self, worker_id: int) -> None:
        while True:
            index = await self.admission.admit()
            prompt = self.task.prompts(self._rng, 1)[0]
            client = self.clients[index % len(self.clients)]
            started_version = self.admission.published
            t0 = time.monotonic()
            resp = await client.chat(
                {
                    "messages": list(prompt.messages),
                    "n": self.group_size,
                    "max_tokens": self.max_tokens,
                    "temperature": self.temperature,
                    "logprobs": True,
                    "return_token_ids": True,
                    "seed": self._rng.randrange(2**31),
                }
            )
            self.requests += 1
            rewards = [self.task.reward(prompt, c.message.content) for c in resp.choices]
            advantages = group_advantages(rewards, self.group_size, normalize_std=self.normalize_std)
            samples = []
            for c, r, a in zip(resp.choices, rewards, advantages, strict=True):
                ids = c.token_ids or []
                self.tokens_generated += len(ids)
                samples.append(
                    Sample(
                        prompt_ids=list(resp.prompt_token_ids or []),
                        completion_ids=list(ids),
                        logprobs=[t.logprob for t in (c.logprobs.content if c.logprobs else [])],
                        versions=list(c.weight_versions),
                        reward=r,
                        advantage=a,
                        finish_reason=c.finish_reason,
                    )
                )
            await self.queue.put(
                Group(index, prompt, tuple(samples), client.url, started_version, t0, time.monotonic())
            )

    def start(self, n: int) -> list[asyncio.Task[None]]:
        return [asyncio.create_task(self.worker(i), name=f"actor-{i}") for i in range(n)]
