"""``--json`` commands print one JSON object on stdout and nothing else: what engines, native code
and child processes write there goes to stderr (a DeepSpeed warning on stdout once broke a
``pipelinerl bench pipeline --json`` consumer)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

NOISY = textwrap.dedent(
    """
    import json, os, subprocess, sys
    from pipelinerl_sdk.stdout_guard import stdout_to_stderr

    with stdout_to_stderr():
        print("python print")
        os.write(1, b"native write\\n")
        subprocess.run([sys.executable, "-c", "print('child print')"], check=True)
    print(json.dumps({"ok": 1}))
    """
)


def test_only_the_result_reaches_stdout() -> None:
    proc = subprocess.run([sys.executable, "-c", NOISY], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"ok": 1}
    for noise in ("python print", "native write", "child print"):
        assert noise in proc.stderr and noise not in proc.stdout


@pytest.mark.integration
def test_bench_gather_json_is_one_object_on_stdout(tiny_model: Path) -> None:
    """DeepSpeed's ZeRO trainers print at import; the bench's stdout still parses as JSON."""
    cmd = [
        sys.executable, "-m", "pipelinerl_sdk.cli", "bench", "gather", "--trainer", "deepspeed-zero2",
        "--world-size", "1", "--model", str(tiny_model), "--updates", "1", "--bucket-mb", "1", "--json",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["config"]["trainer"] == "deepspeed-zero2"
