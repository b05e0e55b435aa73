"""``pipelinerl``: list backends, serve one, build a tiny model, run benchmarks and the demo."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from pipelinerl_sdk.contracts import LOGPROBS_MODES, InferenceCapabilities, ServeConfig, capabilities_to_dict
from pipelinerl_sdk.errors import PipelineRLError
from pipelinerl_sdk.launch import ENV_API_KEY, ENV_CONTROL_TOKEN
from pipelinerl_sdk.plugins import load_registry


def _options(pairs: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--option takes KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


def cmd_backends(args: argparse.Namespace) -> int:
    from pipelinerl_sdk.stdout_guard import stdout_to_stderr

    with stdout_to_stderr():  # a plugin that prints at import must not break --json
        registry = load_registry()
    entries = [
        {
            "kind": e.kind,
            "name": e.name,
            "plugin": e.plugin,
            "description": e.description,
            "capabilities": capabilities_to_dict(e.capabilities),
        }
        for e in sorted(registry.entries.values(), key=lambda e: (e.kind, e.name))
    ]
    plugins = [
        {
            "entry_point": r.name,
            "value": r.value,
            "distribution": r.distribution,
            "version": r.version,
            "status": r.status,
            "error": r.error,
            "backends": list(r.backends),
        }
        for r in registry.load_results
    ]
    if args.json:
        print(json.dumps({"backends": entries, "plugins": plugins}, indent=2))
        return 0
    print("backends:")
    for e in entries:
        print(f"  {e['kind']:<9} {e['name']:<12} (plugin {e['plugin']}) {e['description']}")
    print("plugins:")
    for p in plugins:
        dist = f"{p['distribution']} {p['version']}" if p["distribution"] else "-"
        line = f"  {p['entry_point']:<14} {p['status']:<7} {dist}"
        if p["error"]:
            line += f"\n      {p['error']}"
        print(line)
    return 0


def write_private(path: str, text: str) -> None:
    """Write ``text`` to a new file only its owner can read (an existing file is replaced)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def cmd_serve(args: argparse.Namespace) -> int:
    token = os.environ.get(ENV_CONTROL_TOKEN, "")
    if not token:
        # Never into the log: a log is read by more people than the operator.
        token = secrets.token_urlsafe(24)
        path = args.control_token_file or os.path.join(tempfile.mkdtemp(prefix="pipelinerl-"), "control-token")
        write_private(path, token)
        print(
            f"pipelinerl: {ENV_CONTROL_TOKEN} not set; this run's control token is in {path} (owner-only)",
            file=sys.stderr,
        )
    config = ServeConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        control_token=token,
        api_key=os.environ.get(ENV_API_KEY) or None,
        receive_mode=args.receive_mode,
        ready_file=args.ready_file,
        options={**_options(args.option), **({"workers": str(args.workers)} if args.workers is not None else {})},
        trainer_hosts=tuple(args.allow_trainer_host),
        max_body_bytes=args.max_body_bytes,
        max_queued_requests=args.max_queued_requests,
        max_tokens_in_flight=args.max_tokens_in_flight,
        shutdown_timeout_s=args.shutdown_timeout,
        served_model_names=tuple(args.served_model_name or ()),
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        logprobs_mode=args.logprobs_mode,
        pipelinerl_group_init_method=args.weight_update_group_init_method,
        pipelinerl_group_world_size=args.weight_update_group_world_size or 2,
        pipelinerl_actor_idx=args.actor_llm_idx,
        pipelinerl_local_ranks=args.weight_update_group_local_ranks,
    )
    refused = _pipelinerl_group_refusal(args, config)
    if refused:
        print(f"pipelinerl serve: {refused}", file=sys.stderr)
        return 2
    registry = load_registry()
    registry.factory("inference", args.backend)  # an import error before binding or loading anything
    caps = registry.get("inference", args.backend).capabilities
    modes = caps.logprobs_modes if isinstance(caps, InferenceCapabilities) else frozenset({"raw_logprobs"})
    if config.logprobs_mode not in modes:
        print(
            f"pipelinerl serve: --logprobs-mode {config.logprobs_mode}: the {args.backend} backend serves "
            f"{', '.join(sorted(modes))} only",
            file=sys.stderr,
        )
        return 2
    if args.port:  # fail before loading a model, not after
        from pipelinerl_sdk.http.server import bind_socket

        bind_socket(args.host, args.port).close()
    backend = registry.create_inference(args.backend, config)
    from pipelinerl_sdk.kit.inference.serve import serve

    serve(backend, config)
    return 0


