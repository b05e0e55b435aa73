"""Backend discovery: pluggy hookspecs, a typed registry, guarded entry-point loading.

A plugin is a module exposing ``@hookimpl def register_backends(registry)``, named by an entry
point in the group :data:`ENTRY_POINT_GROUP`. Entry-point modules stay thin: they register
*dotted paths* (``"pkg.module:factory"``), imported only when a backend is created, so listing
backends never imports an engine.

Everything about a backend is declared once, at registration: its factory, its capabilities (the
conformance suite and ``pipelinerl backends`` read them there; :meth:`BackendRegistry.create_inference`
and :meth:`~BackendRegistry.create_trainer` check that the created backend's ``capabilities``
agree), and, for an inference engine, its benchmark anchor (``bench_anchor``, see
:mod:`pipelinerl_sdk.bench.anchor`), imported only by the benchmark and guarded like a factory.

There is no global plugin manager: :func:`load_registry` builds a fresh one each call.
Environment switches: ``PIPELINERL_DISABLE_PLUGIN_AUTOLOAD=1`` skips entry points (built-ins
too, since they are entry points like any other), ``PIPELINERL_PLUGINS=a,b`` loads only the
named entry points, ``PIPELINERL_EXTRA_PLUGINS=pkg.mod,other.mod`` also loads those modules
as plugins (for an adapter under development, or test-only backends), each guarded like an entry
point.
"""

from __future__ import annotations

import importlib
import os
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Literal, TypeVar, cast

import pluggy

from pipelinerl_sdk.contracts import (
    InferenceBackend,
    InferenceCapabilities,
    ServeConfig,
    TrainerBackend,
    TrainerCapabilities,
)
from pipelinerl_sdk.errors import PluginError

PROJECT = "pipelinerl_sdk"
ENTRY_POINT_GROUP = "pipelinerl_sdk.backends"
ENV_DISABLE_AUTOLOAD = "PIPELINERL_DISABLE_PLUGIN_AUTOLOAD"
ENV_ALLOW = "PIPELINERL_PLUGINS"
#: Comma-separated importable modules loaded as plugins without being installed (adapter
#: development, test-only backends); loaded even when autoload is off.
ENV_EXTRA = "PIPELINERL_EXTRA_PLUGINS"

hookspec = pluggy.HookspecMarker(PROJECT)
#: Decorate a plugin's ``register_backends`` with this.
hookimpl = pluggy.HookimplMarker(PROJECT)

F = TypeVar("F", bound=Callable[..., Any])
Kind = Literal["inference", "trainer"]


class _HookSpecs:
    @hookspec
    def register_backends(self, registry: BackendRegistry) -> None:
        """Called once per registry, right after the plugins are loaded. Register each backend
        with ``registry.register_inference_backend`` / ``register_trainer_backend``; import
        nothing heavy here."""


@dataclass(frozen=True, slots=True)
class BackendEntry:
    """A registered backend: ``factory`` is a callable or a ``"module:attr"`` path resolved by
    :meth:`BackendRegistry.factory`."""

    kind: Kind
    name: str
    factory: str | Callable[..., Any]
    capabilities: InferenceCapabilities | TrainerCapabilities
    plugin: str
    description: str = ""
    #: ``"module:attr"`` of the engine's own documented weight-update flow, the anchor of
    #: ``pipelinerl bench weight-update`` (inference backends only; see :mod:`pipelinerl_sdk.bench.anchor`).
    bench_anchor: str | None = None


@dataclass(frozen=True, slots=True)
class LoadResult:
    """One entry point's fate: ``status`` is ``loaded``, ``failed`` or ``skipped``."""

    name: str
    value: str
    distribution: str | None
    version: str | None
    status: Literal["loaded", "failed", "skipped"]
    error: str | None = None
    backends: tuple[str, ...] = ()


