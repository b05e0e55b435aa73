"""Checks that sampling is what was asked for and that completions end as they say.

The distribution checks test distributions, never exact samples, so an engine whose random
number generator differs from the reference's (vLLM, SGLang) passes. Every sampled token gets the
randomized probability integral transform (:func:`~pipelinerl_sdk.conformance.stats.randomized_pit`)
under the distribution the mirror computes for its prefix, temperature and ``top_p``; drawn as
asked, those transforms are i.i.d. uniform, which the DKW bound tests with a false-failure rate of
at most :data:`ALPHA` per check for any number of tokens. The independence check flags a group of
draws only when its coincidence has conditional probability below ``ALPHA / groups``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pipelinerl_sdk.conformance.common import PROMPT, arun, connect
from pipelinerl_sdk.conformance.mirror import Mirror, compare
from pipelinerl_sdk.conformance.stats import (
    all_equal_bound,
    dkw_uniformity,
    nucleus_is_ambiguous,
    randomized_pit,
    sampling_distribution,
)
from pipelinerl_sdk.conformance.targets import ServerUnderTest
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.protocol import ChatCompletionResponse

#: False-failure rate of each statistical check on a correct engine (whatever its RNG).
ALPHA = 1e-6
#: Requests per sampling setting (half seeded, half not), samples per request, tokens per sample.
REQUESTS, N, TOKENS = 4, 8, 12
#: How far from ``top_p`` a token's preceding mass must be for the server's dtype to put it on
#: the same side of the nucleus boundary as the mirror (else that position is not judged).
NUCLEUS_SLACK = {"float32": 1e-3, "bfloat16": 0.05, "float16": 0.02}
#: The same for the min-p and top-k cuts, in logits (a token's logit against the min-p
#: threshold's, the k-th against the (k+1)-th).
LOGIT_SLACK = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.1}
#: Smallest gap between the best and second-best logit along a greedy path the suite relies on.
GREEDY_GAP = {"float32": 0.05, "bfloat16": 1.0, "float16": 0.5}


@dataclass(frozen=True, slots=True)
class Setting:
    """What one sampling check asks for: the temperature and the cuts after it (off by default)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def fields(self) -> dict[str, Any]:
        """The request fields of this setting (a cut that is off is not sent)."""
        out: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p}
        if self.top_k:
            out["top_k"] = self.top_k
        if self.min_p:
            out["min_p"] = self.min_p
        return out

    def cut(self) -> str:
        """The allowed set, named for a message."""
        if self.top_k:
            return f"top_k={self.top_k} set"
        if self.min_p:
            return f"min_p={self.min_p} set"
        return f"top_p={self.top_p} nucleus"


#: Every sampling setting checked. The cuts are applied after the temperature (vLLM's order), so
#: each is also sampled at temperatures other than 1, where the two orders differ.
SETTINGS: dict[str, Setting] = {
    "temperature-1": Setting(1.0),
    "temperature-0.5": Setting(0.5),
    "temperature-2": Setting(2.0),
    "top_p-0.7": Setting(1.0, top_p=0.7),
    "top_p-0.7-temperature-0.5": Setting(0.5, top_p=0.7),
    "top_p-0.7-temperature-2": Setting(2.0, top_p=0.7),
    "top_k-5-temperature-0.5": Setting(0.5, top_k=5),
    "top_k-5-temperature-2": Setting(2.0, top_k=5),
    "min_p-0.1-temperature-0.5": Setting(0.5, min_p=0.1),
    "min_p-0.1-temperature-2": Setting(2.0, min_p=0.1),
}


def _setting_param(name: str) -> Any:
    """``name`` as a parameter; top-k and min-p settings require ``sampling_filters``."""
    s = SETTINGS[name]
    marks = [pytest.mark.requires("sampling_filters")] if s.top_k or s.min_p else []
    return pytest.param(name, marks=marks, id=name)


