"""TorchTitan trainer backend: TorchTitan's model, parallelize function, optimizer container and HF adapter.

Contract (see :class:`pipelinerl_sdk.contracts.TrainerBackend`), as this backend keeps it:

- built on the trainer kit (:mod:`pipelinerl_sdk.kit.trainer`: process group and device, the
  forward/backward template with its idle pass, step, close); on CPU :mod:`cpu_shims` apply;
- ``init``: the model is TorchTitan's (:func:`pipelinerl_sdk_torchtitan.models.model_spec`: llama3 or
  qwen3 registry entry sized from the checkpoint's ``config.json``), built on the meta device, sharded
  by the family's own parallelize function (FSDP2 over every rank, ``spmd_backend="partial_dtensor"``),
  materialised, its buffers (RoPE cache) initialised by TorchTitan; then every rank reads the HF
  safetensors, converts them with the family's state-dict adapter (``from_hf``, fused QKV merged by
  TorchTitan's own load hook) and copies its shard of each parameter. The optimizer is TorchTitan's
  ``OptimizersContainer`` (torch AdamW, one param group, ``for-loop`` implementation);
- gradients are *summed* over ranks (FSDP divide factor 1, plain SUM reductions: gloo has no
  PREMUL_SUM), so the accumulated gradient is that of the objective summed over every ``backward``
  of every rank since the last ``step``;
- ``step`` clips to exactly ``spec.grad_clip`` with TorchTitan's ``clip_grad_norm_`` (None: no
  clipping, the norm is still reported), steps, zeroes gradients;
- ``gather_and_broadcast`` walks the model one unit at a time (embeddings, each decoder layer, final
  norm, lm_head): the kit's :class:`~pipelinerl_sdk.kit.trainer.UnitGather` (each large param
  with whole shards all-gathered on its own, the small ones with one all-gather), through
  :func:`~pipelinerl_sdk.kit.trainer.stream_units`: the next unit in flight meanwhile, except on
  gloo), the fused QKV split by TorchTitan's own save hook, ``to_hf`` of that unit alone, and rank 0
  hands each tensor to the sink under its HF name in ``param_specs()`` order. Extra memory: the
  unit's full parameters (plus the split copy of its QKV weight), the next unit's where
  prefetching; the sink owns bucketing;
- every FSDP unit reshards after forward (``fsdp_reshard_after_forward="always"``): TorchTitan's default
  keeps the last unit unsharded, and then a ``forward`` between ``backward`` and ``step`` loses part of
  the accumulated gradient;
- ``forward`` returns float32 logprobs on the CPU; sequences are right-padded and attention is causal
  SDPA, so padding never reaches a real token. A rank with an empty batch still joins the collectives.

Options (``TrainerSpec.options``): ``mixed_precision="bf16"`` (TorchTitan's
``mixed_precision_param="bfloat16"``: bf16 compute, fp32 master weights and gradient reduction);
``tensor_parallel`` (TP degree,
default 1; experimental: every rank of a TP group must pass the *same* batch, and gradients are then
summed over the data-parallel ranks only, so the standard world-size checks do not apply; it must
divide ``num_key_value_heads``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from pipelinerl_sdk_torchtitan import cpu_shims

cpu_shims.apply()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed.utils import clip_grad_norm_  # noqa: E402
from torchtitan.models.common.attention import FusedQKVLinear  # noqa: E402

from pipelinerl_sdk.contracts import Into, TrainerSpec  # noqa: E402
from pipelinerl_sdk.kit.trainer import KitTrainer, UnitGather, UnitGathers, clip_global_norm, stream_units  # noqa: E402
from pipelinerl_sdk.protocol import ParamSpec  # noqa: E402
from pipelinerl_sdk.weights.tensors import spec_of  # noqa: E402
from pipelinerl_sdk_torchtitan.capabilities import CAPABILITIES  # noqa: E402
from pipelinerl_sdk_torchtitan.models import model_spec, set_tp_sharding  # noqa: E402

__all__ = ["TorchTitanTrainer", "read_hf_checkpoint", "titan_token_logprobs"]

_MIXED_PRECISION = {None: "float32", "no": "float32", "bf16": "bfloat16"}


def read_hf_checkpoint(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of an HF model dir (FileNotFoundError if none)."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def merge_fused_qkv(model: torch.nn.Module, titan_sd: dict[str, Any]) -> None:
    """In place: replace ``wq``/``wk``/``wv`` entries of ``titan_sd`` by each fused module's ``wqkv``
    (TorchTitan's own load hook, the one ``load_state_dict`` runs)."""
    for name, module in model.named_modules():
        if isinstance(module, FusedQKVLinear):
            FusedQKVLinear._merge_qkv_on_load(module, titan_sd, f"{name}.")


def titan_token_logprobs(model: torch.nn.Module, input_ids: Sequence[Sequence[int]], pad_id: int) -> list[torch.Tensor]:
    """Per sequence, ``log p(tok_t | tok_<t)`` for t >= 1 in float32 (graph kept if grad is on): one
    right-padded batch through a TorchTitan decoder (causal attention: padding reaches no real token)."""
    device = next(model.parameters()).device
    width = max(len(s) for s in input_ids)
    ids = torch.full((len(input_ids), width), pad_id, dtype=torch.long, device=device)
    for i, s in enumerate(input_ids):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
    logits = model(ids)
    if isinstance(logits, DTensor):  # tensor parallel: the lm_head's output is sharded over vocab
        logits = logits.full_tensor()
    logits = logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return [logp[i, : len(s) - 1] for i, s in enumerate(input_ids)]


class _TitanUnit:
    """A unit's all-gather in flight; :meth:`tensors` converts the whole unit to HF names."""

    def __init__(
        self, gather: UnitGather, to_hf: Callable[[Iterator[tuple[str, torch.Tensor]]], dict[str, torch.Tensor]]
    ) -> None:
        self._gather = gather
        self._to_hf = to_hf
        self.prefetch = gather.prefetch

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._to_hf(self._gather.tensors()).items()


class TorchTitanTrainer(KitTrainer):
    """One rank of a TorchTitan trainer (see the module docstring for the contract)."""

    capabilities = CAPABILITIES
    mixed_precision_options = frozenset(_MIXED_PRECISION)

    def __init__(self) -> None:
        super().__init__()
        self.adapter: Any = None
        self._specs: list[ParamSpec] | None = None
        self._renamed: dict[str, str] | None = None

    # -- setup -----------------------------------------------------------------------------------

    def check_spec(self, spec: TrainerSpec) -> None:
        from transformers import AutoConfig

        super().check_spec(spec)
        tp = int(spec.options.get("tensor_parallel", 1))
        n_kv = getattr(AutoConfig.from_pretrained(spec.model), "num_key_value_heads", None)
        if tp > 1 and n_kv is not None and n_kv % tp:
            raise ValueError(f"options.tensor_parallel={tp} must divide num_key_value_heads={n_kv}")

    def build_model(self, spec: TrainerSpec) -> Any:
        from transformers import AutoConfig

        tp = int(spec.options.get("tensor_parallel", 1))
        mp = spec.options.get("mixed_precision")
        hf_config = AutoConfig.from_pretrained(spec.model)
        mspec = model_spec(hf_config)
        if tp > 1:
            set_tp_sharding(mspec)
        with torch.device("meta"):
            model = mspec.model.build()

        parallelism = ParallelismConfig(
            data_parallel_shard_degree=-1,
            tensor_parallel_degree=tp,
            spmd_backend="partial_dtensor",
            # "always", not TorchTitan's default (which keeps [norm, lm_head] unsharded after forward):
            # with that, a no_grad forward between backward and step drops part of the accumulated
            # lm_head gradient (measured: grad norm 526.44 instead of 526.74 on the tiny model).
            fsdp_reshard_after_forward="always",
        )
        dims = ParallelDims.from_config(parallelism, dist.get_world_size())
        dims.build_mesh()
        training = TrainingConfig(mixed_precision_param=_MIXED_PRECISION[mp], mixed_precision_reduce="float32")
        with tempfile.TemporaryDirectory() as dump:
            model = mspec.parallelize_fn(
                model,
                parallel_dims=dims,
                training=training,
                parallelism=parallelism,
                compile_config=CompileConfig(enable=False),
                ac_config=None,
                dump_folder=dump,
            )
        for m in model.modules():
            if isinstance(m, FSDPModule):  # sum, not mean, across ranks; plain SUM (gloo has no PREMUL_SUM)
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_states(buffer_device=self.device)  # RoPE cache (params are overwritten below)

        self.adapter = mspec.state_dict_adapter(mspec.model, None)
        self._specs = self._renamed = None
        self._load_hf(model, read_hf_checkpoint(spec.model))
        model.train()
        return model

    def build_optimizer(self, spec: TrainerSpec, params: Sequence[torch.nn.Parameter]) -> OptimizersContainer:
        """TorchTitan's optimizer container: torch AdamW, one param group, ``for-loop``."""
        return OptimizersContainer(
            OptimizersContainer.Config(
                param_groups=[
                    ParamGroupConfig(
                        pattern=".*",
                        optimizer_name="AdamW",
                        optimizer_kwargs={
                            "lr": spec.lr,
                            "betas": tuple(spec.betas),
                            "eps": spec.eps,
                            "weight_decay": spec.weight_decay,
                        },
                    )
                ],
                implementation="for-loop",
            ),
            model_parts=[self.model],
        )

    def current_lr(self) -> float:
        return float(self.optimizer.optimizers[0].param_groups[0]["lr"])

    def clip_gradients(self, params: Sequence[torch.nn.Parameter], max_norm: float | None) -> float:
        """TorchTitan's ``clip_grad_norm_`` (None: the kit's global norm, no clipping)."""
        if max_norm is None:
            return clip_global_norm(params, None)
        return float(clip_grad_norm_(params, max_norm, foreach=False))

    def logprobs(self, input_ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        return titan_token_logprobs(self.model, input_ids, self.pad_id)

    def _load_hf(self, model: torch.nn.Module, hf_sd: dict[str, torch.Tensor]) -> None:
        """Copy this rank's shard of every parameter from the HF state dict (identical on every rank)."""
        titan_sd = self.adapter.from_hf(hf_sd)
        merge_fused_qkv(model, titan_sd)
        names = [n for n, _ in model.named_parameters()]
        missing = sorted(set(names) - set(titan_sd))
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")
        with torch.no_grad():
            for name, param in model.named_parameters():
                full = titan_sd.pop(name).to(device=self.device, dtype=param.dtype)
                if isinstance(param, DTensor):
                    shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                    param.to_local().copy_(shard.to_local())
                else:
                    param.copy_(full)
        tied = {"lm_head.weight"} if getattr(model, "enable_weight_tying", False) else set()
        unused = sorted(set(titan_sd) - tied)
        if unused:
            raise ValueError(f"the model has no parameter for {len(unused)} checkpoint tensors, e.g. {unused[:3]}")

    # -- weights out -----------------------------------------------------------------------------

    def _units(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
        """The gather units in order: (prefix, module) for the embeddings, each decoder layer, the
        final norm and the lm_head."""
        for name, child in model.named_children():
            if name == "layers":
                for idx, layer in child.named_children():
                    yield f"layers.{idx}.", layer
            else:
                yield f"{name}.", child

    def _unit_hf(
        self, prefix: str, module: torch.nn.Module, full: Iterator[tuple[str, torch.Tensor]] | None
    ) -> dict[str, torch.Tensor]:
        """One unit's parameters under HF names: the ``full`` tensors (a gather's output, under
        TorchTitan names) or, for None, meta placeholders."""
        titan: dict[str, Any] = {}
        if full is not None:
            titan.update(full)
        else:
            for name, p in module.named_parameters():
                titan[prefix + name] = torch.empty(p.shape, dtype=p.dtype, device="meta")
        return self._to_hf(prefix, module, titan)

    def _to_hf(self, prefix: str, module: torch.nn.Module, titan: dict[str, Any]) -> dict[str, torch.Tensor]:
        """``titan`` (one unit's tensors under TorchTitan names, changed in place) under HF names:
        the fused QKV split by TorchTitan's own save hook, then ``to_hf``."""
        for name, sub in module.named_modules():
            if isinstance(sub, FusedQKVLinear):  # TorchTitan's own save hook: wqkv -> wq, wk, wv
                FusedQKVLinear._split_qkv_on_save(sub, titan, f"{prefix}{name}.", None)
        n_in = sum(t.numel() for t in titan.values())
        hf: dict[str, torch.Tensor] = self.adapter.to_hf(titan)
        if sum(t.numel() for t in hf.values()) != n_in:
            raise RuntimeError(f"{prefix}: to_hf dropped tensors of {sorted(titan)} (got {sorted(hf)})")
        return hf

    def _renames(self) -> dict[str, str]:
        """TorchTitan name -> HF name of every param that the conversion only renames (``to_hf``
        hands the very tensor on: no split, no permutation), found once on meta placeholders."""
        if self._renamed is None:
            self._renamed = {}
            for prefix, unit in self._units(self.model):
                titan = {
                    prefix + n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in unit.named_parameters()
                }
                ids = {id(t): n for n, t in titan.items()}
                for hf_name, t in self._to_hf(prefix, unit, dict(titan)).items():
                    if id(t) in ids:
                        self._renamed[ids[id(t)]] = hf_name
        return self._renamed

    def param_specs(self) -> list[ParamSpec]:
        model, _, _ = self._require()
        if self._specs is None:
            self._specs = [
                spec_of(name, t)
                for prefix, unit in self._units(model)
                for name, t in self._unit_hf(prefix, unit, None).items()
            ]
        return list(self._specs)

    def full_params(self, into: Into | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """One unit at a time: its full params (the kit's unit gather, buffers reused over the
        pass), the fused QKV split, ``to_hf`` of that unit alone. A param the conversion only
        renames is gathered straight into ``into`` of its HF name (the sink's slot: no copy);
        the others (the split QKV, the permuted Q and K) are made by the conversion."""
        renamed = self._renames() if into is not None else {}

        def into_titan(name: str) -> torch.Tensor | None:
            return into(renamed[name]) if into is not None and name in renamed else None

        gathers = UnitGathers(into=into_titan)
        return stream_units(self._units(self.model), lambda unit: self._start_unit(unit, gathers))

    def _start_unit(self, unit: tuple[str, torch.nn.Module], gathers: UnitGathers) -> _TitanUnit:
        prefix, module = unit
        gather = gathers([(prefix + n, p) for n, p in module.named_parameters()])
        return _TitanUnit(gather, lambda full: self._unit_hf(prefix, module, full))

    def release(self) -> None:
        self.adapter = None
        self._specs = None
        self._renamed = None
