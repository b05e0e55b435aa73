"""What the suite runs against: backends selected by ``--backend``, resolved through the same
registry as ``pipelinerl serve``, or a running server given by URL."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pipelinerl_sdk.contracts import (
    InferenceCapabilities,
    TrainerBackend,
    TrainerCapabilities,
    inference_capabilities_from_dict,
)
from pipelinerl_sdk.errors import PluginError
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.launch import ENV_API_KEY, log_tail
from pipelinerl_sdk.plugins import Kind, load_registry


@dataclass(frozen=True)
class ServerUnderTest:
    """A running inference server and what the suite knows about it."""

    id: str
    url: str
    control_token: str
    capabilities: InferenceCapabilities
    model_dir: Path
    dtype: str
    #: The launched backend's registered name (None for a URL target).
    backend: str | None
    pid: int | None = None
    #: The launched server's log, shown with a failing check's report (None for a URL target).
    log_path: Path | None = None
    #: The OpenAI API key the server requires on its OpenAI routes (launched servers always get
    #: one, so the control routes are checked beside a key; a URL target's: ``$PIPELINERL_API_KEY``).
    api_key: str | None = None

    def log_tail(self, n: int = 60) -> str:
        return "" if self.log_path is None else log_tail(self.log_path, n)

    def client(self, **kwargs: object) -> InferenceClient:
        return InferenceClient(self.url, control_token=self.control_token, api_key=self.api_key, **kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class InferenceTarget:
    """``name`` is a registered backend (launched by the suite) or an ``http(s)://`` URL."""

    name: str
    capabilities: InferenceCapabilities | None

    @property
    def id(self) -> str:
        return f"url:{self.name.split('://', 1)[1]}" if self.is_url else f"inference:{self.name}"

    @property
    def is_url(self) -> bool:
        return self.name.startswith(("http://", "https://"))

    @contextmanager
    def open(
        self, model: Path, *, dtype: str, control_token: str | None, model_given: str | None
    ) -> Iterator[ServerUnderTest]:
        if self.is_url:
            if not control_token:
                raise PluginError(f"{self.name}: pass --control-token or set PIPELINERL_CONTROL_TOKEN")
            info = asyncio.run(_info(self.name, control_token))
            model_dir = Path(model_given) if model_given else Path(info.model)
            if not (model_dir / "config.json").is_file():
                raise PluginError(
                    f"{self.name} serves {info.model!r}, which is not a local HF model dir; pass --conformance-model"
                )
            dtype = info.params[0].dtype if info.params else dtype
            yield ServerUnderTest(
                self.id,
                self.name.rstrip("/"),
                control_token,
                inference_capabilities_from_dict(info.capabilities),
                model_dir,
                dtype,
                None,
                api_key=os.environ.get(ENV_API_KEY) or None,
            )
            return
        from pipelinerl_sdk.launch import ServerProcess

        assert self.capabilities is not None
        api_key = "sk-" + secrets.token_urlsafe(18)
        with ServerProcess(self.name, model, dtype=dtype, api_key=api_key, startup_timeout_s=600) as proc:
            yield ServerUnderTest(
                self.id, proc.url, proc.control_token, self.capabilities, model, dtype, self.name, proc.pid,
                proc.log_path, api_key,
            )  # fmt: skip


async def _info(url: str, token: str):  # type: ignore[no-untyped-def]
    async with InferenceClient(url, control_token=token) as client:
        return await client.info()


@dataclass(frozen=True)
class TrainerTarget:
    name: str
    capabilities: TrainerCapabilities
    factory: Callable[[], TrainerBackend]

    @property
    def id(self) -> str:
        return f"trainer:{self.name}"


KINDS: tuple[Kind, ...] = ("inference", "trainer")


def resolve_targets(values: Sequence[str]) -> tuple[list[InferenceTarget], list[TrainerTarget]]:
    """Split ``--backend`` values into inference and trainer targets. ``NAME`` selects every kind
    it is registered as; ``inference:NAME`` / ``trainer:NAME`` only that kind (PluginError, listing
    what is installed, for a name not registered as that kind, or as neither). A value selected
    twice counts once."""
    inference: list[InferenceTarget] = []
    trainers: list[TrainerTarget] = []
    registry = None
    for value in dict.fromkeys(values):
        if value.startswith(("http://", "https://")):
            inference.append(InferenceTarget(value, None))
            continue
        prefix, sep, rest = value.partition(":")
        kinds = tuple(k for k in KINDS if k == prefix) if sep and prefix in KINDS else KINDS
        name = rest if sep and prefix in KINDS else value
        registry = registry or load_registry()
        found = False
        if "inference" in kinds and name in registry.names("inference"):
            caps = registry.get("inference", name).capabilities
            assert isinstance(caps, InferenceCapabilities)
            if name not in {t.name for t in inference}:
                inference.append(InferenceTarget(name, caps))
            found = True
        if "trainer" in kinds and name in registry.names("trainer"):
            entry = registry.get("trainer", name)
            assert isinstance(entry.capabilities, TrainerCapabilities)
            if name not in {t.name for t in trainers}:
                trainers.append(TrainerTarget(name, entry.capabilities, _lazy_factory(name)))
            found = True
        if not found:
            registry.get(kinds[0], name)  # raises PluginError listing what is installed
    return inference, trainers


def _lazy_factory(name: str) -> Callable[[], TrainerBackend]:
    def make() -> TrainerBackend:
        backend: TrainerBackend = load_registry().create_trainer(name)
        return backend

    return make


def capability_satisfied(subject: InferenceTarget | TrainerTarget | ServerUnderTest, cap: str) -> tuple[bool, str]:
    """Whether ``subject`` declares ``cap``: a boolean field name, or ``field:value`` for a set
    field (``receive_mode:staged`` reads ``receive_modes``), or ``world_size:N`` for trainers."""
    caps = subject.capabilities
    if caps is None:
        return True, ""  # a URL target: its /info decides, at the server fixture
    key, _, value = cap.partition(":")
    if key == "world_size":
        limit = getattr(caps, "max_world_size", None)
        return (limit is None or limit >= int(value)), f"max_world_size={limit}"
    field = {"receive_mode": "receive_modes", "dtype": "dtypes", "group_backend": "group_backends"}.get(key, key)
    if not hasattr(caps, field):
        return False, f"{type(caps).__name__} has no field {field!r}"
    declared = getattr(caps, field)
    if value:
        return value in declared, f"{field}={sorted(declared)}"
    return bool(declared), f"{field}={declared}"
