"""Server-wide generation settings as vLLM names them (``pipelinerl serve --served-model-name A B
--return-tokens-as-token-ids``), on a real reference server: what ``/v1/models`` lists, which
names a request may give, and logprob tokens as ``token_id:N`` for a client that never asks
(PipelineRL's actor reads ids that way and sends no such field)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from pipelinerl_sdk.cli import build_parser
from pipelinerl_sdk.contracts import InferenceCapabilities
from pipelinerl_sdk.http.server import build_router
from pipelinerl_sdk.launch import ServerProcess

API_KEY = "sk-test-settings"
NAMES = ("policy", "policy-alias")
MESSAGES: list[Any] = [{"role": "user", "content": "Count: 1 2 3 4 5 6 7 8 9"}]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def test_cli_reads_the_settings_as_vllm_spells_them() -> None:
    args = build_parser().parse_args(
        ["serve", "--model", "m", "--served-model-name", "a", "b", "--return-tokens-as-token-ids"]
    )
    assert args.served_model_name == ["a", "b"] and args.return_tokens_as_token_ids is True
    args = build_parser().parse_args(["serve", "--model", "m"])
    assert args.served_model_name is None and args.return_tokens_as_token_ids is False


class RawOnly:
    """What build_router reads of a backend before serving: a name, a model, default capabilities
    (raw logprobs only)."""

    name = "raw-only"
    model_name = "/models/tiny"
    capabilities = InferenceCapabilities()


def test_an_empty_served_name_is_refused_at_start_up() -> None:
    with pytest.raises(ValueError, match="served_model_names"):
        build_router(RawOnly(), control_token="c", api_key=None, served_model_names=("ok", " "))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def served(tiny_model: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "reference",
        tiny_model,
        api_key=API_KEY,
        startup_timeout_s=120,
        options={"threads": 1, "max_model_len": 256},
        args=["--served-model-name", *NAMES, "--return-tokens-as-token-ids"],
    )
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


def post(served: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", json=body, headers=HEADERS, timeout=60)


@pytest.mark.integration
def test_models_lists_every_served_name_and_requests_may_use_any(served: ServerProcess, tiny_model: Path) -> None:
    data = httpx.get(f"{served.url}/v1/models", headers=HEADERS, timeout=10).json()["data"]
    assert [m["id"] for m in data] == list(NAMES)
    for name in NAMES:
        r = post(served, "/v1/chat/completions", {"model": name, "messages": MESSAGES, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == NAMES[0]  # responses carry the first name, as vLLM's
    for other in (tiny_model.name, str(tiny_model)):  # the directory is no longer a name
        r = post(served, "/v1/chat/completions", {"model": other, "messages": MESSAGES, "max_tokens": 2})
        assert r.status_code == 404 and "policy" in r.text and other in r.text, r.text


@pytest.mark.integration
def test_logprob_tokens_are_ids_without_asking(served: ServerProcess) -> None:
    """The body PipelineRL's actor sends (no ``return_tokens_as_token_ids``): each logprob entry
    and top alternative is ``token_id:N``, and ``int(token.split(":")[-1])`` (its parser) gives the
    completion's true ids, in chat, completions and streams alike."""
    body = {
        "model": NAMES[0], "messages": MESSAGES, "max_tokens": 16, "temperature": 1.0, "seed": 3,
        "logprobs": True, "top_logprobs": 2, "include_stop_str_in_output": True,
        "skip_special_tokens": False, "return_token_ids": True,
    }  # fmt: skip
    choice = post(served, "/v1/chat/completions", body).json()["choices"][0]
    entries = choice["logprobs"]["content"]
    assert [int(e["token"].split(":")[-1]) for e in entries] == choice["token_ids"]
    assert all(e["token"].startswith("token_id:") for e in entries)
    assert all(t["token"].startswith("token_id:") for e in entries for t in e["top_logprobs"])

    chunks = []
    with httpx.stream(
        "POST", f"{served.url}/v1/chat/completions", json={**body, "stream": True}, headers=HEADERS, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    streamed = [e for c in chunks for ch in c["choices"] for e in (ch.get("logprobs") or {}).get("content") or []]
    assert [e["token"] for e in streamed] == [e["token"] for e in entries]  # same seed, same tokens

    comp = post(
        served,
        "/v1/completions",
        {"model": NAMES[1], "prompt": "1 2 3", "max_tokens": 8, "logprobs": 1, "return_token_ids": True},
    ).json()["choices"][0]
    assert comp["logprobs"]["tokens"] and all(t.startswith("token_id:") for t in comp["logprobs"]["tokens"])
    assert [int(t.split(":")[-1]) for t in comp["logprobs"]["tokens"]] == comp["token_ids"]


# --- /tokenize and /detokenize (vLLM's routes and shapes) -----------------------------------------


@pytest.mark.integration
def test_tokenize_gives_the_ids_generation_uses(served: ServerProcess, tiny_model: Path) -> None:
    """A chat's ``/tokenize`` ids are the ``prompt_token_ids`` the chat route generates from (tools
    and template kwargs included); a text prompt's are the tokenizer's, with or without special
    tokens; ``token_strs`` are the tokenizer's strings; ``/detokenize`` gives the text back."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for extra in ({}, {"tools": tools}, {"chat_template_kwargs": {"enable_thinking": False}}):
        r = post(served, "/tokenize", {"model": NAMES[0], "messages": MESSAGES, "return_token_strs": True, **extra})
        assert r.status_code == 200, r.text
        got = r.json()
        gen = post(
            served,
            "/v1/chat/completions",
            {"messages": MESSAGES, "max_tokens": 1, "return_token_ids": True, **extra},
        ).json()
        assert got["tokens"] == gen["prompt_token_ids"] and got["count"] == len(got["tokens"])
        assert got["max_model_len"] == 256 and got["token_strs"] == tok.convert_ids_to_tokens(got["tokens"])
    text = "Hello, wörld! 12 + 7 = 19 <|im_end|>"
    for special in (True, False):
        got = post(served, "/tokenize", {"prompt": text, "add_special_tokens": special}).json()
        assert got["tokens"] == tok(text, add_special_tokens=special)["input_ids"] and "token_strs" not in got
        back = post(served, "/detokenize", {"model": NAMES[1], "tokens": got["tokens"]})
        assert back.status_code == 200 and back.json() == {"prompt": tok.decode(got["tokens"])}
    assert post(served, "/detokenize", {"tokens": got["tokens"]}).json()["prompt"] == text


@pytest.mark.integration
def test_tokenize_refusals_name_their_field(served: ServerProcess, tiny_model: Path) -> None:
    cases = [
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", {"prompt": "x", "model": tiny_model.name}, 404, "model"),
        ("/tokenize", {"messages": []}, 400, "messages"),
    ]
    for path, body, status, field in cases:
        r = post(served, path, body)
        assert r.status_code == status and field in r.text, (body, r.status_code, r.text)
    r = httpx.post(f"{served.url}/tokenize", json={"prompt": "x"}, timeout=10)  # the OpenAI routes' key
    assert r.status_code == 401


# --- --logprobs-mode (vLLM's meanings) --------------------------------------------------------------


def test_an_undeclared_logprobs_mode_is_refused_at_start_up() -> None:
    with pytest.raises(ValueError, match="logprobs_mode: the raw-only backend serves"):
        build_router(RawOnly(), control_token="c", api_key=None, logprobs_mode="processed_logprobs")  # type: ignore[arg-type]
    build_router(RawOnly(), control_token="c", api_key=None, logprobs_mode="raw_logprobs")  # type: ignore[arg-type]
    with pytest.raises(SystemExit):  # argparse: not one of vLLM's modes
        build_parser().parse_args(["serve", "--model", "m", "--logprobs-mode", "processed"])


@pytest.mark.integration
def test_processed_logprobs_are_the_drawn_distributions(tiny_model: Path) -> None:
    """A server started with ``--logprobs-mode processed_logprobs`` (PipelineRL starts vLLM so)
    reports, at temperature 0.7 with top-p 0.9, the logprobs of the distribution each token was
    drawn from (a full forward, the suite's own sampling distribution), not the raw model's."""
    from transformers import AutoModelForCausalLM

    from pipelinerl_sdk.conformance.stats import sampling_distribution

    proc = ServerProcess("reference", tiny_model, api_key=API_KEY, startup_timeout_s=120,
                         options={"threads": 1, "max_model_len": 256},
                         args=["--logprobs-mode", "processed_logprobs"])  # fmt: skip
    proc.start()
    try:
        body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0.7, "top_p": 0.9, "seed": 5,
                "logprobs": True, "return_token_ids": True}  # fmt: skip
        resp = post(proc, "/v1/chat/completions", body).json()
    finally:
        proc.stop()
    choice = resp["choices"][0]
    ids = resp["prompt_token_ids"] + choice["token_ids"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, len(resp["prompt_token_ids"]) - 1 : -1].double()
    raw = torch.log_softmax(logits, dim=-1)
    dist = sampling_distribution(logits, 0.7, 0.9)
    for j, (token, entry) in enumerate(zip(choice["token_ids"], choice["logprobs"]["content"], strict=True)):
        want = float(torch.log(dist[j, token]))
        assert abs(entry["logprob"] - want) < 1e-3, (j, entry["logprob"], want, float(raw[j, token]))
    assert any(abs(float(torch.log(dist[j, t])) - float(raw[j, t])) > 0.05 for j, t in enumerate(choice["token_ids"]))
