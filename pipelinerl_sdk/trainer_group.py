"""Launch a trainer group (one process per rank) from Python, or join one started by ``torchrun``.

Two ways in, one code path: :func:`run_ranks` spawns ``world_size`` fresh interpreters, sets in each
the variables ``torchrun`` sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) and calls :func:`init_from_env`, exactly what a script launched
by ``torchrun`` calls itself. So a rank function behaves the same under either launcher::

    def train(ctx: RankContext, spec: TrainerSpec) -> float:  # module-level: it is pickled
        trainer = ReferenceTrainer()
        trainer.init(spec)
        ...
        return trainer.step().grad_norm

    norms = run_ranks(2, train, spec)  # [rank 0's result, rank 1's result]

The group is the *trainer's* default ``torch.distributed`` group (gloo on CPU from
:func:`run_ranks`), never the weight-sync group of :mod:`pipelinerl_sdk.weights.group`.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from pipelinerl_sdk.errors import PipelineRLError

log = logging.getLogger(__name__)

__all__ = ["RankContext", "RankError", "RankTeardownWarning", "RankTimeout", "init_from_env", "run_ranks"]

A = TypeVar("A")
R = TypeVar("R")

DistBackend = Literal["gloo", "nccl"]
#: Tries of a group whose rendezvous failed for a network reason (:data:`TRANSIENT_RENDEZVOUS`),
#: as torchrun's agent restarts a group: every rank is connected (a barrier) before any runs ``fn``.
RENDEZVOUS_ATTEMPTS = 3
#: What a rendezvous failure of the network's says (gloo's full-mesh connect to a peer whose
#: connection another process on the machine disturbed; a port taken).
TRANSIENT_RENDEZVOUS = (
    "DistNetworkError",
    "connectFullMesh failed",
    "Connection closed by peer",
    "Connection reset by peer",
    "EADDRINUSE",
)
_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, slots=True)
class RankContext:
    """Where the calling process stands in its trainer group: ``0 <= rank < world_size``."""

    rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        """Rank 0: the rank that talks to inference servers and returns gathered weights."""
        return self.rank == 0


class RankError(PipelineRLError):
    """A rank of a :func:`run_ranks` group failed. ``rank`` names it; ``remote_traceback`` is its
    formatted Python traceback (empty when it died without one, e.g. killed by a signal);
    ``others`` describes further ranks that failed afterwards (usually because a peer was gone);
    ``in_rendezvous``: it failed while the group formed, before any rank ran ``fn``."""

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        remote_traceback: str = "",
        others: tuple[str, ...] = (),
        in_rendezvous: bool = False,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.others = others
        self.in_rendezvous = in_rendezvous


class RankTeardownWarning(RuntimeWarning):
    """A rank crashed after writing its result (see :func:`run_ranks`)."""


class RankTimeout(RankError):
    """A rank was still running at the deadline; every rank of the group was killed.
    ``rank`` is the lowest such rank and ``ranks`` all of them."""

    def __init__(self, message: str, *, ranks: tuple[int, ...]) -> None:
        super().__init__(message, rank=ranks[0])
        self.ranks = ranks


def _env_int(name: str) -> int:
    raw = os.environ.get(name)
    if raw is None:
        raise RuntimeError(
            f"init_from_env: ${name} is not set (need {', '.join('$' + v for v in _ENV_VARS)}); "
            "launch this script with `torchrun` / `python -m torch.distributed.run`, or from Python with run_ranks()"
        )
    try:
        return int(raw)
    except ValueError:
        raise RuntimeError(f"init_from_env: ${name}={raw!r} is not an integer") from None


def init_from_env(backend: DistBackend | None = None, *, timeout_s: float = 300.0) -> RankContext:
    """Initialise the default ``torch.distributed`` process group from the environment that
    ``torchrun`` (or :func:`run_ranks`) sets, and return this process's :class:`RankContext`.

    Contract:
    - reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (all required: a
      RuntimeError naming the missing one and the remedy otherwise) and ``LOCAL_RANK``;
    - ``backend`` defaults to ``nccl`` when CUDA is available, else ``gloo``; with ``nccl`` the
      process's CUDA device is set to ``LOCAL_RANK`` first;
    - blocks until every rank joined, at most ``timeout_s`` (then torch raises);
    - idempotent: if the default group already exists it is kept (its rank and size must match the
      environment, else RuntimeError), so a library may call this defensively.
    The caller owns the group: destroy it with ``torch.distributed.destroy_process_group()``
    (:func:`run_ranks` does so for its ranks).
    """
    import torch
    import torch.distributed as dist

    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            _env_int(name)  # raises the uniform message
    if not 0 <= rank < world_size:
        raise RuntimeError(f"init_from_env: RANK={rank} outside WORLD_SIZE={world_size}")
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise RuntimeError(
                f"init_from_env: a default group (rank {dist.get_rank()} of {dist.get_world_size()}) already "
                f"exists but the environment says rank {rank} of {world_size}"
            )
        return RankContext(rank, world_size)
    chosen: DistBackend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if chosen == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend=chosen,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return RankContext(rank, world_size)


@dataclass(frozen=True, slots=True)
class _Job(Generic[A, R]):
    fn: Callable[[RankContext, A], R]
    arg: A
    world_size: int
    master_port: int
    backend: DistBackend
    outdir: str
    init_timeout_s: float


def _rank_main(rank: int, job: _Job[Any, Any]) -> None:
    """Body of one spawned rank: torchrun's environment, the group, ``fn``, the result file.

    A result goes to ``rank<r>.ok`` (pickled), a failure to ``rank<r>.err`` (JSON: time, type,
    message, traceback), each written to a temporary name first and renamed, so the parent never
    reads half a file."""
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(job.master_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(job.world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(job.world_size),
            # as under torchrun: the launcher hosts the store, every rank is a client of it
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    )
    out = Path(job.outdir)
    failed = False
    try:
        import torch.distributed as dist

        phase = "rendezvous"
        try:
            ctx = init_from_env(job.backend, timeout_s=job.init_timeout_s)
            if job.world_size > 1:
                dist.barrier()  # no rank runs fn before every rank is connected
            phase = "fn"
            result = job.fn(ctx, job.arg)
            payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as e:
            # Record it before the group goes away: destroying it makes the peers fail too, and
            # the parent names the rank whose failure was recorded first.
            failed = True
            _write_error(out, rank, e, phase=phase)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException as e:
        if not failed:
            failed = True
            _write_error(out, rank, e)
    if failed:
        raise SystemExit(1)
    _write_atomic(out / f"rank{rank}.ok", payload)


def _write_error(out: Path, rank: int, e: BaseException, *, phase: str = "fn") -> None:
    report = {
        "time": time.time(),
        "type": type(e).__name__,
        "message": str(e),
        "traceback": traceback.format_exc(),
        "phase": phase,
    }
    _write_atomic(out / f"rank{rank}.err", json.dumps(report).encode())


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _read_error(outdir: Path, rank: int) -> dict[str, Any] | None:
    path = outdir / f"rank{rank}.err"
    if not path.is_file():
        return None
    report: dict[str, Any] = json.loads(path.read_text())
    return report


def _exit_description(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def run_ranks(
    world_size: int,
    fn: Callable[[RankContext, A], R],
    arg: A,
    *,
    timeout_s: float = 300.0,
    backend: DistBackend = "gloo",
) -> list[R]:
    """Run ``fn(ctx, arg)`` on ``world_size`` fresh processes forming one trainer group; return
    the results ordered by rank.

    Contract:
    - processes are started with ``torch.multiprocessing``'s ``spawn`` method: ``fn`` must be a
      module-level function (pickled by reference) and ``arg`` and every result picklable; the
      parent's ``sys.path`` and environment are inherited;
    - each rank gets torchrun's environment (``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``, ``RANK``,
      ``WORLD_SIZE``, ``LOCAL_RANK``, ``TORCHELASTIC_USE_AGENT_STORE``): as torchrun's agent, this
      process hosts the group's store, on a port the system picked and held from then on (so no
      other process can take it between the choice and the bind); the default group is initialised by
      :func:`init_from_env` with ``backend`` before ``fn`` runs, and destroyed after it returns or
      raises;
    - an exception in any rank raises :class:`RankError` here, naming the rank that failed first
      and carrying its traceback; the other ranks are killed at once (they could be blocked in a
      collective with the dead one), and their later failures are listed in ``others``;
    - a rank that exits without a Python exception (a signal, ``os._exit``) is a RankError too,
      unless it had written its result: a crash after that (in teardown at interpreter exit, e.g.
      a native library's thread destroyed while joinable) loses nothing, so the results are
      returned and a :class:`RankTeardownWarning` names the rank and how it ended;
    - after ``timeout_s`` (from the start, process start-up included) every rank still running is
      killed and :class:`RankTimeout` names them;
    - every rank is connected (a barrier after the group's init) before any runs ``fn``; a group
      whose rendezvous failed for a network reason (:data:`TRANSIENT_RENDEZVOUS`: on a busy
      machine another process's traffic can close a gloo peer's connection) is formed again with
      fresh ranks and a fresh store, up to :data:`RENDEZVOUS_ATTEMPTS` tries within ``timeout_s``
      (logged), as torchrun's agent restarts a group; any other failure raises at once;
    - on return or raise no process of the group is left running.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    deadline = time.monotonic() + timeout_s
    for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
        try:
            return _run_group(world_size, fn, arg, timeout_s=timeout_s, deadline=deadline, backend=backend)
        except RankError as e:
            if not (e.in_rendezvous and _transient(e)) or attempt == RENDEZVOUS_ATTEMPTS:
                raise
            if time.monotonic() >= deadline:
                raise
            log.warning("trainer group of %d: its rendezvous failed (attempt %d), forming it again: %s",
                        world_size, attempt, str(e).split("\n", 1)[0])  # fmt: skip
    raise AssertionError("unreachable")


def _transient(e: RankError) -> bool:
    """A rendezvous failure of the network's (a peer's connection closed or reset, a port taken),
    not of the job's (a backend this machine lacks)."""
    first = str(e).split("\n", 1)[0]
    return any(m in first for m in TRANSIENT_RENDEZVOUS)


def _run_group(
    world_size: int,
    fn: Callable[[RankContext, A], R],
    arg: A,
    *,
    timeout_s: float,
    deadline: float,
    backend: DistBackend,
) -> list[R]:
    """One try of :func:`run_ranks`: a fresh store and fresh ranks, up to ``deadline``."""
    import torch.distributed as dist
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip
    outdir = Path(tempfile.mkdtemp(prefix="pipelinerl-ranks-"))
    job: _Job[A, R] = _Job(fn, arg, world_size, store.port, backend, str(outdir), init_timeout_s=timeout_s)
    procs = [
        ctx.Process(target=_rank_main, args=(rank, job), name=f"rank{rank}", daemon=False) for rank in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        pending: dict[Any, int] = {p.sentinel: rank for rank, p in enumerate(procs)}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                hung = tuple(sorted(pending.values()))
                _kill_all(procs)
                raise RankTimeout(
                    f"rank{'s' if len(hung) > 1 else ''} {', '.join(map(str, hung))} of {world_size} still running "
                    f"after {timeout_s:g} s; killed the group",
                    ranks=hung,
                )
            for sentinel in wait(list(pending), timeout=min(left, 1.0)):
                rank = pending.pop(sentinel)
                procs[rank].join()
                if not (outdir / f"rank{rank}.ok").is_file():
                    error = _failure(outdir, procs, world_size)  # before the kill: only ranks that failed by themselves
                    _kill_all(procs)
                    raise error
                if procs[rank].exitcode != 0:
                    how = _exit_description(procs[rank].exitcode)
                    message = f"rank {rank} of {world_size} wrote its result, then {how} while exiting; result kept"
                    warnings.warn(RankTeardownWarning(message), stacklevel=3)
        return [pickle.loads((outdir / f"rank{rank}.ok").read_bytes()) for rank in range(world_size)]
    finally:
        _kill_all(procs)
        shutil.rmtree(outdir, ignore_errors=True)
        del store  # the listener closes with the last reference


def _kill_all(procs: list[Any]) -> None:
    """SIGTERM, a short grace, then SIGKILL every started rank still alive; reap them all."""
    alive = [p for p in procs if p.pid is not None and p.is_alive()]
    for p in alive:
        p.terminate()
    grace = time.monotonic() + 3.0
    for p in alive:
        p.join(timeout=max(0.0, grace - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join(timeout=10)


def _failure(outdir: Path, procs: list[Any], world_size: int) -> RankError:
    """The error for a failed group: the earliest Python exception (by the time the rank recorded
    it) is the cause; ranks that died without one come after every rank that raised."""
    reports: list[tuple[float, int, str, str, str]] = []
    for rank, p in enumerate(procs):
        err = _read_error(outdir, rank)
        if err is not None:
            summary = f"{err['type']}: {err['message']}"
            phase = str(err.get("phase", "fn"))
            reports.append((float(err["time"]), rank, summary, str(err["traceback"]), phase))
        elif p.exitcode not in (0, None) and not (outdir / f"rank{rank}.ok").is_file():
            how = f"{_exit_description(p.exitcode)} without a Python exception"
            reports.append((float("inf"), rank, how, "", "unknown"))
    if not reports:  # exit code 0 but no result: cannot happen unless the result file vanished
        return RankError(f"a rank of {world_size} ended without a result", rank=-1)
    reports.sort()
    _, rank, summary, tb, phase = reports[0]
    others = tuple(f"rank {r}: {s}" for _, r, s, _, _ in reports[1:])
    message = f"rank {rank} of {world_size} failed: {summary}"
    if tb:
        message += f"\n\nTraceback from rank {rank}:\n{tb.rstrip()}"
    if others:
        message += "\n\nthen: " + "; ".join(others)
    return RankError(message, rank=rank, remote_traceback=tb, others=others, in_rendezvous=phase == "rendezvous")
