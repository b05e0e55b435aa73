"""WeightSender on a real gloo group (rank 0 here, rank 1 in a thread): whatever mix of sent, lent
and slot-written tensors, the receiver gets every byte; lent tensors laid out by
``flatten_params`` go out in place (no packing copy, no bucket buffers); a tensor written in its
``slot`` is not copied again."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipelinerl_sdk.contracts import lend
from pipelinerl_sdk.errors import GroupError
from pipelinerl_sdk.weights.buckets import BucketPlan
from pipelinerl_sdk.weights.group import GroupConfig, WeightSyncGroup, listen_socket
from pipelinerl_sdk.weights.publisher import free_port
from pipelinerl_sdk.weights.receive import StagedWeights, WeightReceiver
from pipelinerl_sdk.weights.send import SendOrderError, SendStats, WeightSender
from pipelinerl_sdk.weights.tensors import flatten_params, spec_of

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float16]


def two_members(timeout_s: float = 30) -> tuple[WeightSyncGroup, WeightSyncGroup]:
    """A fresh gloo group of two members in this process: (rank 0, rank 1; rank 1 joined from a
    thread). Rank 0's store takes over a socket bound before the address is handed out."""
    listener = listen_socket("127.0.0.1", 0)
    init = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    joined: Future[WeightSyncGroup] = Future()
    config = GroupConfig(init, 1, 2, timeout_s=timeout_s)
    threading.Thread(target=lambda: joined.set_result(WeightSyncGroup(config))).start()
    first = WeightSyncGroup(GroupConfig(init, 0, 2, timeout_s=timeout_s), listener=listener)
    return first, joined.result(timeout=timeout_s)


def test_a_listener_must_be_rank_0s_and_bound_to_the_groups_port() -> None:
    listener = listen_socket("127.0.0.1", 0)
    other = free_port()
    with pytest.raises(GroupError, match=f"bound to port {listener.getsockname()[1]}.*:{other}"):
        WeightSyncGroup(GroupConfig(f"tcp://127.0.0.1:{other}", 0, 2, timeout_s=5), listener=listener)
    assert listener.fileno() == -1  # closed: the refused socket is not left bound
    listener = listen_socket("127.0.0.1", 0)
    init = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    with pytest.raises(GroupError, match="only rank 0 hosts the store; rank 1"):
        WeightSyncGroup(GroupConfig(init, 1, 2, timeout_s=5), listener=listener)
    assert listener.fileno() == -1


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[WeightSyncGroup, WeightReceiver]]:
    sender, receiver = two_members()
    yield sender, WeightReceiver(receiver)
    receiver.close()
    sender.close()


_keys = itertools.count()


