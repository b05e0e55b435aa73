"""One failing conformance check is reported once: the next check starts from a server that holds
the mirror's weights again, and the failure's report shows the server's log.

Runs a child pytest against a real reference server with two checks written here: the first moves
the mirror's weights without publishing them and fails; the second compares the server's
logprobs with the mirror's, which only holds if the plugin re-synced the server in between.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CHECKS = """
import asyncio

from pipelinerl_sdk.conformance.inference import check_against_mirror, greedy


def test_a_fails_after_moving_the_mirror(server_under_test, mirror):
    mirror.perturb(seed=123)  # never published: the server no longer holds the mirror's weights
    assert False, "deliberate failure"


def test_b_sees_the_mirrors_weights(server_under_test, mirror):
    async def body():
        async with server_under_test.client() as client:
            check_against_mirror(await greedy(client, prompt_logprobs=False), mirror, prompt=False)

    asyncio.run(body())
"""


def test_a_failed_check_does_not_fail_the_next(tmp_path: Path) -> None:
    (tmp_path / "test_checks.py").write_text(textwrap.dedent(CHECKS))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--backend=reference", "test_checks.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert "1 failed, 1 passed" in out, out[-4000:]
    assert "FAILED test_checks.py::test_a_fails_after_moving_the_mirror" in out, out[-4000:]
    assert "inference:reference server log, last lines" in out, out[-4000:]
