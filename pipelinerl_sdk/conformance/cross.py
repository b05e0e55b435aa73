"""The central check of the design: a real trainer step, published through the weight-sync
protocol, makes the inference server compute exactly what the trainer computes.

Subclass :class:`CrossCheckTests` in a test module of its own (``class TestCross(CrossCheckTests):
pass``) and select one trainer and one inference backend with ``--backend`` (a name registered as
both selects both; ``--backend reference --backend http://HOST:PORT`` pairs the reference trainer
with a running server). The update changes the served weights, so this module must not share a
server with :class:`~pipelinerl_sdk.conformance.inference.InferenceContractTests` (its ``mirror``
would no longer know the served weights); the server fixture is per module, so a module of its
own is enough.

The trainer runs at world size 1, in this process, in the dtype of its checks (float32 if it
declares it); the update goes through :func:`~pipelinerl_sdk.pipeline.publish.publish_weights`,
the function ``pipelinerl run`` calls after every step (the publisher's sender itself, so a
trainer that lends its params is checked on its zero-copy path), at world size 1 and, for a
trainer that declares ``world_size:2``, from two spawned ranks as ``pipelinerl run`` makes them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from pipelinerl_sdk.conformance.inference import arun, greedy
from pipelinerl_sdk.conformance.mirror import compare
from pipelinerl_sdk.conformance.targets import ServerUnderTest, TrainerTarget
from pipelinerl_sdk.conformance.trainer import TRAINER_TOLERANCES, CompletionNLL, check_dtype, open_trainer
from pipelinerl_sdk.contracts import TokenBatch, TrainerBackend, TrainerSpec
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.pipeline.publish import CastingSink, publish_weights
from pipelinerl_sdk.protocol import ChatCompletionResponse, ParamSpec
from pipelinerl_sdk.trainer_group import RankContext, run_ranks
from pipelinerl_sdk.weights.publisher import WeightPublisher

#: The step of the cross check: large enough that the logprobs move far beyond the tolerance of
#: any server dtype (so a server that ignored the update fails), no clipping. On the tiny model it
#: moves the logprobs of the server's greedy sequence by 4.5 max / 0.73 mean (bfloat16 tolerance:
#: 0.5 / 0.05).
CROSS_LR = 1e-4


def wire_specs(
    trainer_specs: Sequence[ParamSpec], server_params: Sequence[ParamSpec], server_dtype: str
) -> list[ParamSpec]:
    """The specs of an update from this trainer to this server, in the trainer's order: names and
    shapes must agree exactly; a dtype may differ only when the server serves another dtype than
    the trainer trains in, and then every such param must be in the server's dtype."""
    server = {p.name: p for p in server_params}
    names = [s.name for s in trainer_specs]
    only_trainer, only_server = sorted(set(names) - set(server)), sorted(set(server) - set(names))
    assert not only_trainer and not only_server, (
        f"trainer param_specs() and server /info params differ: only the trainer has {only_trainer[:5]}, "
        f"only the server {only_server[:5]}"
    )
    out = []
    for s in trainer_specs:
        theirs = server[s.name]
        assert theirs.shape == s.shape, f"{s.name}: trainer shape {s.shape}, server expects {theirs.shape}"
        if theirs.dtype != s.dtype:
            assert theirs.dtype == server_dtype, (
                f"{s.name}: trainer dtype {s.dtype}, server expects {theirs.dtype} (it serves {server_dtype})"
            )
        out.append(ParamSpec(name=s.name, dtype=theirs.dtype, shape=s.shape))
    return out


def _sequence(resp: ChatCompletionResponse) -> tuple[list[int], int]:
    choice = resp.choices[0]
    assert resp.prompt_token_ids, "return_token_ids: prompt_token_ids missing"
    assert choice.token_ids, "return_token_ids: choices[].token_ids missing or empty"
    return list(resp.prompt_token_ids) + list(choice.token_ids), len(resp.prompt_token_ids)


