"""The ``torchtitan`` trainer backend (adapters/torchtitan) on real TorchTitan 0.3.0: no mocks.

Runs only in the TorchTitan environment (``scripts/setup-torchtitan`` prints its path); elsewhere the
module is skipped with that reason. Checks:

- each CPU shim (``cpu_shims``) is still needed (TorchTitan fails without it) and still works;
- importing the plugin imports neither torch nor torchtitan; the registry resolves the backend;
- for tiny Qwen2, Qwen3 and Llama checkpoints, at world size 1 and 2 (spawned gloo ranks, half the
  batch each, micro-batches, active clipping): the gathered weights after init equal the checkpoint,
  two steps equal the same steps of the *plain* TorchTitan model (unsharded, fp32, torch AdamW, loaded
  with the family's ``from_hf``), forward equals it too; bf16 mixed precision trains;
- the whole standard conformance suite (trainer contract at world size 1 and 2, cross check against a
  reference server) on the Qwen3 and Llama checkpoints (``--conformance-model``; the default Qwen2 one
  is what CI's ``pytest conformance/... --backend=torchtitan --backend=reference`` runs).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from pipelinerl_sdk.conformance.trainer import STEP_HPARAMS
from pipelinerl_sdk.contracts import TokenBatch, TrainerSpec
from pipelinerl_sdk.rl.objectives import CompletionNLL
from pipelinerl_sdk.testing.ranks import Job, Run, adamw_steps, max_diff, train
from pipelinerl_sdk.trainer_group import RankContext, run_ranks

HAVE_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None
HAVE_ADAPTER = importlib.util.find_spec("pipelinerl_sdk_torchtitan") is not None
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not (HAVE_TORCHTITAN and HAVE_ADAPTER),
        reason="TorchTitan or the TorchTitan adapter is not installed here: run these tests in the env "
        "scripts/setup-torchtitan prints",
    ),
]

#: The suite as a third party runs it: one test module subclassing the standard checks.
CONFORMANCE_MODULE = """
from pipelinerl_sdk.conformance.cross import CrossCheckTests
from pipelinerl_sdk.conformance.trainer import TrainerContractTests


class TestTrainer(TrainerContractTests): ...


