"""PipelineRL's own actor code, unmodified, against ``pipelinerl serve`` (``scripts/test-pipelinerl``).

PipelineRL (ServiceNow/PipelineRL at 58d3934, installed from ``../shared/deps`` into an environment
of its own) generates with ``pipelinerl.async_llm.llm_async_generate`` and turns each call into
training data with ``make_training_text``. Here they run with the request parameters of its shipped
``conf/base.yaml`` (``llm.parameters``, read from the file, not copied) against a server started as
PipelineRL starts vLLM, as far as the SDK has its flags: ``--return-tokens-as-token-ids``. Every
token id, logprob, prompt id and finish reason PipelineRL derives must equal the truth: what the
server generated (a recording session adds ``return_token_ids`` to each request, which changes no
token, and keeps the answer) and what the weights give (logprobs replayed on a local copy of the
model, ``conf/base.yaml``'s temperature 1 with no top-k/top-p, where vLLM's processed logprobs are
the raw ones). Then the same, with calls in flight while the trainer publishes new weights.

The servers and their Python (each backend's environment): ``PIPELINERL_DROPIN_SERVERS``,
``name=python;name=python``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple
from urllib.request import urlopen

import pytest

pipelinerl = pytest.importorskip("pipelinerl", reason="PipelineRL's environment: scripts/test-pipelinerl")

import aiohttp  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from pipelinerl.async_llm import llm_async_generate, make_training_text  # noqa: E402
from pipelinerl.llm import Prompt, TrainableLLM  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from pipelinerl_sdk.http.client import InferenceClient  # noqa: E402
from pipelinerl_sdk.launch import ServerProcess  # noqa: E402
from pipelinerl_sdk.testing.pipelinerl_trainer import PipelineRLTrainerReplay  # noqa: E402
from pipelinerl_sdk.weights.publisher import WeightPublisher, free_port  # noqa: E402

pytestmark = pytest.mark.integration

SERVERS = dict(item.split("=", 1) for item in os.environ.get("PIPELINERL_DROPIN_SERVERS", "").split(";") if "=" in item)
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
QUESTIONS = ["What is 12 + 7?", "Name three colours.", "Count to five.", "Say hello."]
#: Tokens per call: base.yaml's max_tokens is 8192, past the tiny model's context; the actor's own
#: override (``max_tokens_override``) sets it, as PipelineRL's does for short test runs.
MAX_TOKENS = 48
#: Tokens per call while updates land (long enough to be running when they do).
LONG_TOKENS = 400


def pipelinerl_conf() -> dict[str, Any]:
    """``conf/base.yaml``'s ``llm.parameters``, as PipelineRL's actor passes them."""
    root = Path(next(iter(pipelinerl.__path__))).resolve().parent
    conf = OmegaConf.load(root / "conf" / "base.yaml")
    params = OmegaConf.to_container(conf.llm.parameters, resolve=True)
    assert isinstance(params, dict) and params.get("temperature") == 1.0, params
    return {str(k): v for k, v in params.items()}


def as_transformers4(model_dir: Path) -> None:
    """Rewrite the tiny model's tokenizer config in the form transformers 4 reads (PipelineRL pins
    transformers 4.57; the SDK's builder writes transformers 5's ``TokenizersBackend`` form), as a
    Hugging Face checkpoint of a Qwen model ships it. Same tokenizer.json, same template."""
    path = model_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    extra = cfg.pop("extra_special_tokens", [])
    cfg.pop("backend", None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["additional_special_tokens"] = list(extra)
    path.write_text(json.dumps(cfg, indent=2))


class Recorder(aiohttp.ClientSession):
    """The session PipelineRL is given: every chat request also asks ``return_token_ids`` (the
    server's ids: the truth), and every answer is kept, as PipelineRL reads it."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.answers: list[dict[str, Any]] = []
        self.bodies: list[dict[str, Any]] = []

    async def _request(self, method: str, url: Any, **kw: Any) -> aiohttp.ClientResponse:  # type: ignore[override]
        body = kw.get("json")
        if isinstance(body, dict):
            self.bodies.append(dict(body))
            kw["json"] = {**body, "return_token_ids": True}
        resp = await super()._request(method, url, **kw)
        await resp.read()
        self.answers.append(json.loads(await resp.text()))
        return resp


class Served(NamedTuple):
    model: Path
    proc: ServerProcess
    #: PipelineRL's trainer side, rank 0 of its group (world size 2), which the server joined.
    trainer: PipelineRLTrainerReplay


@pytest.fixture(scope="module", params=sorted(SERVERS) or ["unset"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A server started as PipelineRL's launcher starts vLLM, as far as the SDK has its flags:
    ``--return-tokens-as-token-ids`` and the weight-update group's (its trainer's store on a free
    port, world size 2, actor 0)."""
    name = request.param
    if name == "unset":
        pytest.fail("PIPELINERL_DROPIN_SERVERS is not set: run scripts/test-pipelinerl")
    python = SERVERS[name]
    model = tmp_path_factory.mktemp(name) / "tiny"
    subprocess.run([python, "-m", "pipelinerl_sdk.cli", "tiny-model", str(model)], check=True, capture_output=True)
    as_transformers4(model)
    port = free_port()
    group = ["--weight-update-group-init-method", f"tcp://127.0.0.1:{port}", "--weight-update-group-world-size", "2",
             "--actor-llm-idx", "0"]  # fmt: skip
    proc = ServerProcess(name, model, python=python, env=ENV, args=["--return-tokens-as-token-ids", *group],
                         startup_timeout_s=600)  # fmt: skip
    proc.start()
    try:
        trainer = PipelineRLTrainerReplay("127.0.0.1", port)
        yield Served(model, proc, trainer)
        trainer.close()
    finally:
        proc.stop()


def make_llm(model: Path, proc: Any) -> TrainableLLM:
    """As PipelineRL's actor makes it (``actor.py``): the model path as its name, the shipped
    parameters, logprobs collected; the tokenizer loaded by PipelineRL from that path."""
    return TrainableLLM(base_url=proc.url, model_name=str(model), tokenizer_name=str(model),
                        parameters=pipelinerl_conf(), collect_logprobs=True)  # fmt: skip


async def generate(llm: TrainableLLM, n: int, max_tokens: int = MAX_TOKENS) -> tuple[list[Any], Recorder]:
    async with Recorder() as session:
        calls = await asyncio.gather(*(
            llm_async_generate(llm, Prompt(messages=[{"role": "user", "content": q}]), session, max_tokens)
            for q in (QUESTIONS * n)[:n]
        ))  # fmt: skip
    return list(calls), session


def check_calls(llm: TrainableLLM, calls: list[Any], session: Recorder) -> list[tuple[list[int], list[int]]]:
    """Every id, logprob, prompt id and finish reason PipelineRL derives is the server's; the
    (prompt ids, completion ids) of each call."""
    out = []
    assert len(session.answers) == len(calls)
    for body in session.bodies:
        assert "return_tokens_as_token_ids" not in body and "top_logprobs" not in body, body  # PipelineRL's own
    for call in calls:
        text = make_training_text(llm, call)
        (answer,) = [a for a in session.answers if a["choices"][0]["message"]["content"] == call.output.content]
        choice = answer["choices"][0]
        ids = [lp.token_id for lp in call.logprobs]
        assert ids == choice["token_ids"], f"PipelineRL read ids {ids}; the server generated {choice['token_ids']}"
        assert [lp.logprob for lp in call.logprobs] == [e["logprob"] for e in choice["logprobs"]["content"]]
        assert call.llm_info["finish_reason"] == choice["finish_reason"]
        assert text.finished == (choice["finish_reason"] != "length")
        prompt = answer["prompt_token_ids"]
        assert text.input_ids == prompt + ids, "PipelineRL's training ids are not the server's prompt and completion"
        assert text.labels == [-100] * len(prompt) + ids
        assert call.prompt_length_tokens == len(prompt) and call.output_length_tokens == len(ids)
        out.append((prompt, ids))
    return out


@torch.no_grad()
def replayed(model: Any, prompt: list[int], ids: list[int]) -> list[float]:
    logits = model(input_ids=torch.tensor([prompt + ids])).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    return [float(lps[len(prompt) - 1 + j, t]) for j, t in enumerate(ids)]


@torch.no_grad()
def perturb(model: Any, held_in: torch.dtype | None = None) -> None:
    """A trainer's step, stood in for: every parameter moved by 2% of its std (then rounded to
    ``held_in``, the dtype a trainer holds its weights in, where given)."""
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.02 * p.std())
        if held_in is not None:
            p.copy_(p.to(held_in).float())


async def calls_in_flight(url: str, within_s: float = 60.0) -> None:
    """Return once the server at ``url`` has a call in flight (its ``/info``)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        raw = await asyncio.to_thread(lambda: urlopen(f"{url}/info", timeout=10).read())
        if json.loads(raw)["requests_in_flight"] > 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no call in flight at {url} within {within_s:g} s")


def crossed_an_update(session: Recorder) -> list[set[int]]:
    """Each answer's weight versions; some call's tokens span versions (an update landed mid-call)."""
    versions = [set(a["choices"][0].get("weight_versions") or []) for a in session.answers]
    assert any(len(v) > 1 for v in versions), f"no call crossed an update: {versions}"
    return versions


def test_pipelinerl_actor_reads_the_truth(served: Served) -> None:
    model_dir, proc, _ = served
    llm = make_llm(model_dir, proc)
    assert type(AutoTokenizer.from_pretrained(model_dir)).__name__.endswith("Fast")
    calls, session = asyncio.run(generate(llm, 4))
    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for (prompt, ids), call in zip(check_calls(llm, calls, session), calls, strict=True):
        want = replayed(local, prompt, ids)
        got = [lp.logprob for lp in call.logprobs]
        worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
        assert worst < 2e-3, f"PipelineRL's logprobs differ from the weights' by {worst:.2e}"


def test_pipelinerl_actor_across_in_flight_updates(served: Served) -> None:
    """Calls in flight while the trainer publishes two new versions: PipelineRL's ids, prompts and
    finish reasons stay the server's, and some call's tokens span versions (the update landed
    mid-call)."""
    model_dir, proc, _ = served
    llm = make_llm(model_dir, proc)
    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    async def main() -> tuple[list[Any], Recorder]:
        async with InferenceClient(proc.url, control_token=proc.control_token) as client:
            publisher = WeightPublisher([client])
            await publisher.connect()
            info = await client.info()
            running = asyncio.ensure_future(generate(llm, 8, LONG_TOKENS))
            for k in (1, 2):
                await asyncio.sleep(0.5)
                perturb(local)
                state = dict(local.named_parameters())
                async with publisher.update(info.version + k, info.params) as sink:
                    for spec in info.params:
                        sink.send(spec.name, state[spec.name].detach().to(getattr(torch, spec.dtype)))
            await publisher.close()
            return await running

    calls, session = asyncio.run(main())
    check_calls(llm, calls, session)
    crossed_an_update(session)


def test_pipelinerl_trainer_protocol_across_in_flight_calls(served: Served) -> None:
    """PipelineRL's trainer protocol (``/receive_weight_update``, its request posted without a token,
    then every parameter broadcast in order in bfloat16; the replay's data plane is gloo) while
    PipelineRL's actor has calls in flight, twice: each answer is ``{"status": "ok"}``, PipelineRL's
    ids, prompts and finish reasons stay the server's, some call crossed an update, and the server
    then generates with the last weights sent (a fresh call's logprobs replayed on them)."""
    model_dir, proc, trainer = served
    llm = make_llm(model_dir, proc)
    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    version = int(json.loads(urlopen(f"{proc.url}/health", timeout=10).read())["version"])

    async def main() -> tuple[list[Any], Recorder]:
        running = asyncio.ensure_future(generate(llm, 8, LONG_TOKENS))
        for k in (1, 2):
            if k == 1:  # at once when the calls are running: on a fast engine they end within a second
                await calls_in_flight(proc.url)
            perturb(local, torch.bfloat16)  # what a bfloat16 trainer holds
            params = [(n, p.detach().to(torch.bfloat16)) for n, p in local.named_parameters()]
            (answer,) = await asyncio.to_thread(trainer.update, [proc.url], version + 1000 * k, params)
            assert answer.status_code == 200 and answer.json()["status"] == "ok", answer.text
        return await running

    calls, session = asyncio.run(main())
    check_calls(llm, calls, session)
    versions = crossed_an_update(session)
    assert set().union(*versions) <= {version, version + 1000, version + 2000}, versions
    fresh, session = asyncio.run(generate(llm, 1))
    ((prompt, ids),) = check_calls(llm, fresh, session)
    assert set(session.answers[0]["choices"][0]["weight_versions"]) == {version + 2000}
    worst = max(abs(a.logprob - b) for a, b in zip(fresh[0].logprobs, replayed(local, prompt, ids), strict=True))
    assert worst < 2e-3, f"after PipelineRL's updates the server's logprobs differ from the weights sent by {worst:.2e}"
