"""The conformance suite's pytest plugin (entry point ``pytest11``; loaded in any pytest run of an
environment where the SDK is installed, inert unless conformance tests are collected).

Options:
- ``--backend NAME`` (repeatable): a registered backend, launched by the suite with a tiny model it
  builds offline. A name registered both as inference and as trainer backend selects both;
  ``--backend inference:NAME`` / ``--backend trainer:NAME`` selects one kind.
  ``--backend http://HOST:PORT``: an already running inference server (black box); its control
  token comes from ``--control-token`` or ``PIPELINERL_CONTROL_TOKEN``, its model directory from
  ``--conformance-model`` (default: the ``model`` its ``/info`` reports, if that is a local dir).
- ``--list-backends``: print the installed backends and exit.
- ``--conformance-dtype``: dtype of launched inference servers (default float32).
- ``--conformance-level loop|full``: fail the session unless every selected backend reached that
  level (:mod:`pipelinerl_sdk.conformance.levels`); the run always ends with a summary of the
  checks verified, skipped (with the reason) and failed, and the level reached, per backend.
- ``--conformance-shuffle SEED``: run the checks in a random order (seeded): modules, and the
  checks within each module and backend, are shuffled; one module's checks stay together (they
  share a server).

Tests declare what they need with ``@pytest.mark.requires("field", ...)`` naming
:class:`~pipelinerl_sdk.contracts.InferenceCapabilities` / ``TrainerCapabilities`` fields (or
``"receive_mode:staged"``, ``"dtype:float32"``); a backend that does not declare one skips the
test with a reason naming the backend and the capability (resolved at collection for a named
backend, at the server fixture for a URL). Each requirement is declared once, with its reason
and whether a loop needs it, in :data:`~pipelinerl_sdk.conformance.levels.REQUIREMENTS`. A test
class derived from a standard one may override a standard test only as an explicit ``xfail`` with
a reason; anything else is an error at collection.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pipelinerl_sdk.conformance.levels import LEVELS, BackendReport, Requirement, requirement
from pipelinerl_sdk.conformance.targets import (
    InferenceTarget,
    ServerUnderTest,
    TrainerTarget,
    capability_satisfied,
    resolve_targets,
)

if TYPE_CHECKING:
    from pipelinerl_sdk.conformance.mirror import Mirror

ENV_TOKEN = "PIPELINERL_CONTROL_TOKEN"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pipelinerl-conformance", "pipelinerl-sdk conformance suite")
    group.addoption("--backend", action="append", default=[], metavar="NAME|URL", help="backend under test (repeat)")
    group.addoption("--list-backends", action="store_true", help="list installed backends and exit")
    group.addoption("--control-token", default=None, help=f"control token of a --backend URL (else ${ENV_TOKEN})")
    group.addoption("--conformance-model", default=None, help="HF model dir (default: a tiny model built offline)")
    group.addoption("--conformance-dtype", default="float32", help="dtype of launched inference servers")
    group.addoption(
        "--conformance-level",
        choices=LEVELS,
        default=None,
        help="fail unless every selected backend reaches this level (loop: usable in a PipelineRL loop; full)",
    )
    group.addoption(
        "--conformance-fresh-server",
        action="store_true",
        help="a fresh inference server for every check (each check alone), not one per module",
    )
    group.addoption(
        "--conformance-shuffle",
        type=int,
        default=None,
        metavar="SEED",
        help="run the checks in a seeded random order (a module's checks stay together)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "requires(*capabilities): skip unless the backend declares them")
    config.pluginmanager.register(_Recorder(config), "pipelinerl-conformance-recorder")
    config.addinivalue_line("markers", "conformance: a standard check of the pipelinerl-sdk conformance suite")
    config.addinivalue_line(
        "markers", "each_dtype: a trainer check run once per dtype the trainer declares (its ``dtype`` parameter)"
    )
    if config.getoption("--list-backends"):
        from pipelinerl_sdk.cli import main

        main(["backends"])
        pytest.exit("listed backends", returncode=0)


def _targets(config: pytest.Config) -> tuple[list[InferenceTarget], list[TrainerTarget]]:
    cached = config.stash.get(_TARGETS, None)
    if cached is None:
        cached = resolve_targets(config.getoption("--backend"))
        config.stash[_TARGETS] = cached
    return cached


_TARGETS = pytest.StashKey[tuple[list[InferenceTarget], list[TrainerTarget]]]()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    inference, trainers = _targets(metafunc.config)
    if "inference_target" in metafunc.fixturenames:
        metafunc.parametrize(
            "inference_target",
            inference or [None],
            ids=[t.id for t in inference] or ["no-inference-backend"],
            scope="module",
        )
    if "trainer_target" in metafunc.fixturenames:
        metafunc.parametrize(
            "trainer_target", trainers or [None], ids=[t.id for t in trainers] or ["no-trainer-backend"], scope="module"
        )
    if "dtype" in metafunc.fixturenames and metafunc.definition.get_closest_marker("each_dtype"):
        from pipelinerl_sdk.conformance.trainer import CHECK_DTYPES

        metafunc.parametrize("dtype", CHECK_DTYPES)  # the undeclared ones are deselected (_dtype_declared)


def _is_standard(cls: type) -> bool:
    return cls.__module__.startswith("pipelinerl_sdk.conformance.")


@dataclass
class _Session:
    """What the session learns for the summary: each standard item's check and backends, the
    requirement behind each requirement skip, and the per-backend reports."""

    items: dict[str, tuple[str, list[str]]] = field(default_factory=dict)
    requirement_skips: dict[str, Requirement] = field(default_factory=dict)
    reports: dict[str, BackendReport] = field(default_factory=dict)


_SESSION = pytest.StashKey[_Session]()


def _session(config: pytest.Config) -> _Session:
    if _SESSION not in config.stash:
        config.stash[_SESSION] = _Session()
    return config.stash[_SESSION]


def _standard_checks(kind: str) -> list[str]:
    """The standard checks a backend of ``kind`` must pass (its kind's classes and the cross check)."""
    from pipelinerl_sdk.conformance.cross import CrossCheckTests

    classes: list[type]
    if kind == "trainer":
        from pipelinerl_sdk.conformance.trainer import TrainerContractTests

        classes = [TrainerContractTests, CrossCheckTests]
    else:
        from pipelinerl_sdk.conformance.inference import InferenceContractTests
        from pipelinerl_sdk.conformance.stateful import StatefulContractTests

        classes = [InferenceContractTests, StatefulContractTests, CrossCheckTests]
    return list(dict.fromkeys(n for cls in classes for n in standard_tests(cls)))


def standard_tests(cls: type) -> list[str]:
    """Every standard check of ``cls``, its own and the ones it inherits (the sampling, generation,
    structured-output, version-tag and serving mixins of the inference class), as pytest collects
    them: in definition order, the most derived class's first."""
    names: dict[str, None] = {}
    for k in cls.__mro__:
        if _is_standard(k):
            names.update((n, None) for n in k.__dict__ if n.startswith("test_"))
    return list(names)


def _kind_targets(cls: type, inference: list[InferenceTarget], trainers: list[TrainerTarget]) -> list[str]:
    """The ids of the selected backends whose checks ``cls`` holds (by the standard class it derives
    from: trainer, inference or stateful, or the cross check's both)."""
    from pipelinerl_sdk.conformance.cross import CrossCheckTests
    from pipelinerl_sdk.conformance.trainer import TrainerContractTests

    if issubclass(cls, CrossCheckTests):
        return [t.id for t in inference] + [t.id for t in trainers]
    if issubclass(cls, TrainerContractTests):
        return [t.id for t in trainers]
    return [t.id for t in inference]


def _item_targets(item: pytest.Item) -> list[InferenceTarget | TrainerTarget]:
    params: dict[str, Any] = getattr(getattr(item, "callspec", None), "params", {})
    return [t for k in ("inference_target", "trainer_target") if (t := params.get(k)) is not None]


def _subject(item: pytest.Item) -> InferenceTarget | TrainerTarget | None:
    """Whose capabilities a ``requires`` mark of ``item`` reads: the inference target if the test
    uses the server, else the trainer target."""
    params: dict[str, Any] = getattr(getattr(item, "callspec", None), "params", {})
    names = getattr(item, "fixturenames", ())
    if "server_under_test" in names or "inference_target" in names:
        found: InferenceTarget | TrainerTarget | None = params.get("inference_target")
        if found is not None or "trainer_target" not in names:
            return found
    return params.get("trainer_target")


def _trainer_of(item: pytest.Item) -> TrainerTarget | None:
    params: dict[str, Any] = getattr(getattr(item, "callspec", None), "params", {})
    found: TrainerTarget | None = params.get("trainer_target")
    return found


def _dtype_declared(item: pytest.Item) -> bool:
    """Whether an ``each_dtype`` check's dtype is one its trainer declares. A trainer that
    declares none of the checked dtypes keeps the first (the check then skips, naming what it
    declares), as does a run with no trainer selected."""
    from pipelinerl_sdk.conformance.trainer import CHECK_DTYPES

    params: dict[str, Any] = getattr(getattr(item, "callspec", None), "params", {})
    if "dtype" not in params or item.get_closest_marker("each_dtype") is None:
        return True
    target: TrainerTarget | None = params.get("trainer_target")
    dtype = str(params["dtype"])
    declared = set(CHECK_DTYPES) & set(target.capabilities.dtypes) if target and target.capabilities else set()
    if not declared:
        if dtype == CHECK_DTYPES[0] and target is not None and target.capabilities is not None:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"{target.id} declares dtypes {sorted(target.capabilities.dtypes)}; "
                    f"the suite checks {CHECK_DTYPES}"
                )
            )
        return dtype == CHECK_DTYPES[0]
    return dtype in declared