class TestCross(CrossCheckTests): ...
"""
ARCHS = ("qwen2", "qwen3", "llama")
TOL = 1e-6
SEQS: list[list[int]] = [[3 + (7 * i + 3 * j) % 500 for j in range(5 + (i % 4) * 3)] for i in range(8)]
STARTS: list[int] = [2 + i % 3 for i in range(8)]


def _python(code: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter of this environment (imports and shims start clean)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=env
    )


# --- the shims ------------------------------------------------------------------------------------


def test_triton_shim_is_needed_and_works() -> None:
    """Without the stub, TorchTitan's model package does not import here (triton is missing); with
    it, it does, and the stubbed kernels refuse to run instead of pretending."""
    bare = _python("import torchtitan.models.qwen3")
    assert bare.returncode != 0 and "No module named 'triton'" in bare.stderr, (
        "torchtitan.models imports without the triton stub now: remove the shim 'triton_kernels'\n" + bare.stderr
    )
    shimmed = _python(
        """
        from pipelinerl_sdk_torchtitan import cpu_shims
        assert cpu_shims.apply(["triton_kernels"]) == {"triton_kernels"}
        import torchtitan.models.qwen3, torchtitan.models.llama3
        from torchtitan.distributed.minimal_async_ep import kernels
        try:
            kernels.copy_rows_to_peers_kernel()
        except NotImplementedError as e:
            print("refused:", e)
        """
    )
    assert shimmed.returncode == 0, shimmed.stderr
    assert "refused: copy_rows_to_peers_kernel" in shimmed.stdout


def test_cpu_device_shim_is_needed_and_works() -> None:
    """Without it TorchTitan picks ``cuda`` on this accelerator-less machine and cannot build its
    device mesh; with it the mesh is a CPU mesh and FSDP over gloo works (the trainer tests below)."""
    code = """
        import sys
        import torch.distributed as dist
        from pipelinerl_sdk_torchtitan import cpu_shims
        cpu_shims.apply(["triton_kernels"] + sys.argv[1:])
        import torchtitan.tools.utils as utils
        from torchtitan.distributed import ParallelDims
        print("device_type", utils.device_type)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=1,
                            spmd_backend="partial_dtensor")
        print("mesh", dims.build_mesh().device_type)
        """
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    bare = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env)
    assert "device_type cuda" in bare.stdout and bare.returncode != 0, (
        "TorchTitan builds a mesh without the device shim now: remove the shim 'cpu_device'\n" + bare.stdout
    )
    shimmed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), "cpu_device"], capture_output=True, text=True, env=env
    )
    assert shimmed.returncode == 0, shimmed.stderr
    assert "device_type cpu" in shimmed.stdout and "mesh cpu" in shimmed.stdout


def test_unknown_shim_is_refused() -> None:
    from pipelinerl_sdk_torchtitan import cpu_shims

    with pytest.raises(ValueError, match="unknown shims"):
        cpu_shims.apply(["no-such-shim"])


# --- the plugin -----------------------------------------------------------------------------------


def test_plugin_imports_no_engine_and_registers_the_backend() -> None:
    out = _python(
        """
        import json, sys
        import pipelinerl_sdk_torchtitan.plugin
        from pipelinerl_sdk.plugins import load_registry
        entry = load_registry().get("trainer", "torchtitan")
        print(json.dumps({"factory": entry.factory, "loaded": sorted(m for m in ("torch", "torchtitan")
                          if m in sys.modules), "sharded": entry.capabilities.sharded}))
        """
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"factory": "pipelinerl_sdk_torchtitan.trainer:TorchTitanTrainer", "loaded": [], "sharded": True}


def test_unsupported_family_is_refused(tmp_path: Path) -> None:
    from pipelinerl_sdk_torchtitan.models import model_spec
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        model_spec(GPT2Config())


# --- steps vs the plain TorchTitan model --------------------------------------------------------------


def _plain_titan(spec: TrainerSpec, steps: int) -> tuple[dict[str, torch.Tensor], list[float], list[torch.Tensor]]:
    """The same steps on the plain TorchTitan model: unsharded, fp32, loaded with the family's
    ``from_hf`` through ``load_state_dict`` (TorchTitan's own QKV merge hook), whole batch per step,
    torch AdamW, ``clip_grad_norm_``. Returns params under HF names (``state_dict()`` then ``to_hf``),
    grad norms, and the logprobs after the steps."""
    from pipelinerl_sdk_torchtitan.models import model_spec
    from pipelinerl_sdk_torchtitan.trainer import read_hf_checkpoint, titan_token_logprobs
    from transformers import AutoConfig

    mspec = model_spec(AutoConfig.from_pretrained(spec.model))
    model = mspec.model.build()
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    adapter = mspec.state_dict_adapter(mspec.model, None)
    result = model.load_state_dict(adapter.from_hf(read_hf_checkpoint(spec.model)), strict=False)
    params = {n for n, _ in model.named_parameters()}
    assert not result.unexpected_keys and not params & set(result.missing_keys), result
    model.train()
    assert spec.grad_clip is not None

    def loss() -> torch.Tensor:
        return CompletionNLL(len(SEQS))(titan_token_logprobs(model, SEQS, 0), TokenBatch(SEQS, STARTS))[0]

    norms = adamw_steps(list(model.parameters()), spec, steps, loss, foreach=False)
    with torch.no_grad():
        lps = [t.clone() for t in titan_token_logprobs(model, SEQS, 0)]
        hf = adapter.to_hf(model.state_dict())
    return {k: v.detach().clone() for k, v in hf.items()}, norms, lps


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from pipelinerl_sdk.reference.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("titan-models")
    return {arch: build_tiny_model(root / arch, preset="tiny", dtype="float32", seed=0, arch=arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def specs(models: dict[str, Path]) -> dict[str, TrainerSpec]:
    # The conformance suite's step hyper-parameters (well-conditioned at 1e-6: eps 1e-3 damps the
    # rounding-noise gradients, see pipelinerl_sdk.conformance.trainer), with clipping at 300 active
    # (norm ~500). With eps 1e-6 the tiny Llama differed by 4.5e-6 between one batch and 2x2 micro-batches.
    hp = {**STEP_HPARAMS, "grad_clip": 300.0}
    return {
        arch: TrainerSpec(model=str(path), seed=0, **hp)  # type: ignore[arg-type]
        for arch, path in models.items()
    }


@pytest.fixture(scope="module")
def runs(specs: dict[str, TrainerSpec]) -> dict[Any, dict[str, Any]]:
    job = Job(tuple(Run("torchtitan", specs[a]) for a in ARCHS), seqs=SEQS)
    ws1 = run_ranks(1, train, job, timeout_s=600)[0]
    bf16 = replace(specs["qwen3"], options={"mixed_precision": "bf16"})
    ws2 = run_ranks(2, train, replace(job, runs=(*job.runs, Run("torchtitan", bf16))), timeout_s=600)[0]
    out: dict[Any, dict[str, Any]] = {}
    for i, arch in enumerate(ARCHS):
        out[(arch, 1)], out[(arch, 2)] = ws1[i], ws2[i]
    out["bf16"] = ws2[len(ARCHS)]
    return out


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_init_gathers_the_checkpoint(
    runs: dict[Any, dict[str, Any]], models: dict[str, Path], arch: str, world_size: int
) -> None:
    from pipelinerl_sdk_torchtitan.trainer import read_hf_checkpoint

    got = runs[(arch, world_size)]["initial"]
    assert max_diff(got, read_hf_checkpoint(models[arch])) == 0.0
    assert list(got) == [n for n, _, _ in runs[(arch, world_size)]["specs"]]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_steps_equal_the_plain_torchtitan_model(
    runs: dict[Any, dict[str, Any]], specs: dict[str, TrainerSpec], arch: str, world_size: int
) -> None:
    want, norms, lps = _plain_titan(specs[arch], steps=2)
    run = runs[(arch, world_size)]
    moved = max_diff(want, runs[(arch, 1)]["initial"])
    assert moved > 100 * TOL, f"the plain run moved params by only {moved}: vacuous"
    assert max_diff(run["final"], want) <= TOL
    assert max(abs(m.grad_norm - n) for m, n in zip(run["metrics"], norms, strict=True)) <= 1e-5 * max(norms)
    assert min(norms) > specs[arch].grad_clip  # type: ignore[operator]  # clipping was exercised
    assert [m.step for m in run["metrics"]] == [1, 2] and run["metrics"][0].lr == specs[arch].lr
    for i, lp in run["logprobs"].items():
        assert lp.dtype == torch.float32 and lp.shape == (len(SEQS[i]) - 1,)
        assert float((lp - lps[i]).abs().max()) <= 1e-5


def test_bf16_mixed_precision_trains(runs: dict[Any, dict[str, Any]]) -> None:
    out, fp32 = runs["bf16"], runs[("qwen3", 2)]
    assert all(t.dtype == torch.float32 for t in out["final"].values())  # fp32 master weights
    names = sorted(out["final"])
    delta = torch.cat([(out["final"][k] - out["initial"][k]).flatten() for k in names])
    want = torch.cat([(fp32["final"][k] - fp32["initial"][k]).flatten() for k in names])
    assert float(delta.abs().max()) > 1e-6  # it stepped
    assert float(torch.nn.functional.cosine_similarity(delta, want, dim=0)) > 0.9
    for i, lp in out["logprobs"].items():  # bf16 logits: close to fp32, returned as float32
        # logprobs here reach -22: one bf16 ulp there is 0.125; allow two (seen: 0.102 max)
        assert lp.dtype == torch.float32 and float((lp - fp32["logprobs"][i]).abs().max()) < 0.25


# --- the standard suite on the Qwen3 and Llama checkpoints -------------------------------------------


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def reference_server(request: pytest.FixtureRequest, models: dict[str, Path]) -> Iterator[tuple[str, Any]]:
    from pipelinerl_sdk.launch import ServerProcess

    proc = ServerProcess("reference", models[request.param], startup_timeout_s=300, options={"threads": 1})
    proc.start()
    try:
        yield request.param, proc
    finally:
        proc.stop()


def test_conformance_suite_on_qwen3_and_llama(
    reference_server: tuple[str, Any], models: dict[str, Path], tmp_path: Path
) -> None:
    """The trainer and cross checks (a third party's test module, :data:`CONFORMANCE_MODULE`) with
    ``--backend=torchtitan`` against a reference server serving the same checkpoint: every check
    passes, none is skipped."""
    arch, proc = reference_server
    report = tmp_path / "report.xml"
    (tmp_path / "test_conformance.py").write_text(CONFORMANCE_MODULE)
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::UserWarning",
        "test_conformance.py",
        "--backend=torchtitan", f"--backend={proc.url}", f"--control-token={proc.control_token}",
        f"--conformance-model={models[arch]}", f"--junitxml={report}",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    import xml.etree.ElementTree as ET

    suite = ET.parse(report).getroot().find("testsuite")
    assert suite is not None
    counts = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    assert counts == {"tests": _standard_checks(), "failures": 0, "errors": 0, "skipped": 0}, counts


def _standard_checks() -> int:
    """How many standard trainer and cross checks the suite has (each runs once here)."""
    from pipelinerl_sdk.conformance.cross import CrossCheckTests
    from pipelinerl_sdk.conformance.trainer import TrainerContractTests

    return sum(1 for cls in (TrainerContractTests, CrossCheckTests) for n in dir(cls) if n.startswith("test_"))


# --- tensor parallel (experimental option) -------------------------------------------------------------


def _tp_job(ctx: RankContext, args: tuple[Path, int]) -> dict[str, Any]:
    from pipelinerl_sdk_torchtitan.trainer import TorchTitanTrainer

    from pipelinerl_sdk.conformance.trainer import CollectingSink, fixed_batch, step_spec

    model, tp = args
    trainer = TorchTitanTrainer()
    trainer.init(replace(step_spec(model), options={"tensor_parallel": tp}))
    batch = fixed_batch(model, 0)  # the same batch on every rank: TP ranks share their inputs
    logprobs = trainer.forward(batch)
    trainer.backward(batch, CompletionNLL(len(batch)))
    norm = trainer.step().grad_norm
    sink = CollectingSink() if ctx.is_main else None
    trainer.gather_and_broadcast(sink)
    trainer.close()
    return {"logprobs": logprobs, "norm": norm, "params": sink.tensors if sink is not None else None}


def test_tensor_parallel_2_equals_world_size_1(tmp_path: Path) -> None:
    """``tensor_parallel=2`` on two ranks (TorchTitan's TP plan for Qwen3, over gloo), both ranks on the
    same batch: forward, step and gathered params equal one rank without TP. Needs a model whose KV
    heads split over 2 ranks (the bench preset: 4 KV heads); the tiny preset (1 KV head) is refused."""
    from pipelinerl_sdk.conformance.trainer import PARAM_ATOL
    from pipelinerl_sdk.reference.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "bench-qwen3", preset="bench", arch="qwen3")
    (ref,) = run_ranks(1, _tp_job, (model, 1), timeout_s=600)
    tp = run_ranks(2, _tp_job, (model, 2), timeout_s=600)
    for out in tp:
        assert max(float((a - b).abs().max()) for a, b in zip(out["logprobs"], ref["logprobs"], strict=True)) <= 1e-4
        assert abs(out["norm"] - ref["norm"]) <= 1e-5 * ref["norm"]
    assert max_diff(tp[0]["params"], ref["params"]) <= PARAM_ATOL
    tiny = build_tiny_model(tmp_path / "tiny-qwen3", arch="qwen3")
    with pytest.raises(Exception, match="must divide num_key_value_heads=1"):
        run_ranks(2, _tp_job, (tiny, 2), timeout_s=300)


class _SlotSink:
    """A sink with slots, as the SDK's sender has: records, per param sent, whether it arrived in
    its slot (nothing left to copy) and its value."""

    def __init__(self, specs: list[Any]) -> None:
        self.slots = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in specs}
        self.got: dict[str, tuple[bool, torch.Tensor]] = {}

    def slot(self, name: str) -> torch.Tensor:
        return self.slots[name]

    def send(self, name: str, tensor: torch.Tensor) -> None:
        self.got[name] = (tensor.data_ptr() == self.slots[name].data_ptr(), tensor.clone())


def _gather_into_slots(ctx: RankContext, model: str) -> dict[str, Any]:
    from pipelinerl_sdk.plugins import load_registry

    trainer = load_registry().create_trainer("torchtitan")
    trainer.init(TrainerSpec(model=model))
    try:
        expected = trainer.state_dict_hf()
        sink = _SlotSink(trainer.param_specs()) if ctx.is_main else None
        trainer.gather_and_broadcast(sink)
        if sink is None:
            return {}
        return {
            "order": list(sink.got) == [s.name for s in trainer.param_specs()],
            "equal": all(torch.equal(t, expected[n]) for n, (_, t) in sink.got.items()),
            "in_slot": sorted(n for n, (placed, _) in sink.got.items() if placed),
            "copied": sorted(n for n, (placed, _) in sink.got.items() if not placed),
        }
    finally:
        trainer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_params_the_conversion_only_renames_are_gathered_into_the_sinks_slots(
    models: dict[str, Path], arch: str
) -> None:
    """At world size 2, with a sink that offers slots (as the SDK's sender does), every param that
    ``to_hf`` only renames is gathered straight into its slot (the sender then copies nothing);
    what the conversion makes (the split of the fused QKV, weights and Qwen2's biases; Llama's
    permuted Q and K) is sent as made. Values and order as ``state_dict_hf`` gives them."""
    out = run_ranks(2, _gather_into_slots, str(models[arch]), timeout_s=600)[0]
    assert out["order"] and out["equal"]
    made = set(out["copied"])
    qkv = tuple(f"{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias"))
    assert made and all(n.endswith(qkv) for n in made), made
    assert any(n.endswith("mlp.down_proj.weight") for n in out["in_slot"])
    assert any(n.endswith("o_proj.weight") for n in out["in_slot"]) and "model.norm.weight" in out["in_slot"]
