"""A Hypothesis state machine against a running server: generations, updates, bad requests and
interrupted updates in any order, checked against a model of what the server must hold.

The model is (version, weights, group healthy); the weights live in the
:class:`~pipelinerl_sdk.conformance.mirror.Mirror`. After every step: ``/info`` reports the
model's version and no update in progress; every generation's tokens carry that version and its
logprobs are the mirror's.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from pipelinerl_sdk.conformance.inference import _bad_update_cases, arun, check_against_mirror, greedy
from pipelinerl_sdk.conformance.mirror import Mirror
from pipelinerl_sdk.conformance.targets import ServerUnderTest
from pipelinerl_sdk.weights.publisher import WeightPublisher

#: Group timeout for the machine's updates: bounds how long an interrupted update may hold on.
INTERRUPT_TIMEOUT_S = 4.0


class _Interrupted(Exception):
    """Raised by the machine's own sender half-way through a broadcast."""


@dataclass
class Coverage:
    """What the examples of one run reached: the rules of each example, in order."""

    examples: list[list[str]] = field(default_factory=list)

    def pairs(self) -> set[tuple[str, str]]:
        """Distinct consecutive (rule, next rule) pairs over all examples."""
        return {(a, b) for ex in self.examples for a, b in itertools.pairwise(ex)}

    def interleaved(self) -> int:
        """Examples with a generation, an update and a refused update all in them (Hypothesis
        disables a random subset of the rules in each example, swarm testing, so not every
        example has all three)."""
        return sum({"generate", "update", "bad_update"} <= set(ex) for ex in self.examples)

    def describe(self) -> str:
        steps = sum(len(ex) for ex in self.examples)
        rules = ("generate", "update", "bad_update", "interrupted_update")
        missed = sorted({(a, b) for a in rules for b in rules} - self.pairs())
        return (
            f"{len(self.examples)} examples, {steps} steps, {len(self.pairs())}/16 consecutive rule pairs "
            f"(missed: {', '.join(f'{a}>{b}' for a, b in missed) or 'none'}), "
            f"{self.interleaved()} examples with generate, update and bad_update all in them"
        )


def build_machine(
    sut: ServerUnderTest, mirror: Mirror, coverage: Coverage | None = None
) -> type[RuleBasedStateMachine]:
    class ServerMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            info = arun(self._info)
            self.version = info.version
            self.group_healthy = info.group is not None and not info.group.broken
            self.interruptions = 0
            self.trace: list[str] = []
            if coverage is not None:
                coverage.examples.append(self.trace)

        async def _info(self) -> Any:
            async with sut.client() as client:
                return await client.info()

        @rule(n=st.integers(1, 3), max_tokens=st.integers(1, 8))
        def generate(self, n: int, max_tokens: int) -> None:
            self.trace.append("generate")

            async def body() -> None:
                async with sut.client() as client:
                    resp = await greedy(client, prompt_logprobs=sut.capabilities.prompt_logprobs, max_tokens=max_tokens)
                    assert set(resp.choices[0].weight_versions) == {self.version}
                    check_against_mirror(resp, mirror, prompt=sut.capabilities.prompt_logprobs)
                    sampled = await client.chat(
                        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": n}
                    )
                    assert len(sampled.choices) == n
                    assert all(set(c.weight_versions) <= {self.version} for c in sampled.choices)

            arun(body)

        @rule(seed=st.integers(0, 2**16))
        def update(self, seed: int) -> None:
            self.trace.append("update")

            async def body() -> None:
                async with sut.client() as client:
                    publisher = WeightPublisher([client], bucket_bytes=32 << 10)
                    await publisher.connect()
                    info = await client.info()
                    mirror.perturb(seed)
                    await mirror.publish(publisher, self.version + 1, info.params)
                    await publisher.close()

            arun(body)
            self.version += 1
            self.group_healthy = True

        @rule(
            kind=st.sampled_from(
                ["unknown-name", "wrong-shape", "wrong-dtype", "missing-param", "same-version", "bad-digest"]
            )
        )
        def bad_update(self, kind: str) -> None:
            self.trace.append("bad_update")

            async def body() -> None:
                async with sut.client() as client:
                    info = await client.info()
                    case, status = _bad_update_cases(info)[kind]
                    schema_level = kind.endswith("version") and status == 400
                    if not self.group_healthy and not schema_level:
                        status = 409  # no usable group: refused on that, right after the schema
                    headers = {"Authorization": f"Bearer {sut.control_token}"}
                    async with httpx.AsyncClient(base_url=sut.url, timeout=60) as http:
                        r = await http.post("/request_weight_update", json=case, headers=headers)
                    assert r.status_code == status, f"{kind}: {r.status_code} {r.text[:200]}"

            arun(body)

        @precondition(lambda self: self.interruptions < 1)
        @rule(seed=st.integers(0, 2**16))
        def interrupted_update(self, seed: int) -> None:
            """The trainer's sender fails half-way: the server must end up exactly as before."""
            self.trace.append("interrupted_update")
            before = mirror.state()

            async def body() -> None:
                async with sut.client() as client:
                    publisher = WeightPublisher([client], bucket_bytes=4096, timeout_s=INTERRUPT_TIMEOUT_S)
                    await publisher.connect()
                    info = await client.info()
                    mirror.perturb(seed, scale=0.5)
                    half = max(1, len(info.params) // 2)
                    with pytest.raises(_Interrupted):
                        async with publisher.update(self.version + 1, info.params) as sink:
                            await asyncio.to_thread(mirror.send_all, sink, info.params, stop_after=half)
                            raise _Interrupted
                    await publisher.close()
                    deadline = time.monotonic() + INTERRUPT_TIMEOUT_S * 4 + 10
                    while (await client.info()).updating and time.monotonic() < deadline:
                        await asyncio.sleep(0.2)

            try:
                arun(body)
            finally:
                mirror.load(before)
            self.interruptions += 1
            self.group_healthy = False

        @invariant()
        def server_matches_model(self) -> None:
            info = arun(self._info)
            assert not info.updating, "an update is still in progress after its step ended"
            assert info.version == self.version, f"server at version {info.version}, model says {self.version}"

    return ServerMachine


class StatefulContractTests:
    """The state machine, on ``server_under_test``. ``max_examples`` x ``step_count`` bounds its
    cost (an example with an interrupted update waits ~:data:`INTERRUPT_TIMEOUT_S`)."""

    max_examples = 12
    step_count = 10

    def test_any_interleaving_keeps_the_server_consistent(
        self, server_under_test: ServerUnderTest, mirror: Mirror, record_property: Any
    ) -> None:
        """Random interleavings of generate / update / bad update / interrupted update: the server
        always serves exactly the model's version and weights, never stays paused. What the
        examples reached is recorded (``stateful_coverage``)."""
        coverage = Coverage()
        machine = build_machine(server_under_test, mirror, coverage)
        try:
            run_state_machine_as_test(
                machine,
                # No shrinking: the server's state outlives an example, so a replay is not a re-run.
                settings=settings(
                    max_examples=self.max_examples,
                    stateful_step_count=self.step_count,
                    deadline=None,
                    database=None,
                    phases=(Phase.explicit, Phase.generate),
                    report_multiple_bugs=False,
                ),
            )
        finally:
            record_property("stateful_coverage", coverage.describe())
