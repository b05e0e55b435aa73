"""The conformance suite can fail: each deliberately broken backend of :mod:`tests.broken_backends`
is run through the standard check(s) that must catch it, in a child pytest (as a user would run
``pytest conformance --backend=NAME``), and that check must FAIL (not error, not skip) with a message
naming the problem. The same checks pass on the reference backend: tests/test_conformance_order.py
runs every inference check on it (shuffled on one server, and alone on fresh ones), the control.

Tests run in file order: the correct variants, the gap runs, then the caught backends, the slowest
last (it starts in the background with the module and mostly waits on a timeout meanwhile).

The ``GAP_BACKENDS`` (broken in ways no standard check notices yet) run through the whole suite and
xfail; the day the suite catches one, the test fails and says so (a hand-made strict xfail: child
runs that break, rather than pass, still fail the test).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SUITE = "conformance/test_inference.py"
PLUGIN = "tests.broken_backends"


def _load_plugin_module() -> ModuleType:
    """``tests/broken_backends.py``, by path (the repository root need not be on ``sys.path`` here;
    the children get it through ``PYTHONPATH``)."""
    spec = importlib.util.spec_from_file_location("_broken_backends_names", ROOT / "tests" / "broken_backends.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_plugin = _load_plugin_module()
CAUGHT_BACKENDS: dict[str, object] = _plugin.CAUGHT_BACKENDS
GAP_BACKENDS: dict[str, object] = _plugin.GAP_BACKENDS
#: One child run (server start included); the slowest, broken-accepts-unknown-names, takes ~100 s
#: idle, the reference run of every selected check several minutes on a loaded 2-core machine.
CHILD_TIMEOUT_S = 600


@dataclass(frozen=True)
class Expectation:
    """How the suite must report a broken backend."""

    #: ``-k`` selection of the child run: the check(s) that must catch the backend.
    select: str
    #: Name (up to the parameter brackets) of the check that must fail.
    check: str
    #: Text the failure message must contain.
    says: str
    #: The check fails through this door only (the backend's bug is in that door's front): its
    #: runs through the other doors must pass.
    only_door: str | None = None
    #: The suite fails but does not name the problem (a known weakness of the suite): the symptom
    #: it shows instead, and why. The test then xfails, and fails once the message names it.
    weak_message: tuple[str, str] | None = None


EXPECTED: dict[str, Expectation] = {
    "broken-ignores-updates": Expectation(
        "test_update_serves_exactly_the_new_weights and staged and sdk",
        "test_update_serves_exactly_the_new_weights",
        "completion logprobs differ from the weights the server should hold",
    ),
    "broken-wrong-logprobs": Expectation(
        "test_logprobs_match_the_served_weights",
        "test_logprobs_match_the_served_weights",
        "completion logprobs differ from the weights the server should hold: max |diff| 0.05",
    ),
    "broken-aborts-in-flight": Expectation(
        "test_requests_in_flight_survive_updates and sdk",
        "test_requests_in_flight_survive_updates",
        "request cut short: abort",
    ),
    "broken-half-applies": Expectation(
        "test_interrupted_broadcast_keeps_old_weights_serving",
        "test_interrupted_broadcast_keeps_old_weights_serving",
        "completion logprobs differ from the weights the server should hold",
    ),
    "broken-stale-versions": Expectation(
        "test_requests_in_flight_survive_updates and sdk",
        "test_requests_in_flight_survive_updates",
        "no request carried tokens of two versions",
    ),
    "broken-stale-stream-versions": Expectation(
        "test_streamed_version_tags_are_true",
        "test_streamed_version_tags_are_true",
        "a version tag lies",
    ),
    "broken-write-time-stream-versions": Expectation(
        "test_streamed_version_tags_are_true",
        "test_streamed_version_tags_are_true",
        "a version tag lies",
    ),
    "broken-accepts-unknown-names": Expectation(
        "test_bad_updates_are_refused_before_any_receive and sdk",
        "test_bad_updates_are_refused_before_any_receive",
        "unknown-extra-name: got 200",
    ),
    "broken-temperature-logprobs": Expectation(
        "test_sampled_logprobs_are_the_models_raw_logprobs",
        "test_sampled_logprobs_are_the_models_raw_logprobs",
        "sampled logprobs are not the raw model logprobs",
    ),
    "broken-not-atomic-on-abort": Expectation(
        "test_called_off_update_changes_nothing and sdk",
        "test_called_off_update_changes_nothing",
        "a called-off update moved the version",
    ),
    "broken-holds-after-refusal": Expectation(
        "test_a_refused_or_called_off_update_holds_no_generation",
        "test_a_refused_or_called_off_update_holds_no_generation",
        "generation held after a refused update",
    ),
    "broken-greedy-sampling": Expectation(
        "test_samples_follow_the_model_distribution and temperature-1",
        "test_samples_follow_the_model_distribution",
        "do not follow the model's distribution",
    ),
    "broken-ignores-top-p": Expectation(
        "test_samples_follow_the_model_distribution and top_p-0.7",
        "test_samples_follow_the_model_distribution",
        "sampled tokens lie outside the top_p=0.7 nucleus",
    ),
    "broken-ignores-temperature": Expectation(
        "test_samples_follow_the_model_distribution and temperature-2",
        "test_samples_follow_the_model_distribution",
        "samples at temperature 2.0, top_p 1.0 do not follow the model's distribution",
    ),
    "broken-cuts-before-temperature": Expectation(
        "test_samples_follow_the_model_distribution and top_p-0.7-temperature-0.5",
        "test_samples_follow_the_model_distribution",
        "sampled tokens lie outside the top_p=0.7 nucleus (temperature 0.5, cut after it)",
    ),
    "broken-ignores-top-k": Expectation(
        "test_samples_follow_the_model_distribution and top_k-5-temperature-2",
        "test_samples_follow_the_model_distribution",
        "sampled tokens lie outside the top_k=5 set (temperature 2.0",
    ),
    "broken-ignores-min-p": Expectation(
        "test_samples_follow_the_model_distribution and min_p-0.1-temperature-2",
        "test_samples_follow_the_model_distribution",
        "sampled tokens lie outside the min_p=0.1 set (temperature 2.0",
    ),
    "broken-ignores-seed": Expectation(
        "test_a_seed_fixes_the_samples",
        "test_a_seed_fixes_the_samples",
        "seed 11 sent again gave other samples",
    ),
    "broken-copied-group-samples": Expectation(
        "test_samples_of_one_request_are_independent",
        "test_samples_of_one_request_are_independent",
        "samples are copies, not independent draws",
    ),
    "broken-drops-eos": Expectation(
        "test_completions_end_as_they_say",
        "test_completions_end_as_they_say",
        "does not carry its end-of-sequence token",
    ),
    "broken-length-for-stop": Expectation(
        "test_completions_end_as_they_say",
        "test_completions_end_as_they_say",
        "finish_reason 'length' for a completion that ended on end-of-sequence",
    ),
    "broken-early-tags": Expectation(
        "test_every_version_tag_is_true and sdk",
        "test_every_version_tag_is_true",
        "a version tag lies",
    ),
    "broken-late-tags": Expectation(
        "test_every_version_tag_is_true and sdk",
        "test_every_version_tag_is_true",
        "a version tag lies",
    ),
    "broken-in-flight-tags": Expectation(
        "test_every_version_tag_is_true and sdk",
        "test_every_version_tag_is_true",
        "a version tag lies",
    ),
    "broken-refuses-past-batch": Expectation(
        "test_more_sequences_than_the_batch_are_queued",
        "test_more_sequences_than_the_batch_are_queued",
        "were refused, not queued",
    ),
    "broken-api-key-opens-control": Expectation(
        "test_control_routes_need_the_control_token",
        "test_control_routes_need_the_control_token",
        "with the OpenAI API key: 4",
    ),
    "broken-token-prefix-opens-control": Expectation(
        "test_control_routes_need_the_control_token",
        "test_control_routes_need_the_control_token",
        "with the token plus one character: 4",
    ),
    "broken-keeps-stop-string": Expectation(
        "test_stop_strings_cut_where_they_should",
        "test_stop_strings_cut_where_they_should",
        "is not the greedy text before the stop string",
    ),
    "broken-stop-within-a-token": Expectation(
        "test_stop_strings_at_token_edges",
        "test_stop_strings_at_token_edges",
        "include_stop_str_in_output=False: finish_reason 'length'",
    ),
    "broken-includes-the-whole-token": Expectation(
        "test_stop_strings_at_token_edges",
        "test_stop_strings_at_token_edges",
        "ending inside a token",
    ),
    "broken-ignore-eos-ignores-stop-tokens": Expectation(
        "test_stop_token_ids_end_as_vllm",
        "test_stop_token_ids_end_as_vllm",
        "ignore_eos=True, include=False: tokens",
    ),
    "broken-ignores-min-tokens": Expectation(
        "test_min_tokens_holds_the_end_off",
        "test_min_tokens_holds_the_end_off",
        "ignore_eos=True: stop or end-of-sequence ids",
    ),
    "broken-min-tokens-counts-early-stops": Expectation(
        "test_min_tokens_holds_the_end_off",
        "test_min_tokens_holds_the_end_off",
        "a stop string counts only where it ends past",
    ),
    "broken-tokenize-without-template": Expectation(
        "test_tokenize_gives_the_ids_generation_uses",
        "test_tokenize_gives_the_ids_generation_uses",
        "/tokenize of the chat gave",
    ),
    "broken-detokenize-skips-special": Expectation(
        "test_tokenize_gives_the_ids_generation_uses",
        "test_tokenize_gives_the_ids_generation_uses",
        "/detokenize of",
    ),
    "broken-ignores-logit-bias": Expectation(
        "test_logit_bias_forces_a_token",
        "test_logit_bias_forces_a_token",
        "logit_bias +100 on token",
    ),
    "broken-ignores-penalties": Expectation(
        "test_penalties_follow_vllms_rules",
        "test_penalties_follow_vllms_rules",
        "presence_penalty=1.5: greedy tokens differ from vLLM's rules from token 7 on",
    ),
    "broken-repetition-over-output-only": Expectation(
        "test_penalties_follow_vllms_rules",
        "test_penalties_follow_vllms_rules",
        "repetition_penalty=1.6: greedy tokens differ from vLLM's rules",
    ),
    "broken-penalties-over-prompt": Expectation(
        "test_penalties_follow_vllms_rules",
        "test_penalties_follow_vllms_rules",
        "presence_penalty=1.5: greedy tokens differ from vLLM's rules",
    ),
    "broken-drops-a-chunk": Expectation(
        "test_streamed_deltas_add_up_to_the_non_streamed_text",
        "test_streamed_deltas_add_up_to_the_non_streamed_text",
        "streamed deltas add up to",
    ),
    "broken-streams-stop-strings": Expectation(
        "test_streamed_deltas_add_up_to_the_non_streamed_text",
        "test_streamed_deltas_add_up_to_the_non_streamed_text",
        "with stop=",
    ),
    "broken-retokenizes-prompts": Expectation(
        "test_completion_token_ids_are_used_as_given",
        "test_completion_token_ids_are_used_as_given",
        "are not the ids sent",
    ),
    "broken-adds-bos": Expectation(
        "test_completion_token_ids_are_used_as_given",
        "test_completion_token_ids_are_used_as_given",
        "are not the ids sent",
    ),
    "broken-ignores-structured-output": Expectation(
        "test_structured_output_follows_its_constraint",
        "test_structured_output_follows_its_constraint",
        "0 of 6 sampled choices follow the constraint",
    ),
    "broken-tool-calls-as-text": Expectation(
        "test_forced_tool_choice_gives_tool_calls",
        "test_forced_tool_choice_gives_tool_calls",
        "0 of 6 choices are one valid call",
    ),
    "broken-streams-tool-calls-as-text": Expectation(
        "test_streamed_tool_calls_add_up_to_the_non_streamed_calls",
        "test_streamed_tool_calls_add_up_to_the_non_streamed_calls",
        "streamed calls []",
    ),
    # vLLM's RL API in front of a correct engine: caught only through the vllm_rl door
    "broken-vllm-front-skips-unknown-names": Expectation(
        "test_bad_updates_are_refused_before_any_receive",
        "test_bad_updates_are_refused_before_any_receive",
        "unknown-extra-name: got 200",
        only_door="vllm_rl",
    ),
    "broken-vllm-front-drains": Expectation(
        "test_requests_in_flight_survive_updates",
        "test_requests_in_flight_survive_updates",
        "no request carried tokens of two versions",
        only_door="vllm_rl",
    ),
    "broken-vllm-front-always-updated": Expectation(
        "test_called_off_update_changes_nothing",
        "test_called_off_update_changes_nothing",
        "a called-off update was answered as a success",
        only_door="vllm_rl",
    ),
    "broken-vllm-front-ignores-mode": Expectation(
        "test_update_serves_exactly_the_new_weights",
        "test_update_serves_exactly_the_new_weights",
        "the update ran in mode",
        only_door="vllm_rl",
    ),
    "broken-pause-does-not-hold": Expectation(
        "test_a_keep_pause_holds_generation_and_an_update_inside_it",
        "test_a_keep_pause_holds_generation_and_an_update_inside_it",
        "tokens arrived while the server said it was paused",
    ),
}
assert set(EXPECTED) == set(CAUGHT_BACKENDS), "every caught broken backend needs an expectation"

#: Gap backend -> what the suite lacks (the xfail reason).
GAPS: dict[str, str] = {}
assert set(GAPS) == set(GAP_BACKENDS), "every gap backend needs a reason"

#: Started in the background when the module starts (if selected): such a run mostly waits on a
#: timeout, and the other tests run meanwhile; its test comes last (tests run in file order).
SLOW = ("broken-accepts-unknown-names",)


@dataclass(frozen=True)
class Outcome:
    """One testcase of a child run's junit XML: ``passed``, ``failed``, ``error`` or ``skipped``."""

    name: str
    status: str
    message: str


