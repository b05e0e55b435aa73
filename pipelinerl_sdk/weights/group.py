"""The weight-update process group: a TCPStore plus a gloo (CPU) or NCCL (GPU) group of its own.

It is never the trainer's default group: the trainer's ranks keep their own ``torch.distributed``
world, and only trainer rank 0 joins this one, as rank 0, together with every receiving worker of
every inference server. Rank 0 hosts the store.

Besides broadcasts, the store carries one small signal per update: the trainer's *decision*
(``go`` or ``abort: reason``), which receivers wait for with a timeout before they enter any
collective. A receiver that never hears ``go`` therefore never blocks in a collective, and an
update refused by one server of a fleet can be called off cleanly on all the others.

The store has no authentication of its own: rank 0 binds it to the address asked for (not every
interface), and the group's secret (:mod:`pipelinerl_sdk.weights.auth`) namespaces its keys and
signs every decision; a receiver ignores (and logs) a decision not signed with it. Where every
member forms through this module, every rendezvous value is signed too
(:mod:`pipelinerl_sdk.weights.signed_store`): nobody without the secret can take a member's place.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipelinerl_sdk.errors import DecisionTimeout, GroupError, UpdateAborted
from pipelinerl_sdk.protocol import GroupBackend, InitProcessGroupRequest, parse_init_method
from pipelinerl_sdk.weights.auth import group_id, read_decision, sign_decision, store_name
from pipelinerl_sdk.weights.signed_store import SignedStore

log = logging.getLogger("pipelinerl_sdk.weights.group")
#: How often a receiver re-reads a decision key that holds a value not signed with the secret.
FORGED_POLL_S = 0.02


@dataclass(frozen=True, slots=True)
class GroupConfig:
    """Where and how to form the group. ``rank`` 0 hosts the store at ``init_method``."""

    init_method: str
    rank: int
    world_size: int
    backend: GroupBackend = "gloo"
    group_name: str = "pipelinerl-weights"
    timeout_s: float = 120.0
    #: The group's secret (:mod:`~pipelinerl_sdk.weights.auth`); "" only for in-process use: with
    #: it empty, anyone who reaches the store can forge decisions.
    secret: str = field(default="", repr=False)
    #: Every rendezvous value signed with ``secret`` (:mod:`~pipelinerl_sdk.weights.signed_store`):
    #: only when every member forms through this class (``ServerInfo.signed_rendezvous``).
    signed: bool = False

    @property
    def group_id(self) -> str:
        return group_id(self.secret)

    @property
    def store_name(self) -> str:
        """The name the group's keys live under in the store (see ``auth.store_name``)."""
        return store_name(self.group_name, self.secret)

    @classmethod
    def joining(cls, req: InitProcessGroupRequest, rank: int) -> GroupConfig:
        """The config of a server's worker joining, at ``rank`` (``req.rank_offset`` plus the
        worker's index in its server), the group the ``/init_process_group`` body ``req`` names."""
        return cls(
            req.init_method,
            rank,
            req.world_size,
            req.backend,
            req.group_name,
            req.timeout_s,
            req.group_secret,
            req.signed_rendezvous,
        )

    def invitation(self, rank_offset: int) -> InitProcessGroupRequest:
        """The ``/init_process_group`` body that invites a server whose workers take the ranks
        from ``rank_offset`` on into this group (its inverse is :meth:`joining`)."""
        return InitProcessGroupRequest(
            init_method=self.init_method,
            rank_offset=rank_offset,
            world_size=self.world_size,
            backend=self.backend,
            group_name=self.group_name,
            timeout_s=self.timeout_s,
            group_secret=self.secret,
            signed_rendezvous=self.signed,
        )


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
    """The trainer's per-transfer decisions (``go`` / ``abort: reason``) in the group's store,
    each signed with the group's secret (:func:`~pipelinerl_sdk.weights.auth.sign_decision`).

    ``name`` is the group's store name (:attr:`GroupConfig.store_name`). A member whose
    collectives are run by an engine it does not control (SGLang's own group) uses
    :meth:`connect` to wait for decisions in its own process, before it asks the engine to enter
    a collective."""

    def __init__(self, store: Any, name: str, secret: str = "") -> None:
        self._store, self._prefix = store, f"{name}/sig"
        self._signals = dist.PrefixStore(self._prefix, store)  # type: ignore[attr-defined]
        self._secret = secret
        self._lock = threading.Lock()
        self._waiting: str | None = None  # the key a receiver waits on, until it has its decision
        self._cancelled: str | None = None

    @classmethod
    def connect(cls, init_method: str, name: str, timeout_s: float, secret: str = "") -> DecisionBoard:
        """A client of the store rank 0 hosts at ``init_method``; GroupError if unreachable."""
        host, port = parse_init_method(init_method)
        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                host, port, world_size=None, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
            )
        except Exception as e:
            raise GroupError(f"could not reach the group's store at {init_method}: {e}") from e
        return cls(store, name, secret)

    def post(self, key: str, go: bool, reason: str = "") -> None:
        """Rank 0: announce whether the transfer ``key`` will happen."""
        self._signals.set(key, sign_decision(self._secret, key, go, reason))

    def wait(self, key: str, timeout_s: float) -> None:
        """Receivers: wait for the trainer's signed decision on ``key``; return on ``go``, raise
        :class:`UpdateAborted` on an abort, :class:`DecisionTimeout` when none came in time,
        :class:`GroupError` on a lost store. A
        value not signed with the group's secret is logged and ignored: the wait goes on for the
        real decision. :meth:`cancel_wait` ends it with UpdateAborted."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._waiting, self._cancelled = key, None
        try:
            self._signals.wait([key], datetime.timedelta(seconds=timeout_s))
            value = self._signals.get(key)
            decision = read_decision(self._secret, key, value)
            if decision is None and self._cancelled is None:
                log.warning("ignored a decision for %r not signed by the trainer: %.80r", key, value)
            while decision is None and self._cancelled is None and time.monotonic() < deadline:
                time.sleep(FORGED_POLL_S)
                if self._signals.check([key]):
                    decision = read_decision(self._secret, key, self._signals.get(key))
        except Exception as e:
            if self._cancelled is None:
                timed_out = time.monotonic() >= deadline - 0.5  # the wait ran out, not a lost store
                kind = DecisionTimeout if timed_out else GroupError
                raise kind(f"no decision for {key!r} within {timeout_s:.1f}s: {e}") from e
        finally:
            with self._lock:
                self._waiting = None
                cancelled = self._cancelled
        if cancelled is not None:
            raise UpdateAborted(f"{key!r} cancelled while waiting for the trainer's decision: {cancelled}")
        if decision is None:
            raise DecisionTimeout(f"no decision signed by the trainer for {key!r} within {timeout_s:.1f}s")
        go, reason = decision
        if not go:
            raise UpdateAborted(f"trainer called off {key!r}: abort: {reason}")

    def cancel_wait(self, reason: str) -> bool:
        """End a :meth:`wait` that has no decision yet (it raises UpdateAborted naming ``reason``);
        False if no wait is pending (none, or its decision already arrived)."""
        with self._lock:
            key = self._waiting
            if key is None:
                return False
            self._cancelled = reason
        # Wake the waiter with an unsigned value (no receiver acts on it), over a connection of its
        # own: the waiter's holds the client's lock until its wait ends. A lost store ends the
        # wait by itself.
        threading.Thread(target=self._wake, args=(key,), name="pipelinerl-cancel-wait", daemon=True).start()
        return True

    def _wake(self, key: str) -> None:
        try:
            client = dist.TCPStore(  # type: ignore[attr-defined]
                self._store.host, self._store.port, world_size=None, is_master=False,
                timeout=datetime.timedelta(seconds=10),
            )  # fmt: skip
            dist.PrefixStore(self._prefix, client).set(key, "cancelled by the receiver")  # type: ignore[attr-defined]
        except Exception:
            pass

    def clear(self, key: str) -> None:
        try:
            self._signals.delete_key(key)
        except Exception:  # best effort: a stale key only costs a few bytes in the store
            pass


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` only (the store's own listener takes every interface);
    GroupError naming the address if it cannot bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise GroupError(f"cannot bind the group's store to {host}:{port}: {e.strerror}") from e
    return sock


class WeightSyncGroup:
    """One member's handle on the group. Construction blocks until every rank has joined
    (bounded by ``timeout_s``); :class:`GroupError` otherwise.

    Once a collective fails, the group is *broken* (gloo and NCCL cannot resume a group after a
    failed collective): every later collective raises until a new group is formed.

    Rank 0 may pass ``listener``, a socket :func:`listen_socket` bound already (to the port of
    ``config.init_method``): a port chosen by binding to 0 is then held from the choice on, and no
    other process can take it before the store does. The group takes the socket over."""

    def __init__(self, config: GroupConfig, *, listener: socket.socket | None = None) -> None:
        if not 0 <= config.rank < config.world_size:
            raise GroupError(f"rank {config.rank} outside world of {config.world_size}")
        host, port = parse_init_method(config.init_method)
        self.config = config
        self._broken: str | None = None
        self._lock = threading.Lock()
        timeout = datetime.timedelta(seconds=config.timeout_s)
        # Rank 0 listens where asked (the store's own listener would take every interface); the
        # store owns the socket from here on and closes it.
        if listener is not None and config.rank != 0:
            listener.close()
            raise GroupError(f"only rank 0 hosts the store; rank {config.rank} was given a listener")
        if listener is not None and listener.getsockname()[1] != port:
            bound = listener.getsockname()[1]
            listener.close()
            raise GroupError(f"the listener is bound to port {bound}, the group's address is {config.init_method}")
        if config.rank == 0:
            listen_fd: int | None = (listener or listen_socket(host, port)).detach()
        else:
            listen_fd = None
        try:
            self._store = dist.TCPStore(  # type: ignore[attr-defined]
                host,
                port,
                world_size=None,
                is_master=config.rank == 0,
                timeout=timeout,
                wait_for_workers=False,
                master_listen_fd=listen_fd,
            )
            self._decisions = DecisionBoard(self._store, config.store_name, config.secret)
            # the backend's rendezvous over a view that signs and verifies every value (kept: the
            # backend calls back into it)
            self._rendezvous = SignedStore(self._store, config.secret) if config.signed else self._store
            prefixed = torch_group_store(self._rendezvous, config.store_name, config.backend)
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
    def group_id(self) -> str:
        """The id every update for this group names (see ``auth.group_id``)."""
        return self.config.group_id

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

    def cancel_decision_wait(self, reason: str) -> bool:
        """Receivers: see :meth:`DecisionBoard.cancel_wait`."""
        return self._decisions.cancel_wait(reason)

    def close(self) -> None:
        """Release the group: its connections to the other members are closed, so a member
        still blocked in a collective with this one fails at once ("Connection closed by peer")
        instead of at its own timeout. Safe to call twice."""
        self.mark_broken("closed")
        pg = getattr(self, "_pg", None)
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:
                pass
            # gloo's shutdown leaves its pairs' sockets open (a peer blocked in a receive from
            # this member waited out its timeout: 29.7 s of 30 in a test); they close when the
            # backend is destroyed, which dropping the only reference to it does.
            self._pg = None
