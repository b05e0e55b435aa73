"""The conformance suite's pytest plugin (entry point ``pytest11``; loaded in any pytest run of an
environment where the SDK is installed, inert unless conformance tests are collected).

Options:
- ``--backend NAME`` (repeatable): a registered backend, launched by the suite with a tiny model it
  builds offline. A name registered both as inference and as trainer backend selects both.
  ``--backend http://HOST:PORT``: an already running inference server (black box); its control
  token comes from ``--control-token`` or ``PIPELINERL_CONTROL_TOKEN``, its model directory from
  ``--conformance-model`` (default: the ``model`` its ``/info`` reports, if that is a local dir).
- ``--list-backends``: print the installed backends and exit.
- ``--conformance-dtype``: dtype of launched inference servers (default float32).

Tests declare what they need with ``@pytest.mark.requires("field", ...)`` naming
:class:`~pipelinerl_sdk.contracts.InferenceCapabilities` / ``TrainerCapabilities`` fields (or
``"receive_mode:staged"``, ``"dtype:float32"``); a backend that does not declare one skips the
test with a reason naming the backend and the capability. A test class derived from a standard
one may override a standard test only as an explicit ``xfail`` with a reason; anything else is an
error at collection.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "requires(*capabilities): skip unless the backend declares them")
    config.addinivalue_line("markers", "conformance: a standard check of the pipelinerl-sdk conformance suite")
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


def _is_standard(cls: type) -> bool:
    return cls.__module__.startswith("pipelinerl_sdk.conformance.")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Enforce: a standard test overridden in a subclass must be an explicit xfail with a reason."""
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


@pytest.fixture(scope="module")
def server_under_test(
    request: pytest.FixtureRequest, inference_target: InferenceTarget | None, conformance_model: Path
) -> Iterator[ServerUnderTest]:
    """A running inference server: launched for a backend name (stopped by PID at the end of
    the module), or the given URL."""
    if inference_target is None:
        pytest.skip("no inference backend selected: pass --backend NAME or --backend URL")
    token = request.config.getoption("--control-token") or os.environ.get(ENV_TOKEN)
    dtype = request.config.getoption("--conformance-dtype")
    given_model = request.config.getoption("--conformance-model")
    with inference_target.open(conformance_model, dtype=dtype, control_token=token, model_given=given_model) as sut:
        yield sut


@pytest.fixture(scope="module")
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