def _resolve_requirements(config: pytest.Config, item: pytest.Item) -> None:
    """Skip ``item`` now if its backend does not declare what it ``requires`` (a URL target is
    resolved later, from its ``/info``). ``world_size:N`` is always the trainer's."""
    for cap in [c for m in item.iter_markers("requires") for c in m.args]:
        subject = _trainer_of(item) if cap.startswith("world_size:") else _subject(item)
        if subject is None or subject.capabilities is None:
            continue
        ok, reason = capability_satisfied(subject, cap)
        if not ok:
            item.add_marker(pytest.mark.skip(reason=f"{subject.id} does not declare {cap}: {reason}"))
            _session(config).requirement_skips[item.nodeid] = requirement(cap)
            return


def _shuffle(items: list[pytest.Item], seed: int) -> None:
    """Shuffle in place: modules in a random order, and within each module the checks of each
    (inference, trainer) backend pair as a block in random order, checks in random order."""
    rng = random.Random(seed)
    modules: dict[str, dict[tuple[str, ...], list[pytest.Item]]] = {}
    for item in items:
        key = tuple(t.id for t in _item_targets(item))
        modules.setdefault(item.nodeid.split("::")[0], {}).setdefault(key, []).append(item)
    order = list(modules.values())
    rng.shuffle(order)
    items.clear()
    for groups in order:
        blocks = list(groups.values())
        rng.shuffle(blocks)
        for block in blocks:
            rng.shuffle(block)
            items.extend(block)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Enforce the override rule; resolve requirements; shuffle if asked (after pytest's own
    grouping of items by module-scoped parameters)."""
    _enforce_xfail_overrides(items)
    kept = [item for item in items if _dtype_declared(item)]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
    for item in items:
        _resolve_requirements(config, item)
    seed = config.getoption("--conformance-shuffle")
    if seed is not None:
        _shuffle(items, seed)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Index the standard checks collected, per backend, for the summary."""
    if not session.config.getoption("--backend"):
        return
    state = _session(session.config)
    inference, trainers = _targets(session.config)
    for kind, targets in (("inference", inference), ("trainer", trainers)):
        expected = _standard_checks(kind)
        for t in targets:
            state.reports[t.id] = BackendReport(t.id, expected)
    from pipelinerl_sdk.conformance.cross import CrossCheckTests

    cross = set(standard_tests(CrossCheckTests))
    own: set[str] = set()
    for item in session.items:
        cls = getattr(item, "cls", None)
        if cls is None or not any(_is_standard(k) for k in cls.__mro__):
            continue
        name = getattr(item, "originalname", item.name)
        # An xfail override that takes no target (``def test_x(self, *args, **kwargs): ...``) is
        # still that check, for every selected backend of its kind: it counts as a failure there.
        backends = [t.id for t in _item_targets(item)] or _kind_targets(cls, inference, trainers)
        state.items[item.nodeid] = (name, backends)
        if name not in cross:
            own.update(backends)
    for backend, report in state.reports.items():
        report.partner_only = backend not in own


