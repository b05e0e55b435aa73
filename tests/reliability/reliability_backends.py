"""What ``tests/reliability`` needs to know of each backend, and the servers its tests share (the
fixtures are in ``conftest.py``, whose doc says how the suite is run).

:data:`ENGINES` is the one table of what differs per engine: the options every server gets, the
option that bounds the sequences decoded at once, the environment. A vLLM or SGLang server takes
30-80 s to start on 2 busy CPUs, so the suite's servers are shared (:class:`Servers`, one per
session), two kinds in all:

- :data:`SHARED`: room for 64 sequences and 32 MiB bodies (the 10 MB prompt gets through to its
  400); the fuzzing, the hostile cases without limits of their own, and the load run use it;
- :data:`LIMITED`: small admission limits (1 MiB bodies, 3 requests, 3000 tokens in flight), 2
  sequences at once and a 1 s shutdown drain; the limit cases, the client that leaves, and SIGTERM
  (last: it stops it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pipelinerl_sdk.launch import ServerProcess


@dataclass(frozen=True)
class Engine:
    """How the suite starts a server of one backend."""

    #: ``--option`` values of every server of the suite.
    options: Mapping[str, object]
    #: The options that let the engine decode ``n`` sequences at once.
    batch: Callable[[int], Mapping[str, object]]
    #: Environment of the server process.
    env: Mapping[str, str] = field(default_factory=dict)
    #: Modules the backend needs in this environment (a missing one is a usage error, not a skip).
    needs: tuple[str, ...] = ()


ENGINES: dict[str, Engine] = {
    "reference": Engine({"threads": 1}, lambda n: {"max_batch_size": n}),
    "vllm": Engine(
        {},
        lambda n: {"max_num_seqs": n},
        # vLLM fails a regex that takes over 5 s to compile (its ReDoS guard); the slow-grammar
        # check's takes it 3-5 s on 2 busy cores: room to compile, or the check would measure the
        # limit. 20 s, not more: a fuzzed regex that compiles for ever must still get its 400 well
        # within the fuzz's 60 s (one run had a chat request stall past 60 s with this at 60 s; its
        # cause was not seen)
        {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_REGEX_COMPILATION_TIMEOUT_S": "20"},
        ("vllm", "pipelinerl_sdk_vllm"),
    ),
    "sglang": Engine(
        {},
        lambda n: {"sglang_args": f"--max-running-requests {n}"},
        {"TOKENIZERS_PARALLELISM": "false"},
        ("sglang", "pipelinerl_sdk_sglang"),
    ),
}


@dataclass(frozen=True)
class Kind:
    """One kind of server: how many sequences it decodes at once (None: the engine's default)
    and more ``pipelinerl serve`` flags."""

    name: str
    batch: int | None = None
    args: tuple[str, ...] = ()


SHARED = Kind("shared", batch=64, args=("--max-body-bytes", str(32 << 20)))
LIMITED = Kind(
    "limited",
    batch=2,  # a 64-sample request fills the batch for minutes: what comes after it waits
    args=(
        "--max-body-bytes", str(1 << 20), "--max-queued-requests", "3", "--max-tokens-in-flight", "3000",
        "--shutdown-timeout", "1",
    ),
)  # fmt: skip


class Servers:
    """The session's servers of backend ``name``, one per :class:`Kind`, started when first asked
    for and stopped at the end (by PID, with their engines' processes)."""

    def __init__(self, name: str, model: Path) -> None:
        self.name, self.model, self.engine = name, model, ENGINES[name]
        self.pool: dict[str, ServerProcess] = {}

    def start(self, kind: Kind, *, receive_mode: str | None = None) -> ServerProcess:
        """A new server of ``kind`` (not shared: the caller stops it)."""
        options = {**self.engine.options, **(self.engine.batch(kind.batch) if kind.batch else {})}
        t0 = time.perf_counter()
        srv = ServerProcess(
            self.name,
            self.model,
            options=options,
            env=self.engine.env,
            receive_mode=receive_mode,
            args=kind.args,
            startup_timeout_s=600,
        ).start()
        print(f"\n[{self.name}] {kind.name} server ready in {time.perf_counter() - t0:.1f} s", flush=True)
        return srv

    def get(self, kind: Kind) -> ServerProcess:
        """The shared server of ``kind`` (started now if there is none)."""
        srv = self.pool.get(kind.name)
        if srv is None:
            srv = self.pool[kind.name] = self.start(kind)
        return srv

    def take(self, kind: Kind) -> ServerProcess:
        """The shared server of ``kind`` for a test that stops it: no later test gets it (the
        caller stops it)."""
        srv = self.get(kind)
        del self.pool[kind.name]
        return srv

    def dead(self) -> list[str]:
        """Shared servers that exited, each removed from the pool: what each said last."""
        out = []
        for key, srv in list(self.pool.items()):
            if not srv.alive:
                del self.pool[key]
                tail = srv.log_tail(30)
                code = srv.stop()
                out.append(f"the shared {self.name} server {key!r} exited (code {code}):\n{tail}")
        return out

    def close(self) -> None:
        for srv in self.pool.values():
            srv.stop()
        self.pool.clear()
