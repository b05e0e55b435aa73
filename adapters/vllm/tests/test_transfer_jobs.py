"""The SDK's vLLM weight-transfer engine (:mod:`pipelinerl_sdk_vllm.transfer`), worker side, in one
process against a real trainer side (a gloo group of two over loopback): what becomes of a
receive whose update session is closed before the trainer's ``go``.

The engine is the real class, constructed as vLLM constructs it (its config objects reduced to
the fields it reads); the group, the store, the decisions and the broadcast are the SDK's own.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pipelinerl_sdk.protocol import ParamSpec, update_key
from pipelinerl_sdk.weights.auth import new_group_secret
from pipelinerl_sdk.weights.buckets import BucketPlan
from pipelinerl_sdk.weights.group import GroupConfig, WeightSyncGroup
from pipelinerl_sdk.weights.publisher import free_port
from pipelinerl_sdk.weights.send import WeightSender

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed here: run in the env scripts/setup-vllm prints",
)
#: The group's timeout: a receive that misses buckets fails after this long.
GROUP_TIMEOUT_S = 15.0


@pytest.fixture
def trainer_and_engine() -> Iterator[tuple[WeightSyncGroup, Any]]:
    """The trainer's side (rank 0) and the worker's engine (rank 1), joined into one group."""
    from pipelinerl_sdk_vllm.transfer import PipelineRLInitInfo, PipelineRLWeightTransferEngine

    cfg = GroupConfig(f"tcp://127.0.0.1:{free_port()}", 0, 2, timeout_s=GROUP_TIMEOUT_S, secret=new_group_secret())
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0), model_config=None
    )
    engine = PipelineRLWeightTransferEngine(None, vllm_config, torch.device("cpu"), torch.nn.Linear(1, 1))
    # what the engine reads from the model's config (none here): the tests' four params
    engine.expected_params = {f"p{i}": (64, 32) for i in range(4)}
    joined: Future[None] = Future()
    t = threading.Thread(
        target=lambda: joined.set_result(
            engine.init_transfer_engine(PipelineRLInitInfo(request=cfg.invitation(1).model_dump(mode="json")))
        )
    )
    t.start()
    trainer = WeightSyncGroup(cfg)
    t.join(60)
    joined.result(timeout=1)
    try:
        yield trainer, engine
    finally:
        engine.shutdown()
        trainer.close()


def test_a_receive_dropped_before_the_go_never_joins_a_later_broadcast_of_its_version(
    trainer_and_engine: tuple[WeightSyncGroup, Any],
) -> None:
    """An update armed on this worker, then refused elsewhere (the server closes this worker's
    session: ``finish_weight_update`` without apply), then published again under the same
    version, as a publisher does after a refusal: the dropped receive ends called off, the new
    one alone receives the broadcast, every byte as sent. Without the call-off, the dropped job
    still waited for that version's ``go``, took it, and joined the broadcast beside the new one:
    the buckets split between the two and the new receive failed on the group's timeout."""
    from pipelinerl_sdk_vllm.jobs import receive_info

    trainer, engine = trainer_and_engine
    torch.manual_seed(0)
    params = {f"p{i}": torch.randn(64, 32) for i in range(4)}
    specs = [ParamSpec(name=n, dtype="float32", shape=tuple(t.shape)) for n, t in params.items()]
    info = receive_info(5, specs, 8 << 10, timeout_s=60)
    key = update_key(5)

    engine.start_weight_update()
    engine.update_weights(info)
    dropped = engine.job
    engine.finish_weight_update()  # refused at another worker: the session closes unapplied
    assert engine.job is None

    trainer.clear_decision(key)  # the publisher's next update of the same version
    engine.start_weight_update()
    engine.update_weights(info)
    fresh = engine.job
    assert fresh is not dropped
    trainer.post_decision(key, go=True)
    sender = WeightSender(trainer, BucketPlan.build(specs, 8 << 10))
    for name, tensor in params.items():
        sender.send(name, tensor)
    sender.finish()
    fresh.thread.join(GROUP_TIMEOUT_S + 30)
    dropped.thread.join(5)
    assert fresh.state == "received", (fresh.state, fresh.error)
    got = dict(fresh.staged.tensors())
    assert all(torch.equal(got[n], t) for n, t in params.items())
    assert dropped.state == "failed" and dropped.aborted, (dropped.state, dropped.error)
    assert not engine.dropped and trainer.broken is None