class _Recorder:
    """Registered per session (``pytest_configure``): records each standard check's outcome for
    its backends from the final reports (xfail resolved)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        state = self.config.stash.get(_SESSION, None)
        if state is None or report.nodeid not in state.items:
            return
        if report.when != "call" and not (report.failed or report.skipped):
            return
        check, backends = state.items[report.nodeid]
        for backend in backends:
            r = state.reports.get(backend)
            if r is None:
                continue
            result = r.result(check)
            if report.failed:
                result.failed.append(_message(report))
            elif report.skipped and hasattr(report, "wasxfail"):
                result.failed.append(f"xfail: {report.wasxfail}")
            elif report.skipped:
                result.skipped.append((_skip_reason(report), state.requirement_skips.get(report.nodeid)))
            elif hasattr(report, "wasxfail"):
                result.failed.append("xpassed")
            else:
                result.passed += 1


def _message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = getattr(crash, "message", None) or str(report.longrepr)
    return f"{report.when}: " + text.strip().splitlines()[0][:200] if text.strip() else report.when


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return str(reason).removeprefix("Skipped: ")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """With ``--conformance-level``: fail a session whose backends did not all reach it."""
    level = session.config.getoption("--conformance-level")
    state = session.config.stash.get(_SESSION, None)
    if level is None or state is None or not state.reports:
        return
    judged = [r for r in state.reports.values() if not r.partner_only]
    if not all(r.reached(level) for r in judged) and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(_SESSION, None)
    if state is None or not state.reports:
        return
    level = config.getoption("--conformance-level")
    terminalreporter.section("pipelinerl conformance: promises verified, levels reached")
    for report in state.reports.values():
        for line in report.lines():
            terminalreporter.write_line(line)
    if level is not None:
        missed = [r.backend for r in state.reports.values() if not r.partner_only and not r.reached(level)]
        verdict = f"NOT reached by {', '.join(missed)}" if missed else "reached by every backend"
        terminalreporter.write_line(f"--conformance-level={level}: {verdict}", red=bool(missed), green=not missed)


def _enforce_xfail_overrides(items: list[pytest.Item]) -> None:
    """A standard test overridden in a subclass must be an explicit xfail with a reason."""
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is None:
            continue
        name = getattr(item, "originalname", item.name)
        owner = next((k for k in cls.__mro__ if name in k.__dict__), None)
        if owner is None or _is_standard(owner):
            continue
        if not any(_is_standard(k) and name in k.__dict__ for k in cls.__mro__):
            continue  # the adapter's own extra test
        if not [m for m in item.iter_markers("xfail") if m.kwargs.get("reason")]:
            raise pytest.UsageError(
                f"{cls.__name__}.{name} overrides a standard conformance test; only "
                f"@pytest.mark.xfail(reason=...) overrides are allowed"
            )


@pytest.fixture(scope="session")
def conformance_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HF model every check uses: ``--conformance-model`` or a tiny Qwen2 built offline."""
    given = request.config.getoption("--conformance-model")
    if given:
        return Path(given)
    from pipelinerl_sdk.reference.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("conformance") / "tiny", preset="tiny", dtype="float32", seed=0)