async def draw(
    client: InferenceClient, setting: Setting, *, requests: int = REQUESTS, n: int = N
) -> list[ChatCompletionResponse]:
    """``requests`` requests of ``n`` samples of ``TOKENS`` tokens each (``ignore_eos``), sent
    together; even-numbered ones seeded (distinct seeds), odd ones not."""

    def body(r: int) -> dict[str, Any]:
        b: dict[str, Any] = {
            "messages": PROMPT, "max_tokens": TOKENS, "n": n, **setting.fields(),
            "ignore_eos": True, "return_token_ids": True,
        }  # fmt: skip
        if r % 2 == 0:
            b["seed"] = 1000 * (r + 1)
        return b

    return list(await asyncio.gather(*(client.chat(body(r)) for r in range(requests))))


def completions(responses: Sequence[ChatCompletionResponse]) -> tuple[list[int], list[list[int]]]:
    """The shared prompt ids and every choice's completion ids (each exactly ``TOKENS`` long)."""
    prompt = responses[0].prompt_token_ids
    assert prompt, "return_token_ids: prompt_token_ids missing"
    out = []
    for resp in responses:
        assert resp.prompt_token_ids == prompt, "one prompt tokenized two ways"
        for c in resp.choices:
            assert c.token_ids is not None, "return_token_ids: choices[].token_ids missing"
            assert len(c.token_ids) == TOKENS, f"ignore_eos with max_tokens={TOKENS} gave {len(c.token_ids)} tokens"
            out.append(list(c.token_ids))
    return prompt, out


def judge_samples(
    mirror: Mirror, prompt: list[int], samples: list[list[int]], setting: Setting
) -> tuple[list[float], list[str]]:
    """Transforms of every judged token, and the tokens the distribution cannot produce."""
    temperature = setting.temperature
    logits = mirror.next_token_logits([prompt + s for s in samples], len(prompt))
    probs = sampling_distribution(logits, temperature, setting.top_p, top_k=setting.top_k, min_p=setting.min_p)
    ambiguous = nucleus_is_ambiguous(
        logits, temperature, setting.top_p, NUCLEUS_SLACK[mirror.dtype],
        top_k=setting.top_k, min_p=setting.min_p, logit_slack=LOGIT_SLACK[mirror.dtype],
    )  # fmt: skip
    rng = random.Random(0)  # the suite's own randomization, independent of the server
    points: list[float] = []
    impossible: list[str] = []
    for i, s in enumerate(samples):
        for j, tok in enumerate(s):
            v = rng.random()
            if bool(ambiguous[i, j]):
                continue
            u = randomized_pit(probs[i, j], tok, v)
            if u is None:
                mass = float(torch.softmax(logits[i, j].double() / temperature, -1)[tok])
                impossible.append(f"sample {i} token {j} (id {tok}, probability {mass:.3f} before the cut)")
            else:
                points.append(u)
    return points, impossible


