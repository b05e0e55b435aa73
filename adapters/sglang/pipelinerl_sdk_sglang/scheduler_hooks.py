"""Functions that run *inside SGLang's scheduler process*, next to the model.

SGLang calls a function listed in ``--custom-weight-loader`` when ``update_weights_from_tensor``
names it as its ``load_format``: ``fn(model, named_tensors)``, on the scheduler thread, inside a
weight-update session (``begin_weight_update`` .. ``end_weight_update``) and with generation
paused by the adapter. The adapter uses that door for what SGLang's distributed update lacks:

- :func:`snapshot` / :func:`restore` / :func:`discard`: an update of several buckets is loaded
  bucket by bucket (one ``update_weights_from_distributed`` call each), so a broadcast that
  fails half-way would leave the model half-updated. The adapter snapshots the parameters before
  the first bucket, restores them if any bucket fails, and discards the copy on success: a failed
  update leaves exactly the old weights serving.
- :func:`probe`: receive one flat broadcast on the weight-update group and drop it (the SDK's
  ``/probe_broadcast``), to measure the link with SGLang's own receiver.

Payloads carry no tensor data (see :func:`probe_request`): SGLang's scheduler unpickles them with
torch's shared-memory reductions, which fail (and kill the scheduler) across unrelated processes.

Nothing here is imported by the adapter's gateway process; keep it free of SDK imports except
pure-Python ones, and of state other than the snapshot.
"""

from __future__ import annotations

import time
from typing import Any

import torch

#: id(model) -> its parameters' copies (on CPU: host memory, never the accelerator's).
_SNAPSHOTS: dict[int, dict[str, torch.Tensor]] = {}
#: The last probe's receive seconds (logged; the adapter times the call itself).
LAST_PROBE_S: list[float] = []

HOOKS = ("snapshot", "restore", "discard", "probe")


def qualified(hook: str) -> str:
    """The dotted path SGLang imports for ``hook`` (the value of ``load_format``)."""
    return f"{__name__}.{hook}"


@torch.no_grad()
def snapshot(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """Copy every parameter of ``model`` to host memory (replacing an older snapshot)."""
    _SNAPSHOTS[id(model)] = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}


@torch.no_grad()
def restore(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """Copy the snapshot back into ``model``'s parameters, then drop it. Raises KeyError if no
    snapshot was taken (nothing is written then)."""
    saved = _SNAPSHOTS.pop(id(model))
    for n, p in model.named_parameters():
        p.copy_(saved[n])


def discard(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """Drop the snapshot (the update it guarded succeeded)."""
    _SNAPSHOTS.pop(id(model), None)


def probe_request(group_name: str, nbytes: int) -> list[tuple[str, torch.Tensor]]:
    """The ``named_tensors`` of a :func:`probe` call. Everything travels in the name: the tensor
    is empty because SGLang unpickles tensors with torch's shared-memory reductions, which cannot
    cross into an unrelated process (the scheduler dies on them); an empty one pickles by value."""
    return [(f"{group_name}|{nbytes}", torch.empty(0, dtype=torch.uint8))]


def probe(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """Receive one flat broadcast of the requested size from rank 0 of the named group (see
    :func:`probe_request`) and drop it."""
    from torch.distributed.distributed_c10d import _world

    ((request, _),) = named_tensors
    group_name, nbytes = request.rsplit("|", 1)
    groups = {str(name): pg for pg, name in _world.pg_names.items()}
    if group_name not in groups:
        raise RuntimeError(f"no weight-update group {group_name!r} in this SGLang process")
    device = next(model.parameters()).device
    buf = torch.empty(int(nbytes), dtype=torch.uint8, device=device)
    t0 = time.perf_counter()
    torch.distributed.broadcast(buf, src=0, group=groups[group_name])
    LAST_PROBE_S[:] = [time.perf_counter() - t0]
