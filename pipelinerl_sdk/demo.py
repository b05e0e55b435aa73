"""``pipelinerl demo``: the reference trainer teaches a reference server one answer, live.

Each step: the trainer takes one AdamW step towards a target completion, then publishes the new
weights to a running server while a long generation is in flight there. The demo prints, per
step, the server's logprob of the target (it rises), the largest server/trainer logprob gap on
the same tokens (float32: ~1e-6), the generation pause, and the versions the in-flight request's
tokens carry (old, then new). It exits non-zero if any of that does not hold.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import torch

from pipelinerl_sdk.contracts import TokenBatch, TrainerSpec
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.launch import ServerProcess
from pipelinerl_sdk.protocol import ChatCompletionResponse
from pipelinerl_sdk.reference.tiny import build_tiny_model
from pipelinerl_sdk.reference.trainer import ReferenceTrainer
from pipelinerl_sdk.rl.objectives import CompletionNLL
from pipelinerl_sdk.weights.publisher import WeightPublisher

QUESTION = [{"role": "user", "content": "12+7="}]
ANSWER = "19"


async def _score(client: InferenceClient, messages: list[dict[str, str]]) -> ChatCompletionResponse:
    """Prompt logprobs of a full conversation (the answer included), computed by the server."""
    return await client.chat(
        {
            "messages": messages,
            "max_tokens": 1,
            "temperature": 0,
            "prompt_logprobs": True,
            "return_token_ids": True,
            "add_generation_prompt": False,
        }
    )


async def _demo(steps: int, workdir: Path) -> int:
    model = build_tiny_model(workdir / "model", preset="tiny", seed=0)
    trainer = ReferenceTrainer()
    trainer.init(TrainerSpec(model=str(model), lr=1e-3, grad_clip=1.0))
    conversation = [*QUESTION, {"role": "assistant", "content": ANSWER}]
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    with ServerProcess("reference", model, options={"threads": 1}) as server:
        print(f"server: {server.url} (pid {server.pid})")
        async with InferenceClient(server.url, control_token=server.control_token) as client:
            publisher = WeightPublisher([client], bucket_bytes=256 << 10)
            await publisher.connect()
            print(
                f"weight-update group formed: world size {publisher.group.config.world_size if publisher.group else 0}"
            )
            # The server's own tokenisation: the question with the generation prompt is the prefix of
            # the full conversation; the rest (the answer and its end marker) is the target.
            question = await client.chat({"messages": QUESTION, "max_tokens": 1, "return_token_ids": True})
            ids = (await _score(client, conversation)).prompt_token_ids or []
            prompt_len = len(question.prompt_token_ids or [])
            if ids[:prompt_len] != question.prompt_token_ids:
                raise RuntimeError("chat template: the question is not a prefix of the conversation")
            initial = await _score(client, conversation)
            start_lp = sum(x for x in initial.prompt_token_logprobs()[prompt_len:] if x is not None)
            print(f"target {ANSWER!r}: server logprob before training {start_lp:.4f}")
            for version in range(1, steps + 1):
                batch = TokenBatch(input_ids=[ids], completion_start=[prompt_len])
                trainer.backward(batch, CompletionNLL(len(batch)))
                metrics = trainer.step()
                in_flight = asyncio.create_task(
                    client.chat({"messages": QUESTION, "max_tokens": 1500, "ignore_eos": True, "temperature": 1.0})
                )
                await asyncio.sleep(0.1)
                async with publisher.update(version, trainer.param_specs()) as sink:
                    await asyncio.to_thread(trainer.gather_and_broadcast, sink)
                done = publisher.last.events[server.url] if publisher.last else None
                versions = (await in_flight).choices[0].weight_versions
                after = await _score(client, conversation)
                server_lp = torch.tensor([x for x in after.prompt_token_logprobs() if x is not None])
                trainer_lp = trainer.forward(TokenBatch(input_ids=[ids], completion_start=[prompt_len]))[0]
                gap = float((server_lp - trainer_lp).abs().max())
                target_lp = float(server_lp[prompt_len - 1 :].sum())
                row = {
                    "version": version,
                    "grad_norm": round(metrics.grad_norm, 3),
                    "target_logprob": round(target_lp, 4),
                    "max_server_trainer_gap": gap,
                    "pause_ms": round(1e3 * (done.timings["pause_s"] if done else float("nan")), 2),
                    "update_ms": round(1e3 * (publisher.last.wall_s if publisher.last else float("nan")), 2),
                    "in_flight_versions": sorted(set(versions)),
                }
                rows.append(row)
                print(json.dumps(row))
                if gap > 1e-4:
                    failures.append(f"version {version}: server and trainer disagree by {gap:.2e}")
            await publisher.close()
    if rows[-1]["target_logprob"] <= start_lp:
        failures.append("the server's logprob of the target answer did not rise")
    if any(len(r["in_flight_versions"]) != 2 for r in rows):
        failures.append("a request in flight did not carry both the old and the new version")
    summary = (
        f"demo: {steps} updates; target logprob {start_lp:.4f} -> {rows[-1]['target_logprob']}; "
        f"max server/trainer gap {max(r['max_server_trainer_gap'] for r in rows):.1e}; "
        f"median pause {sorted(r['pause_ms'] for r in rows)[len(rows) // 2]} ms"
    )
    print(summary)
    for f in failures:
        print(f"FAILED: {f}")
    return 1 if failures else 0


def run_demo(steps: int = 8, workdir: str | Path = "runs/demo") -> int:
    return asyncio.run(_demo(steps, Path(workdir)))
