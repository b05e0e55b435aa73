"""Where the SDK's routes sit in front of SGLang, decided by measurement (not a test).

``python -m pipelinerl_sdk_sglang.gateway_bench --model PATH [--seconds 20] [--concurrency 8]``
starts one SGLang server (as the adapter would) and the adapter's gateway attached to it, then
runs the same chat load (``max_tokens`` 32, temperature 1, ``ignore_eos``) in alternating windows
against:

- ``in_process``: SGLang's own ``/v1/chat/completions``, served inside SGLang's server process
  (chat template + ``TokenizerManager.generate_request``): the path routes mounted inside SGLang
  would take, without the extra hop;
- ``gateway``: the SDK's ``/v1/chat/completions`` in the gateway process, which forwards to
  SGLang's ``/generate`` (one more local HTTP hop, JSON both ways, tokenisation in the gateway).

Windows alternate ABBA over ``rounds`` so slow drift cancels; each reports the share of the
machine's CPU used by other processes (``foreign_cpu_frac``). Prints one JSON object: completion
tokens/s per target (median over windows), ``gateway_over_in_process`` (ratio of medians and
median of paired ratios), and the median latency of a 1-token request sent alone through each
path (the hop's own cost). On a shared machine the windows' throughput is noisy; the CPU
accounting is not: ``cpu_s_per_1k_tokens`` (SGLang's processes and the gateway's, per target)
and ``gateway_cpu_share``, the gateway's share of the CPU the serving processes used, which bounds
what the gateway can cost a CPU-bound host. Tokens count only requests that finish inside a window.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import httpx

from pipelinerl_sdk.launch import ServerProcess
from pipelinerl_sdk_sglang.engine import SGLangClient, SGLangProcess, free_port, launch_args, launch_env, new_api_key


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds used so far by ``pids`` (Linux ``/proc``)."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


async def _window(url: str, headers: dict[str, str], body: dict[str, Any], concurrency: int, seconds: float) -> float:
    """Completion tokens/s of requests finishing within ``seconds``, once every worker is phased."""
    loop = asyncio.get_running_loop()
    finished: list[tuple[float, int]] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:
        phased = 0
        all_phased = asyncio.Event()

        async def worker(i: int) -> None:
            # The first request is shorter by i/concurrency of a request: finishes spread evenly
            # instead of arriving in waves of ``concurrency`` (which would quantise the windows).
            nonlocal phased
            first = max(1, i * body["max_tokens"] // concurrency)
            n = 0
            while not stop.is_set():
                b = {**body, "seed": i} if n else {**body, "seed": i, "max_tokens": first}
                r = await http.post("/v1/chat/completions", json=b)
                r.raise_for_status()
                finished.append((loop.time(), int(r.json()["usage"]["completion_tokens"])))
                n += 1
                if n == 1:
                    phased += 1
                    if phased == concurrency:
                        all_phased.set()

        tasks = [asyncio.create_task(worker(i)) for i in range(concurrency)]
        await asyncio.wait_for(all_phased.wait(), 300)
        t0 = loop.time()
        await asyncio.sleep(seconds)
        t1 = loop.time()
        stop.set()
        await asyncio.gather(*tasks)
    return sum(n for t, n in finished if t0 <= t < t1) / (t1 - t0)


async def _latency(url: str, headers: dict[str, str], body: dict[str, Any], n: int) -> float:
    """Median seconds of one 1-token request, sent one at a time (the per-request hop cost)."""
    times = []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:
        for i in range(n + 1):
            t0 = time.perf_counter()
            r = await http.post("/v1/chat/completions", json={**body, "max_tokens": 1, "seed": i})
            r.raise_for_status()
            if i:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _tree(pid: int) -> list[int]:
    import psutil

    return [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]


async def _measure(
    sgl: SGLangProcess, sgl_key: str, gw: ServerProcess, model: str, args: argparse.Namespace
) -> dict[str, Any]:
    from pipelinerl_sdk.bench.weight_update import _CpuMeter

    assert sgl.proc is not None
    meter = _CpuMeter([*_tree(sgl.proc.pid), *_tree(gw.pid)])
    messages = [{"role": "user", "content": "What is 12 + 7? Answer with digits."}]
    body = {"messages": messages, "max_tokens": 32, "temperature": 1.0, "ignore_eos": True}
    targets = {
        "in_process": (sgl.url, {"Authorization": f"Bearer {sgl_key}"}, {**body, "model": model}),
        "gateway": (gw.url, {}, body),
    }
    rates: dict[str, list[float]] = {k: [] for k in targets}
    foreign: dict[str, list[float | None]] = {k: [] for k in targets}
    sgl_pids, gw_pids = _tree(sgl.proc.pid), [gw.pid]
    # CPU seconds per 1000 completion tokens, per process, over all of a target's windows.
    cpu = {k: {"sglang": 0.0, "gateway": 0.0, "tokens": 0.0} for k in targets}
    for r in range(args.rounds):
        order = list(targets) if r % 2 == 0 else list(reversed(targets))  # ABBA: drift cancels
        for name in order:
            url, headers, b = targets[name]
            c0, s0, g0 = meter.sample(), _cpu_s(sgl_pids), _cpu_s(gw_pids)
            rate = await _window(url, headers, b, args.concurrency, args.seconds)
            rates[name].append(rate)
            foreign[name].append(_CpuMeter.foreign_frac(c0, meter.sample()))
            # includes the phase-in and drain around the window: a ratio, not an absolute
            cpu[name]["sglang"] += _cpu_s(sgl_pids) - s0
            cpu[name]["gateway"] += _cpu_s(gw_pids) - g0
            cpu[name]["tokens"] += rate * args.seconds
    latency = {name: await _latency(url, headers, b, 20) for name, (url, headers, b) in targets.items()}
    ratios = [g / i for g, i in zip(rates["gateway"], rates["in_process"], strict=True) if i > 0]
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {
        "tokens_per_s": med,
        "gateway_over_in_process": med["gateway"] / med["in_process"],
        "gateway_over_in_process_paired_median": statistics.median(ratios),
        "one_token_latency_s": latency,
        "cpu_s_per_1k_tokens": {
            k: {p: v[p] * 1000 / v["tokens"] for p in ("sglang", "gateway")} for k, v in cpu.items() if v["tokens"]
        },
        "gateway_cpu_share": cpu["gateway"]["gateway"] / (cpu["gateway"]["gateway"] + cpu["gateway"]["sglang"]),
        "tokens_per_s_samples": rates,
        "foreign_cpu_frac_samples": foreign,
        "config": {"seconds": args.seconds, "rounds": args.rounds, "concurrency": args.concurrency, "max_tokens": 32},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelinerl_sdk_sglang.gateway_bench", description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args(argv)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    key, port = new_api_key(), free_port()
    opts: dict[str, str] = {}
    cmd = launch_args(
        args.model, dtype=args.dtype, port=port, api_key=key, device=device, context_length=2048, options=opts
    )
    sgl = SGLangProcess(cmd, port=port, env=launch_env(device, opts))
    sgl.start()
    try:
        client = SGLangClient(sgl.url, key)
        t0 = time.perf_counter()
        asyncio.run(sgl.wait_ready(client, 600))
        print(f"SGLang up in {time.perf_counter() - t0:.0f}s", flush=True)
        options = {"sglang_url": sgl.url, "sglang_api_key": key}
        with ServerProcess("sglang", args.model, dtype=args.dtype, options=options) as gw:
            result = asyncio.run(_measure(sgl, key, gw, args.model, args))
    finally:
        sgl.stop()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
