"""Requirements and conformance levels: what a skip means, and what a run verified.

Every capability a standard check may need is declared once, in :data:`REQUIREMENTS`, with the
reason the check needs it and whether a PipelineRL loop needs it. A backend reaches a level when
every standard check of its kind was run and:

- ``loop`` (usable in a PipelineRL loop): none failed, and every skip was for a requirement a
  loop does not need (a second receive mode, prompt or top logprobs, world size 2);
- ``full`` (the whole contract): every check passed; nothing skipped.

A check not run (deselected, its module not collected, no partner backend for the cross check)
is not verified: a level needing it is not reached. ``--conformance-level=loop|full`` makes the
session fail when a selected backend did not reach it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

LEVELS = ("loop", "full")


@dataclass(frozen=True, slots=True)
class Requirement:
    """A capability a check needs. ``loop``: a PipelineRL loop needs it too, so a backend without
    it does not reach the ``loop`` level."""

    name: str
    reason: str
    loop: bool


#: Every requirement of the standard checks (``@pytest.mark.requires(NAME)``), declared once.
REQUIREMENTS: dict[str, Requirement] = {
    r.name: r
    for r in (
        Requirement("receive_mode:staged", "updates received into a spare buffer while serving", loop=False),
        Requirement("receive_mode:direct", "updates received straight into the live weights", loop=False),
        Requirement(
            "in_flight_updates",
            "the loop publishes while actors generate: running requests must survive updates",
            loop=True,
        ),
        Requirement("prompt_logprobs", "prompt logprobs are compared too (the loop uses completion ones)", loop=False),
        Requirement("top_logprobs", "top-k alternatives are compared (the loop does not use them)", loop=False),
        Requirement("world_size:2", "the trainer runs on 2 ranks (a loop may train on one)", loop=False),
        Requirement("stop_strings", "stop strings and stop token ids end the text (the loop stops on eos)", loop=False),
        Requirement("logit_bias", "logit_bias reaches the sampler (the loop does not bias)", loop=False),
        Requirement("penalties", "penalties reach the sampler (the loop samples the raw model)", loop=False),
        Requirement(
            "sampling_filters", "top_k and min_p cut the distribution (the loop samples the raw model)", loop=False
        ),
        Requirement("seeds", "a seed fixes a request's samples (the loop samples unseeded)", loop=False),
        Requirement("streaming", "streamed chat equals the non-streamed one (the loop does not stream)", loop=False),
        Requirement(
            "structured_outputs", "JSON, regex, choice and forced tool calls (the loop samples free text)", loop=False
        ),
        Requirement(
            "vllm_rl_api",
            "the update checks again through vLLM's RL routes (the loop updates through the SDK's)",
            loop=False,
        ),
        Requirement(
            "pause_generation", "vLLM's /pause?mode=keep and /resume (the loop updates without a pause)", loop=False
        ),
    )
}


def requirement(name: str) -> Requirement:
    """The declared requirement, or one a loop is assumed to need (a third party's own name)."""
    return REQUIREMENTS.get(name) or Requirement(name, "declared by the test", loop=True)


@dataclass(slots=True)
class CheckResult:
    """One standard check (all its parametrizations) for one backend."""

    passed: int = 0
    failed: list[str] = field(default_factory=list)
    #: (reason, the requirement behind the skip if one was).
    skipped: list[tuple[str, Requirement | None]] = field(default_factory=list)

    def status(self) -> str:
        if self.failed:
            return "failed"
        if self.skipped:
            return "skipped"
        return "verified" if self.passed else "not run"

    def loop_ok(self) -> bool:
        """Passed where run; every skip for a requirement the loop does not need; not "not run"."""
        optional = all(r is not None and not r.loop for _, r in self.skipped)
        return not self.failed and (self.passed > 0 or bool(self.skipped)) and optional

    def full_ok(self) -> bool:
        return not self.failed and not self.skipped and self.passed > 0


@dataclass(slots=True)
class BackendReport:
    """What the session verified for one backend (``inference:NAME``, ``trainer:NAME``, ``url:...``)."""

    backend: str
    expected: Sequence[str]
    checks: dict[str, CheckResult] = field(default_factory=dict)
    #: Only the cross check ran with this backend (the partner of a backend under test): its level
    #: is reported, not judged by ``--conformance-level``.
    partner_only: bool = False

    def result(self, check: str) -> CheckResult:
        return self.checks.setdefault(check, CheckResult())

    def reached(self, level: str) -> bool:
        ok = CheckResult.loop_ok if level == "loop" else CheckResult.full_ok
        return all(ok(self.checks.get(c, CheckResult())) for c in self.expected)

    def level(self) -> str:
        """The highest level reached, or ``none``."""
        return next((lv for lv in reversed(LEVELS) if self.reached(lv)), "none")

    def lines(self) -> list[str]:
        """The terminal summary of this backend: every expected check and its status."""
        partner = "; a partner only: its own checks were not collected, not judged" if self.partner_only else ""
        out = [f"{self.backend}: level {self.level()!r} (" + ", ".join(self._counts()) + f"){partner}"]
        for check in self.expected:
            r = self.checks.get(check, CheckResult())
            status = r.status()
            detail = ""
            if status == "failed":
                detail = ": " + "; ".join(r.failed)
            elif status == "skipped":
                detail = ": " + "; ".join(
                    reason + ("" if req is None else f" [{req.name}: {req.reason}; loop needs it: {req.loop}]")
                    for reason, req in dict.fromkeys(r.skipped)
                )
                if r.passed:
                    status = "partly"
            out.append(f"  {status:9} {check}{detail}")
        return out

    def _counts(self) -> Iterable[str]:
        statuses = [self.checks.get(c, CheckResult()).status() for c in self.expected]
        for s in ("verified", "skipped", "failed", "not run"):
            if statuses.count(s):
                yield f"{statuses.count(s)} {s}"


__all__ = ["LEVELS", "REQUIREMENTS", "BackendReport", "CheckResult", "Requirement", "requirement"]
