"""Backend discovery (plugins.py): the built-in entry point, in-process plugins, guarded
entry-point loading, the environment switches, and ``pipelinerl backends``."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest

from pipelinerl_sdk.contracts import InferenceCapabilities, TrainerCapabilities
from pipelinerl_sdk.errors import PluginError
from pipelinerl_sdk.plugins import (
    ENTRY_POINT_GROUP,
    ENV_ALLOW,
    ENV_DISABLE_AUTOLOAD,
    BackendRegistry,
    LoadResult,
    hookimpl,
    load_registry,
)
from pipelinerl_sdk.reference import capabilities as reference_caps

REPO = Path(__file__).resolve().parents[1]
INF = InferenceCapabilities()
TRN = TrainerCapabilities()


@pytest.fixture(autouse=True)
def _clean_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The switches come from the environment; start every test without them."""
    monkeypatch.delenv(ENV_DISABLE_AUTOLOAD, raising=False)
    monkeypatch.delenv(ENV_ALLOW, raising=False)


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in (ENV_DISABLE_AUTOLOAD, ENV_ALLOW)}


def run_python(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env={**clean_env(), **(env or {})},
        cwd=REPO,
        timeout=60,
        check=False,
    )


def result(registry: BackendRegistry, name: str) -> LoadResult:
    matches = [r for r in registry.load_results if r.name == name]
    assert len(matches) == 1, registry.load_results
    return matches[0]


ModuleFactory = Callable[[str], str]


@pytest.fixture
def make_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleFactory]:
    """Write a uniquely named module into a tmp dir on sys.path; returns its name. The modules
    are dropped from ``sys.modules`` afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made: list[str] = []

    def make(source: str) -> str:
        name = f"plugin_{uuid.uuid4().hex[:12]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        made.append(name)
        return name

    yield make
    for name in made:
        sys.modules.pop(name, None)


GOOD_PLUGIN = """
from pipelinerl_sdk.contracts import InferenceCapabilities, TrainerCapabilities
from pipelinerl_sdk.plugins import hookimpl

@hookimpl
def register_backends(registry):
    registry.register_inference_backend("tmp-engine", "collections:OrderedDict", InferenceCapabilities(), "tmp")
    registry.register_trainer_backend("tmp-trainer", dict, TrainerCapabilities())