def _server_scope(fixture_name: str, config: pytest.Config) -> str:
    """One server per module, or per check with ``--conformance-fresh-server``."""
    return "function" if config.getoption("--conformance-fresh-server") else "module"


@pytest.fixture(scope=_server_scope)  # type: ignore[arg-type]
def server_under_test(
    request: pytest.FixtureRequest, inference_target: InferenceTarget | None, conformance_model: Path
) -> Iterator[ServerUnderTest]:
    """A running inference server: launched for a backend name (stopped by PID at the end of
    the module, or of the check with ``--conformance-fresh-server``), or the given URL."""
    if inference_target is None:
        pytest.skip("no inference backend selected: pass --backend NAME or --backend URL")
    token = request.config.getoption("--control-token") or os.environ.get(ENV_TOKEN)
    dtype = request.config.getoption("--conformance-dtype")
    given_model = request.config.getoption("--conformance-model")
    with inference_target.open(conformance_model, dtype=dtype, control_token=token, model_given=given_model) as sut:
        yield sut


@pytest.fixture(scope=_server_scope)  # type: ignore[arg-type]
def mirror(server_under_test: ServerUnderTest) -> Mirror:
    """The suite's copy of the served weights; a server already updated is first synced to it."""
    from pipelinerl_sdk.conformance.mirror import Mirror

    m = Mirror(server_under_test.model_dir, server_under_test.dtype)
    _sync(server_under_test, m, only_if_updated=True)
    return m


