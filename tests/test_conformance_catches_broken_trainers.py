"""The trainer conformance checks can fail: each deliberately broken trainer of
:mod:`tests.broken_trainers` is run through the standard check that must catch it, in a child
pytest (as a user would run ``pytest conformance/test_trainer.py --backend=NAME``), and that check
must FAIL (not error, not skip) with a message naming the problem. The same selection of checks
must pass on the controls (the reference trainer, and the reference declaring bfloat16 only, so
the checks run in bfloat16 there), so the failures are the backends' and not the suite's.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SUITE = "conformance/test_trainer.py"
PLUGIN = "tests.broken_trainers"
CHILD_TIMEOUT_S = 600


def _load_plugin_module() -> ModuleType:
    """``tests/broken_trainers.py``, by path (the repository root need not be on ``sys.path`` here;
    the children get it through ``PYTHONPATH``)."""
    spec = importlib.util.spec_from_file_location("_broken_trainers_names", ROOT / "tests" / "broken_trainers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_plugin = _load_plugin_module()
#: Backend -> (the check that must fail, text its failure message must contain).
CAUGHT_BY: dict[str, tuple[str, str]] = _plugin.CAUGHT_BY
CAUGHT_BY_CROSS: dict[str, tuple[str, str]] = _plugin.CAUGHT_BY_CROSS


@dataclass(frozen=True)
class Outcome:
    """One testcase of a child run's junit XML: ``passed``, ``failed``, ``error`` or ``skipped``."""

    name: str
    status: str
    message: str


def run_suite(
    backends: Sequence[str],
    select: str | None,
    tmp_path: Path,
    *,
    suite: Sequence[str] = (SUITE,),
    extra: Sequence[str] = (),
) -> tuple[subprocess.CompletedProcess[str], list[Outcome]]:
    """``pytest SUITE --backend=B... -k SELECT`` in a child, with the broken trainers loaded as an
    extra plugin; its junit outcomes."""
    xml = tmp_path / "r.xml"
    env = {
        **os.environ,
        "PIPELINERL_EXTRA_PLUGINS": PLUGIN,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    cmd = [sys.executable, "-m", "pytest", *suite, "-p", "no:cacheprovider", "-q", f"--junitxml={xml}", *extra]
    cmd += [f"--backend={b}" for b in backends]
    if select is not None:
        cmd += ["-k", select]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert xml.is_file(), (
        f"the child wrote no junit XML (rc {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    )
    outcomes = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        status, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                status = {"failure": "failed"}.get(tag, tag)
                message = (node.get("message") or "") + "\n" + (node.text or "")
                break
        outcomes.append(Outcome(case.get("name", ""), status, message))
    return proc, outcomes


def _describe(proc: subprocess.CompletedProcess[str], outcomes: list[Outcome]) -> str:
    lines = [f"  {o.status:8} {o.name}: {o.message[:400]}" for o in outcomes]
    return f"child rc {proc.returncode}; outcomes:\n" + "\n".join(lines) + f"\n--- output tail:\n{proc.stdout[-3000:]}"


def _assert_caught(
    proc: subprocess.CompletedProcess[str], outcomes: list[Outcome], name: str, check: str, says: str
) -> None:
    # ``name`` ends the node id, or precedes a dtype parameter (``each_dtype`` checks)
    mine = [o for o in outcomes if o.name.startswith(f"{check}[") and re.search(rf"{re.escape(name)}(-\w+)?\]", o.name)]
    assert mine, f"{check} did not run for {name}: " + _describe(proc, outcomes)
    failed = [o for o in mine if o.status == "failed"]
    assert failed, f"{check} must FAIL on {name}, got {[o.status for o in mine]}: " + _describe(proc, outcomes)
    outcome = failed[0]
    assert says in outcome.message, (
        f"{check} failed on {name} without naming the problem ({says!r}): " + (outcome.message[:2000])
    )
    assert proc.returncode == 1, _describe(proc, outcomes)


@pytest.mark.parametrize("backend", sorted(CAUGHT_BY))
def test_the_check_catches_the_broken_trainer(backend: str, tmp_path: Path) -> None:
    check, says = CAUGHT_BY[backend]
    proc, outcomes = run_suite([backend], check, tmp_path)
    _assert_caught(proc, outcomes, f"trainer:{backend}", check, says)


@pytest.mark.parametrize("control", ["reference", "bf16-only"])
def test_the_same_checks_pass_on_the_controls(control: str, tmp_path: Path) -> None:
    """The reference trainer (checked in float32) and the reference declaring bfloat16 only
    (every check in bfloat16, with bfloat16 tolerances) pass every check that catches a twin."""
    checks = sorted({check for check, _ in CAUGHT_BY.values()})
    proc, outcomes = run_suite([f"trainer:{control}"], " or ".join(checks), tmp_path)
    assert sorted({o.name.split("[")[0] for o in outcomes}) == checks, _describe(proc, outcomes)
    assert all(o.status == "passed" for o in outcomes), _describe(proc, outcomes)
    assert proc.returncode == 0, _describe(proc, outcomes)


def test_the_cross_check_catches_what_only_the_loops_path_shows(tmp_path: Path) -> None:
    """A trainer whose zero-copy ``lend`` path is stale passes every trainer check; the cross
    check, which publishes through the pipeline's own ``publish_weights``, fails it, and passes
    the reference trainer on the same server."""
    (name, (check, says)), *_ = CAUGHT_BY_CROSS.items()
    backends = [f"trainer:{name}", "trainer:reference", "inference:reference"]
    proc, outcomes = run_suite(backends, check, tmp_path, suite=["conformance/test_cross.py"])
    _assert_caught(proc, outcomes, f"trainer:{name}", check, says)
    ref = [o for o in outcomes if o.name.startswith(f"{check}[") and "trainer:reference]" in o.name]
    assert [o.status for o in ref] == ["passed"], _describe(proc, outcomes)
