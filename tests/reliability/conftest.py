"""The inference backend ``tests/reliability`` runs against.

``pytest tests/reliability --reliability-backend NAME`` (default ``reference``; the option is
declared in ``tests/conftest.py``) starts every server of the suite with backend NAME, from the
table :data:`reliability_backends.ENGINES`. The tests are the same on every engine, and none
skips on any. The servers are shared between tests (:class:`reliability_backends.Servers`); a test
that has a shared server die under it fails (in its teardown, naming the exit code and the log's
tail), and the next test that asks gets a fresh one.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from reliability_backends import ENGINES, LIMITED, SHARED, Servers

from pipelinerl_sdk.launch import ServerProcess


def pytest_configure(config: pytest.Config) -> None:
    name = config.getoption("--reliability-backend")
    if name not in ENGINES:
        raise pytest.UsageError(f"--reliability-backend {name!r}: one of {', '.join(ENGINES)}")
    missing = [m for m in ENGINES[name].needs if importlib.util.find_spec(m) is None]
    if missing:
        raise pytest.UsageError(
            f"--reliability-backend {name}: {', '.join(missing)} not installed here; run the suite from the "
            f"environment scripts/setup-{name} prints"
        )


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> str:
    """The backend under test (``--reliability-backend``)."""
    return str(request.config.getoption("--reliability-backend"))


@pytest.fixture(scope="session")
def servers(backend: str, tiny_model: Path) -> Iterator[Servers]:
    pool = Servers(backend, tiny_model)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(autouse=True)
def no_server_died(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that had a shared server die under it fails, naming it (later tests get a new one)."""
    yield
    if "servers" in request.fixturenames:
        pool: Servers = request.getfixturevalue("servers")
        died = pool.dead()
        if died:
            pytest.fail("\n".join(died))


@pytest.fixture
def server(servers: Servers) -> ServerProcess:
    """The shared server (:data:`SHARED`) of the backend under test."""
    return servers.get(SHARED)


@pytest.fixture
def limited(servers: Servers) -> ServerProcess:
    """The server with small limits (:data:`LIMITED`) of the backend under test."""
    return servers.get(LIMITED)
