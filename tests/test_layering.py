"""Layers point one way (DESIGN.md section 1): protocol/errors -> contracts -> weights -> http ->
kits -> everything else (adapters, pipeline, cli, bench, reference, conformance). A module may
import from its own layer and the layers before it, never from a later one. Checked on the source
(AST, every import, ``TYPE_CHECKING`` and function-local ones included), no dependency."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Layer order, lowest first; a module belongs to the layer of its longest matching prefix, and
#: anything not listed (and every adapter) to the last, unlisted layer, which may import anything.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # The bucket plan is part of the wire: its digest travels in every update request and the
    # contract's validation recomputes it. Pure Python, it imports only the protocol.
    ("protocol", ("pipelinerl_sdk.protocol", "pipelinerl_sdk.errors", "pipelinerl_sdk.weights.buckets")),
    ("contracts", ("pipelinerl_sdk.contracts",)),
    ("weights", ("pipelinerl_sdk.weights",)),
    ("http", ("pipelinerl_sdk.http",)),
    ("kits", ("pipelinerl_sdk.kit", "pipelinerl_sdk.hf", "pipelinerl_sdk.logprobs")),
)
TOP = len(LAYERS)


def layer_of(module: str) -> int:
    best, depth = TOP, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > depth:
                best, depth = i, len(p)
    return best


def layer_name(i: int) -> str:
    return LAYERS[i][0] if i < TOP else "top"


def imports(module: str, source: str, *, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, imported module) of every import in ``source``; relative ones resolved."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            yield node.lineno, base
            for alias in node.names:  # ``from pipelinerl_sdk import http`` imports a module
                yield node.lineno, f"{base}.{alias.name}"


def violations(sources: Mapping[str, tuple[str, bool]]) -> list[str]:
    """``module -> (source, is_package)``; one message per import pointing to a later layer."""
    found: dict[tuple[str, int], str] = {}
    for module, (source, is_package) in sorted(sources.items()):
        own = layer_of(module)
        for line, target in imports(module, source, is_package=is_package):
            if not target.startswith("pipelinerl_sdk.") or (module, line) in found:
                continue
            theirs = layer_of(target)
            if theirs > own:
                found[module, line] = (
                    f"{module}:{line} ({layer_name(own)}) imports {target} ({layer_name(theirs)}): layers point one way"
                )
    return sorted(found.values())


def tree() -> dict[str, tuple[str, bool]]:
    out = {}
    for path in (ROOT / "pipelinerl_sdk").rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path.read_text(), is_package)
    return out


def test_the_core_imports_only_downwards() -> None:
    sources = tree()
    assert "pipelinerl_sdk.contracts" in sources and "pipelinerl_sdk.weights.publisher" in sources
    assert violations(sources) == []


@pytest.mark.parametrize(
    ("module", "line", "wrong"),
    [
        ("pipelinerl_sdk.contracts", "from pipelinerl_sdk.http.server import build_router", "contracts"),
        ("pipelinerl_sdk.weights.publisher", "from pipelinerl_sdk.http.client import InferenceClient", "weights"),
        ("pipelinerl_sdk.weights.receive", "import pipelinerl_sdk.kit.inference.update", "weights"),
        ("pipelinerl_sdk.http.server", "from ..kit.inference import serve", "http"),
        ("pipelinerl_sdk.protocol", "from pipelinerl_sdk import contracts", "protocol"),
        ("pipelinerl_sdk.kit.inference.chat", "from pipelinerl_sdk.reference.engine import SamplingParams", "kits"),
    ],
)
def test_a_wrong_way_import_is_reported(module: str, line: str, wrong: str) -> None:
    """The check can fail: one wrong-way import added to a real module (inside a function, as
    lazy imports are) is reported with the module, the line and both layers."""
    sources = tree()
    source, is_package = sources[module]
    lineno = source.count("\n") + 4  # after two blank lines and the def
    sources[module] = (source + f"\n\ndef _lazy() -> None:\n    {line}\n", is_package)
    found = violations(sources)
    assert len(found) == 1, found
    assert found[0].startswith(f"{module}:{lineno} ({wrong}) imports pipelinerl_sdk."), found
    assert found[0].endswith("layers point one way")