@dataclass(frozen=True)
class ChildRun:
    backends: tuple[str, ...]
    select: str | None
    returncode: int
    output: str
    outcomes: tuple[Outcome, ...]
    seconds: float

    def of(self, check: str, backend: str | None = None) -> list[Outcome]:
        """Outcomes of ``check`` (all its parameters), for ``backend`` when given."""
        return [
            o
            for o in self.outcomes
            if o.name.split("[")[0] == check and (backend is None or f"[inference:{backend}" in o.name)
        ]

    def describe(self) -> str:
        lines = [f"  {o.status:8} {o.name}: {o.message[:300]}" for o in self.outcomes]
        return (
            f"child pytest --backend={','.join(self.backends)} -k {self.select!r}: rc {self.returncode} in "
            f"{self.seconds:.0f} s\n" + "\n".join(lines) + "\n--- output tail ---\n" + self.output[-3000:]
        )


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PIPELINERL_EXTRA_PLUGINS"] = PLUGIN
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


class _Pending:
    """A child pytest run of the conformance suite, started now, collected by :meth:`result`."""

    def __init__(self, backends: tuple[str, ...], select: str | None, workdir: Path) -> None:
        self.backends, self.select = backends, select
        self.xml = workdir / "r.xml"
        self._log = workdir / "out.txt"
        cmd = [sys.executable, "-m", "pytest", SUITE, "-p", "no:cacheprovider", "-q", f"--junitxml={self.xml}"]
        cmd += [f"--backend={b}" for b in backends]
        if select is not None:
            cmd += ["-k", select]
        self._t0 = time.monotonic()
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(cmd, cwd=ROOT, env=_child_env(), stdout=log, stderr=subprocess.STDOUT)

    def result(self) -> ChildRun:
        try:
            rc = self._proc.wait(CHILD_TIMEOUT_S - (time.monotonic() - self._t0))
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
            pytest.fail(f"child pytest did not finish in {CHILD_TIMEOUT_S} s:\n{self._log.read_text()[-3000:]}")
        seconds = time.monotonic() - self._t0
        output = self._log.read_text(errors="replace")
        outcomes = _parse_junit(self.xml) if self.xml.exists() else ()
        return ChildRun(self.backends, self.select, rc, output, outcomes, seconds)

    def cancel(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def _parse_junit(path: Path) -> tuple[Outcome, ...]:
    outcomes = []
    for case in ET.parse(path).getroot().iter("testcase"):
        status, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                status = {"failure": "failed"}.get(tag, tag)
                message = f"{el.get('message', '')}\n{el.text or ''}"
                break
        outcomes.append(Outcome(case.get("name", "?"), status, message))
    return tuple(outcomes)


class Runs:
    """Child runs of this module, each started once; the ``SLOW`` ones start at module start, and
    the next one when one is asked for.
    Broken backends caught by the same selection share one child run (one pytest, one model
    build; a server per backend), started for the first of them asked for among those selected."""

    def __init__(self, workdir: Path, selected: set[str]) -> None:
        self._workdir = workdir
        self._selected = selected
        self._pending: dict[str, _Pending] = {}
        self._done: dict[str, ChildRun] = {}
        for name in SLOW:
            if name in selected:
                self._start(name)

    def _group(self, backend: str) -> tuple[str, ...]:
        """``backend`` and the other selected backends with its selection, in EXPECTED's order."""
        select = EXPECTED[backend].select
        return tuple(b for b, e in EXPECTED.items() if e.select == select and (b == backend or b in self._selected))

    def _start(self, backend: str) -> _Pending:
        group = self._group(backend)
        d = self._workdir / backend
        d.mkdir()
        pending = _Pending(group, EXPECTED[backend].select, d)
        for b in group:
            self._pending[b] = pending
        return pending

    def _start_next(self, after: str) -> None:
        """Start the first selected backend past ``after`` (in EXPECTED's order) whose run has not
        started: it builds and runs while ``after``'s is collected (two children at a time: each
        spends much of its life starting pytest, a model and servers on one core)."""
        names = list(EXPECTED)
        for b in names[names.index(after) + 1 :]:
            if b in self._selected and b not in self._pending:
                self._start(b)
                return

    def get(self, backend: str) -> ChildRun:
        if backend not in self._done:
            pending = self._pending.get(backend) or self._start(backend)
            self._start_next(backend)
            run = pending.result()
            for b, p in self._pending.items():
                if p is pending:
                    self._done[b] = run
        return self._done[backend]

    def close(self) -> None:
        for p in set(self._pending.values()):
            p.cancel()


@pytest.fixture(scope="module", autouse=True)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    selected = {
        getattr(item, "callspec").id  # noqa: B009 (pytest.Item has no typed callspec)
        for item in request.session.items
        if getattr(item, "module", None) is request.module and hasattr(item, "callspec")
    }
    r = Runs(tmp_path_factory.mktemp("conformance-children"), selected)
    yield r
    r.close()


#: The checks a correct backend built otherwise than the reference must pass, by backend.
CORRECT_CHECKS: dict[str, tuple[str, ...]] = {
    "correct-static-batching": ("test_requests_in_flight_survive_updates", "test_every_version_tag_is_true"),
    "correct-no-seeds": ("test_streamed_deltas_add_up_to_the_non_streamed_text",),
}
assert set(CORRECT_CHECKS) == set(_plugin.CORRECT_BACKENDS)


@pytest.mark.parametrize("backend", list(CORRECT_CHECKS))
def test_the_checks_pass_on_a_correct_variant(backend: str, tmp_path: Path) -> None:
    """A correct backend that is not built like the reference (static batching) passes the
    checks that could wrongly assume the reference's design."""
    checks = CORRECT_CHECKS[backend]
    run = _Pending((backend,), " or ".join(checks), tmp_path).result()
    for check in checks:  # every parametrization (a door each, for the update checks)
        statuses = [o.status for o in run.of(check)]
        assert statuses and set(statuses) == {"passed"}, run.describe()
    assert run.returncode == 0, run.describe()


@pytest.mark.parametrize("backend", list(GAPS))
def test_the_suite_misses_a_gap_backend(backend: str, tmp_path: Path) -> None:
    """A known gap: the whole suite runs cleanly and passes on this broken backend, so the test
    xfails; once a check fails on it, the test fails, asking to move it to CAUGHT_BACKENDS."""
    run = _Pending((backend,), None, tmp_path).result()
    assert run.outcomes and run.returncode in (0, 1), run.describe()
    assert not [o for o in run.outcomes if o.status == "error"], run.describe()
    failed = [o.name for o in run.outcomes if o.status == "failed"]
    if failed:
        pytest.fail(f"the suite now catches {backend} ({failed}): move it to CAUGHT_BACKENDS with an expectation")
    pytest.xfail(f"suite gap, {len(run.outcomes)} checks pass on {backend}: {GAPS[backend]}")


@pytest.mark.parametrize("backend", list(EXPECTED))
def test_the_suite_catches_a_broken_backend(runs: Runs, backend: str) -> None:
    """The intended check fails in its test body (the server started, nothing skipped), its
    message names the problem, and the report shows the tail of the server's log."""
    exp = EXPECTED[backend]
    run = runs.get(backend)
    mine = run.of(exp.check, backend)
    assert mine, f"{exp.check} did not run against {backend}\n{run.describe()}"
    failed = [o for o in mine if o.status == "failed"]
    assert failed, f"{exp.check} did not FAIL against {backend}\n{run.describe()}"
    assert not [o for o in run.outcomes if o.status in ("error", "skipped")], run.describe()
    assert run.returncode == 1, f"child pytest ended with rc {run.returncode} (1 = tests failed)\n{run.describe()}"
    assert f"inference:{backend} server log, last lines" in run.output, (
        f"the failure report does not show the server's log\n{run.describe()}"
    )
    if exp.only_door is not None:
        elsewhere = [o for o in mine if not o.name.endswith(f"-{exp.only_door}]")]
        assert elsewhere and all(o.status == "passed" for o in elsewhere), (
            f"{exp.check} must fail through the {exp.only_door} door only\n{run.describe()}"
        )
        assert all(o.name.endswith(f"-{exp.only_door}]") for o in failed), run.describe()
    message = failed[0].message
    if exp.weak_message is not None:
        symptom, why = exp.weak_message
        if exp.says in message:
            pytest.fail(f"the suite now names the problem ({exp.says!r}): drop weak_message for {backend}")
        assert symptom in message, f"expected the known weak symptom {symptom!r}\n{run.describe()}"
        pytest.xfail(f"caught, but the message does not name the problem: {why}")
    assert exp.says in message, f"the failure of {exp.check} does not say {exp.says!r}\n{run.describe()}"
