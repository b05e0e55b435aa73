"""The shims TorchTitan 0.3.0 (released against torch 2.14 and CUDA) needs on the CPU build of torch 2.13.

Applied by :func:`apply` before the first ``torchtitan`` import, and only where they are needed: each shim
checks the condition it works around and does nothing otherwise (a CUDA machine with triton gets none).
``tests/test_torchtitan_adapter.py`` (beside this package) holds one test per shim that fails when the shim
stops working *or* becomes unnecessary (a later torchtitan or torch that no longer needs it), so this module
only shrinks.

1. ``triton_kernels``: ``torchtitan.models.common`` imports the MinimalAsyncEP kernels module at load
   time, and that module imports ``triton`` (CUDA-only here). Without triton we install a stand-in
   module whose kernels raise ``NotImplementedError``; expert parallelism is the only user.
2. ``cpu_device``: ``torchtitan.tools.utils.device_type`` is ``_get_available_device_type() or "cuda"``,
   so on a machine without an accelerator every mesh TorchTitan builds (``ParallelDims.build_mesh``)
   asks for CUDA. With no accelerator we point it (and the modules that imported it by value) at
   ``"cpu"`` / ``torch.cpu``.

What is *not* a shim (it is configuration, see ``trainer.py``): SDPA inner attention (flex attention has
no CPU backward), ``spmd_backend="partial_dtensor"``, and FSDP's plain-SUM gradient reduction (gloo has
no PREMUL_SUM).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable, Iterable
from typing import NoReturn

__all__ = ["KERNELS_MODULE", "KERNEL_NAMES", "SHIMS", "applied", "apply", "needs_cpu_device", "needs_triton_stub"]

#: The triton-only module ``torchtitan.models.common`` imports at load time, and the names it takes from it.
KERNELS_MODULE = "torchtitan.distributed.minimal_async_ep.kernels"
KERNEL_NAMES = (
    "copy_full_counts_to_peers_kernel",
    "copy_rows_to_peers_kernel",
    "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel",
    "fill_dispatch_metadata_kernel",
    "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel",
    "topk_scores_grad_kernel",
)
#: Modules that bound ``device_type`` / ``device_module`` from ``torchtitan.tools.utils`` at import.
_DEVICE_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.components.metrics",
    "torchtitan.models.common.token_dispatcher",
    "torchtitan.tools.profiler",
)

SHIMS = ("triton_kernels", "cpu_device")
_applied: set[str] = set()


def needs_triton_stub() -> bool:
    """True when triton cannot be imported (then TorchTitan's model package cannot be either)."""
    return importlib.util.find_spec("triton") is None


def needs_cpu_device() -> bool:
    """True when torch sees no accelerator (TorchTitan would then default to ``"cuda"``)."""
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is None  # type: ignore[no-untyped-call]


def applied() -> frozenset[str]:
    """Names of the shims :func:`apply` installed in this process."""
    return frozenset(_applied)


def _unavailable(name: str) -> Callable[..., NoReturn]:
    def kernel(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(f"{name}: MinimalAsyncEP kernels need triton (CUDA); stubbed by cpu_shims")

    kernel.__name__ = name
    return kernel


def _stub_triton_kernels() -> None:
    stub = types.ModuleType(KERNELS_MODULE, "Stand-in for a triton-only module (pipelinerl_sdk_torchtitan.cpu_shims).")
    for name in KERNEL_NAMES:
        setattr(stub, name, _unavailable(name))
    sys.modules[KERNELS_MODULE] = stub


def _force_cpu_device() -> None:
    import torch

    for name in _DEVICE_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            setattr(module, "device_type", "cpu")  # noqa: B010 - a module global TorchTitan reads
        if hasattr(module, "device_module"):
            setattr(module, "device_module", torch.cpu)  # noqa: B010


def apply(names: Iterable[str] = SHIMS) -> frozenset[str]:
    """Install the shims among ``names`` that this machine needs (idempotent; ``triton_kernels`` must
    come before anything imports ``torchtitan.models``); returns the names of those in place."""
    wanted = set(names)
    unknown = wanted - set(SHIMS)
    if unknown:
        raise ValueError(f"unknown shims {sorted(unknown)} (known: {list(SHIMS)})")
    if "triton_kernels" in wanted and "triton_kernels" not in _applied and needs_triton_stub():
        _stub_triton_kernels()
        _applied.add("triton_kernels")
    if "cpu_device" in wanted and "cpu_device" not in _applied and needs_cpu_device():
        _force_cpu_device()
        _applied.add("cpu_device")
    return applied()
