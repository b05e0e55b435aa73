"""Skips are not passes: the conformance levels, the per-backend summary, ``--conformance-level``,
``--backend=KIND:NAME``, and the one capability that cannot be false."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipelinerl_sdk.conformance.levels import REQUIREMENTS, BackendReport
from pipelinerl_sdk.conformance.targets import resolve_targets
from pipelinerl_sdk.contracts import InferenceCapabilities
from pipelinerl_sdk.errors import PluginError

ROOT = Path(__file__).resolve().parents[1]


# --- kind selection -------------------------------------------------------------------------------


def _ids(values: list[str]) -> tuple[list[str], list[str]]:
    inference, trainers = resolve_targets(values)
    return [t.id for t in inference], [t.id for t in trainers]


def test_a_plain_name_selects_every_kind_it_is_registered_as() -> None:
    assert _ids(["reference"]) == (["inference:reference"], ["trainer:reference"])


def test_a_kind_prefix_selects_that_kind_only() -> None:
    assert _ids(["inference:reference"]) == (["inference:reference"], [])
    assert _ids(["trainer:reference"]) == ([], ["trainer:reference"])
    # the same backend selected twice is one target
    assert _ids(["trainer:reference", "reference"]) == (["inference:reference"], ["trainer:reference"])


def test_a_kind_prefix_with_an_unknown_name_names_the_kind() -> None:
    with pytest.raises(PluginError, match="no trainer backend named 'nope'"):
        resolve_targets(["trainer:nope"])


# --- levels ---------------------------------------------------------------------------------------


def _report(**statuses: str) -> BackendReport:
    """A report whose checks have the given outcomes: ``pass``, ``fail``, ``skip:REQUIREMENT``,
    ``skip`` (a skip with no requirement), or absent (not run)."""
    r = BackendReport("inference:x", expected=["test_a", "test_b"])
    for check, status in statuses.items():
        result = r.result(check)
        if status == "pass":
            result.passed += 1
        elif status == "fail":
            result.failed.append("call: boom")
        else:
            _, _, req = status.partition(":")
            result.skipped.append((f"does not declare {req}", REQUIREMENTS.get(req)))
    return r


def test_every_check_passed_reaches_full() -> None:
    r = _report(test_a="pass", test_b="pass")
    assert r.reached("full") and r.reached("loop") and r.level() == "full"


def test_a_skip_the_loop_does_not_need_reaches_loop_only() -> None:
    r = _report(test_a="pass", test_b="skip:receive_mode:staged")
    assert r.level() == "loop"
    text = "\n".join(r.lines())
    assert "skipped   test_b: does not declare receive_mode:staged [receive_mode:staged:" in text
    assert "loop needs it: False" in text


def test_a_skip_the_loop_needs_reaches_no_level() -> None:
    assert _report(test_a="pass", test_b="skip:in_flight_updates").level() == "none"
    assert _report(test_a="pass", test_b="skip").level() == "none"  # a skip with no declared requirement


def test_a_failed_or_missing_check_reaches_no_level() -> None:
    assert _report(test_a="pass", test_b="fail").level() == "none"
    r = _report(test_a="pass")
    assert r.level() == "none" and "  not run   test_b" in r.lines()


def test_a_partly_skipped_check_counts_its_skip() -> None:
    """One parametrization passed, the other skipped for an optional mode: loop, not full."""
    r = _report(test_a="pass", test_b="pass")
    r.result("test_b").skipped.append(("does not declare receive_mode:direct", REQUIREMENTS["receive_mode:direct"]))
    assert r.level() == "loop"
    assert any(line.startswith("  partly    test_b") for line in r.lines())


def test_per_token_versions_cannot_be_declared_false() -> None:
    with pytest.raises(ValueError, match="per_token_versions: must be True"):
        InferenceCapabilities(per_token_versions=False)


# --- the summary and --conformance-level in a real run ---------------------------------------------


@pytest.mark.integration
def test_a_trainer_without_world_size_2_reaches_loop_not_full(tmp_path: Path) -> None:
    """The trainer and cross checks on ``ws1-only`` (the reference trainer declaring
    ``max_world_size=1``, from ``tests.broken_trainers``) with the reference server as partner:
    every check that runs passes, the world-size-2 checks are skipped at collection for a
    requirement a loop does not need, so the trainer reaches ``loop``; ``--conformance-level=full``
    then fails the session (exit 1 with no failed test) and the summary says why; the partner is
    reported, not judged."""
    env = {
        **os.environ,
        "PIPELINERL_EXTRA_PLUGINS": "tests.broken_trainers",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    cmd = [
        sys.executable, "-m", "pytest", "conformance/test_trainer.py", "conformance/test_cross.py",
        "-p", "no:cacheprovider", "-q", "-rs", "--backend=trainer:ws1-only", "--backend=inference:reference",
        "--conformance-level=full",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 1, out[-4000:] + proc.stderr[-2000:]
    assert " failed" not in out.splitlines()[-1], out[-4000:]
    assert "trainer:ws1-only: level 'loop' (9 verified, 4 skipped)" in out, out[-4000:]
    assert (
        "skipped   test_world_size_2_step_equals_world_size_1: trainer:ws1-only does not declare world_size:2: "
        "max_world_size=1 [world_size:2:" in out
    ), out[-4000:]
    assert "inference:reference: level 'none'" in out and "a partner only" in out, out[-4000:]
    assert "--conformance-level=full: NOT reached by trainer:ws1-only" in out, out[-4000:]


# --- every standard check is judged, the mixins' included --------------------------------------------


def _collected(*classes: type) -> set[str]:
    """What pytest collects from ``classes``: every ``test_`` attribute, inherited ones included."""
    return {n for cls in classes for n in dir(cls) if n.startswith("test_")}


def test_the_levels_judge_every_check_pytest_collects_inherited_ones_included() -> None:
    """The sampling, generation, structured-output, version-tag and serving checks are mixins of
    ``InferenceContractTests``: the levels must count them (they once read only the class's own
    ``__dict__``, 14 of 28 inference checks)."""
    from pipelinerl_sdk.conformance.cross import CrossCheckTests
    from pipelinerl_sdk.conformance.inference import InferenceContractTests
    from pipelinerl_sdk.conformance.plugin import _standard_checks
    from pipelinerl_sdk.conformance.stateful import StatefulContractTests
    from pipelinerl_sdk.conformance.trainer import TrainerContractTests

    inference = _standard_checks("inference")
    assert set(inference) == _collected(InferenceContractTests, StatefulContractTests, CrossCheckTests)
    assert len(inference) == len(set(inference))
    for inherited in ("test_every_version_tag_is_true", "test_samples_follow_the_model_distribution",
                      "test_structured_output_follows_its_constraint", "test_control_routes_need_the_control_token",
                      "test_streamed_deltas_add_up_to_the_non_streamed_text"):  # fmt: skip
        assert inherited in inference
    assert set(_standard_checks("trainer")) == _collected(TrainerContractTests, CrossCheckTests)


@pytest.mark.parametrize("outcome", ["skip", "fail", "xfail"])
def test_an_inherited_check_not_passed_keeps_a_backend_from_full(outcome: str) -> None:
    """Every other inference check passed; one inherited from a mixin was skipped (for a
    requirement the loop does not need), failed, or overridden as an xfail: not ``full``."""
    from pipelinerl_sdk.conformance.plugin import _standard_checks

    r = BackendReport("inference:x", _standard_checks("inference"))
    for check in r.expected:
        r.result(check).passed += 1
    inherited = r.result("test_every_version_tag_is_true")
    inherited.passed = 0
    if outcome == "skip":
        inherited.skipped.append(("does not declare streaming", REQUIREMENTS["streaming"]))
    else:
        inherited.failed.append("xfail: tags lie" if outcome == "xfail" else "call: boom")
    assert not r.reached("full"), r.lines()
    assert r.level() == ("loop" if outcome == "skip" else "none")


@pytest.mark.integration
def test_an_xfail_override_of_an_inherited_check_is_counted_a_failure_in_the_summary(tmp_path: Path) -> None:
    """A third party's test class overrides an inherited check (from the version-tag mixin) as an
    explicit xfail taking no fixtures: the summary lists that check as failed for the backend (not
    ``verified``, not left out), lists every standard check of the kind, and the level is none
    (nothing else ran)."""
    from pipelinerl_sdk.conformance.plugin import _standard_checks

    (tmp_path / "test_third_party.py").write_text(
        "import pytest\n"
        "from pipelinerl_sdk.conformance.inference import InferenceContractTests\n\n\n"
        "class TestInference(InferenceContractTests):\n"
        "    @pytest.mark.xfail(reason='our tags lie', strict=True)\n"
        "    def test_every_version_tag_is_true(self, *args, **kwargs):\n"
        "        raise AssertionError('a version tag lies')\n"
    )
    cmd = [
        sys.executable, "-m", "pytest", str(tmp_path / "test_third_party.py"), "-p", "no:cacheprovider", "-q",
        "--backend=inference:reference", "-k", "test_every_version_tag_is_true", "--conformance-level=loop",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 1, out[-4000:] + proc.stderr[-2000:]
    assert "failed    test_every_version_tag_is_true: xfail: our tags lie" in out, out[-4000:]
    summary = out[out.index("inference:reference: level") :]
    listed = re.findall(r"^  [a-z ]{9} (test_\w+)", summary, flags=re.M)
    assert set(_standard_checks("inference")) <= set(listed), summary
    assert "inference:reference: level 'none'" in out, out[-4000:]
