"""``run_ranks`` and ``init_from_env`` with real processes and a real gloo group.

The rank functions are module-level: ``run_ranks`` pickles them by reference into spawned
interpreters (which inherit this process's ``sys.path``, so they import this module too).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipelinerl_sdk.trainer_group import (
    RankContext,
    RankError,
    RankTeardownWarning,
    RankTimeout,
    init_from_env,
    run_ranks,
)

pytestmark = pytest.mark.integration


def _whoami(ctx: RankContext, tag: str) -> dict[str, object]:
    import torch.distributed as dist

    return {
        "tag": tag,
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "dist": (dist.get_rank(), dist.get_world_size(), dist.get_backend()),
        "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")},
        "pid": os.getpid(),
    }


def _all_reduce(ctx: RankContext, base: float) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([base + ctx.rank, 10.0 * (ctx.rank + 1)])
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def _raise_on_rank_1(ctx: RankContext, _: None) -> int:
    import torch.distributed as dist

    if ctx.rank == 1:
        raise ValueError("rank one exploded on purpose")
    dist.barrier()  # rank 0 blocks in a collective with the failed rank: it must be killed
    return ctx.rank


def _hang_on_rank_1(ctx: RankContext, _: None) -> int:
    if ctx.rank == 1:
        time.sleep(600)
    return ctx.rank


def _exit_without_exception(ctx: RankContext, _: None) -> int:
    if ctx.rank == 1:
        os._exit(3)
    return ctx.rank


def _crash_after_the_result(ctx: RankContext, _: None) -> int:
    """Rank 1 returns, then aborts while its process exits (after the result file is written)."""
    from multiprocessing import util

    if ctx.rank == 1:
        util.Finalize(None, os.abort, exitpriority=0)
    return 10 + ctx.rank


def test_results_come_back_ordered_by_rank_with_torchrun_env() -> None:
    results = run_ranks(3, _whoami, "x", timeout_s=120)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert len({r["pid"] for r in results}) == 3 and os.getpid() not in {r["pid"] for r in results}
    for rank, r in enumerate(results):
        assert r["tag"] == "x" and r["world_size"] == 3
        assert r["dist"] == (rank, 3, "gloo")
        assert r["env"] == {"RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1"}


def test_all_reduce_sums_across_ranks() -> None:
    results = run_ranks(2, _all_reduce, 1.5, timeout_s=120)
    assert results == [[1.5 + 2.5, 30.0], [1.5 + 2.5, 30.0]]


def test_world_size_one() -> None:
    assert run_ranks(1, _all_reduce, 2.0, timeout_s=120) == [[2.0, 10.0]]


def test_an_exception_in_rank_1_surfaces_with_rank_message_and_traceback() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        run_ranks(2, _raise_on_rank_1, None, timeout_s=120)
    assert time.monotonic() - t0 < 60, "the blocked rank 0 was not killed promptly"
    e = err.value
    assert not isinstance(e, RankTimeout)
    assert e.rank == 1
    text = str(e)
    assert text.startswith("rank 1 of 2 failed: ValueError: rank one exploded on purpose"), text
    assert "Traceback from rank 1" in text and "_raise_on_rank_1" in text
    assert "_raise_on_rank_1" in e.remote_traceback


def test_a_rank_that_dies_without_an_exception_is_named() -> None:
    with pytest.raises(RankError) as err:
        run_ranks(2, _exit_without_exception, None, timeout_s=120)
    assert err.value.rank == 1
    assert "rank 1 of 2 failed: exited with code 3" in str(err.value)


def test_a_crash_after_the_result_keeps_the_results_and_warns() -> None:
    with pytest.warns(RankTeardownWarning, match=r"rank 1 of 2 wrote its result, then killed by SIGABRT while exiting"):
        assert run_ranks(2, _crash_after_the_result, None, timeout_s=120) == [10, 11]


def test_a_hanging_rank_is_killed_at_the_timeout() -> None:
    # The timeout counts from the start, spawn and torch import included: 30 s leaves rank 0 room
    # to finish on a loaded machine (at 10 s, rank 0 was once still starting when it fired).
    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as err:
        run_ranks(2, _hang_on_rank_1, None, timeout_s=30)
    elapsed = time.monotonic() - t0
    assert 30 <= elapsed < 60, elapsed
    assert err.value.rank == 1 and err.value.ranks == (1,)
    assert "rank 1 of 2 still running after 30 s" in str(err.value)


def test_init_from_env_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"\$RANK is not set.*torchrun"):
        init_from_env()


def test_run_ranks_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(0, _all_reduce, 1.0)
    with pytest.raises(ValueError, match="timeout_s"):
        run_ranks(1, _all_reduce, 1.0, timeout_s=0)


TORCHRUN_SCRIPT = """
import json
import torch
import torch.distributed as dist
from pipelinerl_sdk.trainer_group import init_from_env

ctx = init_from_env()
t = torch.tensor([float(ctx.rank + 1)])
dist.all_reduce(t)
print("RESULT " + json.dumps({"rank": ctx.rank, "world_size": ctx.world_size, "sum": t.item(),
                              "backend": dist.get_backend()}), flush=True)
dist.destroy_process_group()
"""


def test_same_code_runs_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(TORCHRUN_SCRIPT))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = sorted(
        # the two ranks share one stdout pipe: their lines may run together, so match each record
        (json.loads(m) for m in re.findall(r"RESULT (\{[^}]*\})", proc.stdout)),
        key=lambda r: r["rank"],
    )
    assert results == [
        {"rank": 0, "world_size": 2, "sum": 3.0, "backend": "gloo"},
        {"rank": 1, "world_size": 2, "sum": 3.0, "backend": "gloo"},
    ], proc.stdout


def test_a_group_whose_rendezvous_failed_for_a_network_reason_is_formed_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first try's gloo connect is disturbed (as another process's traffic did on a busy CI
    machine): the group is formed again and the results come back; a rendezvous failure of the
    job's own (no CUDA for nccl) and any failure in ``fn`` are raised at the first try."""
    from pipelinerl_sdk import trainer_group

    real = trainer_group._run_group
    tries: list[int] = []
    disturb = [True]

    def disturbed_once(*args: object, **kwargs: object) -> object:
        tries.append(1)
        if disturb.pop() if disturb else False:
            raise RankError(
                "rank 2 of 2 failed: RuntimeError: Gloo connectFullMesh failed with [...] Connection closed by peer",
                rank=1,
                in_rendezvous=True,
            )
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(trainer_group, "_run_group", disturbed_once)
    assert run_ranks(2, _all_reduce, 1.0, timeout_s=120) == [[1.0 + 2.0, 30.0], [1.0 + 2.0, 30.0]]
    assert len(tries) == 2

    tries.clear()
    with pytest.raises(RankError) as err:
        run_ranks(2, _raise_on_rank_1, None, timeout_s=120)
    assert len(tries) == 1 and not err.value.in_rendezvous
    import torch

    if not torch.cuda.is_available():
        tries.clear()
        with pytest.raises(RankError) as err:
            run_ranks(2, _whoami, "x", timeout_s=120, backend="nccl")
        assert len(tries) == 1 and err.value.in_rendezvous, str(err.value)
