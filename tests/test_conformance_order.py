"""Order independence: every inference check gives the same verdict in a random order on one
(updated) server and alone on a fresh server.

Two child runs of the reference backend's inference and stateful checks:

- shuffled (``--conformance-shuffle=SEED``, seed ``$PIPELINERL_SHUFFLE_SEED`` or 1): one server
  for the module, checks in a random order, so most checks start on a server some other check
  already updated (several times);
- alone (``--conformance-fresh-server``): every check on a server of its own, at version 0.

Both must pass every check (the reference backend is correct), none skipped: a check that skips,
or passes only after another, fails here. Cost bound: the alone run starts one server per check
(~5-15 s each), so it leaves out the two checks that read nothing but the version from the
server and run 30-70 s, ``test_requests_in_flight_survive_updates`` (its timing is calibrated on
the server it finds) and ``test_streamed_version_tags_are_true`` (it times the server it finds),
and the state machine (it starts from whatever ``/info`` reports); they run in the shuffled run
and in the ordered CI run; so do the update checks' runs through vLLM's door. Both children start
when the module does and run side by side (each spends most of its time starting servers).
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SEED = int(os.environ.get("PIPELINERL_SHUFFLE_SEED", "1"))
CHILD_TIMEOUT_S = 900
SLOW_AND_STATELESS = "test_requests_in_flight_survive_updates or test_streamed_version_tags_are_true"


class _Child:
    """A child pytest of the reference backend's checks, started now; :meth:`result` waits."""

    def __init__(self, workdir: Path, *args: str) -> None:
        self.xml, self._log = workdir / "r.xml", workdir / "out.txt"
        cmd = [
            sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={self.xml}",
            "--backend=inference:reference", *args,
        ]  # fmt: skip
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def result(self) -> tuple[subprocess.CompletedProcess[str], list[tuple[str, str]]]:
        """(the child, its testcases in execution order as (name, status))."""
        try:
            rc = self._proc.wait(CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
            rc = -9
        out = self._log.read_text(errors="replace")
        proc = subprocess.CompletedProcess(self._proc.args, rc, out, "")
        assert self.xml.is_file(), f"no junit XML (rc {rc}):\n{out[-6000:]}"
        cases = []
        for case in ET.parse(self.xml).getroot().iter("testcase"):
            status = next((t for t in ("failure", "error", "skipped") if case.find(t) is not None), "passed")
            cases.append((case.get("name", ""), status))
        return proc, cases

    def cancel(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


FILES = ["conformance/test_inference.py", "conformance/test_stateful.py"]
#: The update checks' runs through vLLM's door (``-vllm_rl``) are the same checks through another
#: client: their order independence is the shuffled run's to show (a fresh server each costs
#: about a minute in all).
ALONE = [
    "conformance/test_inference.py", "--conformance-fresh-server", "-k", f"not ({SLOW_AND_STATELESS} or vllm_rl)",
]  # fmt: skip


@pytest.fixture(scope="module")
def children(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, _Child]]:
    """The shuffled and the alone runs, started together."""
    runs = {
        "shuffled": _Child(tmp_path_factory.mktemp("shuffled"), *FILES, f"--conformance-shuffle={SEED}"),
        "alone": _Child(tmp_path_factory.mktemp("alone"), *ALONE),
    }
    yield runs
    for child in runs.values():
        child.cancel()


def _collected(*args: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--collect-only",
         "--backend=inference:reference", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return [line.split("::")[-1] for line in proc.stdout.splitlines() if "::" in line]


def test_shuffled_on_one_server_every_check_passes(children: dict[str, _Child]) -> None:
    ordered = _collected(*FILES)
    proc, cases = children["shuffled"].result()
    names = [n for n, _ in cases]
    assert sorted(names) == sorted(ordered), proc.stdout[-3000:]
    assert names != ordered, f"seed {SEED} did not change the order"
    bad = [(n, s) for n, s in cases if s != "passed"]
    assert not bad and proc.returncode == 0, f"seed {SEED}: {bad}\n{proc.stdout[-5000:]}"


def test_alone_on_a_fresh_server_every_check_passes(children: dict[str, _Child]) -> None:
    proc, cases = children["alone"].result()
    assert len(cases) >= 15, proc.stdout[-3000:]
    bad = [(n, s) for n, s in cases if s != "passed"]
    assert not bad and proc.returncode == 0, f"{bad}\n{proc.stdout[-5000:]}"
