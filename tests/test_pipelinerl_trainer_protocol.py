"""PipelineRL's trainer protocol on a real reference server (``pipelinerl serve
--weight-update-group-init-method tcp://HOST:PORT --weight-update-group-world-size 2``).

The trainer side (:class:`~pipelinerl_sdk.testing.pipelinerl_trainer.PipelineRLTrainerReplay`)
replays what PipelineRL's ``finetune_loop.WeightUpdateManager`` does (58d3934), in bfloat16 as its
trainer holds weights, world size 2 (one actor, one GPU each); only its data plane is gloo where
PipelineRL's is vLLM's PyNcclCommunicator (CUDA only). The same replay drives the vllm and sglang
servers in tests/dropin."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from pipelinerl_sdk.conformance.mirror import Mirror
from pipelinerl_sdk.errors import GroupError
from pipelinerl_sdk.http.pipelinerl_trainer import (
    ParameterInfo,
    PipelineRLGroup,
    PipelineRLGroupConfig,
    ReceiveWeightUpdateRequest,
    source_allowed,
    torch_dtype,
)
from pipelinerl_sdk.launch import ServerProcess
from pipelinerl_sdk.testing.pipelinerl_trainer import PipelineRLTrainerReplay
from pipelinerl_sdk.weights.publisher import free_port

PROMPT = [{"role": "user", "content": "Count: 1 2 3 4 5 6 7 8 9"}]


# --- the request and its options, alone -----------------------------------------------------------


def test_pipelinerls_request_json_parses_and_bad_fields_are_named() -> None:
    body = {
        "kind": "weight_update_request",
        "version": 12,
        "parameters_info": [{"name": "model.embed_tokens.weight", "shape": [512, 128], "dtype": "torch.bfloat16"}],
        "timestamp": 1.5,
        "added_later": True,
    }
    req = ReceiveWeightUpdateRequest.model_validate(body)
    assert req.version == 12 and torch_dtype(req.parameters_info[0].dtype) is torch.bfloat16
    for bad, field in (
        ({"kind": "weight_update_success"}, "kind"),
        ({"version": -1}, "version"),
        ({"parameters_info": []}, "parameters_info"),
        ({"parameters_info": [{"name": "w", "shape": [2], "dtype": "torch.nope"}]}, "dtype"),
        ({"parameters_info": [{"name": "w", "shape": [-2], "dtype": "torch.float32"}]}, "shape"),
    ):
        with pytest.raises(ValueError, match=field):
            ReceiveWeightUpdateRequest.model_validate({**body, **bad})


def test_the_group_options_name_what_cannot_hold_this_server() -> None:
    assert PipelineRLGroupConfig("tcp://127.0.0.1:9000", 5, actor_idx=1, local_ranks=2).ranks == [3, 4]
    with pytest.raises(ValueError, match="past the world size 4"):
        PipelineRLGroupConfig("tcp://127.0.0.1:9000", 4, actor_idx=1, local_ranks=2)
    with pytest.raises(ValueError, match="init_method"):
        PipelineRLGroupConfig("http://127.0.0.1:9000", 2)


def test_the_route_answers_loopback_and_the_trainers_host_only() -> None:
    cfg = PipelineRLGroupConfig("tcp://10.1.2.3:9000", 2)
    assert source_allowed(cfg, "127.0.0.1") and source_allowed(cfg, "::1") and source_allowed(cfg, "10.1.2.3")
    assert not source_allowed(cfg, "10.1.2.4") and not source_allowed(cfg, None)


GROUP = ["--weight-update-group-init-method", "tcp://127.0.0.1:9000", "--weight-update-group-world-size", "2"]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--weight-update-group-init-method", "tcp://127.0.0.1:9000"], "go together"),
        (
            ["--weight-update-group-init-method", "tcp://10.1.2.3:9000", "--weight-update-group-world-size", "2"],
            "--allow-trainer-host",
        ),
        (
            [*GROUP, "--actor-llm-idx", "1"],
            "past the world size 2",
        ),
    ],
)
def test_serve_refuses_group_options_it_cannot_serve(flags: list[str], says: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pipelinerl_sdk.cli", "serve", "--model", str(tmp_path), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr


def test_a_trainer_that_starts_after_the_stores_timeout_is_still_joined() -> None:
    """The server keeps trying to join (PipelineRL's own vLLM gives up after its store's 300 s):
    with a 1 s timeout and the trainer 3 s late, the group forms, and a broadcast arrives."""
    port = free_port()
    group = PipelineRLGroup(PipelineRLGroupConfig(f"tcp://127.0.0.1:{port}", 2, timeout_s=1.0))
    try:
        with pytest.raises(GroupError, match="not joined after 1 s"):
            group.ready(1.0)
        time.sleep(2.0)
        trainer = PipelineRLTrainerReplay("127.0.0.1", port, timeout_s=10)
        group.ready(10.0)
        info = ParameterInfo(name="w", shape=[3], dtype="torch.float32")
        sent = torch.tensor([1.0, 2.0, 3.0])
        work = trainer.pg.broadcast(sent, 0)
        ((name, got),) = list(group.receive([info]))
        work.wait()
        assert name == "w" and torch.equal(got, sent)
        trainer.close()
    finally:
        group.close()


# --- on a real server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny_model: Path) -> Iterator[tuple[ServerProcess, PipelineRLTrainerReplay]]:
    port = free_port()
    proc = ServerProcess(
        "reference",
        tiny_model,
        startup_timeout_s=120,
        options={"threads": 1, "max_model_len": 256},
        args=["--weight-update-group-init-method", f"tcp://127.0.0.1:{port}", "--weight-update-group-world-size", "2"],
    )
    proc.start()
    try:
        trainer = PipelineRLTrainerReplay("127.0.0.1", port)  # the server serves before it, then joins it
        yield proc, trainer
        trainer.close()
    finally:
        proc.stop()


def _scored(proc: ServerProcess) -> dict[str, Any]:
    body = {"messages": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": True, "return_token_ids": True}
    r = httpx.post(f"{proc.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _serves(proc: ServerProcess, mirror: Mirror, version: int) -> None:
    """The server's greedy tokens, logprobs and version tags are those of ``mirror``'s weights."""
    out = _scored(proc)
    choice = out["choices"][0]
    seq = out["prompt_token_ids"] + choice["token_ids"]
    want = mirror.logprobs(seq)[-len(choice["token_ids"]) :]
    got = torch.tensor([t["logprob"] for t in choice["logprobs"]["content"]])
    assert torch.allclose(got, want.float(), atol=1e-4), (got, want)
    assert set(choice["weight_versions"]) == {version}


@pytest.mark.integration
def test_pipelinerls_update_sequence_serves_the_new_weights_then_refusals_keep_them(
    served: tuple[ServerProcess, PipelineRLTrainerReplay], tiny_model: Path
) -> None:
    proc, trainer = served
    mirror = Mirror(tiny_model, "float32")
    _serves(proc, mirror, 0)
    mirror.perturb(seed=3, scale=0.1)
    # PipelineRL's trainer holds bfloat16 weights: the server takes them as sent, in its float32
    bf16 = [(n, t.to(torch.bfloat16)) for n, t in mirror.state().items()]
    mirror.load({n: t.float() for n, t in bf16})

    (r,) = trainer.update([proc.url], 1024, bf16)
    assert (r.status_code, r.json()["status"]) == (200, "ok"), r.text
    assert httpx.get(f"{proc.url}/health", timeout=10).json()["version"] == 1024
    _serves(proc, mirror, 1024)

    # refused, naming the field; the broadcast is still read to its end (the trainer returned)
    # and the weights of 1024 keep serving
    (stale,) = trainer.update([proc.url], 1024, bf16)
    assert stale.status_code == 409 and stale.json()["error"]["param"] == "version", stale.text
    noise = [(n, torch.randn_like(t)) for n, t in bf16]
    renamed = [("model.value_head.weight", noise[0][1]), *noise[1:]]
    (unknown,) = trainer.update([proc.url], 2048, renamed)
    assert unknown.status_code == 422, unknown.text
    assert unknown.json()["error"]["param"] == "parameters_info[0].name"
    _serves(proc, mirror, 1024)

    # the next good update goes through on the same group
    mirror.perturb(seed=4, scale=0.1)
    bf16 = [(n, t.to(torch.bfloat16)) for n, t in mirror.state().items()]
    mirror.load({n: t.float() for n, t in bf16})
    (r,) = trainer.update([proc.url], 2048, bf16)
    assert r.status_code == 200, r.text
    _serves(proc, mirror, 2048)