@dataclass
class BackendRegistry:
    """Registered backends by kind and name, and how each plugin loaded."""

    entries: dict[tuple[Kind, str], BackendEntry] = field(default_factory=dict)
    load_results: list[LoadResult] = field(default_factory=list)
    _current_plugin: str = "<direct>"

    def register_inference_backend(
        self,
        name: str,
        factory: str | Callable[..., Any],
        capabilities: InferenceCapabilities,
        description: str = "",
        *,
        bench_anchor: str | None = None,
    ) -> None:
        """Register an inference backend: ``factory(ServeConfig) -> InferenceBackend`` (or its
        ``"module:attr"``), the capabilities it keeps, and optionally ``bench_anchor``, the
        ``"module:attr"`` of its engine's own update flow for the benchmark."""
        if bench_anchor is not None and ":" not in bench_anchor:
            raise PluginError(f"plugin {self._current_plugin!r}: bench_anchor {bench_anchor!r} must be 'module:attr'")
        self._register("inference", name, factory, capabilities, description, bench_anchor)

    def register_trainer_backend(
        self,
        name: str,
        factory: str | Callable[..., Any],
        capabilities: TrainerCapabilities,
        description: str = "",
    ) -> None:
        """Register a trainer backend: ``factory() -> TrainerBackend`` (or its ``"module:attr"``)
        and the capabilities it keeps."""
        self._register("trainer", name, factory, capabilities, description)

    def _register(
        self,
        kind: Kind,
        name: str,
        factory: str | Callable[..., Any],
        capabilities: InferenceCapabilities | TrainerCapabilities,
        description: str,
        bench_anchor: str | None = None,
    ) -> None:
        if not name or not name.replace("-", "_").replace(".", "_").isidentifier():
            raise PluginError(f"plugin {self._current_plugin!r}: invalid backend name {name!r}")
        want = InferenceCapabilities if kind == "inference" else TrainerCapabilities
        if not isinstance(capabilities, want):
            raise PluginError(f"plugin {self._current_plugin!r}: {kind} backend {name!r} must declare {want.__name__}")
        if isinstance(factory, str) and ":" not in factory:
            raise PluginError(f"plugin {self._current_plugin!r}: factory {factory!r} must be 'module:attr'")
        old = self.entries.get((kind, name))
        if old is not None:
            raise PluginError(
                f"{kind} backend {name!r} registered twice: by {old.plugin!r} and by "
                f"{self._current_plugin!r}; uninstall one or use {ENV_ALLOW} to choose"
            )
        self.entries[(kind, name)] = BackendEntry(
            kind, name, factory, capabilities, self._current_plugin, description, bench_anchor
        )

    def names(self, kind: Kind) -> list[str]:
        return sorted(n for k, n in self.entries if k == kind)

    def get(self, kind: Kind, name: str) -> BackendEntry:
        try:
            return self.entries[(kind, name)]
        except KeyError:
            known = ", ".join(self.names(kind)) or "none"
            failed = [r for r in self.load_results if r.status == "failed"]
            hint = f"; plugins that failed to load: {', '.join(r.name for r in failed)}" if failed else ""
            raise PluginError(
                f"no {kind} backend named {name!r} (installed: {known}){hint}; see `pipelinerl backends`"
            ) from None

    def factory(self, kind: Kind, name: str) -> Callable[..., Any]:
        """Resolve (import) the factory of a backend; PluginError naming plugin and remedy."""
        entry = self.get(kind, name)
        if callable(entry.factory):
            return entry.factory
        return cast(Callable[..., Any], _resolve(entry, entry.factory, "backend"))

    def create_inference(self, name: str, config: ServeConfig) -> InferenceBackend:
        """Create the inference backend ``name`` for ``config``: PluginError (naming plugin and
        remedy) when its factory cannot be imported, returns no :class:`InferenceBackend`, or
        returns one whose ``capabilities`` differ from those it registered."""
        backend = self.factory("inference", name)(config)
        _check(self.get("inference", name), backend, InferenceBackend)
        return cast(InferenceBackend, backend)

    def create_trainer(self, name: str) -> TrainerBackend:
        """Create one rank of the trainer backend ``name`` (not initialised); the checks of
        :meth:`create_inference`, against :class:`TrainerBackend`."""
        backend = self.factory("trainer", name)()
        _check(self.get("trainer", name), backend, TrainerBackend)
        return cast(TrainerBackend, backend)

    def bench_anchor(self, name: str) -> object | None:
        """The benchmark anchor the inference backend ``name`` registered (imported now), or None;
        PluginError naming the plugin when it cannot be imported."""
        entry = self.get("inference", name)
        return None if entry.bench_anchor is None else _resolve(entry, entry.bench_anchor, "bench anchor")


def _resolve(entry: BackendEntry, path: str, what: str) -> object:
    """Import ``"module:attr"`` (``attr`` may be dotted) for ``entry``; PluginError on failure."""
    module, _, attr = path.partition(":")
    try:
        obj: object = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as e:
        raise PluginError(
            f"Error importing {entry.kind} {what} {entry.name!r} from plugin {entry.plugin!r} ({path}): "
            f"{type(e).__name__}: {e}. Is the engine installed in this environment?"
        ) from e
    return obj


def _check(entry: BackendEntry, backend: object, contract: type[Any]) -> None:
    """PluginError unless ``backend`` implements ``contract`` with the registered capabilities."""
    where = f"{entry.kind} backend {entry.name!r} from plugin {entry.plugin!r}"
    if not isinstance(backend, contract):
        raise PluginError(
            f"{where}: its factory ({entry.factory!r}) returned a {type(backend).__name__}, not a "
            f"{contract.__name__}; subclass pipelinerl_sdk.{contract.__name__}"
        )
    declared, actual = entry.capabilities, backend.capabilities
    if declared != actual:
        diff = [
            f"{f}: registered {getattr(declared, f)!r}, backend has {getattr(actual, f, None)!r}"
            for f in type(declared).__slots__
            if getattr(declared, f) != getattr(actual, f, None)
        ]
        raise PluginError(
            f"{where}: the backend's capabilities differ from those it registered ({'; '.join(diff) or 'type'}); "
            "declare them once (one constant, registered and set as the class attribute)"
        )


