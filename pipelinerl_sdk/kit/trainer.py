"""The trainer kit: what every trainer adapter would otherwise repeat, as a template to subclass.

:class:`KitTrainer` implements the whole :class:`~pipelinerl_sdk.contracts.TrainerBackend`
contract around a few engine-specific hooks. An adapter writes :meth:`~KitTrainer.build_model`
(load the HF checkpoint, shard or wrap it) and overrides only the hooks where its engine differs::

    class MyTrainer(KitTrainer):
        capabilities = CAPABILITIES

        def build_model(self, spec: TrainerSpec) -> torch.nn.Module:
            model, _ = load_model(spec.model, dtype=spec.dtype, device=self.device)
            return wrap_with_my_engine(model)

What the kit owns, in the order ``init`` runs it:

- **the process group** (:meth:`~KitTrainer.join_group`). The *launcher* creates the trainer's
  default ``torch.distributed`` group before ``init``: ``torchrun`` plus
  :func:`pipelinerl_sdk.trainer_group.init_from_env`, or :func:`~pipelinerl_sdk.trainer_group.run_ranks`
  (which calls it in every rank). The trainer never creates a group of several ranks itself. With no
  group at all, a trainer whose engine needs one (``needs_process_group``, the default) creates a
  private 1-rank gloo group and ``close`` destroys it; a group made by someone else is never
  destroyed. The device is ``cuda:LOCAL_RANK`` when the group's backend is NCCL, else the CPU. This
  group is never the weight-sync group of :mod:`pipelinerl_sdk.weights.group`;
- the spec's checks (dtype against the capabilities, ``options["mixed_precision"]`` against
  ``mixed_precision_options``), the seed, the model (:meth:`~KitTrainer.build_model`), the pad id
  (from the checkpoint's tokenizer), the optimizer (:meth:`~KitTrainer.build_optimizer`: torch
  AdamW with the spec's hyper-parameters), then :meth:`~KitTrainer.finish_init` (an engine that
  wraps model and optimizer together, such as DeepSpeed, does it there);
- **forward and backward**: score with :meth:`~KitTrainer.logprobs`, apply the objective, run
  :meth:`~KitTrainer.backward_loss`. A rank without sequences (an empty batch) still runs an
  *idle pass* (a one-sequence forward, and a zero loss backward in ``backward``), so that it takes
  part in every collective the engine runs inside forward and backward (FSDP's all-gathers and
  reduce-scatters, ZeRO-3's gathers): without it the other ranks hang;
- **step**: missing gradients become zeros (every param steps: Adam moments, decay), then
  :meth:`~KitTrainer.reduce_gradients` (for engines that do not reduce in backward), then the
  clipping hook :meth:`~KitTrainer.clip_gradients` (default: the global 2-norm over every rank's
  shards, a DTensor norm made full, then clip to exactly ``spec.grad_clip``; None: no clipping,
  the norm is still reported), then the optimizer step and zeroed gradients;
- **weights out**: :meth:`~KitTrainer.full_params` yields full tensors under HF names in
  ``param_specs()`` order, one gather unit (a decoder layer) at a time, each unit with one
  all-gather and the next unit's all-gather in flight meanwhile (:func:`stream_units`, the helper
  every sharded trainer uses); ``gather_and_broadcast`` hands them to the
  sink on rank 0 (with :func:`~pipelinerl_sdk.contracts.lend` when ``lends_params``) and
  ``state_dict_hf`` copies them to CPU on every rank;
- **close**: :meth:`~KitTrainer.release` (the engine's own teardown), then drop model and optimizer,
  then destroy the private group if ``init`` created one.

**Loss over ranks.** The contract *sums* the objective over micro-batches and ranks: after
``backward`` on every rank, the accumulated gradient is the gradient of the sum. Data-parallel
engines *average* gradients over ranks instead (torch DDP's all-reduce, DeepSpeed's, FSDP's default
divide factor): an adapter on such an engine must undo it, e.g. multiply the loss by the world
size in :meth:`~KitTrainer.backward_loss` (DeepSpeed adapter) or set the engine's divide factor to 1
(FSDP adapter). ``test_world_size_2_step_equals_world_size_1`` of the conformance suite catches a
trainer that averages.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from pipelinerl_sdk.contracts import (
    Into,
    Objective,
    StepMetrics,
    TokenBatch,
    TrainerBackend,
    TrainerSpec,
    WeightSink,
    lend,
    slot_of,
)
from pipelinerl_sdk.protocol import ParamSpec
from pipelinerl_sdk.weights.tensors import hf_name, spec_of

__all__ = [
    "DIRECT_MIN_BYTES",
    "FlatShard",
    "FullParamsOut",
    "KitTrainer",
    "PendingUnit",
    "UnitBuffers",
    "UnitGather",
    "UnitGathers",
    "adamw",
    "clip_global_norm",
    "dtensor_shard",
    "full_tensor",
    "stream_units",
]


def adamw(spec: TrainerSpec, params: Sequence[torch.nn.Parameter]) -> torch.optim.AdamW:
    """torch AdamW with the spec's lr, betas, eps and weight decay (the for-loop implementation:
    the same arithmetic on every engine, so trainers agree to float32 rounding)."""
    return torch.optim.AdamW(
        list(params), lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay, foreach=False
    )


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """The full value of a parameter: a DTensor is all-gathered (a collective: every rank calls
    it), a plain tensor is returned detached."""
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


U = TypeVar("U")


@dataclass(frozen=True, slots=True)
class FlatShard:
    """How a param is split over the ranks of ``group``: its full value, flattened to ``rows`` rows
    of ``row_bytes`` bytes, is the concatenation in rank order of ``chunk`` rows per rank (the
    last ranks' shorter or empty: only the first ``rows`` count); ``local`` holds this rank's
    rows (contiguous, at most ``chunk``, any padding past ``rows`` ignored)."""

    local: torch.Tensor
    chunk: int
    rows: int
    row_bytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    group: Any


def dtensor_shard(p: torch.Tensor) -> FlatShard | None:
    """The :class:`FlatShard` of a DTensor sharded on dim 0 of a 1-D mesh the way FSDP2 shards
    (``torch.chunk``: ``ceil(rows / world)`` rows per rank); None for anything else."""
    if not isinstance(p, DTensor) or p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),) or p.dim() == 0:
        return None
    world, rank = p.device_mesh.size(), p.device_mesh.get_local_rank()
    rows = p.shape[0]
    chunk = -(-rows // world)
    local = p.to_local().detach()
    if tuple(local.shape) != (max(0, min(chunk, rows - rank * chunk)), *p.shape[1:]) or not local.is_contiguous():
        return None
    row_bytes = (p.numel() // rows if rows else 0) * p.element_size()
    return FlatShard(local, chunk, rows, row_bytes, tuple(p.shape), p.dtype, p.device_mesh.get_group())


class UnitBuffers:
    """All-gather outputs reused from one gather unit to the next within one pass over the units,
    so that a pass allocates about as many as it has units in flight, not one per unit (fresh
    pages cost a first-touch fault: on the CPU about as much as a copy of them). :meth:`take`
    hands out a free buffer that is large enough (a smaller one is dropped), :meth:`give` takes it
    back once nothing reads it."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        #: Buffers allocated so far (the others were reused).
        self.allocations = 0

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` (a view of a free one if one is large enough)."""
        fits = [b for b in self._free if b.numel() >= nbytes and b.device == device]
        if not fits:
            self._free = [b for b in self._free if b.device != device]
            self.allocations += 1
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._free = [b for b in self._free if b is not fits[0]]
        return fits[0][:nbytes]

    def give(self, buf: torch.Tensor) -> None:
        """Hand ``buf`` (from :meth:`take`) back: nothing reads it any more."""
        self._free.append(buf if buf._base is None else buf._base)


#: A param of at least this many bytes whose shards are all whole (its rows divide evenly over
#: the ranks) is all-gathered on its own, straight into its destination; smaller ones, and uneven
#: ones, share one all-gather of their flat shards.
DIRECT_MIN_BYTES = 1 << 20


class UnitGather:
    """One gather unit's all-gathers, all started (asynchronously) on construction, for every
    param of the unit that ``shard_of`` describes (default :func:`dtensor_shard`: FSDP2's layout),
    all in one group:

    - a param of at least :data:`DIRECT_MIN_BYTES` whose shards are whole is all-gathered on its
      own (``all_gather_into_tensor``) straight into its destination: ``into(name)`` where that
      gives a tensor (a sink's slot, see :func:`~pipelinerl_sdk.contracts.slot_of`: the collective
      writes where the sink reads, and nothing is copied at all), else a new tensor;
    - the others (small ones, uneven shards) share ONE ``all_gather_single`` of their flat shards
      (in place: this rank's slice of the output is the input), each then copied out into its
      destination, chosen the same way.

    Why not one all-gather of the whole unit's flat shard: its copy-in and copy-out cost two
    passes over the unit's bytes, and on gloo a message of a whole layer runs out of cache; on two
    CPU ranks the per-param collectives into place took 0.7x the time of that one all-gather
    (README, ``pipelinerl bench gather``). :meth:`tensors` waits for each param's collective in
    turn and yields each full tensor; any other param is yielded as :func:`full_tensor` makes it
    (a DTensor: a collective each) when its turn comes. Every rank must build the same units in
    the same order. ``buffers``: where the shared all-gather's output comes from and goes back to
    once the last tensor is copied out of it (:class:`UnitGathers` shares one over a pass)."""

    def __init__(
        self,
        params: Sequence[tuple[str, torch.Tensor]],
        shard_of: Callable[[torch.Tensor], FlatShard | None] = dtensor_shard,
        *,
        into: Into | None = None,
        buffers: UnitBuffers | None = None,
    ) -> None:
        self._params = list(params)
        self._into: Into | None = None
        self._dst: dict[int, torch.Tensor] = {}  # index -> where its own all-gather writes
        self._direct: dict[int, Any] = {}  # index -> its own all-gather's work (None: world 1)
        self._flat: dict[int, tuple[int, FlatShard]] = {}  # index -> (byte offset in a rank's part, shard)
        self._out: torch.Tensor | None = None
        self._work: Any = None
        self._per_rank = 0
        self._buffers = buffers or UnitBuffers()
        #: Another unit's gather may start while this one's tensors are handed out (not on gloo:
        #: the next unit's all-gathers would hold their outputs and gloo's temporaries beside this
        #: unit's tensors, even when this unit needed no collective).
        self.prefetch = not (dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo")
        shards: dict[int, FlatShard] = {}
        group: Any = None
        for i, (_, p) in enumerate(self._params):
            shard = shard_of(p)
            if shard is None or (group is not None and shard.group != group):
                continue
            group = shard.group
            shards[i] = shard
        if not shards:
            return
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self._into = into
        for i, shard in shards.items():
            whole = shard.chunk * world == shard.rows and shard.local.numel() * shard.local.element_size() == (
                shard.chunk * shard.row_bytes
            )
            if whole and shard.rows * shard.row_bytes >= DIRECT_MIN_BYTES:
                self._dst[i] = _destination(self._params[i][0], shard, into)
                out, local = self._dst[i].view(-1), shard.local.reshape(-1)
                if world == 1:
                    out.copy_(local)
                    self._direct[i] = None
                else:
                    self._direct[i] = dist.all_gather_into_tensor(out, local, group=group, async_op=True)
            else:
                self._flat[i] = (self._per_rank, shard)
                self._per_rank += shard.chunk * shard.row_bytes
        if self._flat:
            out = self._buffers.take(world * self._per_rank, shards[next(iter(self._flat))].local.device)
            mine = out[rank * self._per_rank : (rank + 1) * self._per_rank]
            for offset, shard in self._flat.values():
                raw = shard.local.reshape(-1).view(torch.uint8)[: shard.chunk * shard.row_bytes]
                mine[offset : offset + raw.numel()].copy_(raw)
            self._out = out
            if world > 1:  # (at world size 1 the copy above was the whole gather)
                self._work = dist.all_gather_single(out, mine, group=group, async_op=True)
        # gloo all-gathers into temporaries of the outputs, then copies: a unit in flight costs
        # two units there, so no second one may be started beside it
        self.prefetch = dist.get_backend(group) != "gloo"

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each param of the unit, full, in the unit's order (each waits for its all-gather)."""
        last_flat = max(self._flat, default=-1)
        for i, (name, p) in enumerate(self._params):
            if i in self._direct:
                full = self._dst.pop(i)  # (the caller's reference is the last one)
                work = self._direct.pop(i)
                if work is not None:
                    work.wait()
                yield name, full
                del full
                continue
            if i not in self._flat:
                yield name, full_tensor(p)
                continue
            if self._work is not None:
                self._work.wait()
                self._work = None
            out = self._out
            assert out is not None
            offset, shard = self._flat[i]
            chunk, rows, row_bytes = shard.chunk, shard.rows, shard.row_bytes
            full = _destination(name, shard, self._into)  # only now: one such tensor at a time
            raw = full.view(-1).view(torch.uint8)
            for r in range(-(-rows // chunk)):
                n = min(chunk, rows - r * chunk) * row_bytes
                src = r * self._per_rank + offset
                raw[r * chunk * row_bytes : r * chunk * row_bytes + n].copy_(out[src : src + n])
            if i == last_flat:  # the last copy-out: nothing reads the output any more
                self._out = None
                self._buffers.give(out)
            yield name, full
            del full, raw


def _destination(name: str, shard: FlatShard, into: Into | None) -> torch.Tensor:
    """Where param ``name``'s full value goes: ``into(name)`` if that gives a tensor (checked:
    ValueError naming the param for a wrong one), else a new tensor."""
    dst = into(name) if into is not None else None
    if dst is None:
        return torch.empty(shard.shape, dtype=shard.dtype, device=shard.local.device)
    if tuple(dst.shape) != shard.shape or dst.dtype != shard.dtype or not dst.is_contiguous():
        raise ValueError(f"{name!r}: slot {dst.dtype} {tuple(dst.shape)}, param {shard.dtype} {shard.shape}")
    return dst


class UnitGathers:
    """The ``start`` of :func:`stream_units` for one pass over the units: each unit's
    :class:`UnitGather` with ``shard_of``, the pass's destinations ``into`` and one
    :class:`UnitBuffers` shared by every unit of the pass (create one per pass)."""

    def __init__(
        self, shard_of: Callable[[torch.Tensor], FlatShard | None] = dtensor_shard, into: Into | None = None
    ) -> None:
        self.shard_of = shard_of
        self.into = into
        self.buffers = UnitBuffers()

    def __call__(self, params: Sequence[tuple[str, torch.Tensor]]) -> UnitGather:
        return UnitGather(params, self.shard_of, into=self.into, buffers=self.buffers)


class PendingUnit(Protocol):
    """A unit whose gather has started (what ``start`` of :func:`stream_units` returns)."""

    #: Another unit's gather may start while this one's tensors are handed out.
    prefetch: bool

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Wait for the gather; then each full tensor of the unit, in order (a tensor is not
        used after the next one is asked for; the unit's memory is freed at the end)."""
        ...


def stream_units(units: Iterable[U], start: Callable[[U], PendingUnit]) -> Iterator[tuple[str, torch.Tensor]]:
    """The full tensors of ``units``, in order: each unit's gather started by ``start`` (e.g.
    :class:`UnitGather` of a list of (name, param): one collective), the next unit's gather
    started as soon as the current one has arrived, so it runs while the caller sends the current
    unit's tensors. At most
    one unit ahead: the extra memory is two units' all-gather outputs plus the one tensor being
    handed out. Not on gloo (:attr:`UnitGather.prefetch`): its all-gather allocates a temporary
    copy of the output, so there units go one after the other (peak: the output, gloo's
    temporary, one tensor). A collective: every rank iterates to the end."""
    it = iter(units)
    first = next(it, None)
    if first is None:
        return
    current = start(first)
    for unit in it:
        if not current.prefetch:
            yield from current.tensors()
            current = start(unit)
            continue
        tensors = current.tensors()
        head = next(tensors, None)  # waits for the current unit
        ahead = start(unit)
        if head is not None:
            yield head
            del head
            yield from tensors
        del tensors
        current = ahead
    yield from current.tensors()


def clip_global_norm(params: Sequence[torch.Tensor], max_norm: float | None) -> float:
    """The 2-norm of all gradients of ``params`` over every rank's shards (a DTensor norm is made
    full: a collective), and, unless ``max_norm`` is None, the gradients scaled so that the norm is
    at most ``max_norm``. Returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False, foreach=False)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=False)
    return float(norm)


class FullParamsOut:
    """The contract's ``gather_and_broadcast`` and ``state_dict_hf`` from one iterator, for any
    trainer (mix it in before :class:`~pipelinerl_sdk.contracts.TrainerBackend`).

    The trainer implements :meth:`full_params`: full tensors under HF names, in ``param_specs()``
    order, every rank iterating to the end (the gathers are collectives); :meth:`lendable`: a
    tensor that stays unchanged until the next ``step`` is handed to the sink with
    :func:`~pipelinerl_sdk.contracts.lend` (no copy), any other is sent (copied, unless it was
    written in the sink's slot); and :meth:`check_ready`: RuntimeError before ``init``.
    ``gather_and_broadcast`` hands every tensor to the sink (rank 0; ``None`` on the others, which
    still iterate), ``state_dict_hf`` copies every tensor to CPU on every rank."""

    def full_params(self, into: Into | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``into`` (rank 0 of a publish, where the sink has slots): where each full tensor may
        be written, so that the sink copies nothing (see :func:`~pipelinerl_sdk.contracts.slot_of`;
        a trainer may ignore it)."""
        raise NotImplementedError(f"{type(self).__name__} must implement full_params")

    def lendable(self, tensor: torch.Tensor) -> bool:
        """Default: nothing is lent."""
        return False

    def check_ready(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement check_ready")

    def gather_and_broadcast(self, sink: WeightSink | None) -> None:
        self.check_ready()
        with torch.no_grad():
            for name, tensor in self.full_params(slot_of(sink)):
                if sink is not None:
                    if self.lendable(tensor):
                        lend(sink, name, tensor)
                    else:
                        sink.send(name, tensor)
                del tensor

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        self.check_ready()
        with torch.no_grad():
            return {name: t.detach().clone().cpu() for name, t in self.full_params()}


class KitTrainer(FullParamsOut, TrainerBackend):
    """A trainer backend built from hooks (see the module docstring for what the kit owns).

    Required: :meth:`build_model`. Everything else has a default for an HF model that takes
    ``input_ids``/``attention_mask`` and whose ``named_parameters()`` are the weights (plain tensors
    or DTensors). Attributes an adapter may read in its hooks: ``spec``, ``device``, ``pad_id``,
    ``model`` (what :meth:`build_model` returned, or what :meth:`finish_init` replaced it with) and
    ``optimizer``."""

    #: Create a private 1-rank gloo group when the launcher made none (engines whose sharding or
    #: wrapping needs ``torch.distributed``). False: run without a group as world size 1.
    needs_process_group: ClassVar[bool] = True
    #: Values of ``TrainerSpec.options["mixed_precision"]`` this trainer implements (None: unset).
    mixed_precision_options: ClassVar[frozenset[str | None]] = frozenset({None, "no"})
    #: Full params persist unchanged between steps: hand them to the sink with ``lend`` (no copy).
    lends_params: ClassVar[bool] = False

    def __init__(self) -> None:
        self.model: Any = None
        self.optimizer: Any = None
        self.spec: TrainerSpec | None = None
        self.device = torch.device("cpu")
        self.pad_id = 0
        self.steps = 0
        self._own_group = False

    # -- hooks -----------------------------------------------------------------------------------

    def build_model(self, spec: TrainerSpec) -> Any:
        """Load the HF checkpoint ``spec.model`` (identical on every rank) onto ``self.device``,
        shard or wrap it as the engine does, and return what :meth:`logprobs` runs. Runs after the
        group is joined and the seed set."""
        raise NotImplementedError(f"{type(self).__name__}: implement build_model(spec)")

    def build_optimizer(self, spec: TrainerSpec, params: Sequence[torch.nn.Parameter]) -> Any:
        """The optimizer over the trainable ``params``; default :func:`adamw`."""
        return adamw(spec, params)

    def finish_init(self, spec: TrainerSpec) -> None:
        """Last step of ``init``, with ``model`` and ``optimizer`` built (default: nothing)."""

    def hf_module(self) -> torch.nn.Module:
        """The module whose ``named_parameters()`` are the weights (wrapper prefixes are dropped
        from the names); default ``model``."""
        module: torch.nn.Module = self.model
        return module

    def logprobs(self, input_ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Per sequence, the float32 logprob of every token after the first (see
        :func:`pipelinerl_sdk.hf.token_logprobs`, the default); keeps the graph when grad is on."""
        from pipelinerl_sdk.hf import token_logprobs

        return token_logprobs(self.model, input_ids, self.pad_id, self.device)

    def backward_loss(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of ``loss`` (default ``loss.backward()``). An engine that
        averages gradients over ranks must scale here (see "Loss over ranks")."""
        loss.backward()  # type: ignore[no-untyped-call]

    def reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum gradients over ranks before clipping; default nothing (the engine reduced them in
        backward, as FSDP does)."""

    def clip_gradients(self, params: Sequence[torch.nn.Parameter], max_norm: float | None) -> float:
        """The clipping hook: returns the global grad norm (before clipping) and clips to
        ``max_norm`` unless None; default :func:`clip_global_norm`."""
        return clip_global_norm(params, max_norm)

    def optimizer_step(self) -> float:
        """One optimizer step on the accumulated gradients, then zeroed gradients; returns the grad
        norm. The default fills missing gradients with zeros, reduces, clips, steps. An engine that
        owns the whole step (DeepSpeed) overrides this."""
        assert self.spec is not None
        params = self.trainable_params()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.reduce_gradients(params)
        norm = self.clip_gradients(params, self.spec.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def current_lr(self) -> float:
        """The learning rate the last step used (reported by ``step``)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def full_params(self, into: Into | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under HF names, in ``param_specs()`` order, gathered one unit at a time
        (every rank iterates to the end: the gathers are collectives), copied out into ``into``'s
        slots where given. Default: the units of :func:`~pipelinerl_sdk.hf.layer_units` (a decoder
        layer; each param outside the layers) through :func:`stream_units` (one all-gather per
        unit, the next one in flight; :class:`UnitGathers`)."""
        from pipelinerl_sdk.hf import layer_units

        units = ([(hf_name(n), p) for n, p in unit] for unit in layer_units(self.hf_module()))
        yield from stream_units(units, UnitGathers(into=into))

    def release(self) -> None:
        """The engine's own teardown, first thing in ``close`` (default: nothing)."""

    def destroy_group(self) -> None:
        """Destroy the private group ``init`` created (default ``dist.destroy_process_group``)."""
        dist.destroy_process_group()

    # -- the contract ----------------------------------------------------------------------------

    def _require(self) -> tuple[Any, Any, TrainerSpec]:
        if self.model is None or self.optimizer is None or self.spec is None:
            raise RuntimeError("call init() first")
        return self.model, self.optimizer, self.spec

    @property
    def world_size(self) -> int:
        """Ranks of the default group (1 without one)."""
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def trainable_params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.hf_module().parameters() if p.requires_grad]

    def join_group(self) -> None:
        """Use the launcher's default group, or create the private 1-rank one (see the module
        docstring); pick the device from the group's backend."""
        if not dist.is_initialized() and self.needs_process_group:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
            self._own_group = True
        if dist.is_initialized() and dist.get_backend() == "nccl":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
            torch.cuda.set_device(self.device)

    def check_spec(self, spec: TrainerSpec) -> None:
        """ValueError naming the field for a spec this trainer cannot honour."""
        if spec.dtype not in self.capabilities.dtypes:
            raise ValueError(f"dtype: {spec.dtype!r} not supported (supported: {sorted(self.capabilities.dtypes)})")
        mp = spec.options.get("mixed_precision")
        if mp not in self.mixed_precision_options:
            known = sorted(str(m) for m in self.mixed_precision_options if m is not None)
            raise ValueError(f"options.mixed_precision: {mp!r} not supported (use one of {known} or leave unset)")

    def init(self, spec: TrainerSpec) -> None:
        self.check_spec(spec)
        self.join_group()
        torch.manual_seed(spec.seed)
        self.spec, self.steps = spec, 0
        self.model = self.build_model(spec)
        from transformers import AutoTokenizer

        from pipelinerl_sdk.hf import pad_token_id

        self.pad_id = pad_token_id(AutoTokenizer.from_pretrained(spec.model))
        self.optimizer = self.build_optimizer(spec, self.trainable_params())
        self.finish_init(spec)

    def param_specs(self) -> list[ParamSpec]:
        self._require()
        return [spec_of(hf_name(n), p) for n, p in self.hf_module().named_parameters()]

    def _idle_pass(self, backward: bool) -> None:
        """Take part in the collectives of a forward (and backward) with no sequences of our own."""
        out = self.logprobs([[self.pad_id, self.pad_id]])
        if backward:
            self.backward_loss(out[0].sum() * 0.0)

    def forward(self, batch: TokenBatch) -> list[torch.Tensor]:
        self._require()
        with torch.no_grad():
            if len(batch) == 0:
                self._idle_pass(backward=False)
                return []
            return [t.detach().float().cpu() for t in self.logprobs(batch.input_ids)]

    def backward(self, batch: TokenBatch, objective: Objective) -> dict[str, float]:
        self._require()
        if len(batch) == 0:
            self._idle_pass(backward=True)
            return {"loss": 0.0}
        loss, metrics = objective(self.logprobs(batch.input_ids), batch)
        self.backward_loss(loss)
        return {"loss": float(loss.detach()), **metrics}

    def step(self) -> StepMetrics:
        self._require()
        norm = self.optimizer_step()
        self.steps += 1
        return StepMetrics(step=self.steps, grad_norm=norm, lr=self.current_lr())

    def lendable(self, tensor: torch.Tensor) -> bool:
        return self.lends_params

    def check_ready(self) -> None:
        self._require()

    def close(self) -> None:
        try:
            if self.model is not None:
                self.release()
        finally:
            self.model = None
            self.optimizer = None
            if self._own_group and dist.is_initialized():
                self.destroy_group()
            self._own_group = False
