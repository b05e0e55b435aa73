"""Which of the SDK's weight-update promises vLLM's own server keeps: the suite's questions, asked
of ``vllm serve`` with its RL routes on (``VLLM_SERVER_DEV_MODE=1``) and no SDK code in it.

    python -m pipelinerl_sdk_vllm.own_server --url http://HOST:PORT --api-key KEY [--json]
    python -m pipelinerl_sdk_vllm.own_server --model DIR [--json]     # starts one itself (CPU build too)

Each :class:`Finding` names a promise, whether vLLM keeps it (``yes``, ``no``, or ``untested``
with the reason) and the evidence: the requests sent and vLLM's answers. The server must be
started with ``--api-key`` (the control check asks whether vLLM's RL routes need it); the probe
pauses and resumes it, and its last question (a failed update) may leave it unable to serve:
restart it after. The update path proper (refusal before any
byte, the new version live at once, old weights kept on a failed broadcast, requests in flight
across an update) needs one of vLLM's weight transfers: all of them need CUDA (``nccl``, ``ipc``
and the rest), so on a machine without a GPU those promises are reported ``untested`` with vLLM's
own answer to the ``nccl`` init as the evidence.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from pipelinerl_sdk.weights.publisher import free_port

__all__ = ["Finding", "OwnServer", "probe", "table"]

Kept = Literal["yes", "no", "untested"]

#: Streams the keep-pause check runs, their length, and how long it holds the pause.
STREAMS, STREAM_TOKENS, HOLD_S = 4, 48, 1.0


@dataclass(frozen=True)
class Finding:
    """One promise of the SDK's contract, as vLLM's own server keeps it or not."""

    promise: str
    kept: Kept
    evidence: str


def _short(r: httpx.Response, n: int = 160) -> str:
    text = " ".join(r.text.split())
    return f"{r.status_code} {text[:n]}{'...' if len(text) > n else ''}"


def _chat(model: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Count: one two three"}],
        "max_tokens": max_tokens,
        **extra,
    }


def _tags(http: httpx.Client, model: str, key: dict[str, str]) -> Finding:
    r = http.post("/v1/chat/completions", json=_chat(model, 4, logprobs=True), headers=key)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    label = http.get("/weight_info").json()
    tagged = "weight_versions" in choice
    return Finding(
        "every generated token carries the version of the weights that computed it",
        "yes" if tagged else "no",
        f"choices[0] keys {sorted(choice)}: no per-token version; one label for the whole server, "
        f"GET /weight_info {label}"
        if not tagged
        else f"choices[0].weight_versions {choice['weight_versions']}",
    )


def _control(http: httpx.Client, model: str) -> Finding:
    chat = http.post("/v1/chat/completions", json=_chat(model, 1))
    paused = http.post("/pause", params={"mode": "keep"})
    if paused.status_code == 200:
        http.post("/resume")
    opened = paused.status_code < 400
    return Finding(
        "weight-update and pause routes answer only a credential (the SDK: its control token)",
        "no" if opened else "yes",
        f"server started with --api-key; without it POST /v1/chat/completions: {_short(chat, 40)}; "
        f"POST /pause?mode=keep: {_short(paused, 60)}",
    )


def _keep(http: httpx.Client, url: str, model: str, key: dict[str, str]) -> Finding:
    """Streams running when a keep-pause comes: frozen while it holds, all finish after resume."""
    counts = [0] * STREAMS
    ends: list[str | None] = [None] * STREAMS
    first = [False] * STREAMS
    last = [0.0] * STREAMS
    started = threading.Barrier(STREAMS + 1, timeout=120)

    def stream(i: int) -> None:
        body = _chat(model, STREAM_TOKENS, stream=True, ignore_eos=True, seed=i)
        body["stream_options"] = {"include_usage": True}
        with (
            httpx.Client(base_url=url, timeout=300) as c,
            c.stream("POST", "/v1/chat/completions", json=body, headers=key) as r,
        ):
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    counts[i] = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or ():
                    if choice.get("finish_reason"):
                        ends[i] = choice["finish_reason"]
                    elif choice.get("delta", {}).get("content") and not first[i]:
                        first[i] = True
                        started.wait()
                    if choice.get("delta", {}).get("content"):
                        last[i] = time.monotonic()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(STREAMS)]
    for t in threads:
        t.start()
    started.wait()
    paused = http.post("/pause", params={"mode": "keep"}, headers=key)
    is_paused = http.get("/is_paused", headers=key).json()
    t_paused = time.monotonic()
    time.sleep(HOLD_S)
    t_resume = time.monotonic()
    during = sum(t_paused + 0.2 < t < t_resume for t in last)  # a stream whose newest delta came while paused
    resumed = http.post("/resume", headers=key)
    for t in threads:
        t.join(300)
    full = sum(1 for c, e in zip(counts, ends, strict=True) if e == "length" and c == STREAM_TOKENS)
    kept = paused.status_code == 200 and resumed.status_code == 200 and during == 0 and full == STREAMS
    return Finding(
        "requests in flight are frozen by a pause (mode=keep), kept, and finish after it",
        "yes" if kept else "no",
        f"{STREAMS} streams of {STREAM_TOKENS} tokens; POST /pause?mode=keep {_short(paused, 40)}, "
        f"/is_paused {is_paused}; streams still receiving deltas while paused: {during} of {STREAMS} "
        f"({HOLD_S:.1f} s held); after /resume {full} of {STREAMS} ended 'length' with all "
        f"{STREAM_TOKENS} tokens (usage {counts}, ends {ends})",
    )


def _bad_input(http: httpx.Client, key: dict[str, str]) -> list[Finding]:
    init = http.post("/init_weight_transfer_engine", json={"init_info": {"bogus": 1}}, headers=key)
    started = http.post("/start_weight_update", headers=key)
    again = http.post("/start_weight_update", headers=key)
    http.post("/finish_weight_update", json={"weight_version": None}, headers=key)
    return [
        Finding(
            "a bad weight-transfer request is a 4xx naming the field",
            "yes" if 400 <= init.status_code < 500 else "no",
            f"POST /init_weight_transfer_engine {{'init_info': {{'bogus': 1}}}}: {_short(init)}",
        ),
        Finding(
            "a second update session while one is open is a 4xx (the SDK: 409)",
            "yes" if 400 <= again.status_code < 500 else "no",
            f"POST /start_weight_update: {_short(started, 40)}; again: {_short(again)}",
        ),
    ]


#: The promises of the update path proper, each needing one of vLLM's weight transfers to run.
UPDATE_PROMISES = (
    "a bad update is refused before any byte is sent",
    "the new weights go live at once, for every later token",
    "a broadcast that fails half-way leaves the old weights serving, unpaused",
    "requests in flight across an update are kept, with true per-token versions",
)


def _failed_update(http: httpx.Client, model: str, key: dict[str, str]) -> Finding:
    """An update session whose ``update_weights`` fails (here: for params vLLM does not hold,
    with no transfer joined), then the next request. Last: it may leave the server unusable."""
    before = http.post("/v1/chat/completions", json=_chat(model, 2), headers=key)
    started = http.post("/start_weight_update", headers=key)
    info = {"names": ["model.no_such_layer.weight"], "dtype_names": ["float32"], "shapes": [[4]]}
    failed = http.post("/update_weights", json={"update_info": info}, headers=key)
    finished = http.post("/finish_weight_update", json={"weight_version": None}, headers=key)
    try:
        after = http.post("/v1/chat/completions", json=_chat(model, 2), headers=key)
        served, next_chat = after.status_code == 200, _short(after, 100)
    except httpx.TransportError as e:  # vLLM ends its server once its engine died
        served, next_chat = False, f"no answer, the server exited ({type(e).__name__}: {e})"
    return Finding(
        "a failed update leaves the old weights serving",
        "yes" if before.status_code == 200 and served else "no",
        f"chat before: {before.status_code}; POST /start_weight_update {_short(started, 40)}; "
        f"/update_weights for a param it does not hold: {_short(failed, 120)}; /finish_weight_update: "
        f"{_short(finished, 100)}; the next chat: {next_chat}",
    )


def _transfers(http: httpx.Client, key: dict[str, str]) -> list[Finding]:
    """vLLM's ``nccl`` transfer, the one its docs use, asked to init; on success a GPU is here
    and this probe stops short: the update path is the GPU script's to check."""
    port = free_port()
    info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    try:
        r = http.post("/init_weight_transfer_engine", json={"init_info": info}, headers=key, timeout=30)
        answer = _short(r)
    except httpx.TimeoutException:
        answer = "no answer in 30 s (it waits for the trainer's rank 0: a GPU transfer began)"
    why = f"vLLM's weight transfers need CUDA: POST /init_weight_transfer_engine (nccl) answered {answer}"
    return [Finding(p, "untested", why) for p in UPDATE_PROMISES]


