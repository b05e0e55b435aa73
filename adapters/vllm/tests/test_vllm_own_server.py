"""vLLM's own server as a third-party target: which of the SDK's promises ``vllm serve`` keeps
(:mod:`pipelinerl_sdk_vllm.own_server`), on this machine. The table in the README is this run's;
a vLLM release that changes an answer fails here, naming the finding, and the table is updated."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None or importlib.util.find_spec("pipelinerl_sdk_vllm") is None,
        reason="vLLM or the vLLM adapter is not installed here: run these tests in the env scripts/setup-vllm prints",
    ),
]

#: vLLM 0.32 (the CPU build, no GPU here): the README's table.
SEEN = {
    "every generated token carries the version of the weights that computed it": "no",
    "weight-update and pause routes answer only a credential (the SDK: its control token)": "no",
    "requests in flight are frozen by a pause (mode=keep), kept, and finish after it": "yes",
    "a bad weight-transfer request is a 4xx naming the field": "no",
    "a second update session while one is open is a 4xx (the SDK: 409)": "no",
    "a bad update is refused before any byte is sent": "untested",
    "the new weights go live at once, for every later token": "untested",
    "a broadcast that fails half-way leaves the old weights serving, unpaused": "untested",
    "requests in flight across an update are kept, with true per-token versions": "untested",
    "a failed update leaves the old weights serving": "no",
}


def test_vllms_own_server_keeps_the_promises_the_readme_says(tiny_model: Path) -> None:
    """Each finding as the README states it, with the evidence it rests on: no per-token
    version; ``/pause`` open without the API key the chat needs; a keep-pause freezes four
    streams and all finish; errors of the RL routes are 500s; vLLM's transfers cannot init
    without CUDA; a failed ``update_weights`` leaves the engine unable to serve."""
    from pipelinerl_sdk_vllm.own_server import OwnServer, probe, table

    with OwnServer(tiny_model) as server:
        findings = probe(server.url, server.api_key)
    got = {f.promise: f.kept for f in findings}
    assert got == SEEN, "vLLM's own server answers otherwise than the README's table:\n" + table(findings)
    evidence = {f.promise: f.evidence for f in findings}
    assert "POST /pause?mode=keep: 200" in evidence[list(SEEN)[1]]
    assert "4 of 4 ended 'length'" in evidence[list(SEEN)[2]]
    assert "Cannot access accelerator device" in evidence[list(SEEN)[5]]
    dead = evidence[list(SEEN)[9]]  # the engine died: a 500 naming it, or the server already gone
    assert ("the next chat: 500" in dead and "EngineCore" in dead) or "the server exited" in dead, dead