def _pipelinerl_group_refusal(args: argparse.Namespace, config: ServeConfig) -> str | None:
    """Why PipelineRL's group options cannot be served as given (None: they can, or are unset)."""
    given = args.weight_update_group_init_method, args.weight_update_group_world_size
    if given == (None, None):
        return None
    if None in given:
        return "--weight-update-group-init-method and --weight-update-group-world-size go together"
    from pipelinerl_sdk.http.server import trainer_host_allowed
    from pipelinerl_sdk.kit.inference.serve import pipelinerl_group

    try:
        pipelinerl_group(config)
        allowed = trainer_host_allowed(args.weight_update_group_init_method, config.trainer_hosts)
    except ValueError as e:
        return f"--weight-update-group-init-method/--actor-llm-idx: {e}"
    if not allowed:
        return (
            f"--weight-update-group-init-method {args.weight_update_group_init_method}: not loopback; "
            "name the trainer's host with --allow-trainer-host"
        )
    return None


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from pipelinerl_sdk.reference.tiny import build_tiny_model

    path = build_tiny_model(args.path, preset=args.preset, dtype=args.dtype, seed=args.seed)
    print(path)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pipelinerl_sdk.stdout_guard import stdout_to_stderr

    # The result is the only thing on stdout: engines' and children's prints go to stderr.
    with stdout_to_stderr():
        result = _run_bench(args)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _run_bench(args: argparse.Namespace) -> dict[str, Any]:
    if args.what == "weight-update":
        from pipelinerl_sdk.bench.weight_update import run_weight_update_bench

        names = ("backend", "model", "seconds", "updates", "concurrency", "bucket_mb")
        result: dict[str, Any] = run_weight_update_bench(**{name: getattr(args, name) for name in names})
    elif args.what == "gather":
        from pipelinerl_sdk.bench.gather import run_gather_bench

        if not args.trainer:
            raise SystemExit("bench gather: --trainer NAME is required (see `pipelinerl backends`)")
        result = run_gather_bench(
            trainer=args.trainer,
            world_size=args.world_size,
            model=args.model,
            bucket_mb=args.bucket_mb,
            repeats=args.updates,
            options=_options(args.option),
        )
    elif args.what == "generate":
        from pipelinerl_sdk.bench.generate import run_generate_bench

        names = ("backend", "model", "seconds", "rounds", "concurrency", "max_tokens")
        result = run_generate_bench(**{name: getattr(args, name) for name in names})
    elif args.what == "pipeline":
        from pipelinerl_sdk.bench.pipeline import run_pipeline_bench

        result = run_pipeline_bench(args.config, args.set, args.out_dir)
    else:
        raise SystemExit(f"unknown benchmark {args.what!r}")
    return result