class SamplingChecks:
    """Mixed into :class:`~pipelinerl_sdk.conformance.inference.InferenceContractTests`."""

    @pytest.mark.parametrize("setting", [_setting_param(n) for n in SETTINGS])
    def test_samples_follow_the_model_distribution(
        self, server_under_test: ServerUnderTest, mirror: Mirror, setting: str
    ) -> None:
        """Sampled tokens are draws from softmax(logits / temperature), then cut as asked (vLLM's
        order: temperature first, then min-p, top-k, top-p) and renormalised, given their prefix:
        at temperature 1 the model's own distribution, at 0.5 a sharper one, at 2 a flatter one;
        with ``top_p`` 0.7, ``top_k`` 5 or ``min_p`` 0.1 (each at temperatures other than 1, where
        cutting before the temperature differs) no token outside the allowed set (tolerance 0).
        Exact test (false-failure rate ALPHA = 1e-6 per setting, any RNG): the transforms of
        384 tokens (seeded and unseeded requests) must be uniform."""
        s = SETTINGS[setting]

        async def body() -> None:
            async with server_under_test.client() as client:
                responses = await draw(client, s)
            prompt, samples = completions(responses)
            points, impossible = judge_samples(mirror, prompt, samples, s)
            assert not impossible, (
                f"{len(impossible)} of {len(samples) * TOKENS} sampled tokens lie outside the {s.cut()} "
                f"(temperature {s.temperature}, cut after it): " + "; ".join(impossible[:5])
            )
            test = dkw_uniformity(points, ALPHA)
            cuts = (f", top_k {s.top_k}" if s.top_k else "") + (f", min_p {s.min_p}" if s.min_p else "")
            assert not test.rejected, (
                f"samples at temperature {s.temperature}, top_p {s.top_p}{cuts} do not follow the model's "
                "distribution: " + test.describe()
            )

        arun(body)

    def test_samples_of_one_request_are_independent(self, server_under_test: ServerUnderTest, mirror: Mirror) -> None:
        """The ``n`` samples of one request (seeded or not), and unseeded requests among
        themselves, are independent draws: no group of draws comes out identical unless that is
        likely (conditional probability of the coincidence >= ALPHA / groups; false-failure
        rate ALPHA). Copies of one sample kill GRPO's group advantages."""

        async def body() -> None:
            async with server_under_test.client() as client:
                responses = await draw(client, Setting(1.0))
            prompt, samples = completions(responses)
            groups: dict[str, list[list[int]]] = {}
            for r in range(REQUESTS):
                seeded = "seeded" if r % 2 == 0 else "unseeded"
                groups[f"the {N} samples of {seeded} request {r}"] = samples[r * N : (r + 1) * N]
            unseeded = [r for r in range(REQUESTS) if r % 2]
            for i in range(N):
                groups[f"sample {i} of the unseeded requests {unseeded}"] = [samples[r * N + i] for r in unseeded]
            bound = all_equal_bound(len(groups), ALPHA)
            flagged = []
            for name, group in groups.items():
                if any(s != group[0] for s in group):
                    continue
                lp = sampled_logprob(mirror, prompt, group[0])
                chance = float(torch.exp(lp * (len(group) - 1)))
                if chance < bound:
                    flagged.append(f"{name} are identical (chance {chance:.2g} < {bound:.2g})")
            assert not flagged, "samples are copies, not independent draws: " + "; ".join(flagged)

        arun(body)

    @pytest.mark.requires("seeds")
    def test_a_seed_fixes_the_samples(self, server_under_test: ServerUnderTest, mirror: Mirror) -> None:
        """A seeded sampled request (temperature 1, ``n`` 2) gives the same tokens every time it
        is sent, alone or beside unseeded requests; another seed gives other samples (flagged
        only when their coincidence has probability below ALPHA under the model). Exact."""

        def body(seed: int | None) -> dict[str, Any]:
            b = {"messages": PROMPT, "max_tokens": TOKENS, "n": 2, "temperature": 1.0, "ignore_eos": True,
                 "return_token_ids": True}  # fmt: skip
            return b if seed is None else {**b, "seed": seed}

        async def main() -> None:
            async with server_under_test.client() as client:
                first = await client.chat(body(11))
                again = await client.chat(body(11))
                busy = await asyncio.gather(client.chat(body(11)), *(client.chat(body(None)) for _ in range(3)))
                other = await client.chat(body(12))
            prompt, (a0, a1) = completions([first])
            for what, resp in (("sent again", again), ("sent beside 3 unseeded requests", busy[0])):
                _, replay = completions([resp])
                assert replay == [a0, a1], f"seed 11 {what} gave other samples: {replay} != {[a0, a1]}"
            _, b = completions([other])
            if b == [a0, a1]:
                chance = float(torch.exp(sampled_logprob(mirror, prompt, a0) + sampled_logprob(mirror, prompt, a1)))
                assert chance >= ALPHA, f"seeds 11 and 12 gave the same samples {b} (chance {chance:.2g} < {ALPHA:g})"

        arun(main)

    def test_completions_end_as_they_say(self, server_under_test: ServerUnderTest, mirror: Mirror) -> None:
        """A completion that stops on end-of-sequence carries that token (id, logprob, version)
        and says ``stop``; one cut by the budget says ``length`` and has no end-of-sequence;
        with ``ignore_eos`` the end-of-sequence is generated and kept, and the budget is used.

        To stop deterministically the suite publishes weights whose greedy path from the
        prompt ends with end-of-sequence after a few tokens (only the output-embedding row of
        end-of-sequence moves), then publishes the previous weights back."""
        eos = _eos_id(mirror)

        async def body() -> None:
            async with server_under_test.client() as client:
                publisher = await connect(server_under_test, client)
                info = await client.info()
                probe = await client.chat({"messages": PROMPT, "max_tokens": 1, "return_token_ids": True})
                assert probe.prompt_token_ids, "return_token_ids: prompt_token_ids missing"
                prompt = probe.prompt_token_ids
                saved = mirror.state()
                restored = False
                try:
                    path = _steer_to_eos(mirror, prompt, eos)
                    await mirror.publish(publisher, info.version + 1, info.params)
                    v = info.version + 1

                    async def ask(max_tokens: int, **extra: Any) -> Any:
                        body = {"messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "logprobs": True,
                                "return_token_ids": True, **extra}  # fmt: skip
                        resp = await client.chat(body)
                        c = resp.choices[0]
                        assert c.token_ids is not None and c.logprobs is not None, "token ids or logprobs missing"
                        return resp, c

                    _, c = await ask(len(path) + 4)
                    what = f"greedy completion {c.token_ids} (the weights' greedy path is {path}, eos id {eos})"
                    assert c.token_ids[-1:] == [eos], (
                        f"a completion that stopped on end-of-sequence does not carry its end-of-sequence token: {what}"
                    )
                    assert c.token_ids == path, f"not the served weights' greedy path: {what}"
                    assert c.finish_reason == "stop", (
                        f"finish_reason {c.finish_reason!r} for a completion that ended on end-of-sequence: {what}"
                    )
                    assert len(c.logprobs.content) == len(path) and len(c.weight_versions) == len(path), (
                        f"{len(c.logprobs.content)} logprobs, {len(c.weight_versions)} versions for {len(path)} tokens"
                    )
                    assert set(c.weight_versions) == {v}, f"versions {c.weight_versions}, expected {v}"
                    ref = mirror.logprobs(prompt + path)[len(prompt) - 1 :]
                    ok, msg = compare([t.logprob for t in c.logprobs.content], ref, mirror.dtype)
                    assert ok, f"logprobs of a completion ending on end-of-sequence (its eos included): {msg}"
                    if len(path) >= 2:
                        _, c = await ask(len(path) - 1)
                        assert c.finish_reason == "length" and c.token_ids == path[:-1], (
                            f"cut by max_tokens={len(path) - 1} before end-of-sequence: finish_reason "
                            f"{c.finish_reason!r}, tokens {c.token_ids} (greedy path {path})"
                        )
                    _, c = await ask(len(path) + 2, ignore_eos=True)
                    assert c.finish_reason == "length" and len(c.token_ids) == len(path) + 2, (
                        f"ignore_eos, max_tokens={len(path) + 2}: finish_reason {c.finish_reason!r}, "
                        f"{len(c.token_ids)} tokens"
                    )
                    assert c.token_ids[: len(path)] == path, (
                        f"ignore_eos must generate and keep end-of-sequence: {c.token_ids} (greedy path {path})"
                    )
                    mirror.load(saved)
                    restored = True
                    await mirror.publish(publisher, v + 1, info.params)
                finally:
                    if not restored:  # the resync after the failure publishes the saved weights
                        mirror.load(saved)
                        mirror.needs_sync = True
                await publisher.close()

        arun(body)