def probe(url: str, api_key: str) -> list[Finding]:
    """Ask vLLM's own server at ``url`` (started with ``--api-key api_key``, RL routes on) every
    question; the server is resumed before this returns. The last question (a failed update)
    may leave it unable to serve: restart it after."""
    key = {"Authorization": f"Bearer {api_key}"}
    # a connection per request: vLLM's server may close one after an error (seen: a reset)
    fresh = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=url.rstrip("/"), timeout=120, limits=fresh) as http:
        model = http.get("/v1/models", headers=key).json()["data"][0]["id"]
        try:
            return [
                _tags(http, model, key),
                _control(http, model),
                _keep(http, url, model, key),
                *_bad_input(http, key),
                *_transfers(http, key),
                _failed_update(http, model, key),  # last: it may leave the engine dead
            ]
        finally:
            with contextlib.suppress(httpx.TransportError):  # gone after the last question: nothing held
                http.post("/resume", headers=key)


def table(findings: list[Finding]) -> str:
    """The findings as a markdown table."""
    rows = ["| promise | vLLM's own server | evidence |", "|---|---|---|"]
    rows += [f"| {f.promise} | {f.kept} | {f.evidence.replace('|', '/')} |" for f in findings]
    return "\n".join(rows)


class OwnServer:
    """``vllm serve MODEL`` (:mod:`pipelinerl_sdk_vllm.vllm_cli`) with the RL routes on, no plugin
    loaded (``VLLM_PLUGINS=``), an API key, vLLM's ``nccl`` weight transfer configured; stopped
    (its process group) on exit. ``url`` once started."""

    def __init__(
        self, model: str | os.PathLike[str], *, dtype: str = "float32", startup_timeout_s: float = 300
    ) -> None:
        self.model, self.dtype, self.startup_timeout_s = str(model), dtype, startup_timeout_s
        self.api_key = secrets.token_urlsafe(16)
        self.log_path = Path(tempfile.mkdtemp(prefix="vllm-own-")) / "server.log"
        self.url = ""
        self._proc: subprocess.Popen[bytes] | None = None

    def _cmd(self, port: int) -> list[str]:
        return [
            sys.executable, "-m", "pipelinerl_sdk_vllm.vllm_cli", "serve", self.model,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", self.dtype, "--max-model-len", "512",
            "--api-key", self.api_key, "--enforce-eager", "--generation-config", "vllm",
            "--weight-transfer-config", json.dumps({"backend": "nccl"}),
        ]  # fmt: skip

    def start(self) -> OwnServer:
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_PLUGINS": ""}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        for _ in range(3):  # vLLM binds the port it is given: one taken meanwhile is tried again
            port = free_port()
            with open(self.log_path, "wb") as log:
                self._proc = subprocess.Popen(
                    self._cmd(port), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + self.startup_timeout_s
            while time.monotonic() < deadline and self._proc.poll() is None:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        self.url = url
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            log_text = self.log_path.read_text(errors="replace")
            self.stop()
            if "Address already in use" not in log_text:
                raise RuntimeError(f"vLLM's server did not start:\n{log_text[-3000:]}")
        raise RuntimeError("vLLM's server found its port taken three times")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def __enter__(self) -> OwnServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def _target(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    if args.url:
        yield args.url, args.api_key
        return
    with OwnServer(args.model) as server:
        yield server.url, server.api_key


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--url", help="a running vLLM server (RL routes on, started with --api-key)")
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY", ""))
    parser.add_argument("--model", help="start vLLM's own server on this model directory instead")
    parser.add_argument("--json", action="store_true", help="one JSON object per finding")
    args = parser.parse_args(argv)
    if bool(args.url) == bool(args.model):
        parser.error("give --url or --model")
    with _target(args) as (url, key):
        findings = probe(url, key)
    if args.json:
        for f in findings:
            print(json.dumps(asdict(f)))
    else:
        print(table(findings))


if __name__ == "__main__":
    main()