def cmd_run(args: argparse.Namespace) -> int:
    import signal
    import threading

    from pipelinerl_sdk.pipeline.config import PipelineConfig
    from pipelinerl_sdk.pipeline.run import run_pipeline

    config = PipelineConfig.load(args.config, args.set)
    # SIGTERM unwinds the run like Ctrl-C, so it stops the inference servers it started: they run
    # in sessions of their own, and killing this process alone would leave them serving.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if main_thread else None
    try:
        summary = run_pipeline(config)
    except KeyboardInterrupt:
        print("pipelinerl: run interrupted; the servers it started were stopped", file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    print(summary.line())
    return 0 if summary.reached_target or summary.steps else 1


def cmd_demo(args: argparse.Namespace) -> int:  # until `pipelinerl run` lands (issue 6)
    from pipelinerl_sdk.demo import run_demo

    return run_demo(steps=args.steps, workdir=args.workdir)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipelinerl", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("backends", help="list installed backends and how each plugin loaded")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_backends)

    s = sub.add_parser("serve", help="serve the inference contract with a backend")
    s.add_argument("--backend", default="reference")
    s.add_argument("--model", required=True, help="HF-format model directory")
    s.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    s.add_argument("--port", type=int, default=8000, help="0 picks a free port (see --ready-file)")
    s.add_argument("--dtype", default="float32")
    s.add_argument("--receive-mode", choices=["direct", "staged"], default=None)
    s.add_argument("--ready-file", default=None, help="write {url, pid, port} here once serving")
    s.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="backend option")
    s.add_argument(
        "--workers", type=int, default=None, help="engine workers, for a backend that runs several (--option workers=N)"
    )
    s.add_argument(
        "--allow-trainer-host",
        action="append",
        default=[],
        metavar="HOST",
        help="a trainer host whose weight-update store this server may join (loopback always may)",
    )
    # server-wide generation settings, as vLLM names them
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names /v1/models lists and requests may use (the first is the one responses carry)",
    )
    s.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="every logprob's token is 'token_id:N' whatever the request asks",
    )
    s.add_argument(
        "--logprobs-mode",
        choices=LOGPROBS_MODES,
        default="raw_logprobs",
        help="what every reported logprob is (vLLM's meanings; a backend that cannot is refused at start-up)",
    )
    # PipelineRL's trainer protocol, under the flags PipelineRL's launcher gives vLLM
    s.add_argument(
        "--weight-update-group-init-method",
        default=None,
        metavar="tcp://HOST:PORT",
        help="serve PipelineRL's /receive_weight_update over its trainer's group at this store (gloo)",
    )
    s.add_argument("--weight-update-group-world-size", type=int, default=None, help="PipelineRL's group size")
    s.add_argument("--actor-llm-idx", type=int, default=0, help="this server's index among PipelineRL's actors")
    s.add_argument(
        "--weight-update-group-local-ranks",
        type=int,
        default=1,
        help="ranks this server takes in PipelineRL's group (its GPUs per LLM)",
    )
    limits = ServeConfig(model="")
    for flag, kind, default, what in (
        ("--max-body-bytes", int, limits.max_body_bytes, "request bodies past this get 413"),
        ("--max-queued-requests", int, limits.max_queued_requests, "chat requests admitted at once; more get 429"),
        ("--max-tokens-in-flight", int, limits.max_tokens_in_flight, "prompts x n x max_tokens at once; more: 429"),
        ("--shutdown-timeout", float, limits.shutdown_timeout_s, "seconds SIGTERM waits before aborting requests"),
    ):
        s.add_argument(flag, type=kind, default=default, help=what)
    s.add_argument(
        "--control-token-file",
        default=None,
        help=f"without {ENV_CONTROL_TOKEN}: write the generated token here (owner-only), never to the log",
    )
    s.set_defaults(func=cmd_serve)

    t = sub.add_parser("tiny-model", help="write a tiny Qwen2 model and offline tokenizer to PATH")
    t.add_argument("path")
    t.add_argument("--preset", default="tiny", choices=["tiny", "bench"])
    t.add_argument("--dtype", default="float32")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_tiny_model)

    k = sub.add_parser("bench", help="benchmarks (ratios measured in one run)")
    k.add_argument("what", choices=["weight-update", "gather", "pipeline", "generate"])
    k.add_argument("--backend", default="reference", help="weight-update: the inference backend")
    k.add_argument("--trainer", default=None, help="gather: the trainer backend")
    k.add_argument("--world-size", type=int, default=2, help="gather: trainer ranks")
    k.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="gather: trainer option")
    k.add_argument("--model", default=None, help="model dir (default: a freshly built 'bench' preset)")
    k.add_argument("--seconds", type=float, default=8.0, help="length of each throughput window")
    k.add_argument("--updates", type=int, default=9, help="updates timed (per mode for weight-update)")
    k.add_argument("--concurrency", type=int, default=16)
    k.add_argument("--rounds", type=int, default=4, help="generate: rounds of the three modes")
    k.add_argument("--max-tokens", type=int, default=64, help="generate: tokens per request")
    k.add_argument("--bucket-mb", type=int, default=64)
    k.add_argument("--json", action="store_true", help="one JSON object on one line")
    k.add_argument("--config", default=None, help="pipeline: the run config (TOML/JSON)")
    k.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="pipeline: config overrides")
    k.add_argument("--out-dir", default="runs/bench-pipeline", help="pipeline: where both runs write")
    k.set_defaults(func=cmd_bench)

    r = sub.add_parser("run", help="a PipelineRL run (pipeline or conventional mode)")
    r.add_argument("config", nargs="?", default=None, help="TOML/JSON config (default: built-in defaults)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    r.set_defaults(func=cmd_run)

    d = sub.add_parser("demo", help="a short trainer -> server weight-update run on CPU")
    d.add_argument("--steps", type=int, default=8)
    d.add_argument("--workdir", default="runs/demo")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except PipelineRLError as e:
        print(f"pipelinerl: error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"pipelinerl: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