def _sync(sut: ServerUnderTest, m: Mirror, *, only_if_updated: bool) -> None:
    """Publish the mirror's weights to the server as its next version."""
    import asyncio

    from pipelinerl_sdk.weights.publisher import WeightPublisher

    async def sync() -> None:
        async with sut.client() as client:
            info = await client.info()
            if only_if_updated and info.version == 0:
                return
            publisher = WeightPublisher([client])
            await publisher.connect()
            await m.publish(publisher, info.version + 1, info.params)
            await publisher.close()

    asyncio.run(sync())
    m.needs_sync = False


@pytest.fixture(autouse=True)
def _mirror_resynced(request: pytest.FixtureRequest) -> None:
    """After a failed check the server may hold weights the mirror does not (an update that
    landed before the check failed, or a perturbation never published): publish the mirror's
    weights first, so that one failure is reported once, not again by every later check."""
    if "mirror" not in request.fixturenames:
        return
    m: Mirror = request.getfixturevalue("mirror")
    if m.needs_sync:
        _sync(request.getfixturevalue("server_under_test"), m, only_if_updated=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failing check's report carries the tail of the launched server's log; a failure also
    marks the mirror for re-sync (see ``_mirror_resynced``)."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    if not report.failed:
        return
    funcargs: dict[str, Any] = getattr(item, "funcargs", {})
    sut = funcargs.get("server_under_test")
    if isinstance(sut, ServerUnderTest) and sut.log_path is not None:
        alive = "" if sut.pid is None or _alive(sut.pid) else f" (server pid {sut.pid} is gone)"
        report.sections.append((f"{sut.id} server log, last lines{alive}", sut.log_tail()))
    m = funcargs.get("mirror")
    if m is not None:
        m.needs_sync = True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@pytest.fixture(autouse=True)
def _requirements(request: pytest.FixtureRequest) -> None:
    marks = list(request.node.iter_markers("requires"))
    if not marks:
        return
    caps: list[str] = [c for m in marks for c in m.args]
    subject: Any = None
    if "server_under_test" in request.fixturenames:
        subject = request.getfixturevalue("server_under_test")  # concrete, also for URL targets
    elif "inference_target" in request.fixturenames:
        subject = request.getfixturevalue("inference_target")
    if subject is None and "trainer_target" in request.fixturenames:
        subject = request.getfixturevalue("trainer_target")
    if subject is None:
        return  # the server/trainer fixture skips with its own reason
    for cap in caps:
        ok, reason = capability_satisfied(subject, cap)
        if not ok:
            _session(request.config).requirement_skips[request.node.nodeid] = requirement(cap)
            pytest.skip(f"{subject.id} does not declare {cap}: {reason}")


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    if not config.getoption("--backend"):
        return None
    inference, trainers = _targets(config)
    return [
        "pipelinerl conformance: inference "
        + (", ".join(t.id for t in inference) or "-")
        + "; trainer "
        + (", ".join(t.id for t in trainers) or "-")
        + f"; python {sys.version.split()[0]}"
    ]