"""


def ep(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)


# --- the built-in entry point ---------------------------------------------------------------------


def test_builtin_entry_point_registers_reference_backends() -> None:
    # allow-listed: installed adapters (fsdp, deepspeed...) are plugins of their own
    registry = load_registry(allow=["reference"])
    assert registry.names("inference") == ["reference"]
    assert registry.names("trainer") == ["reference"]
    ref = result(registry, "reference")
    assert ref.status == "loaded"
    assert ref.error is None
    assert ref.value == "pipelinerl_sdk.reference.plugin"
    assert ref.distribution == "pipelinerl-sdk"
    assert ref.version is not None and ref.version[0].isdigit()
    assert ref.backends == ("inference:reference", "trainer:reference")
    inference = registry.get("inference", "reference")
    assert inference.plugin == "reference"
    assert inference.factory == "pipelinerl_sdk.reference.backend:ReferenceInferenceBackend"
    assert inference.capabilities == reference_caps.INFERENCE
    trainer = registry.get("trainer", "reference")
    assert trainer.factory == "pipelinerl_sdk.reference.trainer:ReferenceTrainer"
    assert trainer.capabilities == reference_caps.TRAINER


def test_discovery_imports_no_torch() -> None:
    code = (
        "import sys; from pipelinerl_sdk.plugins import load_registry; r = load_registry(); "
        "assert ('inference', 'reference') in r.entries, r.load_results; "
        "assert 'torch' not in sys.modules; assert 'transformers' not in sys.modules; print('ok')"
    )
    proc = run_python("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


# --- in-process plugins ---------------------------------------------------------------------------


class TwoBackends:
    @hookimpl
    def register_backends(self, registry: BackendRegistry) -> None:
        registry.register_inference_backend("fake", "collections:OrderedDict", INF, "a fake engine")
        registry.register_trainer_backend("fake", dict, TRN)


def test_in_process_plugin_registers() -> None:
    registry = load_registry(autoload=False, plugins={"mine": TwoBackends()})
    assert registry.load_results == [
        LoadResult(
            "mine", registry.load_results[0].value, None, None, "loaded", None, ("inference:fake", "trainer:fake")
        )
    ]
    entry = registry.get("inference", "fake")
    assert (entry.kind, entry.name, entry.plugin, entry.description) == ("inference", "fake", "mine", "a fake engine")
    assert entry.factory == "collections:OrderedDict"
    assert entry.capabilities is INF
    assert registry.factory("trainer", "fake") is dict
    assert registry.names("inference") == ["fake"]


def test_module_plugin_in_process(make_module: ModuleFactory) -> None:
    name = make_module(GOOD_PLUGIN)
    module = __import__(name)
    registry = load_registry(autoload=False, plugins={"tmp": module})
    assert result(registry, "tmp").backends == ("inference:tmp-engine", "trainer:tmp-trainer")


def test_factory_path_is_resolved_lazily(make_module: ModuleFactory) -> None:
    engine = make_module(
        """
        import sys
        IMPORTS = sys.modules[__name__]

        class Engine:
            def __init__(self, size):
                self.size = size
        """
    )

    class Lazy:
        @hookimpl
        def register_backends(self, registry: BackendRegistry) -> None:
            registry.register_inference_backend("lazy", f"{engine}:Engine", INF)
            registry.register_inference_backend("od", "collections:OrderedDict", INF)
            registry.register_inference_backend("od-method", "collections:OrderedDict.fromkeys", INF)

    registry = load_registry(autoload=False, plugins={"lazy-plugin": Lazy()})
    assert engine not in sys.modules, "registration must not import the factory's module"
    factory = registry.factory("inference", "lazy")
    assert engine in sys.modules
    assert factory.__module__ == engine and factory.__name__ == "Engine"
    assert factory(7).size == 7
    assert registry.factory("inference", "od") is OrderedDict
    assert registry.factory("inference", "od-method")("ab") == OrderedDict(a=None, b=None)


@pytest.mark.parametrize(
    ("path", "cause"),
    [
        ("collections:NoSuchThing", "AttributeError"),
        ("no_such_module_pipelinerl_test:Engine", "ModuleNotFoundError"),
        ("collections:OrderedDict.nope", "AttributeError"),
    ],
)
def test_bad_factory_path_names_plugin_and_backend(path: str, cause: str) -> None:
    class Bad:
        @hookimpl
        def register_backends(self, registry: BackendRegistry) -> None:
            registry.register_trainer_backend("broken-engine", path, TRN)

    registry = load_registry(autoload=False, plugins={"bad-plugin": Bad()})
    assert result(registry, "bad-plugin").status == "loaded"  # nothing imported yet
    with pytest.raises(PluginError) as info:
        registry.factory("trainer", "broken-engine")
    message = str(info.value)
    assert message.startswith(
        f"Error importing trainer backend 'broken-engine' from plugin 'bad-plugin' ({path}): {cause}"
    )
    assert "Is the engine installed" in message


def test_direct_registration_and_get_unknown() -> None:
    registry = BackendRegistry()
    registry.register_inference_backend("b", dict, INF)
    registry.register_inference_backend("a", dict, INF)
    assert registry.get("inference", "a").plugin == "<direct>"
    with pytest.raises(PluginError) as info:
        registry.get("inference", "nope")
    assert str(info.value) == "no inference backend named 'nope' (installed: a, b); see `pipelinerl backends`"
    with pytest.raises(PluginError, match=r"no trainer backend named 'a' \(installed: none\)"):
        registry.factory("trainer", "a")


def test_get_unknown_lists_installed_and_failed_plugins() -> None:
    registry = load_registry(entry_points=[ep("ghost", "no_such_module_pipelinerl_test")], plugins={"t": TwoBackends()})
    with pytest.raises(PluginError) as info:
        registry.get("inference", "vllm")
    assert str(info.value) == (
        "no inference backend named 'vllm' (installed: fake); plugins that failed to load: ghost; "
        "see `pipelinerl backends`"
    )


# --- guarded entry-point loading ------------------------------------------------------------------


def test_broken_entry_point_does_not_hide_a_good_one(make_module: ModuleFactory) -> None:
    good = make_module(GOOD_PLUGIN)
    registry = load_registry(
        entry_points=[ep("broken", "no_such_module_pipelinerl_test.plugin"), ep("good", good)],
    )
    broken = result(registry, "broken")
    assert broken.status == "failed"
    assert broken.value == "no_such_module_pipelinerl_test.plugin"
    assert (broken.distribution, broken.version) == (None, None)
    assert broken.error is not None
    assert broken.error.startswith('Error importing plugin "broken": ModuleNotFoundError: ')
    assert "no_such_module_pipelinerl_test" in broken.error
    ok = result(registry, "good")
    assert (ok.status, ok.error) == ("loaded", None)
    assert ok.backends == ("inference:tmp-engine", "trainer:tmp-trainer")
    assert registry.get("inference", "tmp-engine").plugin == "good"
    assert registry.factory("inference", "tmp-engine") is OrderedDict
    assert ("inference", "reference") not in registry.entries  # only the given entry points


def test_entry_point_raising_at_import(make_module: ModuleFactory) -> None:
    bad = make_module("raise RuntimeError('engine 9.9 required')\n")
    good = make_module(GOOD_PLUGIN)
    registry = load_registry(entry_points=[ep("a-bad", bad), ep("b-good", good)])
    failed = result(registry, "a-bad")
    assert failed.status == "failed"
    assert failed.error is not None
    assert failed.error.startswith('Error importing plugin "a-bad": RuntimeError: engine 9.9 required (at ')
    assert f"{bad}.py:1)" in failed.error
    assert result(registry, "b-good").status == "loaded"


def test_entry_point_with_attr_value(make_module: ModuleFactory) -> None:
    module = make_module(
        """
        from pipelinerl_sdk.contracts import InferenceCapabilities
        from pipelinerl_sdk.plugins import hookimpl

        class Plugin:
            @hookimpl
            def register_backends(self, registry):
                registry.register_inference_backend("obj", "collections:OrderedDict", InferenceCapabilities())

        PLUGIN = Plugin()
        """
    )
    registry = load_registry(entry_points=[ep("objplug", f"{module}:PLUGIN"), ep("missing", f"{module}:NOPE")])
    assert result(registry, "objplug").backends == ("inference:obj",)
    missing = result(registry, "missing")
    assert missing.status == "failed"
    assert missing.error is not None and missing.error.startswith('Error importing plugin "missing": AttributeError')


def test_unknown_hook_fails_only_its_plugin(make_module: ModuleFactory) -> None:
    typo = make_module(
        """
        from pipelinerl_sdk.plugins import hookimpl

        @hookimpl
        def register_backend(registry):  # typo: the hook is register_backends
            pass
        """
    )
    good = make_module(GOOD_PLUGIN)

    class TypoToo:
        @hookimpl
        def register_backend(self, registry: BackendRegistry) -> None:
            pass

    registry = load_registry(entry_points=[ep("typo", typo), ep("good", good)], plugins={"typo-too": TypoToo()})
    for name in ("typo", "typo-too"):
        r = result(registry, name)
        assert r.status == "failed"
        assert r.error is not None and "unknown hook 'register_backend'" in r.error
    assert result(registry, "good").status == "loaded"
    assert registry.names("inference") == ["tmp-engine"]


def test_hookimpl_with_wrong_signature_fails() -> None:
    class WrongArgs:
        @hookimpl
        def register_backends(self, registry: BackendRegistry, config: Any) -> None:
            pass

    registry = load_registry(autoload=False, plugins={"wrong": WrongArgs(), "t": TwoBackends()})
    r = result(registry, "wrong")
    assert r.status == "failed"
    assert r.error is not None and "PluginValidationError" in r.error and "config" in r.error
    assert result(registry, "t").status == "loaded"


def test_failing_register_backends_is_rolled_back() -> None:
    class HalfWay:
        @hookimpl
        def register_backends(self, registry: BackendRegistry) -> None:
            registry.register_inference_backend("half-a", dict, INF)
            registry.register_trainer_backend("half-b", dict, TRN)
            raise RuntimeError("engine config missing")

    registry = load_registry(autoload=False, plugins={"first": TwoBackends(), "half": HalfWay()})
    half = result(registry, "half")
    assert half.status == "failed"
    assert half.backends == ()
    assert half.error is not None
    assert half.error.startswith('Error in plugin "half" register_backends: RuntimeError: engine config missing (at ')
    assert sorted(registry.entries) == [("inference", "fake"), ("trainer", "fake")]
    assert result(registry, "first").status == "loaded"


def test_duplicate_backend_name_fails_the_second_plugin(make_module: ModuleFactory) -> None:
    good = make_module(GOOD_PLUGIN)

    class Clash:
        @hookimpl
        def register_backends(self, registry: BackendRegistry) -> None:
            registry.register_trainer_backend("own-trainer", dict, TRN)
            registry.register_inference_backend("tmp-engine", dict, INF)

    # Entry points load first (sorted by name), then in-process plugins.
    registry = load_registry(entry_points=[ep("aaa", good)], plugins={"zzz": Clash()})
    assert result(registry, "aaa").status == "loaded"
    clash = result(registry, "zzz")
    assert clash.status == "failed"
    assert clash.error is not None
    assert clash.error.startswith(
        'Error in plugin "zzz" register_backends: PluginError: inference backend '
        "'tmp-engine' registered twice: by 'aaa' and by 'zzz'; uninstall one or use PIPELINERL_PLUGINS to choose"
    )
    # The first registration stands; the clashing plugin's other backend is rolled back.
    assert registry.get("inference", "tmp-engine").plugin == "aaa"
    assert registry.get("inference", "tmp-engine").factory == "collections:OrderedDict"
    assert ("trainer", "own-trainer") not in registry.entries


def test_same_name_different_kind_is_not_a_clash() -> None:
    registry = load_registry(autoload=False, plugins={"t": TwoBackends()})
    assert set(registry.entries) == {("inference", "fake"), ("trainer", "fake")}


@pytest.mark.parametrize(
    ("register", "message"),
    [
        (
            lambda r: r.register_inference_backend("has space", dict, INF),
            "plugin 'p': invalid backend name 'has space'",
        ),
        (lambda r: r.register_inference_backend("", dict, INF), "plugin 'p': invalid backend name ''"),
        (lambda r: r.register_trainer_backend("9lives", dict, TRN), "plugin 'p': invalid backend name '9lives'"),
        (
            lambda r: r.register_inference_backend("ok", dict, TRN),
            "plugin 'p': inference backend 'ok' must declare InferenceCapabilities",
        ),
        (
            lambda r: r.register_trainer_backend("ok", dict, INF),
            "plugin 'p': trainer backend 'ok' must declare TrainerCapabilities",
        ),
        (
            lambda r: r.register_trainer_backend("ok", dict, {"sharded": True}),
            "plugin 'p': trainer backend 'ok' must declare TrainerCapabilities",
        ),
        (
            lambda r: r.register_inference_backend("ok", "collections.OrderedDict", INF),
            "plugin 'p': factory 'collections.OrderedDict' must be 'module:attr'",
        ),
    ],
)
def test_invalid_registrations_fail_with_clear_message(
    register: Callable[[BackendRegistry], None], message: str
) -> None:
    class Plugin:
        @hookimpl
        def register_backends(self, registry: BackendRegistry) -> None:
            register(registry)

    registry = load_registry(autoload=False, plugins={"p": Plugin()})
    r = result(registry, "p")
    assert r.status == "failed"
    assert r.error is not None
    assert r.error.startswith(f'Error in plugin "p" register_backends: PluginError: {message}')
    assert registry.entries == {}


def test_valid_name_forms() -> None:
    class Names:
        @hookimpl
        def register_backends(self, registry: BackendRegistry) -> None:
            for name in ("vllm", "sglang-0.5", "deep_speed", "a.b-c"):
                registry.register_inference_backend(name, dict, INF)

    registry = load_registry(autoload=False, plugins={"n": Names()})
    assert registry.names("inference") == ["a.b-c", "deep_speed", "sglang-0.5", "vllm"]


def test_same_entry_point_name_twice_is_skipped(make_module: ModuleFactory) -> None:
    good = make_module(GOOD_PLUGIN)
    registry = load_registry(entry_points=[ep("dup", good), ep("dup", "no_such_module_pipelinerl_test")])
    statuses = sorted((r.status, r.error) for r in registry.load_results)
    # Sorting by name is stable: the first one loads, the second is skipped unimported.
    assert statuses == [("loaded", None), ("skipped", "an entry point of that name was already loaded")]


# --- switches ---------------------------------------------------------------------------------------


def test_autoload_false_loads_no_entry_point() -> None:
    registry = load_registry(autoload=False, entry_points=[ep("broken", "no_such_module_pipelinerl_test")])
    assert registry.load_results == []
    assert registry.entries == {}
    assert load_registry(autoload=False).entries == {}


def test_allow_list_skips_the_others(make_module: ModuleFactory) -> None:
    good = make_module(GOOD_PLUGIN)
    registry = load_registry(
        allow=["x"], entry_points=[ep("x", good), ep("y", "no_such_module_pipelinerl_test"), ep("z", good)]
    )
    assert [(r.name, r.status, r.error) for r in registry.load_results] == [
        ("y", "skipped", "not in PIPELINERL_PLUGINS"),
        ("z", "skipped", "not in PIPELINERL_PLUGINS"),
        ("x", "loaded", None),
    ]
    assert registry.names("inference") == ["tmp-engine"]


def test_allow_list_does_not_apply_to_in_process_plugins() -> None:
    registry = load_registry(allow=[], plugins={"t": TwoBackends()})
    assert result(registry, "reference").status == "skipped"
    assert result(registry, "t").status == "loaded"
    assert registry.names("inference") == ["fake"]


def test_allow_list_matches_distribution_name() -> None:
    registry = load_registry(allow=["pipelinerl-sdk"])
    assert result(registry, "reference").status == "loaded"
    assert registry.names("trainer") == ["reference"]


def test_env_disables_autoload(monkeypatch: pytest.MonkeyPatch) -> None:
    for value in ("1", "true", "yes"):
        monkeypatch.setenv(ENV_DISABLE_AUTOLOAD, value)
        registry = load_registry(plugins={"t": TwoBackends()})
        assert [r.name for r in registry.load_results] == ["t"]
        assert registry.names("inference") == ["fake"]
    # Entry points load again: the built-in backend (and any installed adapter) is back.
    monkeypatch.setenv(ENV_DISABLE_AUTOLOAD, "0")
    names = load_registry().names("inference")
    assert "reference" in names and "fake" not in names
    monkeypatch.setenv(ENV_DISABLE_AUTOLOAD, "1")
    assert load_registry(autoload=True).names("inference") == names, "the argument wins"


def test_env_allow_list(monkeypatch: pytest.MonkeyPatch, make_module: ModuleFactory) -> None:
    good = make_module(GOOD_PLUGIN)
    eps = [ep("one", good), ep("two", "no_such_module_pipelinerl_test")]
    monkeypatch.setenv(ENV_ALLOW, " one , ,three")
    registry = load_registry(entry_points=eps)
    assert [(r.name, r.status) for r in registry.load_results] == [("two", "skipped"), ("one", "loaded")]
    monkeypatch.setenv(ENV_ALLOW, "someone-else")
    registry = load_registry()
    assert ("reference", "skipped", "not in PIPELINERL_PLUGINS") in [
        (r.name, r.status, r.error) for r in registry.load_results
    ]
    assert {r.status for r in registry.load_results} == {"skipped"}
    assert registry.entries == {}
    assert load_registry(allow=["reference"]).names("inference") == ["reference"], "the argument wins"


# --- CLI ------------------------------------------------------------------------------------------


def caps_json(caps: InferenceCapabilities | TrainerCapabilities) -> dict[str, Any]:
    return {
        f.name: sorted(v) if isinstance(v := getattr(caps, f.name), frozenset) else v for f in dataclasses.fields(caps)
    }


def test_cli_backends_json() -> None:
    # allow-listed: installed adapters are plugins of their own
    proc = run_python("-m", "pipelinerl_sdk.cli", "backends", "--json", env={ENV_ALLOW: "reference"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    backends = {(b["kind"], b["name"]): b for b in out["backends"]}
    assert set(backends) == {("inference", "reference"), ("trainer", "reference")}
    inference = backends[("inference", "reference")]
    assert inference["plugin"] == "reference"
    assert inference["capabilities"] == caps_json(reference_caps.INFERENCE)
    assert inference["capabilities"]["receive_modes"] == ["direct", "staged"]
    trainer = backends[("trainer", "reference")]
    assert trainer["capabilities"] == caps_json(reference_caps.TRAINER)
    assert set(trainer["capabilities"]) == {"sharded", "max_world_size", "group_backends", "dtypes"}
    [plugin] = [p for p in out["plugins"] if p["status"] != "skipped"]
    assert plugin["entry_point"] == "reference"
    assert plugin["status"] == "loaded"
    assert plugin["distribution"] == "pipelinerl-sdk"
    assert plugin["error"] is None
    assert plugin["backends"] == ["inference:reference", "trainer:reference"]


def test_cli_backends_plain() -> None:
    proc = run_python("-m", "pipelinerl_sdk.cli", "backends", env={ENV_ALLOW: "reference"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "backends:"
    assert any(line.split()[:2] == ["inference", "reference"] for line in lines)
    assert any(line.split()[:2] == ["trainer", "reference"] for line in lines)
    plugins = lines.index("plugins:")
    assert ["reference", "loaded", "pipelinerl-sdk"] in [line.split()[:3] for line in lines[plugins + 1 :]]


# --- typed creation, capabilities declared once, the benchmark anchor -----------------------------


class _Registers:
    """An in-process plugin registering what ``register`` does."""

    def __init__(self, register: Callable[[BackendRegistry], None]) -> None:
        self.register = register

    @hookimpl
    def register_backends(self, registry: BackendRegistry) -> None:
        self.register(registry)


def _registry(register: Callable[[BackendRegistry], None]) -> BackendRegistry:
    registry = load_registry(autoload=False, plugins={"p": _Registers(register)})
    assert result(registry, "p").status == "loaded"
    return registry


def test_create_trainer_returns_the_backend() -> None:
    from pipelinerl_sdk.reference.trainer import ReferenceTrainer

    trainer = load_registry(allow=["reference"]).create_trainer("reference")
    assert type(trainer) is ReferenceTrainer
    assert trainer.capabilities == reference_caps.TRAINER


def test_create_refuses_a_factory_that_returns_no_backend() -> None:
    from pipelinerl_sdk.contracts import ServeConfig

    registry = _registry(
        lambda r: (r.register_trainer_backend("t", dict, TRN), r.register_inference_backend("i", lambda c: c, INF))
    )
    with pytest.raises(PluginError) as info:
        registry.create_trainer("t")
    assert str(info.value) == (
        "trainer backend 't' from plugin 'p': its factory (<class 'dict'>) returned a dict, not a TrainerBackend; "
        "subclass pipelinerl_sdk.TrainerBackend"
    )
    with pytest.raises(PluginError, match=r"inference backend 'i' from plugin 'p': .* returned a ServeConfig, not an?"):
        registry.create_inference("i", ServeConfig(model="m"))


def test_create_refuses_capabilities_that_differ_from_the_registration() -> None:
    """Registered sharded, the class says replicated: creation fails naming the field (the suite reads
    the registration for launched targets and the backend's own for URL targets; they must agree)."""
    wrong = dataclasses.replace(reference_caps.TRAINER, sharded=True)
    registry = _registry(
        lambda r: r.register_trainer_backend("lying", "pipelinerl_sdk.reference.trainer:ReferenceTrainer", wrong)
    )
    with pytest.raises(PluginError) as info:
        registry.create_trainer("lying")
    message = str(info.value)
    assert message.startswith("trainer backend 'lying' from plugin 'p': the backend's capabilities differ")
    assert "sharded: registered True, backend has False" in message
    assert "max_world_size" not in message  # only the fields that differ


def test_bench_anchor_is_registered_resolved_lazily_and_guarded() -> None:
    from pipelinerl_sdk.bench.anchor import load_anchor

    registry = _registry(
        lambda r: (
            r.register_inference_backend("standalone", dict, INF, bench_anchor="json:dumps"),
            r.register_inference_backend("flow", dict, INF, bench_anchor="os:environ"),  # has update()
            r.register_inference_backend("none", dict, INF),
            r.register_inference_backend("missing", dict, INF, bench_anchor="no_such_module_pipelinerl_test:A"),
        )
    )
    assert registry.get("inference", "standalone").bench_anchor == "json:dumps"
    standalone, flow = load_anchor("standalone", registry), load_anchor("flow", registry)
    assert standalone is not None and standalone.standalone is json.dumps and standalone.flow is None
    assert flow is not None and flow.flow is os.environ and flow.standalone is None
    assert load_anchor("none", registry) is None
    with pytest.raises(PluginError) as info:
        load_anchor("missing", registry)
    assert str(info.value).startswith(
        "Error importing inference bench anchor 'missing' from plugin 'p' (no_such_module_pipelinerl_test:A): "
        "ModuleNotFoundError"
    )
    with pytest.raises(PluginError, match=r"bench_anchor 'x\.y' must be 'module:attr'"):
        BackendRegistry().register_inference_backend("x", dict, INF, bench_anchor="x.y")
