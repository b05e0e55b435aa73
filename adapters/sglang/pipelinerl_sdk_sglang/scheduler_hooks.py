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


def probe(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """Receive one flat broadcast from rank 0 of the group named by the one tensor's name
    (``"<group name>"``; the tensor holds the byte count) and drop it."""
    from torch.distributed.distributed_c10d import _world

    ((group_name, count),) = named_tensors
    groups = {str(name): pg for pg, name in _world.pg_names.items()}
    if group_name not in groups:
        raise RuntimeError(f"no weight-update group {group_name!r} in this SGLang process")
    pg = groups[group_name]
    device = next(model.parameters()).device
    buf = torch.empty(int(count.reshape(-1)[0].item()), dtype=torch.uint8, device=device)
    t0 = time.perf_counter()
    torch.distributed.broadcast(buf, src=0, group=pg)
    LAST_PROBE_S[:] = [time.perf_counter() - t0]
