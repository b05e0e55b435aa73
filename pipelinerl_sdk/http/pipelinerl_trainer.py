"""PipelineRL's trainer protocol, served: ``POST /receive_weight_update`` over a group joined at launch.

PipelineRL's trainer (``pipelinerl/finetune_loop.py``, ServiceNow/PipelineRL 58d3934) updates the
vLLM servers it launched with ``--weight-update-group-init-method tcp://HOST:PORT
--weight-update-group-world-size W --actor-llm-idx I``:

- at launch, the trainer (rank 0) hosts a TCPStore at HOST:PORT and every server's GPU workers join
  as ranks ``1 + I * G + g`` (``G`` GPUs per server; here ``--weight-update-group-local-ranks``);
- each update, it posts ``{"kind": "weight_update_request", "version": V, "parameters_info":
  [{"name", "shape", "dtype": "torch.bfloat16"}, ...], "timestamp": T}`` to every server without
  waiting, broadcasts every parameter in that order (one broadcast each, in its dtype), then waits
  for every server's ``200 {"status": "ok"}``.

Served here as a relay onto the SDK's own update path: this process joins PipelineRL's group and
forwards each parameter, as it arrives, to its own engine through a
:class:`~pipelinerl_sdk.weights.publisher.WeightPublisher` (a loopback group with its own server,
formed on the first update). The update is then the contract's: validated before anything is
applied (a refused update still reads PipelineRL's broadcast to its end, so its trainer never
blocks), received in flight in the server's default mode, every token tagged with the version
that computed it, the old weights kept on any failure. The price is a second transfer of every
parameter, on this machine.

Data plane: gloo (``ProcessGroupGloo`` over ``PrefixStore(GLOO_PREFIX, store)``), on any machine.
PipelineRL's own trainer broadcasts with vLLM's ``PyNcclCommunicator`` (NCCL, CUDA only), which this
relay does not speak yet: its trainer code runs against this route only with its data plane
replaced by gloo (what ``tests/test_pipelinerl_trainer_protocol.py`` replays).
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipelinerl_sdk.errors import FanOutError, GroupError, PipelineRLError, ServerError, UpdateRejected
from pipelinerl_sdk.protocol import ParamSpec, parse_init_method

__all__ = [
    "GLOO_PREFIX",
    "ParameterInfo",
    "PipelineRLGroup",
    "PipelineRLGroupConfig",
    "PipelineRLTrainerBridge",
    "ReceiveWeightUpdateRequest",
    "source_allowed",
    "torch_dtype",
]

#: The store prefix of the gloo group (a trainer replaying PipelineRL's sequence on CPU forms
#: ``ProcessGroupGloo(PrefixStore(GLOO_PREFIX, store), 0, W)``).
GLOO_PREFIX = "pipelinerl-gloo"
#: Seconds between tries to join PipelineRL's group (its trainer may start long after a server).
JOIN_RETRY_S = 1.0


class ParameterInfo(BaseModel):
    """PipelineRL's ``ParameterInfo``: one parameter of the broadcast, in broadcast order."""

    name: Annotated[str, Field(min_length=1, max_length=1024)]
    shape: list[Annotated[int, Field(ge=0)]]
    #: ``str(tensor.dtype)``: ``torch.bfloat16`` (the prefix is optional here).
    dtype: str

    @field_validator("dtype")
    @classmethod
    def _known(cls, v: str) -> str:
        torch_dtype(v)
        return v