def transfer(
    pair: tuple[WeightSyncGroup, WeightReceiver],
    params: list[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    how: list[str],
) -> tuple[SendStats, StagedWeights, WeightSender]:
    """One update of ``params``; ``how[i]`` is ``send``, ``lend``, ``lend-copy`` (a lent clone:
    right values, wrong place) or ``slot`` (written in the sender's slot, then sent)."""
    sender, received = start(pair, BucketPlan.build([spec_of(n, t) for n, t in params], bucket_bytes))
    for (name, tensor), mode in zip(params, how, strict=True):
        if mode == "send":
            sender.send(name, tensor)
        elif mode == "lend":
            lend(sender, name, tensor)
        elif mode == "slot":
            dst = sender.slot(name)
            dst.copy_(tensor)
            sender.send(name, dst)
        else:
            sender.lend(name, tensor.clone())
    stats = sender.finish()
    return stats, received(), sender


def start(
    pair: tuple[WeightSyncGroup, WeightReceiver], plan: BucketPlan, on_start: Callable[[], None] | None = None
) -> tuple[WeightSender, Callable[[], StagedWeights]]:
    """One update of ``plan``: rank 1 receives (a thread), the trainer's go is posted; returns the
    sender and a function that waits for what rank 1 received (and clears the decision)."""
    group, receiver = pair
    key = f"test/{next(_keys)}"
    staged: Future[StagedWeights] = Future()
    rx = threading.Thread(target=lambda: staged.set_result(receiver.receive(plan, key, decision_timeout_s=30)))
    rx.start()
    group.post_decision(key, go=True)

    def received() -> StagedWeights:
        rx.join(30)
        group.clear_decision(key)
        return staged.result(timeout=1)

    return WeightSender(group, plan, on_start=on_start), received


def model_params(sizes: list[tuple[int, torch.dtype]], seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (n, dtype) in enumerate(sizes):
        t = torch.randint(-1000, 1000, (n,), generator=g).to(dtype)
        out.append((f"layers.{i}.w", t.reshape(n, 1) if n % 2 else t))
    return out


def assert_received(params: list[tuple[str, torch.Tensor]], staged: StagedWeights) -> None:
    got = dict(staged.tensors())
    for name, tensor in params:
        assert torch.equal(got[name], tensor), name


def test_flattened_params_go_out_in_place(pair: tuple[WeightSyncGroup, WeightReceiver]) -> None:
    params = model_params([(1000, torch.float32), (33, torch.bfloat16), (4096, torch.float32), (7, torch.int64)] * 3)
    flat = flatten_params(params)
    for bucket_bytes in (64, 4096, 20_000, 1 << 20):
        stats, staged, sender = transfer(pair, params, bucket_bytes, ["lend"] * len(params))
        assert_received(params, staged)
        assert stats.in_place_buckets == stats.buckets, bucket_bytes
        assert sender.buffers is None  # nothing was packed: no bucket buffers at all
        assert stats.bytes_sent == flat.numel()


def test_separate_tensors_are_packed(pair: tuple[WeightSyncGroup, WeightReceiver]) -> None:
    params = model_params([(1000, torch.float32), (33, torch.bfloat16), (4096, torch.float32)])
    stats, staged, sender = transfer(pair, params, 1 << 20, ["lend"] * len(params))
    assert_received(params, staged)
    assert stats.in_place_buckets == 0 and sender.buffers is not None


def test_a_sent_or_misplaced_param_packs_only_its_bucket(pair: tuple[WeightSyncGroup, WeightReceiver]) -> None:
    # 4 params of 4000 B; buckets of 8192 B hold two each: [0, 1] [2, 3] [4, 5]
    params = model_params([(1000, torch.float32)] * 6)
    flatten_params(params)
    how = ["lend", "lend", "lend", "send", "lend-copy", "lend"]
    stats, staged, _ = transfer(pair, params, 8192, how)
    assert_received(params, staged)
    assert stats.buckets == 3 and stats.in_place_buckets == 1


def test_right_offsets_in_another_buffer_are_packed(pair: tuple[WeightSyncGroup, WeightReceiver]) -> None:
    """Two copies of the model, each flattened: a bucket mixing params of both has every param at
    its offset, but not in one storage; it must be packed, not read from either buffer."""
    a = model_params([(1000, torch.float32)] * 4, seed=1)
    b = model_params([(1000, torch.float32)] * 4, seed=2)
    flatten_params(a)
    flatten_params(b)
    mixed = [a[0], b[1], a[2], b[3]]
    stats, staged, _ = transfer(pair, mixed, 1 << 20, ["lend"] * 4)
    assert_received(mixed, staged)
    assert stats.buckets == 1 and stats.in_place_buckets == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.tuples(st.integers(1, 3000), st.sampled_from(DTYPES)), min_size=1, max_size=10),
    bucket_bytes=st.integers(64, 16_384),
    flattened=st.booleans(),
    data=st.data(),
)
def test_any_mix_of_send_and_lend_delivers_every_byte(
    pair: tuple[WeightSyncGroup, WeightReceiver],
    sizes: list[tuple[int, torch.dtype]],
    bucket_bytes: int,
    flattened: bool,
    data: st.DataObject,
) -> None:
    params = model_params(sizes, seed=len(sizes))
    if flattened:
        flatten_params(params)
    modes = st.sampled_from(["send", "lend", "lend-copy", "slot"])
    how = data.draw(st.lists(modes, min_size=len(params), max_size=len(params)))
    stats, staged, _ = transfer(pair, params, bucket_bytes, how)
    assert_received(params, staged)
    if flattened and all(h == "lend" for h in how):
        assert stats.in_place_buckets == stats.buckets
    if not flattened:
        # separate tensors can be in place only one per bucket, where a bucket holds one param
        assert stats.in_place_buckets <= sum(1 for h in how if h not in ("send", "slot"))


