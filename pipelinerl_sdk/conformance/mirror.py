"""The suite's own copy of the served model: it plays the trainer.

The mirror holds, at every moment, exactly the weights the server under test must be serving
(rounded to the server's dtype). It perturbs them deterministically, publishes them through the
real weight-sync protocol, and computes with plain transformers the logprobs the server must
return for any token sequence.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from pipelinerl_sdk.protocol import ParamSpec
from pipelinerl_sdk.weights.publisher import WeightPublisher
from pipelinerl_sdk.weights.tensors import TORCH_DTYPES


@dataclass(frozen=True, slots=True)
class Tolerance:
    """Server vs reference logprobs: both bounds must hold."""

    max_abs: float
    mean_abs: float


#: By the server's dtype. float32 engines agree to ~1e-6 on CPU; bf16 greedy paths split at
#: near-ties, so only the mean is tight there.
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(1e-4, 1e-5),
    "bfloat16": Tolerance(0.5, 0.05),
    "float16": Tolerance(0.1, 0.01),
}


def compare(server: Sequence[float], reference: torch.Tensor, dtype: str) -> tuple[bool, str]:
    """(within tolerance, a message with the figures)."""
    got = torch.tensor(list(server), dtype=torch.float64)
    want = reference.detach().to(torch.float64)
    if got.shape != want.shape:
        return False, f"{got.numel()} logprobs, expected {want.numel()}"
    if got.numel() == 0:
        return True, "no tokens"
    diff = (got - want).abs()
    tol = TOLERANCES[dtype]
    ok = float(diff.max()) <= tol.max_abs and float(diff.mean()) <= tol.mean_abs
    return (
        ok,
        f"max |diff| {float(diff.max()):.3g} (<= {tol.max_abs}), mean {float(diff.mean()):.3g} (<= {tol.mean_abs})",
    )


class Mirror:
    """Owns a float32 transformers model whose weights track the server's."""

    def __init__(self, model_dir: Path, server_dtype: str) -> None:
        self.dtype = server_dtype
        #: Set when a check failed: the server may no longer hold these weights.
        self.needs_sync = False
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()  # type: ignore[no-untyped-call]
        self._round()

    def _round(self) -> None:
        """Keep exactly what a server of ``dtype`` holds."""
        wire = TORCH_DTYPES[self.dtype]
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(p.to(wire).to(torch.float32))

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.named_parameters()}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for k, p in self.model.named_parameters():
                p.copy_(state[k])

    def perturb(self, seed: int, scale: float = 0.05) -> None:
        """Add noise of ``scale`` times each tensor's std (deterministic in ``seed``)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                std = float(p.std()) if p.numel() > 1 else 1.0
                p.add_(torch.randn(p.shape, generator=g) * (scale * (std or 1.0)))
        self._round()

    def check_specs(self, specs: Sequence[ParamSpec]) -> None:
        """The server's expected params must be this model's, under HF names."""
        local = dict(self.model.named_parameters())
        for s in specs:
            if s.name not in local:
                raise AssertionError(f"server expects param {s.name!r}, which the HF model does not have")
            if tuple(local[s.name].shape) != s.shape:
                raise AssertionError(f"{s.name}: server shape {s.shape} != HF shape {tuple(local[s.name].shape)}")

    def send_all(
        self, sink: object, specs: Sequence[ParamSpec], *, start: int = 0, stop_after: int | None = None
    ) -> None:
        """Hand every param to ``sink`` in the server's order and dtype (``stop_after``: only the
        first n, to simulate a sender that dies or stalls; ``start``: from param ``start`` on, the
        rest of such a send)."""
        local = dict(self.model.named_parameters())
        for i, s in enumerate(specs):
            if stop_after is not None and i >= stop_after:
                return
            if i < start:
                continue
            sink.send(s.name, local[s.name].detach().to(TORCH_DTYPES[s.dtype]))  # type: ignore[attr-defined]

    async def publish(self, publisher: WeightPublisher, version: int, specs: Sequence[ParamSpec]) -> None:
        async with publisher.update(version, specs) as sink:
            await asyncio.to_thread(self.send_all, sink, specs)

    @torch.no_grad()
    def greedy(self, prompt: Sequence[int], max_tokens: int, stop: int) -> tuple[list[int], float]:
        """Greedy completion of ``prompt`` (ends at ``stop`` or after ``max_tokens``) and the
        smallest gap between the best and second-best logit along it."""
        ids, out, gap = list(prompt), [], math.inf
        for _ in range(max_tokens):
            logits = self.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
            top = torch.topk(logits, 2).values
            gap = min(gap, float(top[0] - top[1]))
            tok = int(torch.argmax(logits))
            out.append(tok)
            ids.append(tok)
            if tok == stop:
                break
        return out, gap

    @torch.no_grad()
    def steer_to(self, prompt: Sequence[int], token: int, after: int, margin: float = 4.0) -> None:
        """Change only ``token``'s row of the output embedding so that, after the first ``after``
        greedy tokens of ``prompt``, ``token`` beats every other logit by ``margin``. The row
        moves along the part of that position's final hidden state orthogonal to the earlier
        positions' (their logits do not move, up to the rounding to the server's dtype); ask
        :meth:`greedy` what the new weights do."""
        ids = [*prompt, *self.greedy(prompt, after, stop=-1)[0]]
        states = self.model.model(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state[0].double()
        states = states[len(prompt) - 1 :]
        hidden, earlier = states[-1], states[:-1]
        direction = hidden
        if len(earlier):
            coef = torch.linalg.lstsq(earlier.T, hidden[:, None]).solution
            direction = hidden - (earlier.T @ coef)[:, 0]
        head = self.model.lm_head.weight
        logits = head.double() @ hidden
        others = torch.cat([logits[:token], logits[token + 1 :]])
        delta = float(others.max()) + margin - float(logits[token])
        head[token] += (delta * direction / direction.dot(hidden)).to(head.dtype)
        self._round()

    @torch.no_grad()
    def full_logprobs(self, token_ids: Sequence[int]) -> torch.Tensor:
        """``log p(. | tok_<=t)`` over the vocabulary, for t = 0 .. len-2 (rows)."""
        ids = torch.tensor([list(token_ids)])
        return torch.log_softmax(self.model(input_ids=ids, use_cache=False).logits.float()[0, :-1], dim=-1)

    @torch.no_grad()
    def next_token_logits(self, sequences: Sequence[Sequence[int]], start: int) -> torch.Tensor:
        """``[batch, len - start, vocab]`` fp32 logits of the token at each position ``>= start``
        given everything before it, for sequences of one length (teacher forcing, one forward)."""
        ids = torch.tensor([list(s) for s in sequences])
        logits: torch.Tensor = self.model(input_ids=ids, use_cache=False).logits.float()
        return logits[:, start - 1 : -1]

    @torch.no_grad()
    def replay(
        self,
        prompt: Sequence[int],
        tokens: Sequence[int],
        versions: Sequence[int],
        states: Mapping[int, dict[str, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logprob each completion token must have if its version tag is true, two ways.

        ``kept_kv``: an engine that keeps its KV cache across updates. Position i's keys and
        values were computed by the forward that produced token i + 1 (the prompt's by the
        prefill, which produced token 0), i.e. by the weights of *that* token's tag; so the
        replay decodes one token at a time with one cache, loading the weights of ``versions[j]``
        before the forward that yields token j. Exact for such an engine: every position's K/V
        and every query use the same weights, in the same order, as the engine did.
        ``fresh``: an engine that recomputes its KV cache after an update: token j is one full
        forward of ``prompt + tokens[:j]`` by the weights of ``versions[j]``.
        The mirror holds its current weights again afterwards."""
        from transformers import DynamicCache

        current = self.state()
        kept: list[float] = []
        fresh = torch.empty(len(tokens))
        try:
            cache = DynamicCache()
            ids = list(prompt)
            loaded: int | None = None
            for j, (tok, v) in enumerate(zip(tokens, versions, strict=True)):
                if v != loaded:
                    self.load(states[v])
                    loaded = v
                step = torch.tensor([ids if j == 0 else [tokens[j - 1]]])
                out = self.model(input_ids=step, past_key_values=cache, use_cache=True)
                kept.append(float(torch.log_softmax(out.logits[0, -1].float(), dim=-1)[tok]))
            seq = [*prompt, *tokens]
            for v in sorted(set(versions)):
                self.load(states[v])
                lp = self.logprobs(seq)[len(prompt) - 1 :]
                for j, tag in enumerate(versions):
                    if tag == v:
                        fresh[j] = lp[j]
        finally:
            self.load(current)
        return torch.tensor(kept), fresh

    @torch.no_grad()
    def logprobs(self, token_ids: Sequence[int]) -> torch.Tensor:
        """``log p(tok_t | tok_<t)`` for t >= 1."""
        ids = torch.tensor([list(token_ids)])
        logits = self.model(input_ids=ids, use_cache=False).logits.float()
        return torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