def make_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(_HookSpecs)
    return pm


def _dist_of(ep: metadata.EntryPoint) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


def load_registry(
    *,
    autoload: bool | None = None,
    allow: Iterable[str] | None = None,
    plugins: Mapping[str, object] | None = None,
    entry_points: Iterable[metadata.EntryPoint] | None = None,
) -> BackendRegistry:
    """Build a registry: load entry points (each inside its own try), register ``plugins``
    (name -> module or object with hookimpls; for tests and embedding), call
    ``register_backends`` on each plugin separately so one failing registration never hides the
    others, then ``check_pending``.

    ``autoload``/``allow`` default to the environment switches."""
    if autoload is None:
        autoload = os.environ.get(ENV_DISABLE_AUTOLOAD, "") not in ("1", "true", "yes")
    if allow is None and os.environ.get(ENV_ALLOW):
        allow = [a.strip() for a in os.environ[ENV_ALLOW].split(",") if a.strip()]
    allowed = set(allow) if allow is not None else None
    pm = make_plugin_manager()
    registry = BackendRegistry()
    loaded: list[tuple[str, object, LoadResult]] = []

    if autoload:
        eps = entry_points if entry_points is not None else metadata.entry_points(group=ENTRY_POINT_GROUP)
        for ep in sorted(eps, key=lambda e: e.name):
            dist, version = _dist_of(ep)
            if allowed is not None and ep.name not in allowed and (dist or "") not in allowed:
                registry.load_results.append(
                    LoadResult(ep.name, ep.value, dist, version, "skipped", f"not in {ENV_ALLOW}")
                )
                continue
            if pm.get_plugin(ep.name) is not None:
                registry.load_results.append(
                    LoadResult(
                        ep.name,
                        ep.value,
                        dist,
                        version,
                        "skipped",
                        "an entry point of that name was already loaded",
                    )
                )
                continue
            try:
                plugin = ep.load()
                _register_checked(pm, plugin, ep.name)
            except Exception as e:
                registry.load_results.append(
                    LoadResult(
                        ep.name,
                        ep.value,
                        dist,
                        version,
                        "failed",
                        _describe(e, f'Error importing plugin "{ep.name}"'),
                    )
                )
                continue
            loaded.append((ep.name, plugin, LoadResult(ep.name, ep.value, dist, version, "loaded")))

    for module_name in [m.strip() for m in os.environ.get(ENV_EXTRA, "").split(",") if m.strip()]:
        try:
            module = importlib.import_module(module_name)
            _register_checked(pm, module, module_name)
        except Exception as e:
            registry.load_results.append(
                LoadResult(
                    module_name,
                    module_name,
                    None,
                    None,
                    "failed",
                    _describe(e, f'Error importing plugin "{module_name}" (from {ENV_EXTRA})'),
                )
            )
            continue
        loaded.append((module_name, module, LoadResult(module_name, module_name, None, None, "loaded")))

    for name, plugin in (plugins or {}).items():
        try:
            _register_checked(pm, plugin, name)
        except Exception as e:
            registry.load_results.append(LoadResult(name, repr(plugin), None, None, "failed", _describe(e, "")))
            continue
        loaded.append((name, plugin, LoadResult(name, repr(plugin), None, None, "loaded")))

    pm.check_pending()
    for name, plugin, result in loaded:
        before = set(registry.entries)
        registry._current_plugin = name
        impls = [i for i in pm.hook.register_backends.get_hookimpls() if i.plugin is plugin]
        try:
            for impl in impls:
                impl.function(registry=registry)
        except Exception as e:
            for key in set(registry.entries) - before:  # a half-registered plugin is not kept
                del registry.entries[key]
            registry.load_results.append(
                LoadResult(
                    result.name,
                    result.value,
                    result.distribution,
                    result.version,
                    "failed",
                    _describe(e, f'Error in plugin "{name}" register_backends'),
                )
            )
            continue
        added = tuple(sorted(f"{k}:{n}" for k, n in set(registry.entries) - before))
        registry.load_results.append(
            LoadResult(
                result.name,
                result.value,
                result.distribution,
                result.version,
                "loaded",
                None,
                added,
            )
        )
    registry._current_plugin = "<direct>"
    return registry


def _register_checked(pm: pluggy.PluginManager, plugin: object, name: str) -> None:
    """Register one plugin and check its hooks now, so that an unknown hook (a typo such as
    ``register_backend``) fails this plugin alone instead of the final ``check_pending``."""
    pm.register(plugin, name=name)
    try:
        pm.check_pending()
    except Exception:
        pm.unregister(name=name)
        raise


def _describe(e: BaseException, prefix: str) -> str:
    last = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    head = f"{prefix}: " if prefix else ""
    return f"{head}{type(e).__name__}: {e}{where}"
