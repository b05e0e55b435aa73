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
- :func:`sign_rendezvous`: the next ``tcp://host:port`` rendezvous of this process (SGLang's
  ``init_weights_update_group``) goes through the SDK's
  :class:`~pipelinerl_sdk.weights.signed_store.SignedStore` under the group's secret, so that
  SGLang forms the group as the SDK's members do: every rendezvous value it writes signed, every
  value it reads verified (an outsider's address written over the trainer's is refused, naming
  its key). torch's ``tcp://`` rendezvous handler is wrapped once, in this process only, and
  wraps nothing but the one armed address.

Payloads carry no tensor data (see :func:`probe_request`): SGLang's scheduler unpickles them with
torch's shared-memory reductions, which fail (and kill the scheduler) across unrelated processes.

Nothing here is imported by the adapter's gateway process; keep it free of SDK imports except
pure-Python ones, and of state other than the snapshot and the armed rendezvous.
"""

from __future__ import annotations

import time
from typing import Any

import torch

#: id(model) -> its parameters' copies (on CPU: host memory, never the accelerator's).
_SNAPSHOTS: dict[int, dict[str, torch.Tensor]] = {}
#: The last probe's receive seconds (logged; the adapter times the call itself).
LAST_PROBE_S: list[float] = []

#: (host, port) of a ``tcp://`` rendezvous armed by :func:`sign_rendezvous` -> the group's secret.
_ARMED: dict[tuple[str, int], str] = {}
#: The signed store of the group formed last (kept alive: its backend may call back into it; an
#: older group was destroyed before a new one formed).
_SIGNED: list[Any] = []

HOOKS = ("snapshot", "restore", "discard", "probe", "sign_rendezvous")


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


def sign_rendezvous_request(init_method: str, secret: str) -> list[tuple[str, torch.Tensor]]:
    """The ``named_tensors`` of a :func:`sign_rendezvous` call (everything in the name, as for
    :func:`probe_request`): the group's ``tcp://host:port`` and its secret."""
    return [(f"{init_method}|{secret}", torch.empty(0, dtype=torch.uint8))]


def _address(url: str) -> tuple[str, int]:
    from urllib.parse import urlparse

    parsed = urlparse(url)
    if parsed.hostname is None or parsed.port is None:
        raise ValueError(f"not a tcp://host:port address: {url!r}")
    return parsed.hostname, parsed.port


def sign_rendezvous(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """Arm the next ``tcp://`` rendezvous of this process at the requested address (see
    :func:`sign_rendezvous_request`) to go through a :class:`SignedStore` under the secret; the
    arming is used once. The first call wraps torch's ``tcp://`` handler (every other address is
    left as torch makes it). Never raises: an exception in a hook ends SGLang's scheduler. A
    request it cannot read is logged and arms nothing; SGLang then joins with plain values, which
    the trainer's signed rendezvous refuses, so the group does not form."""
    import importlib
    import logging

    try:
        ((request, _),) = named_tensors
        init_method, secret = request.rsplit("|", 1)
        address = _address(init_method)
        if not secret:
            raise ValueError("the group's secret is empty")
        handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
        if not getattr(handlers["tcp"], "pipelinerl_signed", False):
            handlers["tcp"] = _signing_handler(handlers["tcp"])
        _ARMED[address] = secret
    except Exception as e:
        logging.getLogger(__name__).error("pipelinerl: could not arm a signed rendezvous: %s", e)


def _signing_handler(plain: Any) -> Any:
    """torch's ``tcp://`` rendezvous handler ``plain``, its store wrapped in a
    :class:`SignedStore` for an address armed by :func:`sign_rendezvous`."""
    from pipelinerl_sdk.weights.signed_store import SignedStore

    def handler(url: str, *args: Any, **kwargs: Any) -> Any:
        secret = _ARMED.pop(_address(url), None)
        for store, rank, world_size in plain(url, *args, **kwargs):
            if secret is not None:
                store = SignedStore(store, secret)
                _SIGNED[:] = [store]
            yield store, rank, world_size

    handler.pipelinerl_signed = True  # type: ignore[attr-defined]
    return handler
