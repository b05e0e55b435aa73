"""The README's main job (until the pipeline lands): it must keep passing its own checks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.integration
def test_demo_teaches_the_server_live(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pipelinerl_sdk.cli", "demo", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAILED" not in proc.stdout
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("demo: 8 updates"), summary
    gap = re.search(r"max server/trainer gap ([0-9.e+-]+)", summary)
    assert gap is not None and float(gap.group(1)) <= 1e-5, summary
    before, after = (float(x) for x in re.findall(r"target logprob (-?[0-9.]+) -> (-?[0-9.]+)", summary)[0])
    assert after > before + 1.0, summary
