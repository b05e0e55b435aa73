"""The reference continuous-batching engine against plain transformers forwards (no mocks)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel

from pipelinerl_sdk.reference.engine import (
    ContinuousBatchingEngine,
    GenerationResult,
    SamplingParams,
)
from pipelinerl_sdk.reference.tiny import build_tiny_model, load_model

T = TypeVar("T")
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [
    "What is 12+7?",
    "hi",
    "<|im_start|>user\nThe quick red dog runs and jumps over the old cat.<|im_end|>\n<|im_start|>assistant\n",
    "1",
    "please add 3 and 4, then multiply the result by 2",
    "who thinks so",
]


@pytest.fixture(autouse=True)
def _torch_threads() -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("engine-model"), seed=0)


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("engine-model-b"), seed=1)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> PreTrainedModel:
    return load_model(model_dir)[0]


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    tokenizer = load_model(model_dir)[1]
    return [tokenizer.encode(p) for p in PROMPTS]


def full_logprobs(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """log_softmax of one plain forward over ``ids``: row i predicts ids[i + 1]."""
    with torch.inference_mode():
        logits: torch.Tensor = model(torch.tensor([ids])).logits[0]
    return logits.float().log_softmax(-1)


def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]  # GenerationMixin, typed loosely
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def started(model: PreTrainedModel, **kwargs: Any) -> ContinuousBatchingEngine:
    kwargs.setdefault("eos_token_ids", [model.config.eos_token_id])
    engine = ContinuousBatchingEngine(model, **kwargs)
    await engine.start()
    return engine


#: fp32 logprobs of cached, batched decoding against one full forward: the batch each token is
#: decoded in depends on arrival timing, so the reduction order does too; 1.0014e-5 was seen once
#: in a loaded CI run (a top alternative), 1e-5 or less in every other.
BATCHED_LOGPROB_ATOL = 2e-5


def test_greedy_batched_equals_hf_and_full_forward(model: PreTrainedModel, prompts: list[list[int]]) -> None:
    eos = model.config.eos_token_id
    lengths = [24, 40, 8, 33, 17, 29]

    async def main() -> list[GenerationResult]:
        engine = await started(model, max_batch_size=8)
        tasks = []
        for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
            params = SamplingParams(max_tokens=n, temperature=0.0, top_logprobs=3)
            tasks.append(asyncio.create_task(engine.generate(prompt, params)))
            if i % 2:  # stagger arrivals: later requests join a batch that is already decoding
                await asyncio.sleep(0.01)
        results = await asyncio.gather(*tasks)
        stats = engine.stats()
        assert stats.running == 0 and stats.waiting == 0
        assert stats.generated_tokens == sum(len(r.token_ids) for r in results)
        await engine.stop()
        return results

    results = run(main())
    for prompt, n, res in zip(prompts, lengths, results, strict=True):
        assert res.prompt_token_ids == prompt
        assert res.token_ids == hf_greedy(model, prompt, n, eos)
        stopped = res.token_ids[-1] == eos
        assert res.finish_reason == ("stop" if stopped else "length")
        assert stopped or len(res.token_ids) == n
        assert res.versions == [0] * len(res.token_ids)
        assert res.prompt_logprobs is None
        ref = full_logprobs(model, prompt + res.token_ids)[len(prompt) - 1 : -1]
        targets = torch.tensor(res.token_ids)
        expected = ref.gather(-1, targets[:, None])[:, 0]
        assert (torch.tensor(res.logprobs) - expected).abs().max().item() <= BATCHED_LOGPROB_ATOL
        top = ref.topk(3, dim=-1)
        for i, alternatives in enumerate(res.top_logprobs):
            assert [t for t, _ in alternatives] == top.indices[i].tolist()
            diffs = [abs(lp - e) for (_, lp), e in zip(alternatives, top.values[i].tolist(), strict=True)]
            assert max(diffs) <= BATCHED_LOGPROB_ATOL
            assert alternatives[0][0] == res.token_ids[i]  # greedy picks the best


def test_prompt_logprobs_match_full_forward(model: PreTrainedModel, prompts: list[list[int]]) -> None:
    async def main() -> list[GenerationResult]:
        engine = await started(model)
        params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=True)
        results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        await engine.stop()
        return list(results)

    results = run(main())
    for prompt, res in zip(prompts, results, strict=True):
        assert res.prompt_logprobs is not None and len(res.prompt_logprobs) == len(prompt)
        assert res.prompt_logprobs[0] is None
        if len(prompt) == 1:
            continue
        ref = full_logprobs(model, prompt)[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
        got = torch.tensor(res.prompt_logprobs[1:])
        assert (got - ref).abs().max().item() <= 1e-5


def test_admission_queue_and_seeded_sampling(model: PreTrainedModel, prompts: list[list[int]]) -> None:
    sampled = [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=100 + i) for i in range(10)]

    async def main() -> tuple[list[GenerationResult], list[GenerationResult], int, int, list[GenerationResult]]:
        engine = await started(model, max_batch_size=3)
        tasks = [asyncio.create_task(engine.generate(prompts[i % len(prompts)], p)) for i, p in enumerate(sampled)]
        max_running = max_waiting = 0
        while not all(t.done() for t in tasks):
            stats = engine.stats()
            max_running, max_waiting = max(max_running, stats.running), max(max_waiting, stats.waiting)
            await asyncio.sleep(0.001)
        first = [t.result() for t in tasks]
        # Same seeds, another batch composition (one at a time): same tokens.
        again = [await engine.generate(prompts[i % len(prompts)], p) for i, p in enumerate(sampled)]
        # A tiny top_p keeps only the most likely token: sampling becomes greedy.
        narrow = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=1.0, top_p=1e-6)
        pairs = await asyncio.gather(*(engine.generate(p, q) for p in prompts[:3] for q in (narrow, GREEDY)))
        await engine.stop()
        return first, again, max_running, max_waiting, list(pairs)

    out = run(main())
    first, again, max_running, max_waiting, pairs = out
    assert all(len(r.token_ids) == 12 or r.finish_reason == "stop" for r in first)
    assert max_running <= 3 and max_waiting >= 1
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    for a, b in zip(first, again, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-5
    assert len({tuple(r.token_ids) for r in first}) > 5  # seeds differ, samples differ
    for i in range(0, len(pairs), 2):
        assert pairs[i].token_ids == pairs[i + 1].token_ids


def _weights_of(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_in_flight_weight_update(model_dir: Path, other_dir: Path, prompts: list[list[int]]) -> None:
    served = load_model(model_dir)[0]
    old = load_model(model_dir)[0]
    new = load_model(other_dir)[0]
    new_weights = _weights_of(new)
    max_tokens = 400

    async def main() -> tuple[list[GenerationResult], int, int, float, bool]:
        engine = await started(served, eos_token_ids=[], max_batch_size=4)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        tasks = [asyncio.create_task(engine.generate(p, params)) for p in (prompts[0], prompts[2])]
        while engine.stats().generated_tokens < 40:
            await asyncio.sleep(0.001)
        with pytest.raises(RuntimeError):
            engine.set_version(1)
        async with engine.paused() as handle:
            before = engine.stats()
            await asyncio.sleep(0.3)
            after = engine.stats()
            with torch.no_grad():
                for name, tensor in engine.model.state_dict().items():
                    tensor.copy_(new_weights[name])
            engine.set_version(1)
            assert engine.version == 1
        results = await asyncio.gather(*tasks)
        await engine.stop()
        return list(results), before.generated_tokens, after.generated_tokens, handle.held_s, after.paused

    out = run(main())
    results, before, after, held_s, was_paused = out
    assert before == after and was_paused
    assert 0.3 <= held_s < 5.0
    for prompt, res in zip((prompts[0], prompts[2]), results, strict=True):
        assert res.finish_reason == "length" and len(res.token_ids) == max_tokens
        k = res.versions.index(1)
        assert 0 < k < max_tokens
        assert res.versions == [0] * k + [1] * (max_tokens - k)
        # Tokens before the switch: the old weights, full forward.
        ref_old = full_logprobs(old, prompt + res.token_ids)[len(prompt) - 1 : -1]
        got = torch.tensor(res.logprobs)
        expected_old = ref_old[:k].gather(-1, torch.tensor(res.token_ids[:k])[:, None])[:, 0]
        assert (got[:k] - expected_old).abs().max().item() <= 1e-5
        # After it: K/V of everything up to token k-2 came from the old weights (stale cache),
        # the rest from the new ones. Rebuild exactly that and decode with the new weights.
        with torch.inference_mode():
            cache = DynamicCache()
            context = prompt + res.token_ids[: k - 1]
            old(torch.tensor([context]), past_key_values=cache, use_cache=True)
            for j in range(k, max_tokens):
                position = len(prompt) + j - 1
                logits = new(
                    torch.tensor([[res.token_ids[j - 1]]]),
                    position_ids=torch.tensor([[position]]),
                    past_key_values=cache,
                    use_cache=True,
                ).logits[0, -1]
                logp = logits.float().log_softmax(-1)
                assert abs(logp[res.token_ids[j]].item() - res.logprobs[j]) <= 1e-4, j
                best = logp.topk(2).values
                if (best[0] - best[1]).item() > 1e-4:
                    assert int(logp.argmax()) == res.token_ids[j], j
        # The update changed the distribution the tokens were drawn from.
        assert abs(ref_old[k, res.token_ids[k]].item() - res.logprobs[k]) > 1e-3


def test_pauses_are_serialised(model: PreTrainedModel) -> None:
    async def main() -> list[str]:
        engine = await started(model)
        events: list[str] = []

        async def hold(name: str) -> None:
            async with engine.paused() as handle:
                events.append(f"enter {name}")
                await asyncio.sleep(0.05)
                events.append(f"exit {name}")
            assert handle.held_s >= 0.05

        await asyncio.gather(hold("a"), hold("b"))
        assert not engine.stats().paused
        async with engine.paused(), engine.paused() as inner:  # nested in one task: no deadlock
            engine.set_version(3)
        assert inner.held_s >= 0 and engine.version == 3 and not engine.stats().paused
        res = await engine.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
        assert len(res.token_ids) == 3
        await engine.stop()
        return events

    assert run(main()) == ["enter a", "exit a", "enter b", "exit b"]


def test_stop_conditions_and_validation(model: PreTrainedModel, prompts: list[list[int]]) -> None:
    eos = model.config.eos_token_id
    greedy = hf_greedy(model, prompts[4], 20, eos)
    stop_token = greedy[5]
    first_stop = greedy.index(stop_token)

    async def main() -> None:
        engine = ContinuousBatchingEngine(model, eos_token_ids=[eos], max_model_len=32)
        with pytest.raises(RuntimeError):
            await engine.generate([1, 2], GREEDY)
        await engine.start()
        res = await engine.generate(
            prompts[4], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(stop_token,))
        )
        assert res.token_ids == greedy[: first_stop + 1] and res.finish_reason == "stop"
        res = await engine.generate(list(range(3, 30)), SamplingParams(max_tokens=100, temperature=0.0))
        assert len(res.token_ids) == 32 - 27 and res.finish_reason == "length"
        await engine.stop()
        # an EOS id ends a request unless ignore_eos; explicit stop ids end it either way
        engine = ContinuousBatchingEngine(model, eos_token_ids=[stop_token], max_model_len=32)
        await engine.start()
        res = await engine.generate(prompts[4], SamplingParams(max_tokens=12, temperature=0.0))
        assert res.token_ids == greedy[: first_stop + 1] and res.finish_reason == "stop"
        res = await engine.generate(prompts[4], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        assert res.token_ids == greedy[:12] and res.finish_reason == "length"
        res = await engine.generate(
            prompts[4], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_token,))
        )
        assert res.finish_reason == "stop" and len(res.token_ids) == first_stop + 1
        # min_tokens masks every stop and EOS id (ignore_eos or not, as vLLM) for that many tokens
        for ignore_eos in (False, True):
            held = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=ignore_eos, min_tokens=first_stop + 2)
            res = await engine.generate(prompts[4], held)
            assert stop_token not in res.token_ids[: first_stop + 2], (ignore_eos, res.token_ids)
            assert res.token_ids[:first_stop] == greedy[:first_stop] and len(res.token_ids) > first_stop + 1
        for bad_prompt, bad_params in [
            ([3], SamplingParams(max_tokens=2, min_tokens=3)),
            ([], GREEDY),
            (list(range(3, 35)), GREEDY),
            ([10**6], GREEDY),
            ([3], SamplingParams(max_tokens=0)),
            ([3], SamplingParams(top_p=0.0)),
            ([3], SamplingParams(top_logprobs=21)),
            ([3], SamplingParams(temperature=-1.0)),
        ]:
            with pytest.raises(ValueError):
                await engine.generate(bad_prompt, bad_params)
        await engine.stop()

    run(main())


def test_cancel_stop_abort_and_step_errors(model_dir: Path) -> None:
    served = load_model(model_dir)[0]
    long = SamplingParams(max_tokens=1500, temperature=0.0)

    async def main() -> None:
        engine = await started(served, eos_token_ids=[], max_model_len=4096)
        # Cancelling the caller drops the request from the batch.
        task = asyncio.create_task(engine.generate([3, 4, 5], long))
        while engine.stats().generated_tokens < 5:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(1000):
            if engine.stats().running == 0:
                break
            await asyncio.sleep(0.001)
        assert engine.stats().running == 0

        # A broken weight update fails the running requests with the real error; the loop survives.
        task = asyncio.create_task(engine.generate([3, 4, 5], long))
        while engine.stats().running == 0:
            await asyncio.sleep(0.001)
        head = engine.model.lm_head
        good = head.weight
        async with engine.paused():
            head.weight = torch.nn.Parameter(torch.zeros(7, 3))
        with pytest.raises(RuntimeError, match=r"shape|size"):
            await task
        async with engine.paused():
            head.weight = good
        res = await engine.generate([3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0))
        assert len(res.token_ids) == 4

        # stop() aborts what is running or waiting, returning the partial output.
        base = engine.stats().generated_tokens
        running = asyncio.create_task(engine.generate([3, 4, 5], long))
        while engine.stats().generated_tokens < base + 3:
            await asyncio.sleep(0.001)
        await engine.stop()
        partial = await running
        assert partial.finish_reason == "abort" and 0 < len(partial.token_ids) < 1500
        assert len(partial.versions) == len(partial.logprobs) == len(partial.token_ids)
        with pytest.raises(RuntimeError):
            await engine.generate([3], GREEDY)

    run(main())


def test_a_request_whose_sampling_fails_mid_decode_fails_alone(
    model: PreTrainedModel, prompts: list[list[int]]
) -> None:
    """A temperature so small that ``logits / t`` overflows float32 at one decode step (not at the
    prefill) ends that request with its error; the request decoding beside it finishes."""
    found: tuple[list[int], float, int] | None = None
    for prompt in prompts:
        greedy = run(_greedy(model, prompt, 60))
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + greedy])).logits[0].float()
        peaks = logits[len(prompt) - 1 :].max(-1).values  # [0]: the prefill's, then each decode step's
        for k in range(1, len(greedy)):
            if peaks[k] > 0 and peaks[k] > 1.1 * peaks[:k].max():
                found = (prompt, float(peaks[k]) / 3.5e38, k)  # step k overflows, none before it
                break
        if found:
            break
    assert found is not None, "no prompt whose logits peak later than at the prefill"
    prompt, temperature, step = found

    async def main() -> tuple[GenerationResult, BaseException | GenerationResult]:
        engine = await started(model, eos_token_ids=[])
        innocent = asyncio.ensure_future(engine.generate(prompts[1], SamplingParams(max_tokens=200, temperature=0)))
        while engine.stats().running == 0:
            await asyncio.sleep(0.001)
        hostile = SamplingParams(max_tokens=60, temperature=temperature)
        bad = await asyncio.gather(engine.generate(prompt, hostile), return_exceptions=True)
        good = await innocent
        await engine.stop()
        return good, bad[0]

    good, bad = run(main())
    assert isinstance(bad, ValueError) and "no finite distribution" in str(bad), (bad, step)
    assert good.finish_reason == "length" and len(good.token_ids) == 200


async def _greedy(model: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    engine = await started(model, eos_token_ids=[])
    out = await engine.generate(prompt, SamplingParams(max_tokens=n, temperature=0))
    await engine.stop()
    return out.token_ids


def test_stream_equals_generate_and_closing_it_drops_the_request(
    model: PreTrainedModel, prompts: list[list[int]]
) -> None:
    """``stream`` of a seeded request gives, step by step, the tokens, logprobs and versions of
    the same request through ``generate``, the finish reason on its last step only; a stream
    closed after its first step leaves the engine with nothing running (the request dropped,
    not run to its 400 tokens)."""
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3, top_logprobs=2, ignore_eos=True)

    async def main() -> None:
        engine = await started(model, max_model_len=512)
        whole = await engine.generate(prompts[0], params)
        steps = [s async for s in engine.stream(prompts[0], params)]
        assert [t for s in steps for t in s.token_ids] == whole.token_ids
        assert [v for s in steps for v in s.logprobs] == whole.logprobs
        assert [v for s in steps for v in s.versions] == whole.versions
        assert [list(a) for s in steps for a in s.top_logprobs] == whole.top_logprobs
        assert [s.finish_reason for s in steps][-1] == "length" and not any(s.finish_reason for s in steps[:-1])
        long = engine.stream(prompts[0], SamplingParams(max_tokens=400, ignore_eos=True))
        first = await anext(long)
        assert first.token_ids and first.finish_reason is None
        await long.aclose()  # type: ignore[attr-defined]
        for _ in range(200):
            if engine.stats().running == engine.stats().waiting == 0:
                break
            await asyncio.sleep(0.05)
        stats = engine.stats()
        assert (stats.running, stats.waiting) == (0, 0) and stats.generated_tokens < 24 + 400, stats
        await engine.stop()

    run(main())


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes_report_what_vllm_reports(model: PreTrainedModel, prompts: list[list[int]], mode: str) -> None:
    """Each logprobs mode reports vLLM 0.32's values for every token and top alternative, checked
    against a full forward and the suite's own sampling distribution (vLLM's order: temperature,
    min-p, top-k, top-p; a cut token at -9999): raw logits; the drawn distribution's logprobs or
    logits (temperature-scaled, cut at -inf); greedy: the biased logits, unscaled."""
    from pipelinerl_sdk.conformance.stats import sampling_distribution

    settings = [
        SamplingParams(max_tokens=10, temperature=0.7, top_p=0.9, top_k=20, min_p=0.02, seed=3, top_logprobs=5),
        SamplingParams(max_tokens=10, temperature=2.0, top_p=0.5, seed=4, top_logprobs=5),
        SamplingParams(max_tokens=10, temperature=0.0, logit_bias=((7, 3.0),), top_logprobs=5),
    ]

    async def main() -> list[GenerationResult]:
        engine = await started(model, logprobs_mode=mode)
        out = [await engine.generate(prompts[0], p) for p in settings]
        await engine.stop()
        return out

    for params, res in zip(settings, run(main()), strict=True):
        ids = res.prompt_token_ids + res.token_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, len(res.prompt_token_ids) - 1 : -1].double()
        for j, (token, got, tops) in enumerate(zip(res.token_ids, res.logprobs, res.top_logprobs, strict=True)):
            row = logits[j].clone()
            for t, b in params.logit_bias:
                row[t] += b
            if mode == "raw_logits":
                want = logits[j]
            elif params.temperature == 0:
                want = row if mode == "processed_logits" else torch.log_softmax(row, dim=-1)
            else:
                dist = sampling_distribution(row, params.temperature, params.top_p, top_k=params.top_k,
                                             min_p=params.min_p)  # fmt: skip
                cut = dist == 0
                assert not bool(cut[token]), f"token {j} was drawn from outside the distribution"
                scaled = (row / params.temperature).masked_fill(cut, float("-inf"))
                want = scaled if mode == "processed_logits" else torch.log_softmax(scaled, dim=-1)
            want = want.clamp(min=-9999.0)
            assert abs(got - float(want[token])) < 1e-3, (mode, params, j, got, float(want[token]))
            assert tops == sorted(tops, key=lambda x: -x[1]) and len(tops) == 5
            for t, v in tops:
                assert abs(v - float(want[t])) < 1e-3, (mode, params, j, t, v, float(want[t]))


def test_a_client_hold_freezes_the_loop_and_an_update_runs_inside_it(
    model: PreTrainedModel, prompts: list[list[int]]
) -> None:
    """``GenerationHold`` over the engine's pause: held, no step runs (the token count stays);
    an update's pause (``around``) enters at once inside the hold and may tag the version; a
    second hold is a no-op; release waits for the update inside to end, then the request
    finishes, its tokens after the hold tagged with the new version. Outside a hold, the
    update's pause is the engine's own."""
    from pipelinerl_sdk.kit.inference.hold import GenerationHold

    async def body() -> None:
        engine = await started(model, max_model_len=256)
        hold = GenerationHold(engine.paused)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
            stream = engine.stream(prompts[0], params)
            tags: list[int] = []
            first = await anext(stream)
            tags += list(first.versions)
            await hold.hold()
            await hold.hold()  # held already: at once
            assert hold.held and engine.stats().paused
            frozen = engine.stats().generated_tokens
            await asyncio.sleep(0.3)
            assert engine.stats().generated_tokens == frozen
            inside = asyncio.Event()
            leave = asyncio.Event()

            async def update() -> None:
                async with hold.around(engine.paused)():
                    engine.set_version(1)  # only allowed while the loop is parked
                    inside.set()
                    await leave.wait()

            task = asyncio.create_task(update())
            await asyncio.wait_for(inside.wait(), 5)  # entered at once: the hold parks the loop
            releasing = asyncio.create_task(hold.release())
            await asyncio.sleep(0.2)
            assert not releasing.done() and engine.stats().generated_tokens == frozen, "released under an update"
            leave.set()
            await asyncio.wait_for(asyncio.gather(task, releasing), 5)
            assert not hold.held
            async for step in stream:
                tags += list(step.versions)
            assert len(tags) == 120 and tags == sorted(tags) and tags[-1] == 1, tags
            assert tags.count(0) <= frozen, (tags.count(0), frozen)  # none computed while held
            async with hold.around(engine.paused)():  # no hold: the engine's own pause
                assert engine.stats().paused
            assert not engine.stats().paused
        finally:
            await engine.stop()

    run(body())