class CrossCheckTests:
    """Trainer and inference server together: ``trainer_target`` (world size 1, in-process) and
    ``server_under_test``."""

    @pytest.fixture(autouse=True)
    def _trainer_selected(self, trainer_target: TrainerTarget | None) -> None:
        if trainer_target is None:
            pytest.skip(
                "no trainer backend selected: pass --backend NAME of a registered trainer backend "
                "(e.g. --backend=trainer:reference)"
            )

    def test_server_expects_the_trainers_params(
        self, trainer_target: TrainerTarget, server_under_test: ServerUnderTest
    ) -> None:
        """The params the server expects in an update (``/info``) are exactly the trainer's
        ``param_specs()``: the same HF names and shapes; dtypes equal, unless the server serves
        another dtype than the trainer trains in, and then each differing param is in the
        server's dtype (the update casts, see :class:`CastingSink`)."""

        async def body() -> None:
            async with server_under_test.client() as client:
                info = await client.info()
            spec = TrainerSpec(model=str(server_under_test.model_dir), dtype=check_dtype(trainer_target))
            with open_trainer(trainer_target, spec) as trainer:
                specs = trainer.param_specs()
            wire = wire_specs(specs, info.params, server_under_test.dtype)
            if server_under_test.dtype == spec.dtype:
                assert wire == specs, f"a {spec.dtype} server expects other dtypes than the {spec.dtype} trainer has"

        arun(body)

    def test_trained_weights_reach_the_server(
        self, trainer_target: TrainerTarget, server_under_test: ServerUnderTest
    ) -> None:
        """The trainer takes a real step (AdamW, lr :data:`CROSS_LR`, on the server's own greedy
        completion), publishes it with :func:`~pipelinerl_sdk.pipeline.publish.publish_weights`
        (what ``pipelinerl run`` calls: the loop's publisher, bucket size and sender, cast to
        the server's dtype if it differs); then the server's greedy completion carries the new
        version on every token, and its completion logprobs (and prompt logprobs, if it declares
        ``prompt_logprobs``) equal the trainer's ``forward`` on the same tokens within the
        tolerance of the narrower dtype (:func:`~pipelinerl_sdk.conformance.mirror.compare`). The
        step is first shown to move the trainer's logprobs beyond that tolerance, so a server that
        kept its old weights fails."""
        _check_update(trainer_target, server_under_test, world_size=1)

    @pytest.mark.requires("world_size:2")
    def test_trained_weights_reach_the_server_from_2_ranks(
        self, trainer_target: TrainerTarget, server_under_test: ServerUnderTest
    ) -> None:
        """The loop's world-size-2 path: two spawned ranks as ``pipelinerl run`` makes them (rank
        0 a :class:`~pipelinerl_sdk.pipeline.ranks.LeaderTrainer` mirroring init, backward on
        shards, step and gather to rank 1, which runs :func:`~pipelinerl_sdk.pipeline.ranks.follow`);
        rank 0 publishes with ``publish_weights``. The server then computes what the same step
        at world size 1 in this process computes (as in ``test_trained_weights_reach_the_server``)."""
        _check_update(trainer_target, server_under_test, world_size=2)


@dataclass(frozen=True, slots=True)
class LoopPublishJob:
    """What each spawned rank of :func:`loop_publish_rank` needs (picklable)."""

    backend: str
    spec: TrainerSpec
    batch: TokenBatch
    url: str
    control_token: str
    version: int
    wire: tuple[ParamSpec, ...]