def test_a_slot_is_the_params_place_in_its_bucket_buffer(pair: tuple[WeightSyncGroup, WeightReceiver]) -> None:
    """Each slot lies in the sender's bucket buffer at its entry's offset (so ``send`` of it copies
    nothing: the buffer already holds it). Slots are handed out ahead, for every param of the
    bucket being filled and the next one (the other buffer, once its broadcast two buckets back is
    over), None beyond; a name already sent or not in the plan is refused."""
    params = model_params([(1000, torch.float32), (33, torch.bfloat16), (1500, torch.float32), (7, torch.int64)] * 3)
    plan = BucketPlan.build([spec_of(n, t) for n, t in params], 8192)
    sender, received = start(pair, plan)
    values = dict(params)
    where = {e.spec.name: (b, e) for b in plan.buckets for e in b.entries}
    places, beyond = [], []
    for bucket in plan.buckets:
        ahead = [e.spec.name for b in plan.buckets[bucket.index : bucket.index + 2] for e in b.entries]
        later = [e.spec.name for b in plan.buckets[bucket.index + 2 :] for e in b.entries]
        slots = {name: sender.slot(name) for name in ahead}  # this bucket's and the next one's
        beyond += [sender.slot(name) is None for name in later]
        for entry in bucket.entries:
            name = entry.spec.name
            dst = slots[name]
            assert dst is not None and (dst.dtype, tuple(dst.shape)) == (values[name].dtype, tuple(values[name].shape))
            dst.copy_(values[name])
            assert sender.buffers is not None
            b, e = where[name]
            places.append(dst.data_ptr() - sender.buffers[b.index % 2].data_ptr() == e.offset)
            sender.send(name, dst)
            with pytest.raises(SendOrderError, match="not a param of the plan still to send"):
                sender.slot(name)
    with pytest.raises(SendOrderError, match="not a param of the plan still to send"):
        sender.slot("no-such-param")
    stats = sender.finish()
    assert all(places) and stats.buckets == len(plan.buckets) >= 4
    assert beyond and all(beyond)
    assert_received(params, received())


@pytest.mark.parametrize("first", ["send", "lend", "slot", "slot-of-the-next-bucket"])
def test_on_start_runs_once_as_the_first_param_is_handed_over(
    pair: tuple[WeightSyncGroup, WeightReceiver], first: str
) -> None:
    """``on_start`` (where the publisher posts its ``sending`` mark) runs when the first param is
    handed over or its slot asked for, before any bucket is full, so before any broadcast; once."""
    params = model_params([(256, torch.float32)] * 6)
    plan = BucketPlan.build([spec_of(n, t) for n, t in params], 3 * 1024)  # 3 params a bucket
    calls: list[float] = []
    sender, received = start(pair, plan, on_start=lambda: calls.append(time.time()))
    assert calls == []
    name, tensor = params[0]
    if first == "send":
        sender.send(name, tensor)
    elif first == "lend":
        sender.lend(name, tensor)
    elif first == "slot":
        sender.slot(name)
    else:
        sender.slot(params[3][0])
    assert len(calls) == 1
    for i, (name, tensor) in enumerate(params):
        if first in ("send", "lend") and i == 0:
            continue
        sender.send(name, tensor)
    stats = sender.finish()
    assert len(calls) == 1 and stats.first_bucket_at is not None and calls[0] <= stats.first_bucket_at
    assert_received(params, received())


def test_flatten_params_keeps_values_objects_and_training(pair: tuple[WeightSyncGroup, WeightReceiver]) -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    ids = {n: id(p) for n, p in m.named_parameters()}
    flat = flatten_params(list(m.named_parameters()))
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n]) and id(p) == ids[n]
        assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.ones(2, 5)).sum().backward()
    opt.step()
    assert all(not torch.equal(p, before[n]) for n, p in m.named_parameters())
    # the step wrote into the flat buffer: the params are still its views
    assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in m.parameters())
    with pytest.raises(ValueError, match="at least one"):
        flatten_params([])


def test_closing_a_member_ends_a_peers_receive_at_once() -> None:
    """gloo's ``shutdown`` leaves its connections open: a peer blocked in a receive from a
    closed member waited out the group's timeout (30 s here). ``WeightSyncGroup.close`` drops
    the backend as well, so the peer's receive fails at once, naming the closed connection."""
    trainer, server = two_members()
    outcome: Future[str] = Future()

    def receive() -> None:
        try:
            server.broadcast(torch.zeros(4))  # the group works
            server.broadcast(torch.zeros(1 << 16))
            outcome.set_result("received")
        except GroupError as e:
            outcome.set_result(str(e))

    rx = threading.Thread(target=receive, daemon=True)
    rx.start()
    trainer.broadcast(torch.ones(4))
    time.sleep(0.3)  # the server is blocked in its receive
    t0 = time.perf_counter()
    trainer.close()
    message = outcome.result(timeout=60)
    took = time.perf_counter() - t0
    server.close()
    print(f"\nthe peer's receive ended {took:.2f} s after the close (group timeout 30 s): {message[:80]}")
    assert "Connection closed" in message or "Connection reset" in message, message
    assert took < 10, f"the peer's receive ended {took:.1f} s after the close"
    with pytest.raises(GroupError, match="closed"):
        trainer.broadcast(torch.ones(4))
