"""Tasks: prompts and a verifiable reward. A task is anything with :meth:`Task.prompts` and
:meth:`Task.reward`; the built-in one learns on a CPU in minutes.

``digit-successor`` ("n+1=") and ``digit-sum`` ("a+b=" with a + b <= 9), answered by one digit.
The base model is a tiny random Qwen2 taught only the *format* (a digit, then end of turn) by a
short supervised warm-up on random digits, as a pretrained model knows a format but not the
skill: its reward starts near 0.1 (chance) and RL has to find the answers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt: chat messages plus whatever the reward needs (``answer`` here)."""

    messages: tuple[dict[str, str], ...]
    answer: str
    meta: tuple[tuple[str, Any], ...] = ()


@runtime_checkable
class Task(Protocol):
    @property
    def name(self) -> str: ...

    def prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        """``n`` prompts drawn with ``rng``."""
        ...

    def reward(self, prompt: Prompt, completion: str) -> float:
        """The reward of one completion, in [0, 1]; ``completion`` is the decoded text without
        special tokens."""
        ...


@dataclass(frozen=True)
class DigitSum:
    """a + b for single digits with a + b <= ``max_sum`` and b in ``addends``; reward 1 for
    exactly the right digit."""

    name: str = "digit-sum"
    max_sum: int = 9
    addends: tuple[int, ...] = tuple(range(10))

    def problems(self) -> list[tuple[int, int]]:
        return [(a, b) for a in range(10) for b in self.addends if a + b <= self.max_sum]

    def make(self, a: int, b: int) -> Prompt:
        return Prompt(messages=({"role": "user", "content": f"{a}+{b}="},), answer=str(a + b))

    def prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        problems = self.problems()
        return [self.make(*rng.choice(problems)) for _ in range(n)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if completion.strip() == prompt.answer else 0.0

    def format_examples(self, rng: random.Random, n: int) -> list[tuple[Prompt, str]]:
        """Warm-up data: real prompts with *random* digit answers (teaches the format only)."""
        return [(p, str(rng.randrange(10))) for p in self.prompts(rng, n)]


BUILTIN_TASKS: dict[str, DigitSum] = {
    # n+1=: nine facts, each answer equally likely, so no input-blind answer beats chance (0.1)
    "digit-successor": DigitSum(name="digit-successor", addends=(1,)),
    # a+b=: 55 facts; harder (an input-blind "9" already scores 0.18)
    "digit-sum": DigitSum(),
}


def get_task(name: str) -> Task:
    """A built-in task by name, or ``module:attr`` naming a Task instance or factory."""
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name]
    if ":" in name:
        import importlib

        module, _, attr = name.partition(":")
        obj = getattr(importlib.import_module(module), attr)
        task = obj() if isinstance(obj, type) or (callable(obj) and not isinstance(obj, Task)) else obj
        if not isinstance(task, Task):
            raise ValueError(f"task: {name!r} is not a Task (needs name, prompts(), reward())")
        return task
    raise ValueError(f"task: unknown {name!r} (built-in: {sorted(BUILTIN_TASKS)}, or module:attr)")


def build_base_model(path: Path, task: DigitSum, *, steps: int = 60, seed: int = 0, lr: float = 3e-3) -> Path:
    """A tiny random model taught the answer format of ``task`` by supervised steps on random
    answers (the reference trainer, so the same code path as RL). Written to ``path`` once;
    reused when ``path/config.json`` exists."""
    if (path / "config.json").is_file():
        return path

    from pipelinerl_sdk.contracts import TokenBatch, TrainerSpec
    from pipelinerl_sdk.reference.tiny import build_tiny_model, load_model
    from pipelinerl_sdk.reference.trainer import ReferenceTrainer
    from pipelinerl_sdk.rl.objectives import CompletionNLL

    raw = build_tiny_model(path.with_name(path.name + "-init"), preset="tiny", seed=seed)
    _, tokenizer = load_model(raw)
    trainer = ReferenceTrainer()
    trainer.init(TrainerSpec(model=str(raw), lr=lr, grad_clip=1.0, seed=seed, options={"local": True}))
    rng = random.Random(seed)

    for _ in range(steps):
        ids, starts = [], []
        for prompt, answer in task.format_examples(rng, 32):
            p = tokenizer.apply_chat_template(
                list(prompt.messages), add_generation_prompt=True, tokenize=True, return_dict=False
            )
            full = tokenizer.apply_chat_template(
                [*prompt.messages, {"role": "assistant", "content": answer}], tokenize=True, return_dict=False
            )
            ids.append(list(full))
            starts.append(len(p))
        trainer.backward(TokenBatch(input_ids=ids, completion_start=starts), CompletionNLL(len(ids)))
        trainer.step()
    state = trainer.state_dict_hf()
    model, _ = load_model(raw)
    model.load_state_dict(state)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
