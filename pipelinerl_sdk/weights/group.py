"""The weight-update process group: a TCPStore plus a gloo (CPU) or NCCL (GPU) group of its own.

It is never the trainer's default group: the trainer's ranks keep their own ``torch.distributed``
world, and only trainer rank 0 joins this one, as rank 0, together with every receiving worker of
every inference server. Rank 0 hosts the store.

Besides broadcasts, the store carries one small signal per update: the trainer's *decision*
(``go`` or ``abort: reason``), which receivers wait for with a timeout before they enter any
collective. A receiver that never hears ``go`` therefore never blocks in a collective, and an
update refused by one server of a fleet can be called off cleanly on all the others.
"""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipelinerl_sdk.errors import GroupError, UpdateAborted
from pipelinerl_sdk.protocol import GroupBackend, parse_init_method

_DECISION_GO = "go"


@dataclass(frozen=True, slots=True)
class GroupConfig:
    """Where and how to form the group. ``rank`` 0 hosts the store at ``init_method``."""

    init_method: str
    rank: int
    world_size: int
    backend: GroupBackend = "gloo"
    group_name: str = "pipelinerl-weights"
    timeout_s: float = 120.0


def torch_group_store(store: Any, group_name: str, backend: GroupBackend) -> Any:
    """The store view a member of ``group_name`` forms its backend on: the layout torch's own
    group helper gives a group created over ``tcp://`` with that name (``rendezvous`` store ->
    ``PrefixStore(name)`` -> ``PrefixStore(name/)`` -> ``PrefixStore(device/)``), which is what an
    engine's own "init weights update group" call builds (SGLang's ``init_custom_process_group``,
    verl, OpenRLHF). Using it here lets such an engine's workers join a group the SDK formed."""
    device = "cpu" if backend == "gloo" else "cuda"
    named = dist.PrefixStore(group_name, store)  # type: ignore[attr-defined]
    return dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", named))  # type: ignore[attr-defined]


class DecisionBoard:
    """The trainer's per-transfer decisions (``go`` / ``abort: reason``) in the group's store.

    A member whose collectives are run by an engine it does not control (SGLang's own group) uses
    :meth:`connect` to wait for decisions in its own process, before it asks the engine to enter
    a collective."""

    def __init__(self, store: Any, group_name: str) -> None:
        self._signals = dist.PrefixStore(f"{group_name}/sig", store)  # type: ignore[attr-defined]

    @classmethod
    def connect(cls, init_method: str, group_name: str, timeout_s: float) -> DecisionBoard:
        """A client of the store rank 0 hosts at ``init_method``; GroupError if unreachable."""
        host, port = parse_init_method(init_method)
        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                host, port, world_size=None, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
            )
        except Exception as e:
            raise GroupError(f"could not reach the group's store at {init_method}: {e}") from e
        return cls(store, group_name)

    def post(self, key: str, go: bool, reason: str = "") -> None:
        """Rank 0: announce whether the transfer ``key`` will happen."""
        self._signals.set(key, _DECISION_GO if go else f"abort: {reason}")

    def wait(self, key: str, timeout_s: float) -> None:
        """Receivers: wait for the decision on ``key``; return on ``go``, raise
        :class:`UpdateAborted` on an abort, :class:`GroupError` on a timeout or a lost store."""
        try:
            self._signals.wait([key], datetime.timedelta(seconds=timeout_s))
            value = self._signals.get(key)
        except Exception as e:
            raise GroupError(f"no decision for {key!r} within {timeout_s:.1f}s: {e}") from e
        if value != _DECISION_GO.encode():
            raise UpdateAborted(f"trainer called off {key!r}: {value.decode(errors='replace')}")

    def clear(self, key: str) -> None:
        try:
            self._signals.delete_key(key)
        except Exception:  # best effort: a stale key only costs a few bytes in the store
            pass


class WeightSyncGroup:
    """One member's handle on the group. Construction blocks until every rank has joined
    (bounded by ``timeout_s``); :class:`GroupError` otherwise.

    Once a collective fails, the group is *broken* (gloo and NCCL cannot resume a group after a
    failed collective): every later collective raises until a new group is formed."""

    def __init__(self, config: GroupConfig) -> None:
        if not 0 <= config.rank < config.world_size:
            raise GroupError(f"rank {config.rank} outside world of {config.world_size}")
        host, port = parse_init_method(config.init_method)
        self.config = config
        self._broken: str | None = None
        self._lock = threading.Lock()
        timeout = datetime.timedelta(seconds=config.timeout_s)
        try:
            self._store = dist.TCPStore(  # type: ignore[attr-defined]
                host,
                port,
                world_size=None,
                is_master=config.rank == 0,
                timeout=timeout,
                wait_for_workers=False,
            )
            self._decisions = DecisionBoard(self._store, config.group_name)
            prefixed = torch_group_store(self._store, config.group_name, config.backend)
            if config.backend == "gloo":
                self.device = torch.device("cpu")
                self._pg: Any = dist.ProcessGroupGloo(prefixed, config.rank, config.world_size, timeout)
            else:
                if not torch.cuda.is_available():
                    raise GroupError("backend 'nccl' needs a CUDA device; use 'gloo' on CPU")
                self.device = torch.device("cuda", torch.cuda.current_device())
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self._pg = dist.ProcessGroupNCCL(prefixed, config.rank, config.world_size, opts)
            # What torch's process-group helper does after creating the backend (a store exchange
            # led by rank 0): members that form the group through torch's API wait for it.
            self._pg._set_sequence_number_for_group()
        except GroupError:
            raise
        except Exception as e:  # torch raises RuntimeError/DistError subclasses here
            raise GroupError(
                f"could not form group {config.group_name!r} at {config.init_method} as rank "
                f"{config.rank}/{config.world_size}: {e}"
            ) from e

    # --- state ----------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def broken(self) -> str | None:
        """Why the group is unusable, or None while it is healthy."""
        return self._broken

    def mark_broken(self, reason: str) -> None:
        self._broken = self._broken or reason

    def _check(self) -> None:
        if self._broken is not None:
            raise GroupError(f"group {self.config.group_name!r} is broken ({self._broken}); form a new one")

    # --- collectives ----------------------------------------------------------------------------

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> dist.Work:
        """Start a broadcast of ``tensor`` (on :attr:`device`) from ``src``; wait on the result."""
        self._check()
        work: dist.Work = self._pg.broadcast(tensor, src)
        return work

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for ``work``; on failure mark the group broken and raise GroupError."""
        try:
            work.wait()
        except Exception as e:
            self.mark_broken(f"{what} failed: {e}")
            raise GroupError(f"{what} failed: {e}") from e

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, what: str = "broadcast") -> None:
        self.wait(self.broadcast_async(tensor, src), what)

    # --- decisions (through the store; never blocks in a collective) ----------------------------

    def post_decision(self, key: str, go: bool, reason: str = "") -> None:
        """Rank 0: announce whether the transfer ``key`` will happen."""
        self._decisions.post(key, go, reason)

    def await_decision(self, key: str, timeout_s: float) -> None:
        """Receivers: see :meth:`DecisionBoard.wait`."""
        self._decisions.wait(key, timeout_s)

    def clear_decision(self, key: str) -> None:
        self._decisions.clear(key)

    def close(self) -> None:
        """Release the group. Safe to call twice."""
        self.mark_broken("closed")
        pg = getattr(self, "_pg", None)
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:
                pass
