"""The doors a weight update can come through, for the update checks: the SDK's own routes
(``/init_process_group``, ``/request_weight_update``) and vLLM 0.32's RL API
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``: :mod:`pipelinerl_sdk.http.vllm_rl`), which a server serves where its
capabilities declare ``vllm_rl_api``.

A check parametrized with :data:`DOORS` runs once per door (ids ``sdk`` and ``vllm_rl``; the
``vllm_rl`` run is skipped on a server that does not declare the front). Through the ``vllm_rl``
door the suite is a trainer written for vLLM's weight-transfer API: the SDK's sender driving
vLLM's calls (:class:`~pipelinerl_sdk.http.vllm_flow.VLLMFlowLink`), so every promise the check
makes (refusal before any byte, old weights kept on failure, the new version live at once,
requests in flight kept, true tags) is checked as a client of vLLM's API meets it.
"""

from __future__ import annotations

from typing import Any, Literal

import httpx
import pytest

from pipelinerl_sdk.conformance.targets import ServerUnderTest
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.http.vllm_flow import ControlTokenClient, VLLMFlowLink
from pipelinerl_sdk.protocol import ServerInfo

__all__ = ["DOORS", "Door", "VLLMDoorLink", "post_update", "vllm_update_info"]

Door = Literal["sdk", "vllm_rl"]

#: ``@pytest.mark.parametrize("door", DOORS)``: the SDK's routes, and vLLM's where declared.
DOORS = [
    pytest.param("sdk", id="sdk"),
    pytest.param("vllm_rl", id="vllm_rl", marks=pytest.mark.requires("vllm_rl_api")),
]


class VLLMDoorLink(VLLMFlowLink):
    """vLLM's flow to a server under test, with the control token. vLLM's API has no ``/info``;
    the server's own (served beside) tells the publisher its params, workers and signing."""

    def __init__(self, sut: ServerUnderTest, client: InferenceClient, info: ServerInfo) -> None:
        super().__init__(
            ControlTokenClient(sut.url, sut.control_token),
            receiving_workers=info.receiving_workers,
            signed_rendezvous=info.signed_rendezvous,
            url=sut.url,
        )
        self._sdk = client

    async def info(self) -> ServerInfo:
        return await self._sdk.info()


def _spec(p: Any) -> bool:
    return isinstance(p, dict) and {"name", "dtype", "shape"} <= set(p)


def vllm_update_info(body: dict[str, Any]) -> dict[str, Any]:
    """The ``update_info`` (op ``receive``) of a ``/request_weight_update`` body: the same
    update asked through vLLM's ``/update_weights``; params as vLLM's ``[name, dtype, shape]``
    where they parse as such, any other key kept as it is (an unknown one must be refused)."""
    info: dict[str, Any] = {"op": "receive"}
    for key, value in body.items():
        if key == "params" and isinstance(value, list):
            value = [[p["name"], p["dtype"], p["shape"]] if _spec(p) else p for p in value]
        info[key] = value
    return info


async def post_update(
    http: httpx.AsyncClient, door: Door, body: dict[str, Any] | str, headers: dict[str, str]
) -> httpx.Response:
    """Ask for the update ``body`` (a ``/request_weight_update`` body, or raw text sent as
    JSON) through ``door`` and return the server's answer to it. Through ``vllm_rl``: a session
    is opened first and closed after (whatever the answer), so each call stands alone."""
    path, payload = "/request_weight_update", body
    if door == "vllm_rl":
        path = "/update_weights"
        if not isinstance(body, str):
            payload = {"update_info": vllm_update_info(body)}
        opened = await http.post("/start_weight_update", headers=headers)
        assert opened.status_code == 200, f"/start_weight_update: {opened.status_code} {opened.text[:200]}"
    try:
        if isinstance(payload, str):
            return await http.post(path, content=payload, headers={**headers, "content-type": "application/json"})
        return await http.post(path, json=payload, headers=headers)
    finally:
        if door == "vllm_rl":  # closes the session where the refusal did not (a body that is no JSON)
            await http.post("/finish_weight_update", json={"weight_version": None}, headers=headers)