def test_a_receive_dropped_mid_broadcast_refuses_the_next_arm_until_it_ends(
    trainer_and_engine: tuple[WeightSyncGroup, Any],
) -> None:
    """A session closed while its receive is mid-broadcast (the trainer sent half, then died):
    the receive runs on until the group's timeout; arming another receive meanwhile is refused
    with a message (two receives on one member would mix their buckets)."""
    from pipelinerl_sdk_vllm.jobs import receive_info
    from pipelinerl_sdk_vllm.transfer import CALL_OFF_S

    trainer, engine = trainer_and_engine
    specs = [ParamSpec(name=f"p{i}", dtype="float32", shape=(64, 32)) for i in range(4)]
    engine.start_weight_update()
    engine.update_weights(receive_info(5, specs, 8 << 10, timeout_s=60))
    job = engine.job
    trainer.post_decision(update_key(5), go=True)
    sender = WeightSender(trainer, BucketPlan.build(specs, 8 << 10))
    sender.send("p0", torch.zeros(64, 32))  # one bucket of four, then the trainer stops
    for _ in range(500):
        if job.state == "receiving":
            break
        threading.Event().wait(0.01)
    engine.finish_weight_update()
    assert engine.dropped == [job] and job.state == "receiving"
    assert CALL_OFF_S < GROUP_TIMEOUT_S
    with pytest.raises(RuntimeError, match=r"a dropped receive \(update/5, receiving\) has not ended yet"):
        engine.update_weights(receive_info(6, specs, 8 << 10, timeout_s=60))


def test_cancel_decision_ends_only_a_receive_still_waiting_for_the_go(
    trainer_and_engine: tuple[WeightSyncGroup, Any],
) -> None:
    """``cancel_decision`` (a new group replaces this one): a receive still waiting for the
    trainer's decision ends at once, failed and aborted, naming why; one that already has its
    ``go`` is left to receive (False), and receives every byte."""
    import time

    from pipelinerl_sdk_vllm.jobs import receive_info

    trainer, engine = trainer_and_engine
    specs = [ParamSpec(name=f"p{i}", dtype="float32", shape=(64, 32)) for i in range(4)]
    engine.start_weight_update()
    engine.update_weights(receive_info(5, specs, 8 << 10, timeout_s=60))
    job = engine.job
    assert not engine.cancel_decision(update_key(4), "not that job")
    t0 = time.monotonic()
    assert engine.cancel_decision(update_key(5), "a new group replaced this one")
    job.thread.join(10)
    ended_s = time.monotonic() - t0
    assert ended_s < 5, ended_s
    assert job.state == "failed" and job.aborted and "a new group replaced this one" in job.error, job.error
    engine.finish_weight_update()
    assert not engine.dropped and trainer.broken is None

    trainer.clear_decision(update_key(6))
    engine.start_weight_update()
    engine.update_weights(receive_info(6, specs, 8 << 10, timeout_s=60))
    job = engine.job
    trainer.post_decision(update_key(6), go=True)
    for _ in range(500):
        if job.state != "deciding":
            break
        threading.Event().wait(0.01)
    assert not engine.cancel_decision(update_key(6), "too late")
    sender = WeightSender(trainer, BucketPlan.build(specs, 8 << 10))
    for i in range(4):
        sender.send(f"p{i}", torch.full((64, 32), float(i)))
    sender.finish()
    job.thread.join(GROUP_TIMEOUT_S + 30)
    assert job.state == "received", (job.state, job.error)
    assert all(torch.equal(t, torch.full((64, 32), float(n[1:]))) for n, t in job.staged.tensors())


def test_a_receive_without_the_trainers_decision_is_a_decision_timeout() -> None:
    """A worker whose wait for the decision timed out reports it (``timed_out``): the server
    raises DecisionTimeout (408), not the GroupError of a failed receive (502); a failed receive
    is still a GroupError."""
    from pipelinerl_sdk_vllm.jobs import settled

    from pipelinerl_sdk.errors import DecisionTimeout, GroupError

    def status(timed_out: bool) -> dict[str, Any]:
        job = {"key": "probe/1", "state": "failed", "error": "no decision", "aborted": False, "timed_out": timed_out}
        return {"rank": 1, "group_broken": "no decision", "job": job}

    with pytest.raises(DecisionTimeout, match="no decision"):
        settled([status(True), status(True)], "probe/1", received=True)
    with pytest.raises(GroupError) as failed:
        settled([status(True), status(False)], "probe/1", received=True)
    assert not isinstance(failed.value, DecisionTimeout)
