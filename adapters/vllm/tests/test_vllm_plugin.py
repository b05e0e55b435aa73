"""The mend the adapter's vLLM plugin applies (``pipelinerl_sdk_vllm.vllm_plugin``): a seeded
request's CPU generator is rewound by its state, not by vLLM's Philox offset.

Each test here fails once the mend is no longer needed (a vLLM or torch release that makes it
pointless), so it is removed rather than kept forever; that it works is checked on a real server
by ``test_a_seeded_request_with_a_split_prefill_hurts_no_other`` in ``test_vllm_adapter.py``.
Run in the environment scripts/setup-vllm prints; skipped elsewhere.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("pipelinerl_sdk_vllm") is None,
    reason="vLLM or the vLLM adapter is not installed here: run in the env scripts/setup-vllm prints",
)

#: vLLM 0.32's rewind of a discarded draw (``GPUModelRunner._bookkeeping_sync``).
OFFSET_REWIND = "gen.set_offset(gen.get_offset() - 4)"


def test_cpu_generator_mend_is_still_needed() -> None:
    """vLLM still rewinds a discarded draw by the generator's offset, and a CPU generator still
    has none (reading the source, without importing vLLM's model runner here)."""
    from pipelinerl_sdk_vllm.vllm_plugin import RUNNER_MODULE

    spec = importlib.util.find_spec(RUNNER_MODULE)
    assert spec is not None and spec.origin is not None
    assert OFFSET_REWIND in Path(spec.origin).read_text(), (
        f"vLLM's model runner no longer rewinds a generator with {OFFSET_REWIND!r}: the CPU generator mend in "
        "pipelinerl_sdk_vllm/vllm_plugin.py may no longer be needed; check and remove it"
    )
    try:
        torch.Generator("cpu").get_offset()
    except RuntimeError as e:
        assert "does not use offset" in str(e)
    else:
        raise AssertionError(
            "a CPU torch.Generator has an offset now: vLLM's own rewind works on it, remove the CPU generator mend "
            "in pipelinerl_sdk_vllm/vllm_plugin.py"
        )


def test_the_mend_is_in_place_once_vllm_loads_its_model_runner() -> None:
    """In a fresh process, as in vLLM's engine processes: the plugin registered first, the model
    runner imported later is mended (once, however often the plugin is registered)."""
    code = (
        "import sys\n"
        "from pipelinerl_sdk_vllm import vllm_plugin as p\n"
        "p.register(); p.register()\n"
        "assert p.RUNNER_MODULE not in sys.modules\n"
        "from vllm.v1.worker.cpu_model_runner import CPUModelRunner\n"
        "assert getattr(CPUModelRunner, p.MENDED)\n"
        "assert CPUModelRunner._sample.__wrapped__.__module__ == p.RUNNER_MODULE\n"
        "assert CPUModelRunner._bookkeeping_sync.__wrapped__.__module__ == p.RUNNER_MODULE\n"
        "p.register()\n"
        "assert CPUModelRunner._sample.__wrapped__.__module__ == p.RUNNER_MODULE\n"
        "assert not any(isinstance(f, p._MendOnImport) for f in sys.meta_path)\n"
        "print('mended')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "mended" in r.stdout, r.stderr[-3000:]
