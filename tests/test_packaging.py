"""Packaging a GPU user can install: no exact torch pin in any package's metadata, and every
adapter's requirements (the SDK extras it names, expanded) hold beside its engine's own GPU pins.

The engines' pins are the versions a real resolution chose (``tests/data/gpu_resolutions.json``:
``pip install --dry-run --report`` of ``vllm==0.32.0`` / ``sglang==0.5.23`` with the SDK and the
adapter, against the public registry; the command is in the file). That resolution downloads ~4.5 GB
of CUDA wheels per engine, so CI checks the declared specifiers against it offline instead.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
SDK = "pipelinerl-sdk"
ADAPTERS = ("vllm", "sglang", "fsdp", "deepspeed", "torchtitan")
RESOLUTIONS: dict[str, dict[str, str]] = json.loads((ROOT / "tests/data/gpu_resolutions.json").read_text())[
    "resolutions"
]
#: Which engine resolution each adapter must fit beside (trainer adapters share an environment with
#: an inference engine, as scripts/setup-vllm does with FSDP; DeepSpeed and TorchTitan are checked
#: for the packages the resolution holds).
ENGINE_OF = {
    "vllm": "vllm==0.32.0",
    "sglang": "sglang==0.5.23",
    "fsdp": "vllm==0.32.0",
    "deepspeed": "sglang==0.5.23",
    "torchtitan": "sglang==0.5.23",
}


def _project(path: Path) -> dict[str, object]:
    project: dict[str, object] = tomllib.loads(path.read_text())["project"]
    return project


def _sdk_extras() -> dict[str, list[str]]:
    extras: dict[str, list[str]] = _project(ROOT / "pyproject.toml")["optional-dependencies"]  # type: ignore[assignment]
    return extras


def expand(requirements: list[str], extras: dict[str, list[str]]) -> list[Requirement]:
    """``requirements`` with every ``pipelinerl-sdk[...]`` replaced by the SDK's dependencies and the
    named extras, recursively (as pip expands them)."""
    out: list[Requirement] = []
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if canonicalize_name(req.name) != SDK:
            out.append(req)
            continue
        if "" not in seen:
            seen.add("")
            todo += [Requirement(r) for r in _project(ROOT / "pyproject.toml")["dependencies"]]  # type: ignore[union-attr]
        for extra in req.extras - seen:
            seen.add(extra)
            todo += [Requirement(r) for r in extras[extra]]
    return out


def unsatisfied(requirements: list[Requirement], resolved: dict[str, str]) -> list[str]:
    """The requirements the resolved versions break (a requirement on a package the resolution
    does not hold cannot conflict with it and is not listed)."""
    bad = []
    for req in requirements:
        version = resolved.get(canonicalize_name(req.name))
        if version is not None and not req.specifier.contains(version, prereleases=True):
            bad.append(f"{req} (the engine resolves {req.name}=={version})")
    return bad


def _adapter_requirements(name: str) -> list[str]:
    requirements: list[str] = _project(ROOT / "adapters" / name / "pyproject.toml")["dependencies"]  # type: ignore[assignment]
    return requirements


def test_no_exact_torch_pin_in_any_metadata() -> None:
    files = [ROOT / "pyproject.toml", *(ROOT / "adapters" / a / "pyproject.toml" for a in ADAPTERS)]
    files.append(ROOT / "examples/ddp_trainer/pyproject.toml")
    for path in files:
        project = _project(path)
        lists = [project.get("dependencies", []), *dict(project.get("optional-dependencies", {})).values()]  # type: ignore[call-overload]
        for requirement in (Requirement(r) for reqs in lists for r in reqs):
            if requirement.name == "torch":
                ops = {s.operator for s in requirement.specifier}
                assert not ops & {"==", "==="}, f"{path.relative_to(ROOT)}: {requirement} pins torch exactly"


def test_the_cpu_pin_lives_in_the_constraints_file() -> None:
    assert "torch==2.13.0" in (ROOT / "scripts/constraints-cpu.txt").read_text().splitlines()
    for script in ("setup", "setup-vllm", "setup-sglang", "setup-torchtitan"):
        assert "scripts/constraints-cpu.txt" in (ROOT / "scripts" / script).read_text(), script


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_adapter_requirements_hold_beside_the_engine_gpu_pins(adapter: str) -> None:
    engine = ENGINE_OF[adapter]
    requirements = expand(_adapter_requirements(adapter), _sdk_extras())
    assert {r.name for r in requirements} >= {"torch"}, "every adapter needs torch, through an SDK extra"
    assert unsatisfied(requirements, RESOLUTIONS[engine]) == []


def test_an_exact_cpu_pin_would_not_hold_beside_sglang() -> None:
    """The broken twin: the SDK's old ``reference`` extra (``torch==2.13.0``) cannot install beside
    SGLang 0.5.23, whose GPU build is torch 2.14.1."""
    old = {**_sdk_extras(), "reference": ["torch==2.13.0", "transformers>=5.16.1,<5.20"]}
    bad = unsatisfied(expand(["pipelinerl-sdk[reference]"], old), RESOLUTIONS["sglang==0.5.23"])
    assert bad == ["torch==2.13.0 (the engine resolves torch==2.14.1)"]