def sampled_logprob(mirror: Mirror, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log P(completion | prompt) at temperature 1, top_p 1."""
    return mirror.logprobs(prompt + completion)[len(prompt) - 1 :].double().sum()


def _eos_id(mirror: Mirror) -> int:
    eos = mirror.model.generation_config.eos_token_id
    if eos is None:
        eos = mirror.model.config.eos_token_id
    if isinstance(eos, list):
        eos = eos[0]
    assert isinstance(eos, int), "the model declares no eos_token_id"
    return eos


def _steer_to_eos(mirror: Mirror, prompt: list[int], eos: int) -> list[int]:
    """Move the mirror's weights so that greedy decoding of ``prompt`` ends with ``eos`` after a
    few tokens, every step clear of near-ties for the server's dtype; returns that path."""
    base = mirror.state()
    tried = []
    for after in (3, 2, 4, 1, 5, 0):
        mirror.load(base)
        mirror.steer_to(prompt, eos, after)
        path, gap = mirror.greedy(prompt, after + 1, stop=eos)
        if path[-1:] == [eos] and gap >= GREEDY_GAP[mirror.dtype]:
            return path
        tried.append(f"after {after}: path {path}, smallest logit gap {gap:.3g}")
    mirror.load(base)
    pytest.fail("could not steer the weights to a clear end-of-sequence: " + "; ".join(tried))
