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
- :func:`apply_floor`: SGLang's own apply of an update's tensors with no transfer, timed in the
  scheduler (the SDK's ``/bench/apply_floor``): what one update's session does to the model
  (``restore_weights_before_loading``, ``model.load_weights`` of every param under its HF name,
  ``postprocess_weights``), the served weights copied aside before and back after.
- :func:`serve_staged` / :func:`apply_staged`: the ``staged`` receive mode. The first starts a
  :class:`~pipelinerl_sdk_sglang.staged_receiver.StagedReceiver` (a thread of this process that
  receives an update on SGLang's group while the scheduler keeps generating); the second loads
  what it received with ``model.load_weights``, in the update's session, generation paused.
- :func:`sign_rendezvous`: the next ``tcp://host:port`` rendezvous of this process (SGLang's
  ``init_weights_update_group``) goes through the SDK's
  :class:`~pipelinerl_sdk.weights.signed_store.SignedStore` under the group's secret, so that
  SGLang forms the group as the SDK's members do: every rendezvous value it writes signed, every
  value it reads verified (an outsider's address written over the trainer's is refused, naming
  its key). torch's ``tcp://`` rendezvous handler is wrapped once, in this process only, and
  wraps nothing but the one armed address.

How a hook is called (:func:`hook_request`, what the gateway sends): its arguments and the path
its result goes to travel in the one name of ``named_tensors``; the tensor is empty, because
SGLang unpickles tensors with torch's shared-memory reductions, which fail (and kill the
scheduler) across unrelated processes. A hook never raises: SGLang does not catch an exception
of a custom loader, and one ends its scheduler, hence the whole server (seen: a probe whose
trainer went away would have taken SGLang down). Each hook writes ``{"ok": true, ...}`` or
``{"error": "..."}`` as JSON to the result path plus ``.RANK`` (the scheduler's rank in SGLang's
default group), which the gateway reads once the call returned.

Nothing here is imported by the adapter's gateway process except :func:`hook_request`,
:func:`qualified` and :data:`HOOKS`; keep it free of SDK imports except pure-Python ones, and of
state other than the snapshot and the armed rendezvous.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

#: id(model) -> its parameters' copies (on CPU: host memory, never the accelerator's).
_SNAPSHOTS: dict[int, dict[str, torch.Tensor]] = {}
#: (host, port) of a ``tcp://`` rendezvous armed by :func:`sign_rendezvous` -> the group's secret.
_ARMED: dict[tuple[str, int], str] = {}
#: The signed store of the group formed last (kept alive: its backend may call back into it; an
#: older group was destroyed before a new one formed).
_SIGNED: list[Any] = []

#: The probe's receive buffer on CPU, kept across probes of the same size.
_PROBE: dict[str, torch.Tensor] = {}
#: This scheduler's staged receivers (:mod:`.staged_receiver`), by socket path: one, in practice.
_STAGED: dict[str, Any] = {}

HOOKS = ("snapshot", "restore", "discard", "probe", "sign_rendezvous", "apply_floor", "serve_staged", "apply_staged")


def qualified(hook: str) -> str:
    """The dotted path SGLang imports for ``hook`` (the value of ``load_format``)."""
    return f"{__name__}.{hook}"


def hook_request(args: str, result_path: str) -> list[tuple[str, torch.Tensor]]:
    """The ``named_tensors`` of a hook call: its ``args`` (``|``-separated fields, see each hook)
    and where its result goes, all in the name."""
    return [(f"{args}|{result_path}", torch.empty(0, dtype=torch.uint8))]


def _hook(fn: Callable[[torch.nn.Module, list[str]], dict[str, Any]]) -> Callable[[torch.nn.Module, Any], None]:
    """A scheduler hook from ``fn(model, args) -> result``: never raises (see the module doc);
    the result, or the error, written for the gateway."""

    @functools.wraps(fn)
    def hook(model: torch.nn.Module, named_tensors: Any) -> None:
        try:
            ((request, _),) = named_tensors
            *args, result_path = str(request).split("|")
        except Exception as e:  # no path to answer on: the gateway reports the missing result
            log.error("pipelinerl: unreadable %s request: %s", fn.__name__, e)
            return
        try:
            with torch.no_grad():
                result: dict[str, Any] = {"ok": True, **fn(model, args)}
        except Exception as e:
            log.error("pipelinerl: %s failed: %s: %s", fn.__name__, type(e).__name__, e)
            result = {"error": f"{type(e).__name__}: {e}"}
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        try:
            Path(f"{result_path}.{rank}").write_text(json.dumps(result))
        except Exception as e:
            log.error("pipelinerl: could not write the result of %s: %s", fn.__name__, e)

    return hook


@_hook
def snapshot(model: torch.nn.Module, args: list[str]) -> dict[str, Any]:
    """Copy every parameter of ``model`` to host memory (replacing an older snapshot)."""
    _SNAPSHOTS[id(model)] = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    return {}


@_hook
def restore(model: torch.nn.Module, args: list[str]) -> dict[str, Any]:
    """Copy the snapshot back into ``model``'s parameters, then drop it. An error (KeyError) if
    no snapshot was taken (nothing is written then)."""
    saved = _SNAPSHOTS.pop(id(model))
    for n, p in model.named_parameters():
        p.copy_(saved[n])
    return {}


@_hook
def discard(model: torch.nn.Module, args: list[str]) -> dict[str, Any]:
    """Drop the snapshot (the update it guarded succeeded)."""
    _SNAPSHOTS.pop(id(model), None)
    return {}


