"""vLLM's own trainer-side code, unchanged (``WeightTransferTrainerFactory.trainer_init``,
``ModuleSource``, ``send_weights``), updating SDK servers through vLLM's RL routes with the
adapter's ``pipelinerl`` trainer engine (:mod:`pipelinerl_sdk_vllm.trainer_engine`), while
requests run (:func:`pipelinerl_sdk_vllm.testing.vllm_trainer_updates_while_requests_run`).

The servers: ``PIPELINERL_VLLM_FLOW_SERVERS="NAME=PYTHON;..."`` (scripts/test sets it for sglang,
whose environment has no vLLM), else the reference server in this environment. Dynamo's own
tests run the same check on its 2-worker server; vLLM's own server is in test_vllm_adapter.py."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from pipelinerl_sdk.launch import ServerProcess

pytestmark = pytest.mark.integration

SERVERS = dict(
    entry.split("=", 1) for entry in os.environ.get("PIPELINERL_VLLM_FLOW_SERVERS", "").split(";") if "=" in entry
) or {"reference": sys.executable}
OPTIONS = {"reference": {"threads": 1, "max_model_len": 512}}


@pytest.fixture(scope="module", params=sorted(SERVERS))
def sdk_server(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[ServerProcess]:
    name = request.param
    proc = ServerProcess(
        name,
        tiny_model,
        python=SERVERS[name],
        env={"TOKENIZERS_PARALLELISM": "false"},
        options=OPTIONS.get(name, {}),
        startup_timeout_s=600,
    )
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


def test_the_trainer_engine_is_registered_by_vllms_plugin_loader() -> None:
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from pipelinerl_sdk_vllm.trainer_engine import PipelineRLTrainerWeightTransferEngine

    assert WeightTransferTrainerFactory._registry["pipelinerl"]() is PipelineRLTrainerWeightTransferEngine


def test_vllms_trainer_code_updates_the_server_while_requests_run(sdk_server: ServerProcess, tiny_model: Path) -> None:
    from pipelinerl_sdk_vllm.testing import vllm_trainer_updates_while_requests_run

    vllm_trainer_updates_while_requests_run(sdk_server.url, sdk_server.control_token, tiny_model)


def test_vllms_own_http_client_gets_401_from_an_sdk_server(sdk_server: ServerProcess) -> None:
    """vLLM's ``HTTPVLLMWeightSyncClient`` sends no credentials; an SDK server never serves the
    RL routes unauthenticated (``ControlTokenClient`` is the same four calls with the token)."""
    import requests

    with pytest.raises(requests.HTTPError, match="401"):
        HTTPVLLMWeightSyncClient(sdk_server.url, timeout=30).start_weight_update()
