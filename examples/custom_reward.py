"""Writing a task: prompts plus a verifiable reward, used as ``--set task=examples.custom_reward:ParityTask``.

Any object with ``name``, ``prompts(rng, n)`` and ``reward(prompt, completion)`` is a task. The
reward sees the decoded completion (special tokens removed) and returns a float; PipelineRL
uses it as is (no shaping): advantages are reward minus the mean of the prompt's group.

    PYTHONPATH=. pipelinerl run --set task=examples.custom_reward:ParityTask --set model=PATH
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pipelinerl_sdk.pipeline.tasks import Prompt


@dataclass(frozen=True)
class ParityTask:
    """ "Is 37 odd?" -> "1" for odd, "0" for even."""

    name: str = "parity"

    def prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            k = rng.randrange(100)
            out.append(Prompt(messages=({"role": "user", "content": f"Is {k} odd?"},), answer=str(k % 2)))
        return out

    def reward(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if completion.strip() == prompt.answer else 0.0