@_hook
def probe(model: torch.nn.Module, args: list[str]) -> dict[str, Any]:
    """Receive one flat broadcast from rank 0 of a group and drop it. Args: the group's name, the
    bytes. Result: ``seconds`` of the receive."""
    from torch.distributed.distributed_c10d import _world

    group_name, nbytes = args
    groups = {str(name): pg for pg, name in _world.pg_names.items()}
    if group_name not in groups:
        raise RuntimeError(f"no weight-update group {group_name!r} in this SGLang process")
    device = next(model.parameters()).device
    buf = _PROBE.get("buffer")
    if buf is None or buf.numel() != int(nbytes) or buf.device != device:
        _PROBE.clear()  # the old one freed first
        buf = torch.empty(int(nbytes), dtype=torch.uint8, device=device)
        if device.type == "cpu":  # kept in host memory: a fresh buffer's first-touch page faults
            _PROBE["buffer"] = buf  # would inflate the baseline (a staged receive reuses its
            # buffer; on an accelerator torch's caching allocator hands back the same block)
    t0 = time.perf_counter()
    torch.distributed.broadcast(buf, src=0, group=groups[group_name])
    return {"seconds": time.perf_counter() - t0}


@_hook
def apply_floor(model: torch.nn.Module, args: list[str]) -> dict[str, Any]:
    """Apply the model's checkpoint (its ``*.safetensors``, read first: the same names, shapes
    and bytes an update of the served dtype carries) ``repeats`` times as one update's session
    applies it, each apply timed alone; the served weights are copied aside first and back at
    the end (bit-identical). Args: the model directory, the repeats. Result: ``seconds`` of each
    apply. Runs inside a weight-update session (the state ``begin_weight_update`` left),
    generation held; leaves that state."""
    from safetensors.torch import load_file
    from sglang.srt.model_loader.loader import DefaultModelLoader

    model_dir, repeats = args
    device = next(model.parameters()).device
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors")
    checkpoint: dict[str, torch.Tensor] = {}
    for f in files:
        checkpoint.update(load_file(str(f), device=str(device)))
    served = {n: p.detach().clone() for n, p in model.named_parameters()}  # in the session's format
    seconds = []
    try:
        DefaultModelLoader.postprocess_weights(model, device)  # as served, as an update starts
        for _ in range(int(repeats)):
            t0 = time.perf_counter()
            DefaultModelLoader.restore_weights_before_loading(model, device)  # begin_weight_update
            model.load_weights(iter(checkpoint.items()))  # type: ignore[operator]
            DefaultModelLoader.postprocess_weights(model, device)  # end_weight_update
            seconds.append(time.perf_counter() - t0)
    finally:
        DefaultModelLoader.restore_weights_before_loading(model, device)
        for n, p in model.named_parameters():
            p.copy_(served[n])
    return {"seconds": seconds}


@_hook
def serve_staged(model: torch.nn.Module, args: list[str]) -> dict[str, Any]:
    """Start this scheduler's staged receiver on the UNIX socket ``PATH.RANK`` (once per path: a
    second call finds it running). Args: the socket path's stem. Result: the ``path`` bound."""
    from pipelinerl_sdk_sglang.staged_receiver import StagedReceiver

    (stem,) = args
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    path = f"{stem}.{rank}"
    if path not in _STAGED:
        _STAGED[path] = StagedReceiver(path, next(model.parameters()).device)
    return {"path": path}


@_hook
def apply_staged(model: torch.nn.Module, args: list[str]) -> dict[str, Any]:
    """Load the last staged receive into ``model`` (``model.load_weights`` of every param under
    its HF name: SGLang's own loader, which fuses QKV and gate/up as at start-up), inside the
    update's session. Args: the socket path's stem. Result: ``start`` and ``end`` of the load
    (``time.time()``). An error if nothing was received since the last apply (the model is then
    untouched)."""
    (stem,) = args
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    receiver = _STAGED.get(f"{stem}.{rank}")
    if receiver is None:
        raise RuntimeError("no staged receiver in this scheduler: serve_staged was not called")
    tensors = receiver.take()
    start = time.time()
    model.load_weights(iter(tensors))  # type: ignore[operator]
    return {"start": start, "end": time.time()}


def _address(url: str) -> tuple[str, int]:
    from urllib.parse import urlparse

    parsed = urlparse(url)
    if parsed.hostname is None or parsed.port is None:
        raise ValueError(f"not a tcp://host:port address: {url!r}")
    return parsed.hostname, parsed.port


@_hook
def sign_rendezvous(model: torch.nn.Module, args: list[str]) -> dict[str, Any]:
    """Arm the next ``tcp://`` rendezvous of this process at an address to go through a
    :class:`SignedStore` under a secret; the arming is used once. Args: the group's
    ``tcp://host:port``, its secret. The first call wraps torch's ``tcp://`` handler (every other
    address is left as torch makes it). Should it fail, SGLang joins with plain values, which the
    trainer's signed rendezvous refuses: the group does not form."""
    import importlib

    init_method, secret = args
    address = _address(init_method)
    if not secret:
        raise ValueError("the group's secret is empty")
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    if not getattr(handlers["tcp"], "pipelinerl_signed", False):
        handlers["tcp"] = _signing_handler(handlers["tcp"])
    _ARMED[address] = secret
    return {}


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