class ReceiveWeightUpdateRequest(BaseModel):
    """PipelineRL's ``WeightUpdateRequest`` (fields it may add later are ignored)."""

    model_config = ConfigDict(extra="ignore")

    kind: Literal["weight_update_request"] = "weight_update_request"
    version: Annotated[int, Field(ge=0)]
    parameters_info: Annotated[list[ParameterInfo], Field(min_length=1)]
    timestamp: float | None = None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype ``name`` (``torch.bfloat16`` or ``bfloat16``); ValueError otherwise."""
    attr = name.removeprefix("torch.")
    dtype = getattr(torch, attr, None) if attr.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


@dataclass(frozen=True, slots=True)
class PipelineRLGroupConfig:
    """Where this server joins PipelineRL's weight-update group (PipelineRL's launch flags)."""

    init_method: str
    world_size: int
    actor_idx: int = 0
    #: Ranks this server takes (PipelineRL's GPUs per LLM): ``1 + actor_idx * local_ranks + g``.
    local_ranks: int = 1
    #: How long the join and each broadcast may wait (PipelineRL's store waits 300 s).
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        parse_init_method(self.init_method)
        if self.local_ranks < 1:
            raise ValueError(f"local_ranks must be at least 1, got {self.local_ranks}")
        if self.actor_idx < 0:
            raise ValueError(f"actor_idx must be at least 0, got {self.actor_idx}")
        if self.ranks[-1] >= self.world_size:
            raise ValueError(
                f"actor_idx {self.actor_idx} with {self.local_ranks} rank(s) each takes ranks {self.ranks}, "
                f"past the world size {self.world_size}"
            )

    @property
    def ranks(self) -> list[int]:
        first = 1 + self.actor_idx * self.local_ranks
        return list(range(first, first + self.local_ranks))


class PipelineRLGroup:
    """This server's ranks in PipelineRL's group, joined in background threads from construction
    (the trainer forms its side when it starts; a server serves meanwhile)."""

    def __init__(self, config: PipelineRLGroupConfig) -> None:
        self.config = config
        self._pgs: dict[int, Any] = {}
        self._stores: list[Any] = []
        #: Why the last try to join failed (it is tried again until it works).
        self.last_error: str | None = None
        self._broken: str | None = None
        self._joined = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        threads = [threading.Thread(target=self._join, args=(r,), daemon=True) for r in config.ranks]
        self._waiter = threading.Thread(target=self._wait_all, args=(threads,), daemon=True)
        for t in threads:
            t.start()
        self._waiter.start()

    def _join(self, rank: int) -> None:
        """Join as ``rank``, trying again (every :data:`JOIN_RETRY_S`) until it works or the group
        is closed: a trainer that starts after the store's timeout is still joined."""
        host, port = parse_init_method(self.config.init_method)
        timeout = datetime.timedelta(seconds=self.config.timeout_s)
        while not self._closed.is_set():
            try:
                store = dist.TCPStore(  # type: ignore[attr-defined]
                    host, port, world_size=self.config.world_size, is_master=False, timeout=timeout
                )
                prefixed = dist.PrefixStore(GLOO_PREFIX, store)  # type: ignore[attr-defined]
                pg = dist.ProcessGroupGloo(prefixed, rank, self.config.world_size, timeout)
            except Exception as e:
                self.last_error = f"{type(e).__name__}: {e}"
                self._closed.wait(JOIN_RETRY_S)
                continue
            with self._lock:
                self._stores.append(store)
                self._pgs[rank] = pg
            return

    def _wait_all(self, threads: Sequence[threading.Thread]) -> None:
        for t in threads:
            t.join()
        if not self._closed.is_set():
            self._joined.set()

    @property
    def joined(self) -> bool:
        """Every rank joined (and the group is not broken)."""
        return self._joined.is_set() and self._broken is None

    def ready(self, timeout_s: float) -> None:
        """Wait until every rank has joined; GroupError naming the init method (and the last
        failure to join) if it has not after ``timeout_s``, or the group broke since."""
        where = f"PipelineRL's weight-update group at {self.config.init_method} (ranks {self.config.ranks})"
        if not self._joined.wait(timeout_s):
            why = f"; last try: {self.last_error}" if self.last_error else ""
            raise GroupError(f"{where}: not joined after {timeout_s:.0f} s (has the trainer started?){why}")
        if self._broken is not None:
            raise GroupError(f"{where}: broken ({self._broken}); restart the server and the trainer")

    def receive(self, infos: Sequence[ParameterInfo]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each parameter of ``infos`` as rank 0 broadcasts it, in order (every local rank takes
        part; the first one's copy is yielded). A failed broadcast breaks the group: GroupError."""
        pgs = [self._pgs[r] for r in self.config.ranks]
        for info in infos:
            dtype, shape = torch_dtype(info.dtype), tuple(info.shape)
            bufs = [torch.empty(shape, dtype=dtype) for _ in pgs]
            try:
                works = [pg.broadcast(buf, 0) for pg, buf in zip(pgs, bufs, strict=True)]
                for w in works:
                    w.wait()
            except Exception as e:
                self._broken = f"the broadcast of {info.name!r} failed: {e}"
                raise GroupError(f"PipelineRL's weight-update group: {self._broken}") from e
            yield info.name, bufs[0]

    def close(self) -> None:
        self._closed.set()
        for pg in self._pgs.values():
            try:
                pg.shutdown()
            except Exception:  # a group already gone
                pass
        self._pgs.clear()
        self._stores.clear()


def source_allowed(config: PipelineRLGroupConfig, client_host: str | None) -> bool:
    """PipelineRL's trainer sends no token: ``/receive_weight_update`` answers loopback and the
    trainer's host (the init method's, as it resolves) only."""
    if client_host is None:
        return False
    try:
        if ipaddress.ip_address(client_host).is_loopback:
            return True
    except ValueError:
        return False
    host, _ = parse_init_method(config.init_method)
    return client_host == host or client_host in _addresses(host)


def _addresses(host: str) -> set[str]:
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return set()


@dataclass
class PipelineRLTrainerBridge:
    """Serves ``/receive_weight_update`` for one server (see the module doc). ``control_token``:
    the server's, for the loopback publisher (which asks the server's default receive mode)."""

    config: PipelineRLGroupConfig
    control_token: str
    timeout_s: float = 300.0
    group: PipelineRLGroup = field(init=False)
    _publisher: Any = field(default=None, init=False)
    _client: Any = field(default=None, init=False)
    _busy: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.group = PipelineRLGroup(self.config)

    def allowed_source(self, client_host: str | None) -> bool:
        """See :func:`source_allowed`."""
        return source_allowed(self.config, client_host)

    async def receive(self, req: ReceiveWeightUpdateRequest, own_url: str) -> dict[str, Any]:
        """Relay one update (``own_url``: this server, for the loopback publisher). Raises
        UpdateRejected (the server's 4xx, naming PipelineRL's field) for a refused update, after
        reading the broadcast to its end; GroupError (502) when PipelineRL's group is not there."""
        if self._busy:
            raise UpdateRejected(
                "an update from PipelineRL's trainer is already being received", status=409, field="version"
            )
        self._busy = True
        try:
            await asyncio.to_thread(self.group.ready, self.timeout_s)
            return await self._relay(req, own_url)
        finally:
            self._busy = False

    async def _publisher_for(self, own_url: str, *, fresh: bool = False) -> Any:
        """The loopback publisher, formed on first use (again when ``fresh`` or broken)."""
        from pipelinerl_sdk.http.client import InferenceClient
        from pipelinerl_sdk.weights.publisher import WeightPublisher

        if self._client is None:
            self._client = InferenceClient(own_url, control_token=self.control_token, timeout_s=self.timeout_s)
        if fresh or self._publisher is None or self._publisher.group is None or self._publisher.group.broken:
            if self._publisher is not None:
                await self._publisher.close()
            publisher = WeightPublisher([self._client], timeout_s=self.timeout_s)
            await publisher.connect()
            self._publisher = publisher
        return self._publisher

    async def _relay(self, req: ReceiveWeightUpdateRequest, own_url: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        infos = req.parameters_info
        reader = _Reader(self.group, infos)
        try:
            publisher = await self._publisher_for(own_url)
            served = {p.name: p for p in (await self._client.info()).params}
            unknown = next((i for i, p in enumerate(infos) if p.name not in served), None)
            if unknown is not None:
                raise UpdateRejected(
                    f"{infos[unknown].name!r} is not a parameter this server serves",
                    status=422,
                    field=f"parameters_info[{unknown}].name",
                )
            specs = [ParamSpec(name=p.name, dtype=served[p.name].dtype, shape=tuple(p.shape)) for p in infos]
            dtypes = [torch_dtype(s.dtype) for s in specs]
            try:
                async with publisher.update(req.version, specs) as sink:
                    await asyncio.to_thread(reader.forward, sink, dtypes)
            except FanOutError as e:
                if reader.started or not _group_replaced(e):
                    raise
                # another trainer joined this server to its own group since: form ours again
                publisher = await self._publisher_for(own_url, fresh=True)
                async with publisher.update(req.version, specs) as sink:
                    await asyncio.to_thread(reader.forward, sink, dtypes)
        except BaseException as e:
            # PipelineRL's trainer broadcasts every parameter whatever this server answers: what
            # is left of it is read (and dropped), or that trainer would block for ever.
            if self.group.joined:
                await asyncio.to_thread(reader.drain)
            if isinstance(e, FanOutError):
                raise _as_rejected(e) from e
            raise
        return {"status": "ok", "version": req.version, "relay_s": time.perf_counter() - t0}

    async def close(self) -> None:
        if self._publisher is not None:
            await self._publisher.close()
        if self._client is not None:
            await self._client.aclose()
        await asyncio.to_thread(self.group.close)


class _Reader:
    """PipelineRL's broadcast of one update, read once: forwarded to the SDK's sender, and what
    is left drained after a failure."""

    def __init__(self, group: PipelineRLGroup, infos: Sequence[ParameterInfo]) -> None:
        self._params = group.receive(infos)
        #: Whether reading began (a refusal after it cannot be retried).
        self.started = False

    def forward(self, sink: Any, dtypes: Sequence[torch.dtype]) -> None:
        self.started = True
        for (name, tensor), dtype in zip(self._params, dtypes, strict=True):
            sink.send(name, tensor.to(dtype))

    def drain(self) -> None:
        try:
            for _ in self._params:
                pass
        except GroupError:
            pass  # broken: the trainer's side failed too


def _group_replaced(e: FanOutError) -> bool:
    """The loopback server refused because it no longer is in the publisher's group (409 on
    ``group``: another trainer's ``/init_process_group`` replaced it)."""
    return any(err.status == 409 and "group" in str(err) for err in e.errors)


def _as_rejected(e: FanOutError) -> PipelineRLError:
    """The loopback server's refusal (a 4xx) as this route's answer, its field renamed to
    PipelineRL's; any other failure as it is."""
    first: ServerError = e.errors[0]
    if first.status is None or not 400 <= first.status < 500:
        return e
    message = str(first).split(": ", 1)[-1]
    field_name = "version" if "version" in message else "parameters_info"
    return UpdateRejected(message, status=first.status, field=field_name)