def loop_publish_rank(ctx: RankContext, job: LoopPublishJob) -> int:
    """One rank of the loop's trainer: rank 0 steps through a LeaderTrainer and publishes, the
    others follow (module level: spawned ranks unpickle it)."""
    from pipelinerl_sdk.pipeline.ranks import LeaderTrainer, follow
    from pipelinerl_sdk.plugins import load_registry

    trainer: TrainerBackend = load_registry().factory("trainer", job.backend)()
    if ctx.rank != 0:
        return follow(trainer)
    leader = LeaderTrainer(trainer)
    leader.init(job.spec)
    try:
        leader.backward(job.batch, CompletionNLL(len(job.batch)))
        leader.step()

        async def publish() -> None:
            async with InferenceClient(job.url, control_token=job.control_token) as client:
                publisher = WeightPublisher([client])
                await publisher.connect()
                try:
                    await publish_weights(leader, publisher, job.version, job.wire)
                finally:
                    await publisher.close()

        asyncio.run(publish())
    finally:
        leader.close()
    return 1


def _check_update(trainer_target: TrainerTarget, sut: ServerUnderTest, *, world_size: int) -> None:
    caps = sut.capabilities
    trainer_dtype = check_dtype(trainer_target)
    lr = CROSS_LR if trainer_dtype == "float32" else TRAINER_TOLERANCES[trainer_dtype].lr
    spec = TrainerSpec(model=str(sut.model_dir), dtype=trainer_dtype, lr=lr, grad_clip=None)
    # compared within the tolerance of the narrower of the two dtypes
    dtype = sut.dtype if trainer_dtype == "float32" else trainer_dtype

    async def body() -> None:
        async with sut.client() as client:
            with open_trainer(trainer_target, spec) as trainer:
                info = await client.info()
                wire = wire_specs(trainer.param_specs(), info.params, sut.dtype)
                seq0, n0 = _sequence(await greedy(client, prompt_logprobs=False))
                # two copies: one per rank at world size 2, the same gradient as one copy alone
                batch0 = TokenBatch(input_ids=[seq0, seq0], completion_start=[n0, n0])
                before = trainer.forward(batch0)[0]
                trainer.backward(batch0, CompletionNLL(len(batch0)))
                trainer.step()
                moved, msg = compare(trainer.forward(batch0)[0].tolist(), before, dtype)
                assert not moved, f"the step left the logprobs within the {dtype} tolerance ({msg}): vacuous"

                version = info.version + 1
                if world_size == 1:
                    publisher = WeightPublisher([client])  # the loop's bucket size and mode
                    await publisher.connect()
                    try:
                        await publish_weights(trainer, publisher, version, wire)
                    finally:
                        await publisher.close()
                else:
                    job = LoopPublishJob(
                        trainer_target.name, spec, batch0, sut.url, sut.control_token, version, tuple(wire)
                    )
                    await asyncio.to_thread(run_ranks, world_size, loop_publish_rank, job, timeout_s=300)
                assert (await client.info()).version == version

                resp = await greedy(client, prompt_logprobs=caps.prompt_logprobs)
                choice = resp.choices[0]
                assert set(choice.weight_versions) == {version}, choice.weight_versions
                seq, n_prompt = _sequence(resp)
                want = trainer.forward(TokenBatch(input_ids=[seq], completion_start=[n_prompt]))[0]
        assert choice.logprobs is not None, "logprobs requested but missing"
        where = f"world size {world_size}: " if world_size > 1 else ""
        ok, msg = compare([t.logprob for t in choice.logprobs.content], want[n_prompt - 1 :], dtype)
        assert ok, f"completion logprobs: {where}server and trainer disagree after the update: {msg}"
        if caps.prompt_logprobs:
            assert resp.prompt_logprobs is not None and len(resp.prompt_logprobs) == n_prompt
            got = [x for x in resp.prompt_token_logprobs()[1:] if x is not None]
            ok, msg = compare(got, want[: n_prompt - 1], dtype)
            assert ok, f"prompt logprobs: {where}server and trainer disagree after the update: {msg}"

    arun(body)


__all__ = ["CROSS_LR", "CastingSink", "CrossCheckTests", "LoopPublishJob", "loop_publish_rank", "wire_specs"]
