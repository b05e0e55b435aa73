"""Order independence: every inference check gives the same verdict in a random order on one
(updated) server and alone on a fresh server.

Two child runs of the reference backend's inference and stateful checks:

- shuffled (``--conformance-shuffle=SEED``, seed ``$PIPELINERL_SHUFFLE_SEED`` or 1): one server
  for the module, checks in a random order, so most checks start on a server some other check
  already updated (several times);
- alone (``--conformance-fresh-server``): every check on a server of its own, at version 0.

Both must pass every check (the reference backend is correct), none skipped: a check that skips,
or passes only after another, fails here. Cost bound: the alone run starts one server per check
(~5-15 s each), so it leaves out the one check that reads nothing but the version from the
server and runs 30-70 s, ``test_requests_in_flight_survive_updates`` (its timing is calibrated on
the server it finds), and the state machine (it starts from whatever ``/info`` reports); both run
in the shuffled run and in the ordered CI run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SEED = int(os.environ.get("PIPELINERL_SHUFFLE_SEED", "1"))
CHILD_TIMEOUT_S = 900
SLOW_AND_STATELESS = "test_requests_in_flight_survive_updates"


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[tuple[str, str]]]:
    """(the child, its testcases in execution order as (name, status))."""
    xml = tmp_path / "r.xml"
    cmd = [
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={xml}",
        "--backend=inference:reference", *args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert xml.is_file(), f"no junit XML (rc {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    cases = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        status = next((t for t in ("failure", "error", "skipped") if case.find(t) is not None), "passed")
        cases.append((case.get("name", ""), status))
    return proc, cases


def _collected(*args: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--collect-only",
         "--backend=inference:reference", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return [line.split("::")[-1] for line in proc.stdout.splitlines() if "::" in line]


def test_shuffled_on_one_server_every_check_passes(tmp_path: Path) -> None:
    files = ["conformance/test_inference.py", "conformance/test_stateful.py"]
    ordered = _collected(*files)
    proc, cases = _run(tmp_path, *files, f"--conformance-shuffle={SEED}")
    names = [n for n, _ in cases]
    assert sorted(names) == sorted(ordered), proc.stdout[-3000:]
    assert names != ordered, f"seed {SEED} did not change the order"
    bad = [(n, s) for n, s in cases if s != "passed"]
    assert not bad and proc.returncode == 0, f"seed {SEED}: {bad}\n{proc.stdout[-5000:]}"


def test_alone_on_a_fresh_server_every_check_passes(tmp_path: Path) -> None:
    proc, cases = _run(
        tmp_path, "conformance/test_inference.py", "--conformance-fresh-server", "-k", f"not {SLOW_AND_STATELESS}"
    )
    assert len(cases) >= 15, proc.stdout[-3000:]
    bad = [(n, s) for n, s in cases if s != "passed"]
    assert not bad and proc.returncode == 0, f"{bad}\n{proc.stdout[-5000:]}"
